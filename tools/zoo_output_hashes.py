"""sha256 of quantize() and fix(quantize_static u8s8_pc) on every zoo model: the byte-identity check of a refactor.

    python tools/zoo_output_hashes.py --json before.json          # on the old checkout
    python tools/zoo_output_hashes.py --json after.json --compare before.json

Each model is calibrated on the first 8 default photos. A refactor is behaviour-preserving when every
entry is the same; ``--compare`` prints SAME/DIFF per entry and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import kenosis_rewrite
from kenosis_rewrite import zoo
from kenosis_rewrite.core.ort_quantize import quantize_with_ort


def _sha(model) -> str:
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:16]


def _entry(make) -> str:
    try:
        return _sha(make())
    except Exception as error:  # noqa: BLE001 - a refusal is an outcome to compare too
        return f"ERR {type(error).__name__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the hashes here")
    parser.add_argument("--compare", help="hashes written by an earlier run")
    parser.add_argument("models", nargs="*", help="zoo model names (default: all)")
    args = parser.parse_args(argv)
    photos = zoo.load_photos()
    hashes = {}
    for name in args.models or zoo.list_models():
        model = zoo.load_model(name)
        feeds = zoo.model_feeds(name, photos)[:8]
        hashes[f"quantize:{name}"] = _entry(lambda: kenosis_rewrite.quantize(model, calibration=feeds))
        hashes[f"fix_qs:{name}"] = _entry(lambda: kenosis_rewrite.fix(quantize_with_ort(model, feeds, "u8s8_pc")))
        print(name, hashes[f"quantize:{name}"], hashes[f"fix_qs:{name}"], flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(hashes, handle, indent=1, sort_keys=True)
    if not args.compare:
        return 0
    with open(args.compare) as handle:
        before = json.load(handle)
    differ = 0
    for key, value in sorted(hashes.items()):
        same = before.get(key) == value
        differ += not same
        print(("SAME " if same else "DIFF ") + key, value, "" if same else f"(was {before.get(key)})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

"""Calibration over many samples: one pass in this process against shards as Ray tasks (wall time).

    python benchmarks/sharded_calibration.py mobilenet_v2 --samples 512 --shards 2 \\
        --json docs/benchmarks/sharded_calibration/mobilenet_v2.json

The samples are the zoo's photos, each flipped and shifted into many (calibration needs many
samples, the zoo ships dozens). Three ways to the same kind of ranges (percentile): the single pass
of ``collect_ranges`` (this process, ONNX Runtime on every core), the two passes of
``collect_ranges_sharded`` in one shard here, and the same over ``--shards`` Ray tasks (a local Ray
instance of ``--shards`` CPUs). The last two give the same ranges bit for bit (checked here too).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kenosis_rewrite import zoo
from kenosis_rewrite.benchmark.pages import save_variants_record, variants_record
from kenosis_rewrite.calibration import collect_ranges
from kenosis_rewrite.calibration.sharded import collect_ranges_sharded


def _many_feeds(model_name: str, samples: int) -> list[dict]:
    base = zoo.model_feeds(model_name, zoo.load_photo_set("objects", 64))
    feeds = []
    for index in range(samples):
        feed = base[index % len(base)]
        shift, flip = (index // len(base)) % 7, (index // (7 * len(base))) % 2
        feeds.append({name: np.ascontiguousarray(np.roll(array[..., ::-1] if flip else array, shift, axis=-1))
                      for name, array in feed.items()})
    return feeds


def _timed(function) -> tuple[float, object]:
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a zoo model name")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import ray

    model = zoo.load_model(args.model)
    feeds = _many_feeds(args.model, args.samples)
    shards = [feeds[i::args.shards] for i in range(args.shards)]
    single_s, _ = _timed(lambda: collect_ranges(model, feeds, "percentile"))
    local_s, local = _timed(lambda: collect_ranges_sharded(model, [feeds], "percentile"))
    start_s, _ = _timed(lambda: ray.init(num_cpus=args.shards, include_dashboard=False, log_to_driver=False))
    ray_s, on_ray = _timed(lambda: collect_ranges_sharded(model, shards, "percentile", engine="ray"))
    ray.shutdown()
    assert dict(on_ray) == dict(local), "the sharded ranges differ from one shard's"
    result = variants_record("sharded_calibration", args.model, "benchmarks/sharded_calibration.py", sys.argv[1:])
    result["variants"] = {
        "collect_ranges, one pass here": {"seconds": single_s, "samples": args.samples},
        "collect_ranges_sharded, 1 shard here": {"seconds": local_s, "samples": args.samples},
        f"collect_ranges_sharded, {args.shards} Ray tasks": {"seconds": ray_s, "samples": args.samples,
                                                             "ray_start_seconds": start_s},
    }
    save_variants_record(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

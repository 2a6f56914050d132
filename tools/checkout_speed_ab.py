"""Speed of quantize()'s model from two checkouts of this project, interleaved in one process.

    python tools/checkout_speed_ab.py crnn_captcha,nudenet_yolov8n OLD_CHECKOUT NEW_CHECKOUT [--rounds 2]

Each checkout quantizes the zoo model in its own interpreter (``PYTHONPATH=CHECKOUT``), on the 16
scenes the zoo benchmarks calibrate on; both models are then timed in this process, interleaved,
on one held-out photo, at 1 and 2 threads (medians, warm-up first: ``kenosis_rewrite.core.interleaved_timing``).
Run it with the roles swapped too: the second variant of a pair can read a little slower on a
shared host. Prints new/old per round, and whether the two models are byte-identical.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from kenosis_rewrite import zoo
from kenosis_rewrite.core import interleaved_timing

_QUANTIZE = """
import sys
import kenosis_rewrite
from kenosis_rewrite import zoo
name, path = sys.argv[1:3]
feeds = zoo.model_feeds(name, zoo.load_photo_set("scenes")[:16])
model = kenosis_rewrite.quantize(zoo.load_model(name), calibration=feeds)
open(path, "wb").write(model.SerializeToString())
"""


def _quantized(checkout: str, name: str, folder: str, label: str) -> bytes:
    path = os.path.join(folder, f"{label}.onnx")
    environment = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    subprocess.run([sys.executable, "-c", _QUANTIZE, name, path], check=True, env=environment, cwd=checkout)
    with open(path, "rb") as handle:
        return handle.read()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", help="zoo model names, comma-separated")
    parser.add_argument("old", help="checkout of the old code")
    parser.add_argument("new", help="checkout of the new code")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=2.0, help="minimum timing per variant and round")
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as folder:
            old, new = (_quantized(checkout, name, folder, label) for checkout, label in ((args.old, "old"), (args.new, "new")))
        feed = zoo.model_feeds(name, zoo.load_photo_set("objects", 1))[0]
        print(f"{name}: models {'byte-identical' if old == new else 'differ'}", flush=True)
        for threads in (1, 2):
            for _ in range(args.rounds):
                sessions = {"old": interleaved_timing.session(old, threads), "new": interleaved_timing.session(new, threads)}
                medians = interleaved_timing.interleaved_medians(sessions, feed, seconds=args.seconds)
                print(f"  {threads} thread(s): old {medians['old'] * 1e3:.2f} ms, new {medians['new'] * 1e3:.2f} ms, "
                      f"new/old {medians['new'] / medians['old']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

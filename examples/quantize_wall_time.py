"""Wall time of quantize() on zoo models, calibrated on the 16 scenes the zoo benchmarks use.

    python examples/quantize_wall_time.py mobilenet_v2,efficientnet_lite0 [--runs 3]

One untimed call first (imports, the model's first load), then ``--runs`` timed calls: wall time,
and the process's CPU time over all its threads (on a shared host the wall time moves with the
neighbours' load; the CPU time much less). To compare two versions of the code, run it from each
checkout in turn (``PYTHONPATH=/path/to/checkout``).
"""

from __future__ import annotations

import argparse
import sys
import time

import kenosis_rewrite
from kenosis_rewrite import zoo


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", help="zoo model names, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    scenes = zoo.load_photo_set("scenes")[:16]
    for name in args.models.split(","):
        model = zoo.load_model(name)
        feeds = zoo.model_feeds(name, scenes)
        kenosis_rewrite.quantize(model, calibration=feeds[:2])
        seconds, cpu = [], []
        for _ in range(args.runs):
            start, start_cpu = time.perf_counter(), time.process_time()
            kenosis_rewrite.quantize(model, calibration=feeds)
            seconds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        print(name, " ".join(f"{s:.2f}" for s in seconds), "s, CPU", " ".join(f"{s:.2f}" for s in cpu), "s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

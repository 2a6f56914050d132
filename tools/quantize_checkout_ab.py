"""quantize()'s wall time, two checkouts interleaved: each in its own interpreter, called in turn.

    python tools/quantize_checkout_ab.py MODEL CHECKOUT_A CHECKOUT_B [--rounds 8]

Each interpreter imports ``kenosis_rewrite`` from its checkout, loads the zoo model and its 16
calibration scenes, makes one untimed call, then waits; every round calls A then B, or B then A
(alternating), one quantize() each, and the medians of the rounds are printed. Both run on the same
host at the same time, so a busy neighbour slows both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_WORKER = r'''
import sys, time
sys.path.insert(0, sys.argv[1])
import kenosis_rewrite, kenosis_rewrite.zoo as zoo
if not kenosis_rewrite.__file__.startswith(sys.argv[1]):
    raise SystemExit(f"kenosis_rewrite came from {kenosis_rewrite.__file__}, not {sys.argv[1]}")
scenes = zoo.load_photo_set("scenes")[:16]
model = zoo.load_model(sys.argv[2])
feeds = zoo.model_feeds(sys.argv[2], scenes)
kenosis_rewrite.quantize(model, calibration=feeds[:2])
print("ready", flush=True)
for _ in sys.stdin:
    start = time.perf_counter()
    kenosis_rewrite.quantize(model, calibration=feeds)
    print(time.perf_counter() - start, flush=True)
'''


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("a", metavar="CHECKOUT_A")
    parser.add_argument("b", metavar="CHECKOUT_B")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    workers = {label: subprocess.Popen([sys.executable, "-c", _WORKER, os.path.abspath(path), args.model],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for label, path in (("A", args.a), ("B", args.b))}
    for worker in workers.values():
        if worker.stdout.readline().strip() != "ready":
            raise SystemExit("a worker failed to start")
    seconds: dict[str, list[float]] = {"A": [], "B": []}
    for round_ in range(args.rounds):
        for label in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
            worker = workers[label]
            worker.stdin.write("go\n")
            worker.stdin.flush()
            seconds[label].append(float(worker.stdout.readline()))
    for worker in workers.values():
        worker.stdin.close()
        worker.wait()
    a, b = statistics.median(seconds["A"]), statistics.median(seconds["B"])
    print(f"{args.model}: A {a:.3f} s, B {b:.3f} s, B/A {b / a:.3f} (medians of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

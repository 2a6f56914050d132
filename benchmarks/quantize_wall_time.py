"""Wall time of quantize() on zoo models, calibrated on the 16 scenes the zoo benchmarks use.

    python benchmarks/quantize_wall_time.py mobilenet_v2,efficientnet_lite0 [--runs 3] [--against inc]

One untimed call first (imports, the model's first load), then ``--runs`` timed calls: wall time,
and the process's CPU time over all its threads (on a shared host the wall time moves with the
neighbours' load; the CPU time much less). To compare two versions of the code, run it with
``--code CHECKOUT`` for each checkout in turn (that checkout's ``kenosis_rewrite`` is imported,
ahead of the installed one; PYTHONPATH alone loses to an editable install).

``--against PEER`` (nncf, inc, quark; installed with ``kenosis-rewrite peers install PEER``)
quantizes the same model on the same feeds with the peer after each run, interleaved (after one
untimed run of its own), and prints the peer's time (its quantize call alone, in its own
interpreter) and the ratio of each round.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time


def _seconds(values: list[float]) -> str:
    return " ".join(f"{value:.2f}" for value in values)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", help="zoo model names, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--against", metavar="PEER", help="also time this peer, interleaved with quantize()")
    parser.add_argument("--code", metavar="CHECKOUT", help="import kenosis_rewrite from this checkout")
    args = parser.parse_args(argv)
    if args.code:
        sys.path.insert(0, os.path.abspath(args.code))
    kenosis_rewrite = importlib.import_module("kenosis_rewrite")
    zoo = importlib.import_module("kenosis_rewrite.zoo")
    try:
        peers = importlib.import_module("kenosis_rewrite.benchmark.peers")
    except ModuleNotFoundError:  # a checkout from before the re-layout by concern
        peers = importlib.import_module("kenosis_rewrite.peers")
    if args.code and not kenosis_rewrite.__file__.startswith(os.path.abspath(args.code)):
        parser.error(f"kenosis_rewrite came from {kenosis_rewrite.__file__}, not {args.code}")
    scenes = zoo.load_photo_set("scenes")[:16]
    for name in args.models.split(","):
        model = zoo.load_model(name)
        feeds = zoo.model_feeds(name, scenes)
        kenosis_rewrite.quantize(model, calibration=feeds[:2])
        if args.against:  # and the peer's first run (its interpreter's files read from disk)
            peers.quantize_with_peer(args.against, model, feeds[:2])
        seconds, cpu, theirs = [], [], []
        for _ in range(args.runs):
            start, start_cpu = time.perf_counter(), time.process_time()
            kenosis_rewrite.quantize(model, calibration=feeds)
            seconds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            if args.against:
                theirs.append(peers.quantize_with_peer(args.against, model, feeds).wall_s)
        line = f"{name} {_seconds(seconds)} s, CPU {_seconds(cpu)} s"
        if theirs:
            ratios = [ours / peer for ours, peer in zip(seconds, theirs)]
            line += f"; {args.against} {_seconds(theirs)} s; ratio {_seconds(ratios)}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

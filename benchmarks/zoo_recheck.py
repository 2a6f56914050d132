"""Re-time quantize() against chosen rivals on one zoo model: several interleaved rounds at 1 and 2 threads.

One `kenosis-rewrite bench` run times a dozen variants once; where quantize() and the best other
variant are within a few percent, that single comparison is within this host's noise (±5% on one
thread, ±10% on two). This script builds only quantize() and the rivals named (on the same 16
scenes as `bench --photos large --calibration-samples 16`) and repeats the interleaved measurement.

    python benchmarks/zoo_recheck.py MODEL RIVAL[,RIVAL...] [--rounds 3] [--seconds 3]

RIVAL: a bench variant name: a quantize_static config (`u8s8_pc`, `u8s8`) or a peer (`nncf`, `inc`,
`quark`), either one optionally followed by `+fix`.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from kenosis_rewrite.benchmark import bench

OURS = "quantize()"


def _sources(rivals: list[str]) -> tuple[list[str], list[str]]:
    """The quantize_static configs and the peers the rivals come from."""
    configs, peers = [], []
    for rival in rivals:
        base = rival.removesuffix(bench.FIX_SUFFIX)
        (peers if base.split(":")[0] in ("nncf", "inc", "quark") else configs).append(base)
    return list(dict.fromkeys(configs)), list(dict.fromkeys(peers))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("rivals")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    rivals = args.rivals.split(",")
    configs, peers = _sources(rivals)
    inputs = bench._zoo_inputs(args.model, 16, None, photos="large")
    models, _ = bench._build_variants(inputs, configs, True, lambda _: None, include_quantize=True, peer_specs=peers)
    missing = [name for name in [OURS, *rivals] if name not in models]
    if missing:
        print(f"not built: {missing}", file=sys.stderr)
        return 1
    chosen = {name: models[name] for name in [OURS, *rivals]}
    print("| threads | rival | quantize() speed / rival's, each round | median |")
    print("|---:|---|---|---:|")
    for threads in (1, 2):
        ratios: dict[str, list[float]] = {rival: [] for rival in rivals}
        for _ in range(args.rounds):
            latency = bench.measure_latency(chosen, inputs.evaluation[0], threads=threads, runs=100,
                                            min_seconds=args.seconds)
            for rival in rivals:
                ratios[rival].append(latency[rival].median_ms / latency[OURS].median_ms)
        for rival, values in ratios.items():
            rounds = ", ".join(f"{value:.3f}" for value in values)
            print(f"| {threads} | {rival} | {rounds} | **{statistics.median(values):.3f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

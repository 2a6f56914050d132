"""Benchmark: weight-only int4 MatMulNBits vs the dequantize-then-float-MatMul form, batch 1.

    python benchmarks/bench_weight_only.py [--hidden 512] [--layers 2] [--seq 1] [--rounds 7] [--runs 50]

For the toy transformer (FP32 and FP16) this builds, per model:

* ``float``: the original float model;
* ``DQ + MatMul``: ``quantize_weights()`` output with ORT's QDQ fusions disabled
  (``disabled_optimizers=["QDQSelectorActionTransformer"]``): what a model whose pattern is slightly
  off runs (every DequantizeLinear is recomputed each inference, then a float MatMul);
* ``MatMulNBits``: the same model with ORT's default optimizations (every eligible MatMul fused).

Single-threaded ORT sessions, 20 warm-up runs each, then interleaved rounds (every session runs
``--runs`` inferences per round, in turn) in this one process; the figure is the median of the
round medians. Prints a markdown table with latency, speedup over ``DQ + MatMul`` and the output
cosine against the FP32 float model.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort

from kenosis_rewrite.weight_only import weights

WARMUP = 20


def _session(model: onnx.ModelProto, fused: bool = True) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    disabled = [] if fused else ["QDQSelectorActionTransformer"]
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=disabled)


def _round_median(session: ort.InferenceSession, feed: dict, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_latency(sessions: dict, feed: dict, rounds: int, runs: int) -> dict[str, float]:
    """Median over rounds of each session's per-round median latency, in milliseconds."""
    for session in sessions.values():
        for _ in range(WARMUP):
            session.run(None, feed)
    medians = {name: [] for name in sessions}
    for _ in range(rounds):
        for name, session in sessions.items():
            medians[name].append(_round_median(session, feed, runs))
    return {name: 1000 * statistics.median(values) for name, values in medians.items()}


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def bench_model(float16: bool, args) -> list[tuple]:
    reference = weights.toy_transformer(hidden=args.hidden, layers=args.layers, seq=args.seq)
    model = weights.toy_transformer(hidden=args.hidden, layers=args.layers, seq=args.seq, float16=float16)
    quantized = weights.quantize_weights(model, block_size=args.block_size)
    sessions = {
        "float": _session(model),
        "DQ + MatMul": _session(quantized, fused=False),
        "MatMulNBits": _session(quantized),
    }
    x = np.random.default_rng(0).standard_normal((1, args.seq, args.hidden)).astype(np.float32)
    feed = {"x": x.astype(np.float16) if float16 else x}
    expected = _session(reference).run(None, {"x": x})[0]
    latency = interleaved_latency(sessions, feed, args.rounds, args.runs)
    rows = []
    for name, session in sessions.items():
        cosine = _cosine(expected, session.run(None, feed)[0])
        speedup = latency["DQ + MatMul"] / latency[name]
        rows.append(("FP16" if float16 else "FP32", name, latency[name], speedup, cosine))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    print(f"toy transformer: hidden {args.hidden}, {args.layers} layers, seq {args.seq}, batch 1, int4 block "
          f"{args.block_size}; onnxruntime {ort.__version__}, 1 thread, median of {args.rounds} interleaved "
          f"rounds x {args.runs} runs\n")
    print("| model | variant | latency (ms) | speedup vs DQ + MatMul | cosine vs FP32 |")
    print("|---|---|---:|---:|---:|")
    for float16 in (False, True):
        for dtype, name, ms, speedup, cosine in bench_model(float16, args):
            print(f"| {dtype} | {name} | {ms:.3f} | {speedup:.2f}x | {cosine:.5f} |")


if __name__ == "__main__":
    main()

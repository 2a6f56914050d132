"""quantize() with and without the FP32 canonicalization stage, on zoo models: speed, fidelity, wall time.

Usage::

    python benchmarks/prepare_table.py yahoo_open_nsfw_pt2 nudenet_yolov8n [--calibration 8] [--seconds 3]

Real photos from the zoo: the first ``--calibration`` calibrate, the rest measure cosine against FP32.
Latency: interleaved medians, 1 and 2 threads, as x FP32 (higher is faster).
"""

from __future__ import annotations

import argparse
import time

import onnx

import kenosis_rewrite
from kenosis_rewrite import zoo
from kenosis_rewrite.core import fidelity, interleaved_timing


def _row(name: str, calibration: int, seconds: float) -> list[str]:
    float_model = onnx.load(zoo.fetch_model(name))
    feeds = zoo.model_feeds(name, zoo.load_photos())
    calib, held_out = feeds[:calibration], feeds[calibration:]
    variants, wall = {}, {}
    start = time.perf_counter()
    variants["prepare (FP32)"] = kenosis_rewrite.prepare(float_model, calib)
    wall["prepare (FP32)"] = time.perf_counter() - start
    for label, canonicalize in (("quantize(canonicalize=False)", False), ("quantize()", True)):
        start = time.perf_counter()
        variants[label] = kenosis_rewrite.quantize(float_model, calib, canonicalize=canonicalize)
        wall[label] = time.perf_counter() - start
    scores = fidelity.compare_to_float(float_model, variants, held_out)
    speed = {}
    for threads in (1, 2):
        sessions = {"fp32": interleaved_timing.session(float_model.SerializeToString(), threads=threads)}
        sessions.update({k: interleaved_timing.session(m.SerializeToString(), threads=threads) for k, m in variants.items()})
        medians = interleaved_timing.interleaved_medians(sessions, feeds[0], seconds=seconds)
        speed[threads] = {k: medians["fp32"] / v for k, v in medians.items()}
    rows = []
    for label, model in variants.items():
        macs = kenosis_rewrite.explain(model).integer_mac_fraction
        rows.append(f"| {name} | {label} | {macs:.1%} | {scores[label]['cosine']:.5f} | {speed[1][label]:.2f} | "
                    f"{speed[2][label]:.2f} | {wall[label]:.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--calibration", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    print(f"host: {interleaved_timing.cpu_description()}")
    print("| model | variant | integer MACs | cosine (held-out photos) | x FP32, 1 thread | x FP32, 2 threads | wall s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.models:
        for row in _row(name, args.calibration, args.seconds):
            print(row, flush=True)


if __name__ == "__main__":
    main()

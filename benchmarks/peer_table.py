"""Peer output vs fix(peer output) vs quantize_static -> fix, on one model: integer MACs, cosine, latency.

Usage (the peer's model made in the peer's own venv, e.g. NNCF: ``nncf.quantize(model, nncf.Dataset(feeds))``
on the same calibration feeds)::

    python benchmarks/peer_table.py FP32.onnx PEER.onnx FEEDS.npz [--calibration 8] [--seconds 3] [--quantize]

``FEEDS.npz`` holds ``"{i}::{input name}"`` arrays: the first ``--calibration`` feed dicts calibrate
(quantize_static, fix), the rest measure fidelity. Latency: interleaved medians, 1 and 2 threads.
``--quantize`` adds ``kenosis_rewrite.quantize()`` of the FP32 model on the same calibration feeds.
"""

from __future__ import annotations

import argparse

import onnx

import kenosis_rewrite
from kenosis_rewrite.benchmark import peers
from kenosis_rewrite.core import fidelity, interleaved_timing, ort_quantize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fp32")
    parser.add_argument("peer")
    parser.add_argument("feeds")
    parser.add_argument("--calibration", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--quantize", action="store_true", help="add kenosis_rewrite.quantize() of the FP32 model")
    args = parser.parse_args()
    feeds = peers.load_feeds(args.feeds)
    calibration, held_out = feeds[: args.calibration], feeds[args.calibration:]
    fp32, peer = onnx.load(args.fp32), onnx.load(args.peer)
    qdq = ort_quantize.quantize_with_ort(fp32, calibration, "default")
    variants = {
        "peer": peer,
        "fix(peer)": kenosis_rewrite.fix(peer, float_model=fp32, calibration=calibration),
        "quantize_static": qdq,
        "fix(quantize_static)": kenosis_rewrite.fix(qdq, float_model=fp32, calibration=calibration),
    }
    if args.quantize:
        variants["quantize()"] = kenosis_rewrite.quantize(fp32, calibration=calibration)
    scores = fidelity.compare_to_float(fp32, variants, held_out)
    speed = {}
    for threads in (1, 2):
        sessions = {"fp32": interleaved_timing.session(fp32.SerializeToString(), threads=threads)}
        sessions.update({name: interleaved_timing.session(m.SerializeToString(), threads=threads) for name, m in variants.items()})
        medians = interleaved_timing.interleaved_medians(sessions, feeds[0], seconds=args.seconds)
        speed[threads] = {name: medians["fp32"] / value for name, value in medians.items()}
    print(f"host: {interleaved_timing.cpu_description()}")
    print("| variant | integer MACs | cosine | x FP32, 1 thread | x FP32, 2 threads |")
    print("|---|---:|---:|---:|---:|")
    for name, model in variants.items():
        macs = kenosis_rewrite.explain(model).integer_mac_fraction
        print(f"| {name} | {macs:.1%} | {scores[name]['cosine']:.5f} | {speed[1][name]:.2f} | {speed[2][name]:.2f} |")


if __name__ == "__main__":
    main()

"""Quantize a real model with onnxruntime's quantize_static (its defaults), fix it, compare.

    python examples/quickstart.py                     # open_nsfw: a ResNet-50-style classifier
    python examples/quickstart.py --model ddddocr_det # a YOLOX-style detector (SiLU)

The model comes from a pinned PyPI package (sha256-checked) and the inputs are real photos from
PyPI wheels, preprocessed the way the model's own package does it (see kenosis_rewrite.zoo).
Latency: one thread, warm-up, interleaved runs, median.
"""

from __future__ import annotations

import argparse
import sys

import onnxruntime as ort

import kenosis_rewrite
from kenosis_rewrite.benchmark import bench
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite import zoo


def _outputs(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), bench.session_options(1), providers=["CPUExecutionProvider"])
    return [session.run(None, feed) for feed in feeds]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="open_nsfw", choices=zoo.list_models())
    parser.add_argument("--runs", type=int, default=50, help="timed runs per model (default 50)")
    args = parser.parse_args(argv)

    print(f"fetching {args.model} and real photos (pinned PyPI packages, sha256-checked) ...", file=sys.stderr)
    spec = zoo.get_model(args.model)
    float_model = zoo.load_model(args.model)
    feeds = zoo.model_feeds(args.model, zoo.load_photos())
    calibration, evaluation = feeds[:6], feeds[6:]

    print("quantize_static with its defaults (QDQ, int8 activations, int8 weights) ...", file=sys.stderr)
    quantized = ort_quantize.quantize_with_ort(float_model, calibration, "default")
    fixed, report = kenosis_rewrite.fix(quantized, return_report=True)

    print("\n== what fix() changed ==")
    print(report.summary().split("\n    -")[0])
    print("\n== explain(): where ORT CPU runs integer kernels ==")
    print("quantize_static:", kenosis_rewrite.explain(quantized).summary().splitlines()[0])
    print("fixed:          ", kenosis_rewrite.explain(fixed).summary().splitlines()[0])

    models = {"FP32": float_model, "quantize_static": quantized, "quantize_static + fix()": fixed}
    print(f"\nmeasuring latency ({args.runs} interleaved runs each, 1 thread) ...", file=sys.stderr)
    latency = bench.measure_latency(models, evaluation[0], threads=1, warmup=20, runs=args.runs, min_seconds=3)
    reference = _outputs(float_model, evaluation)
    print(f"\n== {args.model}: {spec.structure} ==")
    # detectors and recognisers: their answers, decoded as their package decodes them, against FP32's
    task = f" {spec.task.name} vs FP32 |" if spec.task is not None else ""
    print(f"| model | median ms | vs FP32 | cosine vs FP32 | top-1 agreement |{task}")
    print("|---|---:|---:|---:|---:|" + ("---:|" if task else ""))
    for name, model in models.items():
        outputs = _outputs(model, evaluation)
        scores = bench.fidelity(reference, outputs, spec.class_output)
        top1 = f"{scores.top1_agreement:.0%}" if scores.top1_agreement is not None else "n/a"
        speed = latency["FP32"].median_ms / latency[name].median_ms
        answer = spec.task(reference, outputs) if spec.task is not None else None
        shown = "" if spec.task is None else f" {answer:.3f} |" if answer is not None else " n/a |"
        print(f"| {name} | {latency[name].median_ms:.2f} | {speed:.2f}x | {scores.cosine:.5f} | {top1} |{shown}")
    if spec.task is not None:
        print(f"\n{spec.task.name}: {spec.task.description}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

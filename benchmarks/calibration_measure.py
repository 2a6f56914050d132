"""Measurements (a script, not a test): synthetic vs real-photo calibration, and calibration memory.

    python benchmarks/calibration_measure.py fidelity MODEL.onnx --calib-wheels W.whl ... --eval-wheels W.whl ...
    python benchmarks/calibration_measure.py memory MODEL.onnx --samples 500

(A research script: it lived in the package as ``kenosis_rewrite.calibration.measure``.)

Photos are read straight out of PyPI wheels (zip files), see shared research "Real photos".
Calibration photos and evaluation photos are different files; each photo yields several random
crops and flips. Both quantized models (default quantize_static config, precomputed ranges via
``quantize_with_ranges``) are scored against FP32 on the same evaluation feeds.
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import time
import zipfile
from collections.abc import Iterator

import numpy as np

from kenosis_rewrite.calibration import (
    collect_ranges,
    describe,
    image_feeds,
    infer_inputs,
    iter_synthetic_feeds,
    quantize_with_ranges,
)
from kenosis_rewrite.calibration.collect import _float_proto
from kenosis_rewrite.core import fidelity

_PHOTO_SUFFIXES = (".jpg", ".jpeg", ".png")
_PHOTO_DIRS = ("skimage/data/", "sklearn/datasets/images/", "matplotlib/mpl-data/sample_data/")
_SKIP = ("logo", "mask", "text", "page", "horse", "checker", "camera", "moon", "coins", "clock", "cell",
         "brick", "grass", "gravel", "rough", "kidney", "lily", "retina", "lbp", "microaneurysms",
         "binary", "shepp", "phantom", "eagle", "immuno", "ihc", "palisades", "skin", "motorcycle_disp",
         "motorcycle_right", "colorwheel", "hubble", "chessboard", "s1045", "membrane", "cubic", "stent")


def wheel_photos(wheel: str) -> list[np.ndarray]:
    """RGB uint8 photos stored in a wheel (natural colour photos only)."""
    from PIL import Image

    photos = []
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(archive.namelist()):
            base = name.rsplit("/", 1)[-1].lower()
            if not name.startswith(_PHOTO_DIRS) or not base.endswith(_PHOTO_SUFFIXES) or \
                    any(s in base for s in _SKIP):
                continue
            image = Image.open(io.BytesIO(archive.read(name)))
            if image.mode not in ("RGB", "RGBA") or min(image.size) < 200:
                continue
            photos.append(np.asarray(image.convert("RGB")))
    return photos


def augmented(photos: list[np.ndarray], per_photo: int, seed: int) -> Iterator[np.ndarray]:
    """Random crops (50-100 % of the short side) with random horizontal flips."""
    rng = np.random.default_rng(seed)
    for photo in photos:
        height, width = photo.shape[:2]
        for _ in range(per_photo):
            side = int(min(height, width) * rng.uniform(0.5, 1.0))
            top, left = rng.integers(0, height - side + 1), rng.integers(0, width - side + 1)
            crop = photo[top:top + side, left:left + side]
            yield crop[:, ::-1] if rng.random() < 0.5 else crop


def _top1(reference: list, outputs: list) -> float:
    """Top-1 agreement of the first output, each sample's output flattened to one row of classes."""
    return float(np.mean([fidelity.top1_agreement(r[0].reshape(1, -1), o[0].reshape(1, -1))
                          for r, o in zip(reference, outputs)]))


def logits_model(model):
    """``model`` cut before a final Softmax, so fidelity is measured on logits, not saturated probabilities."""
    import onnx

    last = {out: node for node in model.graph.node for out in node.output}
    outputs = list(model.graph.output)
    node = last.get(outputs[0].name)
    if node is None or node.op_type != "Softmax":
        return model
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    cut.graph.node.remove(next(n for n in cut.graph.node if n.output[0] == outputs[0].name))
    del cut.graph.output[:]
    cut.graph.output.append(onnx.ValueInfoProto(name=node.input[0]))
    return onnx.shape_inference.infer_shapes(cut)


def fidelity_report(model_path: str, calib_photos: list, eval_photos: list, samples: int, methods: list[str]) -> dict:
    """Cosine / top-1 agreement vs FP32 of synthetic- and photo-calibrated quantized models."""
    model = logits_model(_float_proto(model_path))
    specs = infer_inputs(model)
    print(describe(specs))
    per_photo = max(1, -(-samples // len(calib_photos)))
    eval_feeds = list(image_feeds(model, augmented(eval_photos, 8, seed=1), specs=specs))
    reference = fidelity.run(model, eval_feeds)
    report = {"model": model_path, "eval_feeds": len(eval_feeds), "calib_samples": samples, "results": {}}
    for method in methods:
        for source in ("synthetic", "photos"):
            if source == "synthetic":
                feeds = lambda: iter_synthetic_feeds(model, samples, 0, specs)  # noqa: E731
            else:
                feeds = lambda: image_feeds(model, augmented(calib_photos, per_photo, 0), samples, specs=specs)  # noqa: E731
            started = time.time()
            ranges = collect_ranges(model, feeds, method, progress=False)
            quantized = quantize_with_ranges(model, ranges)
            outputs = fidelity.run(quantized, eval_feeds)
            scores = fidelity.scores(reference, outputs)
            key = f"{method}/{source}"
            report["results"][key] = {"cosine": round(scores["cosine"], 5),
                                      "worst_cosine": round(scores["worst_cosine"], 5),
                                      "top1_agreement": round(_top1(reference, outputs), 4),
                                      "seconds": round(time.time() - started, 1)}
            print(key, report["results"][key], flush=True)
    return report


def memory_report(model_path: str, samples: int, method: str) -> dict:
    """Peak RSS growth while calibrating ``samples`` synthetic samples (lazy feeds, streaming)."""
    model = _float_proto(model_path)
    specs = infer_inputs(model)
    cold = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    warm = list(iter_synthetic_feeds(model, 1, 0, specs))
    collect_ranges(model, warm, method, progress=False)  # load ORT and allocate once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.time()
    ranges = collect_ranges(model, lambda: iter_synthetic_feeds(model, samples, 0, specs), method)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"model": model_path, "samples": ranges.samples, "tensors": len(ranges), "method": method,
            "peak_rss_model_loaded_mb": cold / 1024, "extra_peak_over_model_loaded_mb": (after - cold) / 1024,
            "peak_rss_after_one_sample_mb": before / 1024, "peak_rss_after_mb": after / 1024,
            "extra_peak_over_one_sample_mb": (after - before) / 1024, "seconds": round(time.time() - started, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["fidelity", "memory"])
    parser.add_argument("model")
    parser.add_argument("--calib-wheels", nargs="*", default=[])
    parser.add_argument("--eval-wheels", nargs="*", default=[])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--methods", nargs="*", default=["minmax", "percentile"])
    args = parser.parse_args(argv)
    if args.what == "memory":
        print(json.dumps(memory_report(args.model, args.samples, args.methods[-1]), indent=1))
        return
    calib = [p for w in args.calib_wheels for p in wheel_photos(w)]
    evaluation = [p for w in args.eval_wheels for p in wheel_photos(w)]
    print(f"{len(calib)} calibration photos, {len(evaluation)} evaluation photos")
    print(json.dumps(fidelity_report(args.model, calib, evaluation, args.samples, args.methods), indent=1))


if __name__ == "__main__":
    main()

"""fix() on other quantizers' transformer outputs: quantize_static's defaults, and NNCF if installed.

    python benchmarks/fix_peer_transformers.py [--nncf PYTHON] [--seconds S] [--pin] [MODEL ...]

``--nncf`` names a Python that has NNCF (``kenosis-rewrite peers install nncf`` puts one at
``~/.cache/kenosis_rewrite/peers/nncf/bin/python``); NNCF runs there, in its own process, with
``model_type=TRANSFORMER``. Models: the DINOv2 ViT-S (8 street photos calibrate, 8 object photos
score the heat map) and paraphrase-MiniLM-L3 (16 sentences calibrate, 32 others score the sentence
embedding). One thread, interleaved medians; cosine against FP32, mean / worst. ``--pin`` adds a
row per quantizer for ``fix(..., input_shapes=)`` with the feeds' shapes (shape arithmetic folded).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import textwrap

import numpy as np
import onnx

import kenosis_rewrite
from kenosis_rewrite import zoo
from kenosis_rewrite.core import fidelity, interleaved_timing, ort_quantize
from kenosis_rewrite.testing import model_checks
from kenosis_rewrite.zoo import text

_NNCF = textwrap.dedent("""
    import sys, numpy as np, onnx, nncf
    data = np.load(sys.argv[3])
    names = sorted({key.rsplit("_", 1)[0] for key in data.files})
    count = len(data.files) // len(names)
    feeds = [{name: data[f"{name}_{i}"] for name in names} for i in range(count)]
    model = nncf.quantize(onnx.load(sys.argv[1]), nncf.Dataset(feeds), model_type=nncf.ModelType.TRANSFORMER)
    onnx.save(model, sys.argv[2])
""")


def _inputs(name: str):
    if name == "vit_s_focus":
        feeds = zoo.model_feeds(name, zoo.load_photo_set("scenes", 8) + zoo.load_photo_set("objects", 8))
        return zoo.load_model(name), feeds[:8], feeds[8:], 0
    model = text.load_text_model(name)
    index = [o.name for o in model.graph.output].index(text.get_text_model(name).embedding_output)
    return (model, text.text_feeds(name, text.sentences(16)),
            text.text_feeds(name, text.sentences(32, offset=16)), index)


def _nncf(python: str, model: onnx.ModelProto, calibration: list[dict]) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory() as tmp:
        source, target, data = (os.path.join(tmp, f) for f in ("f.onnx", "q.onnx", "feeds.npz"))
        onnx.save(model, source)
        np.savez(data, **{f"{key}_{i}": value for i, feed in enumerate(calibration) for key, value in feed.items()})
        subprocess.run([python, "-c", _NNCF, source, target, data], check=True, capture_output=True)
        return onnx.load(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nncf", metavar="PYTHON", default=None)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--pin", action="store_true", help="also fix(input_shapes=the feeds' shapes)")
    parser.add_argument("models", nargs="*", default=["vit_s_focus", "minilm_l3_paraphrase"])
    args = parser.parse_args()
    print("| model | quantizer | cosine before fix | cosine after fix | ms before | ms after | FP32 ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.models:
        model, calibration, held_out, index = _inputs(name)
        peers = {"quantize_static default": ort_quantize.quantize_with_ort(model, calibration, "default")}
        if args.nncf:
            peers["NNCF (transformer)"] = _nncf(args.nncf, model, calibration)
        reference = [model_checks.outputs(model, feed)[index] for feed in held_out]
        shapes = {key: list(value.shape) for key, value in held_out[0].items()}
        for label, quantized in peers.items():
            fixes = {"fix": kenosis_rewrite.fix(quantized)}
            if args.pin:
                fixes["fix(input_shapes)"] = kenosis_rewrite.fix(quantized, input_shapes=shapes, calibration=calibration)
            for how, fixed in fixes.items():
                cosines = {key: [fidelity.cosine(r, model_checks.outputs(m, feed)[index]) for r, feed in zip(reference, held_out)]
                           for key, m in (("before", quantized), ("after", fixed))}
                sessions = {key: interleaved_timing.session(m.SerializeToString(), 1)
                            for key, m in (("fp32", model), ("before", quantized), ("after", fixed))}
                ms = {key: value * 1e3 for key, value in
                      interleaved_timing.interleaved_medians(sessions, held_out[0], seconds=args.seconds).items()}
                cells = " | ".join(f"{np.mean(cosines[k]):.5f} / {np.min(cosines[k]):.5f}" for k in ("before", "after"))
                print(f"| {name} | {label}, {how} | {cells} | {ms['before']:.2f} | {ms['after']:.2f} | {ms['fp32']:.2f} |",
                      flush=True)

if __name__ == "__main__":
    main()

"""quantize() an FP32 model: calibrate, quantize, fix, check against FP32, and save; print what it did.

    python examples/quantize_model.py mtcnn_onet onet_int8.onnx                   # a zoo model, real photos
    python examples/quantize_model.py MODEL.onnx OUT.onnx --calibration PHOTOS/   # yours, a folder of images
    python examples/quantize_model.py MODEL.onnx OUT.onnx --calibration synthetic # no data at hand

A zoo model (``kenosis_rewrite.zoo.list_models()``) is calibrated on the zoo's real photos,
preprocessed as its package does. For your own model, ``--calibration`` is a folder of images
(resized and normalised for the model's image input, see ``quantize``'s docstring), ``synthetic``,
or left out: quantize() then calibrates itself. Feed dicts (``[{input name: array}, ...]``) are
what to pass in your own code when you have them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import kenosis_rewrite
from kenosis_rewrite import zoo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a zoo model name or an FP32 .onnx file")
    parser.add_argument("output", help="where to save the quantized model")
    parser.add_argument("--calibration", help="a folder of images or 'synthetic' (your own model only)")
    parser.add_argument("--samples", type=int, default=32, help="calibration samples to use (default 32)")
    args = parser.parse_args(argv)

    if args.model in zoo.list_models():
        model, calibration = zoo.load_model(args.model), zoo.model_feeds(args.model, zoo.load_photos())
    else:
        model, calibration = args.model, args.calibration  # quantize() takes a path as well

    start = time.perf_counter()
    quantized, report = kenosis_rewrite.quantize(model, calibration, calibration_samples=args.samples,
                                                 return_report=True)
    seconds = time.perf_counter() - start
    print(f"quantize() took {seconds:.1f} s\n")
    # the summary without the one line per candidate a rule left alone
    print("\n".join(line for line in report.summary().splitlines() if not line.startswith("    - ")))
    print("\n" + kenosis_rewrite.explain(quantized).summary())

    kenosis_rewrite.save(quantized, args.output)
    print(f"\nsaved {args.output} ({os.path.getsize(args.output) / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

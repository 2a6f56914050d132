"""One of fix()'s placement rules on its own, through onnxscript's rewriter: PRelu -> LeakyRelu / Relu + Min.

    python examples/custom_rule.py                    # a Conv -> PRelu toy, one slope for every channel
    python examples/custom_rule.py --toy conv_prelu   # a slope per channel

Every rule in ``kenosis_rewrite.placement.rules`` is an onnxscript ``RewriteRule``; each module has
a function returning its ``RewriteRuleSet``, which takes a ``kenosis_rewrite.FixReport`` to record
what it changed and what it left alone, and why. So a rule can run in your own onnxscript / onnx-ir
pipeline, beside your own rules, without the rest of fix(). Here: a toy model from
``kenosis_rewrite.testing.toy_models``, quantized by onnxruntime's quantize_static, then the PRelu
rules alone. ORT CPU has only a float PRelu kernel; the rewritten model runs QLinearLeakyRelu.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_static
from onnxscript import rewriter

import kenosis_rewrite
from kenosis_rewrite.placement.rules.prelu import prelu_rules
from kenosis_rewrite.testing import toy_models


class FeedsReader(CalibrationDataReader):
    def __init__(self, feeds):
        self.feeds = iter(feeds)

    def get_next(self):
        return next(self.feeds, None)


def quantized(model: onnx.ModelProto, feeds) -> onnx.ModelProto:
    """quantize_static, QDQ format, uint8 activations, int8 weights."""
    with tempfile.TemporaryDirectory() as tmp:
        source, target = os.path.join(tmp, "float.onnx"), os.path.join(tmp, "qdq.onnx")
        onnx.save(model, source)
        quantize_static(source, target, FeedsReader(feeds), activation_type=QuantType.QUInt8)
        return onnx.load(target)


def run(model: onnx.ModelProto, feeds, optimized: bool) -> tuple[list[np.ndarray], collections.Counter]:
    """Outputs on ``feeds`` and the op types of the graph ORT runs (all optimizations, or none)."""
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.optimized_model_filepath = os.path.join(tmp, "ran.onnx")
        options.log_severity_level = 3
        if not optimized:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        ran = collections.Counter(node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node)
    return [session.run(None, feed)[0] for feed in feeds], ran


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", default="conv_prelu_uniform", choices=["conv_prelu_uniform", "conv_prelu"])
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization's pre-processing hint
    float_model = toy_models.build(args.toy)
    feeds = toy_models.random_feeds(float_model, 8)
    before = quantized(float_model, feeds[:4])

    report = kenosis_rewrite.FixReport()
    after = rewriter.rewrite(before, pattern_rewrite_rules=prelu_rules(report))  # also drops unused nodes
    print(report.summary())

    for optimized in (False, True):
        (old, old_ops), (new, new_ops) = (run(m, feeds[4:], optimized) for m in (before, after))
        difference = max(float(np.max(np.abs(a - b))) for a, b in zip(old, new))
        label = "all ORT optimizations" if optimized else "no ORT optimization"
        print(f"\n{label}: outputs differ by at most {difference:.3g}")
        print(f"  ORT runs before: {dict(old_ops)}")
        print(f"  ORT runs after:  {dict(new_ops)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tests of the PRelu replacement rules."""

from __future__ import annotations

import numpy as np
import onnx

from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.placement.rules.prelu import prelu_rules
from kenosis_rewrite.testing import model_checks, toy_models

PRELU = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,3,4,4] x) => (float[1,3,4,4] y)
<float[3,1,1] slope = {{{slope}}}>
{{ y = PRelu(x, slope) }}
"""


def _apply(proto):
    return model_checks.apply_reporting_rules(proto, prelu_rules)


def _assert_bit_identical(a, b, n=4):
    for seed in range(n):
        feed = {"x": np.random.default_rng(seed).standard_normal((1, 3, 4, 4)).astype(np.float32)}
        np.testing.assert_array_equal(model_checks.outputs(a, feed)[0], model_checks.outputs(b, feed)[0])


def test_uniform_slope_becomes_leakyrelu_exactly():
    proto = onnx.parser.parse_model(PRELU.format(slope="0.25, 0.25, 0.25"))
    fixed, report, count = _apply(proto)
    assert count == 1
    (node,) = fixed.graph.node
    assert node.op_type == "LeakyRelu" and node.attribute[0].f == np.float32(0.25)
    assert [c.rule for c in report.changes] == ["prelu-to-leakyrelu"]
    _assert_bit_identical(proto, fixed)


def test_per_channel_slope_becomes_relu_min_mul_add_exactly():
    proto = onnx.parser.parse_model(PRELU.format(slope="0.1, -0.2, 0.37"))
    fixed, report, count = _apply(proto)
    assert count == 1
    assert sorted(model_checks.op_types(fixed)) == ["Add", "Min", "Mul", "Relu"]
    assert [c.rule for c in report.changes] == ["prelu-to-relu-min"]
    _assert_bit_identical(proto, fixed)


def test_non_constant_slope_is_refused_with_reason():
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,3,4,4] x, float[3,1,1] slope) => (float[1,3,4,4] y) { y = PRelu(x, slope) }""")
    fixed, report, count = _apply(proto)
    assert count == 0
    assert {r.reason for r in report.refusals} == {"slope 'slope' is not a constant"}


def test_quantized_prelu_models_keep_their_outputs_and_lose_the_prelu_kernel():
    for name, expected in (("conv_prelu_uniform", "QLinearLeakyRelu"), ("conv_prelu", "Min")):
        float_model = toy_models.build(name)
        feeds = toy_models.random_feeds(float_model, 4)
        qdq = ort_quantize.quantize_with_ort(float_model, feeds, "u8s8")
        fixed, _, count = _apply(qdq)
        assert count == 1
        optimized = model_checks.ort_optimized_op_types(fixed)
        assert "PRelu" not in optimized and expected in optimized
        for feed in feeds:
            np.testing.assert_array_equal(model_checks.outputs(qdq, feed)[0], model_checks.outputs(fixed, feed)[0])

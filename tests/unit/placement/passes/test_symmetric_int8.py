"""Tests of the symmetric int8 requantization pass."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.placement.passes.symmetric_int8 import RULE_NAME, SymmetricActivationsPass
from kenosis_rewrite.testing import model_checks, toy_models


def _apply(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, FixReport]:
    return model_checks.apply_pass(proto, SymmetricActivationsPass)


def test_range_is_kept_and_zero_point_is_zero():
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[8] x) => (float[8] y)
    <float s = {0.1}, uint8 z = {100}>
    { a = Sin(x)  q = QuantizeLinear(a, s, z)  y = DequantizeLinear(q, s, z) }""")
    out, report = _apply(proto)
    q = model_checks.producer_of(out, "q")
    assert float(model_checks.initializer(out, q.input[1])) == pytest.approx(0.1 * 155 / 127)
    assert model_checks.initializer(out, q.input[2]).dtype == np.int8 and int(model_checks.initializer(out, q.input[2])) == 0
    assert [c.rule for c in report.changes] == [RULE_NAME]
    feed = {"x": np.linspace(-1.6, 1.6, 8).astype(np.float32)}
    np.testing.assert_allclose(model_checks.outputs(out, feed)[0], np.sin(feed["x"]), atol=0.1 * 155 / 127 / 2 + 1e-6)


def test_relu_the_quantizer_deleted_comes_back():
    float_model = toy_models.build("conv_relu")
    feeds = toy_models.random_feeds(float_model, 6)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds[:3], "default")  # Relu folded into zp=-128
    assert "Relu" not in model_checks.op_types(qdq)
    out, report = _apply(qdq)
    assert model_checks.op_types(out)["Relu"] == 1
    assert any("Relu restored" in c.detail for c in report.changes)
    scores = fidelity.compare_to_float(float_model, {"sym": out}, feeds[3:])
    assert scores["sym"]["cosine"] > 0.999


def test_uint8_weights_become_symmetric_int8_per_channel():
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,2,2] x) => (float[1,2,2,2] y)
    <uint8[2,2,1,1] w = {10, 200, 128, 0}, float[2] sw = {0.01, 0.02}, uint8[2] zw = {128, 128}>
    { dw = DequantizeLinear<axis=0>(w, sw, zw)  y = Conv(x, dw) }""")
    out, _ = _apply(proto)
    dq = model_checks.producer_of(out, "dw")
    weights = model_checks.initializer(out, dq.input[0])
    assert weights.dtype == np.int8 and not model_checks.initializer(out, dq.input[2]).any()
    feed = {"x": np.random.default_rng(0).standard_normal((1, 2, 2, 2)).astype(np.float32)}
    np.testing.assert_allclose(model_checks.outputs(out, feed)[0], model_checks.outputs(proto, feed)[0], atol=0.02)


_SOFTMAX_HEAD = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,400] x) => (float[1,400] y{extra_output})
<float s = {{0.00392157}}, uint8 z = {{0}}>
{{ p = Softmax(x)  q = QuantizeLinear(p, s, z)  y = DequantizeLinear(q, s, z) {extra_node} }}"""


def test_one_sided_graph_output_is_left_float_not_rounded_to_zero():
    # a Softmax over 400 classes: values near 1/400, below the symmetric step 1/127
    proto = onnx.parser.parse_model(_SOFTMAX_HEAD.format(extra_output="", extra_node=""))
    out, report = _apply(proto)
    assert "QuantizeLinear" not in model_checks.op_types(out) and "DequantizeLinear" not in model_checks.op_types(out)
    assert [o.name for o in out.graph.output] == ["y"]
    assert [c.rule for c in report.changes] == [RULE_NAME] and "left float" in report.changes[0].detail
    onnx.checker.check_model(out, full_check=True)
    x = np.random.default_rng(0).standard_normal((1, 400)).astype(np.float32)
    probabilities = np.exp(x) / np.exp(x).sum()
    got, given = model_checks.outputs(out, {"x": x})[0], model_checks.outputs(proto, {"x": x})[0]
    np.testing.assert_allclose(got, probabilities, rtol=1e-5)
    # closer to the float model than the input model
    assert np.abs(got - probabilities).max() < np.abs(given - probabilities).max()


def test_one_sided_tensor_an_op_reads_still_becomes_symmetric():
    proto = onnx.parser.parse_model(_SOFTMAX_HEAD.format(extra_output=", float[1,400] n", extra_node="n = Neg(y)"))
    out, report = _apply(proto)
    q = model_checks.producer_of(out, "q")
    assert q.op_type == "QuantizeLinear" and model_checks.initializer(out, q.input[2]).dtype == np.int8
    assert float(model_checks.initializer(out, q.input[1])) == pytest.approx(0.00392157 * 255 / 127)
    assert all("left float" not in c.detail for c in report.changes)


def test_a_graph_output_left_float_keeps_the_clamps_its_quantizer_applied():
    # the Q over [0, 2.55] clamps 3 * x (x in [-1, 1]) on both sides: a deleted Relu/Clip or a
    # calibrated bound, the graph cannot tell; the float output keeps both
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[64] x) => (float[64] y)
    <float three = {3.0}, float s = {0.01}, uint8 z = {0}>
    { a = Mul(x, three)  q = QuantizeLinear(a, s, z)  y = DequantizeLinear(q, s, z) }""")
    out, report = _apply(proto)
    assert "QuantizeLinear" not in model_checks.op_types(out) and "left float" in report.changes[0].detail
    x = np.linspace(-1, 1, 64).astype(np.float32)
    np.testing.assert_allclose(model_checks.outputs(out, {"x": x})[0], np.clip(3 * x, 0, 2.55), rtol=1e-6, atol=1e-6)

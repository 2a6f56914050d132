"""Tests of the stale int32 bias requantization pass."""

from __future__ import annotations

import numpy as np
import onnx

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.placement.passes.bias_rescale import RULE_NAME, BiasRescalePass
from kenosis_rewrite.testing import model_checks

CONV = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,4,4] x) => (float[1,2,4,4] y)
<float sx = {{0.05}}, uint8 zx = {{0}}, int8[2,2,1,1] w = {{60, -30, 20, 90}}, float[2] sw = {{0.01, 0.02}},
 int8[2] zw = {{0, 0}}, int32[2] b = {{{bias}}}, float[2] sb = {{{sb}}}, float sy = {{0.1}}, uint8 zy = {{128}}>
{{
  qx = QuantizeLinear(x, sx, zx)
  dx = DequantizeLinear(qx, sx, zx)
  dw = DequantizeLinear<axis=0>(w, sw, zw)
  db = DequantizeLinear<axis=0>(b, sb)
  c = Conv(dx, dw, db)
  qc = QuantizeLinear(c, sy, zy)
  y = DequantizeLinear(qc, sy, zy)
}}
"""


def _apply(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, FixReport]:
    return model_checks.apply_pass(proto, BiasRescalePass)


def test_stale_per_channel_bias_is_requantized_to_input_times_weight_scale():
    # bias scale 0.0007 / 0.0013 was right for an input scale of 0.07 / a different weight scale.
    proto = onnx.parser.parse_model(CONV.format(bias="1000, -2000", sb="0.0007, 0.0013"))
    fixed, report = _apply(proto)
    db = model_checks.producer_of(fixed, "db")
    np.testing.assert_allclose(model_checks.initializer(fixed, db.input[1]), [0.0005, 0.001], rtol=1e-6)
    np.testing.assert_array_equal(model_checks.initializer(fixed, db.input[0]), [1400, -2600])
    assert [c.rule for c in report.changes] == [RULE_NAME]
    feed = {"x": np.random.default_rng(0).uniform(0, 5, (1, 2, 4, 4)).astype(np.float32)}
    before, after = model_checks.outputs(proto, feed, optimized=False)[0], model_checks.outputs(fixed, feed, optimized=False)[0]
    # the bias moved by at most half a step of its new scale, so outputs move by at most one output step
    np.testing.assert_allclose(after, before, atol=0.1 + 1e-6)
    assert "QLinearConv" not in model_checks.ort_optimized_op_types(proto)
    assert "QLinearConv" in model_checks.ort_optimized_op_types(fixed)


def test_consistent_bias_is_left_alone():
    proto = onnx.parser.parse_model(CONV.format(bias="1000, -2000", sb="0.0005, 0.001"))
    fixed, report = _apply(proto)
    assert not report.changes
    assert model_checks.producer_of(fixed, "db").input[0] == "b"


def test_gemm_with_alpha_is_refused_with_reason():
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2] x) => (float[1,2] y)
    <float sx = {0.05}, uint8 zx = {0}, int8[2,2] w = {60, -30, 20, 90}, float sw = {0.01}, int8 zw = {0},
     int32[2] b = {10, 20}, float sb = {0.0009}>
    { qx = QuantizeLinear(x, sx, zx)  dx = DequantizeLinear(qx, sx, zx)  dw = DequantizeLinear(w, sw, zw)
      db = DequantizeLinear(b, sb)  y = Gemm<alpha=2.0>(dx, dw, db) }""")
    _, report = _apply(proto)
    assert [r.reason for r in report.refusals] == ["Gemm with alpha or beta other than 1 has no integer bias"]


INT8_BIAS_CONV = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,4,4] x) => (float[1,2,4,4] y)
<float sx = {0.0625}, uint8 zx = {128}, int8[2,2,1,1] w = {60, -30, 20, 90}, float sw = {0.0078125},
 int8 zw = {0}, int8[2] b = {50, -77}, float sb = {0.001953125}, int8 zb = {0}, float sy = {0.125}, uint8 zy = {128}>
{
  qx = QuantizeLinear(x, sx, zx)
  dx = DequantizeLinear(qx, sx, zx)
  dw = DequantizeLinear(w, sw, zw)
  db = DequantizeLinear(b, sb, zb)
  c = Conv(dx, dw, db)
  qc = QuantizeLinear(c, sy, zy)
  y = DequantizeLinear(qc, sy, zy)
}
"""


def test_int8_bias_becomes_int32_at_input_times_weight_scale_and_the_conv_fuses():
    """Quark's XINT8 preset writes int8 biases with their own power-of-two scale: ORT keeps such a Conv float."""
    proto = onnx.parser.parse_model(INT8_BIAS_CONV)
    fixed, report = _apply(proto)
    db = model_checks.producer_of(fixed, "db")
    assert model_checks.initializer(fixed, db.input[1]) == np.float32(0.0625 * 0.0078125)
    # powers of two: 50 * 2^-9 / 2^-11 = 200 exactly
    np.testing.assert_array_equal(model_checks.initializer(fixed, db.input[0]), np.array([200, -308], np.int32))
    assert len(db.input) == 2 and [c.detail.split(" ->")[0] for c in report.changes] == ["int8 bias"]
    feed = {"x": np.random.default_rng(0).uniform(-5, 5, (1, 2, 4, 4)).astype(np.float32)}
    np.testing.assert_array_equal(model_checks.outputs(fixed, feed, optimized=False)[0],
                                  model_checks.outputs(proto, feed, optimized=False)[0])  # exact here: powers of two
    assert "QLinearConv" not in model_checks.ort_optimized_op_types(proto)
    assert "QLinearConv" in model_checks.ort_optimized_op_types(fixed)

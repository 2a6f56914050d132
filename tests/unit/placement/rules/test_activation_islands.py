"""Tests of the Relu/Clip island folding rules."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.placement.rules.activation_islands import activation_island_rules
from kenosis_rewrite.testing import model_checks, toy_models

# x -> Conv(int8 weights) -> Q1 -> DQ1 -> ACT -> Q2 -> DQ2 -> y, parameters filled in per test.
ISLAND = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,4,4] x) => (float[1,2,4,4] y)
<float sx = {{0.02}}, uint8 zx = {{128}}, int8[2,2,1,1] w = {{60, -30, 20, 90}}, float sw = {{0.01}},
 int8 zw = {{0}}, float s1 = {{{s1}}}, uint8 z1 = {{{z1}}}, float s2 = {{{s2}}}, uint8 z2 = {{{z2}}},
 float lo = {{{lo}}}, float hi = {{{hi}}}>
{{
  qx = QuantizeLinear(x, sx, zx)
  dx = DequantizeLinear(qx, sx, zx)
  dw = DequantizeLinear(w, sw, zw)
  c = Conv(dx, dw)
  q1 = QuantizeLinear(c, s1, z1)
  d1 = DequantizeLinear(q1, s1, z1)
  a = {act}
  q2 = QuantizeLinear(a, s2, z2)
  y = DequantizeLinear(q2, s2, z2)
}}
"""


def _island(act="Relu(d1)", s1=0.01, z1=128, s2=0.01, z2=0, lo=0.0, hi=6.0) -> onnx.ModelProto:
    return onnx.parser.parse_model(ISLAND.format(act=act, s1=s1, z1=z1, s2=s2, z2=z2, lo=lo, hi=hi))


def _apply(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, FixReport, int]:
    return model_checks.apply_reporting_rules(proto, activation_island_rules)


def _feed(scale=1.0, seed=0):
    return {"x": (np.random.default_rng(seed).standard_normal((1, 2, 4, 4)) * scale).astype(np.float32)}


def test_relu_island_with_equal_grids_folds_bit_exactly():
    proto = _island()
    fixed, report, count = _apply(proto)
    assert count == 1
    relu = model_checks.producer_of(fixed, model_checks.producer_of(fixed, "y").input[0]).input[0]
    assert model_checks.producer_of(fixed, relu).op_type == "Relu"
    assert model_checks.producer_of(fixed, model_checks.producer_of(fixed, relu).input[0]).op_type == "Conv"
    assert [c.exact for c in report.changes] == [True]
    for seed in range(5):  # |conv output| stays inside Q1's range, so the fold is bit-exact
        feed = _feed(0.5, seed)
        np.testing.assert_array_equal(
            model_checks.outputs(proto, feed, optimized=False)[0], model_checks.outputs(fixed, feed, optimized=False)[0]
        )


def test_symmetric_relu_island_requantizes_onto_finer_grid_and_removes_float_relu():
    proto = _island(s1=0.01, z1=128, s2=0.01, z2=128)
    fixed, report, _ = _apply(proto)
    q2 = model_checks.producer_of(fixed, "q2") or model_checks.producer_of(fixed, model_checks.producer_of(fixed, "y").input[0])
    new_scale = float(model_checks.initializer(fixed, q2.input[1]))
    assert new_scale == pytest.approx(0.01 * 127 / 255)
    assert int(model_checks.initializer(fixed, q2.input[2])) == 0
    assert report.changes[0].exact is False
    y_dq = model_checks.producer_of(fixed, "y")
    assert y_dq.input[1] == q2.input[1] and y_dq.input[2] == q2.input[2]
    assert "Relu" not in model_checks.ort_optimized_op_types(fixed)
    assert "Relu" in model_checks.ort_optimized_op_types(proto)
    # Against the float computation the folded model is at least as accurate.
    float_model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,4,4] x) => (float[1,2,4,4] y)
    <float[2,2,1,1] w = {0.6, -0.3, 0.2, 0.9}>
    { c = Conv(x, w)  y = Relu(c) }""")
    for seed in range(3):
        feed = _feed(1.0, seed)
        reference = model_checks.outputs(float_model, feed)[0]
        before = model_checks.sqnr_db(reference, model_checks.outputs(proto, feed)[0])
        after = model_checks.sqnr_db(reference, model_checks.outputs(fixed, feed)[0])
        assert after >= before - 0.1


def test_clip_island_keeps_upper_bound_and_lets_ort_drop_the_clip():
    proto = _island(act="Clip(d1, lo, hi)", s1=0.02, z1=128, s2=0.02, z2=128, hi=2.0)
    fixed, report, count = _apply(proto)
    assert count == 1
    q = model_checks.producer_of(fixed, model_checks.producer_of(fixed, "y").input[0])
    # representable upper bound 0.02 * 127 = 2.54 is capped at the Clip's 2.0
    assert float(model_checks.initializer(fixed, q.input[1])) == pytest.approx(2.0 / 255)
    assert "Clip" not in model_checks.ort_optimized_op_types(fixed)
    assert model_checks.ort_optimized_op_types(fixed)["QLinearConv"] == 1


def test_clip_with_negative_lower_bound_is_refused_with_reason():
    proto = _island(act="Clip(d1, lo, hi)", lo=-1.0)
    fixed, report, count = _apply(proto)
    assert count == 0
    assert report.refusals[0].reason == "Clip lower bound -1.0 is not 0, so Clip does not commute with dequantization"
    assert model_checks.op_types(fixed) == model_checks.op_types(proto)


def test_output_read_by_float_op_is_refused():
    text = ISLAND.replace("y = DequantizeLinear(q2, s2, z2)", "y = Cast<to=1>(q2)").replace(
        "(float[1,2,4,4] y)", "(float[1,2,4,4] y)")
    proto = onnx.parser.parse_model(text.format(act="Relu(d1)", s1=0.01, z1=128, s2=0.01, z2=0, lo=0, hi=6))
    _, report, count = _apply(proto)
    assert count == 0
    assert "read by a non-DequantizeLinear node" in report.refusals[0].reason


def test_graph_input_before_island_is_not_matched_as_foldable():
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4] x) => (float[4] y)
    <float s = {0.1}, uint8 z = {128}, uint8 z0 = {0}>
    { q = QuantizeLinear(x, s, z)  d = DequantizeLinear(q, s, z)  r = Relu(d)
      q2 = QuantizeLinear(r, s, z0)  y = DequantizeLinear(q2, s, z0) }""")
    _, report, count = _apply(proto)
    assert count == 0
    assert "graph input" in report.refusals[0].reason


@pytest.mark.parametrize("config", ["sym", "keep", "convmm"])
@pytest.mark.parametrize("name", ["conv_relu", "conv_clip", "gemm_relu", "matmul_relu"])
def test_quantize_static_islands_fold_on_toy_models(name, config):
    float_model = toy_models.build(name)
    feeds = toy_models.random_feeds(float_model, 4)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds, config, activation_type=ort_quantize.QuantType.QUInt8)
    fixed, report, count = _apply(qdq)
    assert count >= 1, report.summary()
    activations = [n for n in fixed.graph.node if n.op_type in ("Relu", "Clip")]
    for act in activations:  # every activation now reads the weighted op directly
        assert model_checks.producer_of(fixed, act.input[0]).op_type in ("Conv", "MatMul", "Gemm")


FUSED_OUTPUT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,4,4] x) => (float[1,2,4,4] y)
<float sx = {{0.02}}, uint8 zx = {{128}}, int8[2,2,1,1] w = {{60, -30, 20, 90}}, float sw = {{0.01}},
 int8 zw = {{0}}, float s2 = {{{s2}}}, uint8 z2 = {{{z2}}}, float lo = {{0.0}}, float hi = {{{hi}}}>
{{
  qx = QuantizeLinear(x, sx, zx)
  dx = DequantizeLinear(qx, sx, zx)
  dw = DequantizeLinear(w, sw, zw)
  c = Conv(dx, dw)
  a = {act}
  q2 = QuantizeLinear(a, s2, z2)
  y = DequantizeLinear(q2, s2, z2)
}}
"""


@pytest.mark.parametrize("act, z2, hi, rule", [
    ("Relu(c)", 100, 6.0, "relu-zero-point-to-qmin"),
    ("Clip(c, lo, hi)", 100, 6.0, "clip-zero-point-to-qmin"),
    ("Clip(c, lo, hi)", 0, 0.5, "clip-zero-point-to-qmin"),  # zp already qmin, but Q range wider than Clip
])
def test_output_zero_point_moves_to_qmin_so_ort_fuses_the_conv(act, z2, hi, rule):
    proto = onnx.parser.parse_model(FUSED_OUTPUT.format(act=act, s2=0.01, z2=z2, hi=hi))
    assert "QLinearConv" not in model_checks.ort_optimized_op_types(proto)  # float FusedConv before
    fixed, report, count = _apply(proto)
    assert count == 1 and [c.rule for c in report.changes] == [rule]
    q = model_checks.producer_of(fixed, model_checks.producer_of(fixed, "y").input[0])
    assert int(model_checks.initializer(fixed, q.input[2])) == 0
    assert model_checks.ort_optimized_op_types(fixed)["QLinearConv"] == 1
    for seed in range(3):  # same range [0, u], finer grid: within one old step of the input model
        feed = _feed(1.0, seed)
        np.testing.assert_allclose(model_checks.outputs(fixed, feed)[0], model_checks.outputs(proto, feed)[0], atol=0.01 + 1e-6)


def test_already_fused_output_is_left_alone():
    proto = onnx.parser.parse_model(FUSED_OUTPUT.format(act="Relu(c)", s2=0.01, z2=0, hi=6.0))
    fixed, report, count = _apply(proto)
    assert count == 0 and not report.refusals

"""Tests of the activation-on-codes rules: Relu/Clip applied to the quantizer's codes, bit-exactly."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kenosis_rewrite.placement.rules.activation_on_codes import activation_on_codes_rules
from kenosis_rewrite.testing import model_checks

# x -> Conv(int8 weights) -> ACT -> Q -> DQ -> y; ACT reads c (the Conv) or d1 (an island's DQ).
CONV_ACT = """
<ir_version: 8, opset_import: ["" : {opset}]>
g (float[1,2,4,4] x) => (float[1,2,4,4] y)
<float sx = {{0.02}}, uint8 zx = {{128}}, int8[2,2,1,1] w = {{60, -30, 20, 90}}, float sw = {{0.01}},
 int8 zw = {{0}}, float s1 = {{{s1}}}, {dtype} z1 = {{{z1}}}, float s2 = {{{s2}}}, {dtype} z2 = {{{z2}}},
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


def _model(act="Relu(c)", s1=0.01, z1=128, s2=0.01, z2=128, lo=0.0, hi=6.0, dtype="uint8", opset=17) -> onnx.ModelProto:
    proto = onnx.parser.parse_model(CONV_ACT.format(act=act, s1=s1, z1=z1, s2=s2, z2=z2, lo=lo, hi=hi, dtype=dtype, opset=opset))
    if "d1" not in act:  # no island: the Conv feeds the activation directly
        nodes = [n for n in proto.graph.node if n.output[0] not in ("q1", "d1")]
        del proto.graph.node[:]
        proto.graph.node.extend(nodes)
    return proto


def _feeds(scale: float, count: int = 4) -> list[dict[str, np.ndarray]]:
    return [{"x": (np.random.default_rng(seed).standard_normal((1, 2, 4, 4)) * scale).astype(np.float32)}
            for seed in range(count)]


def _assert_bit_exact(before: onnx.ModelProto, after: onnx.ModelProto, scale: float = 1.0) -> None:
    for feed in _feeds(scale):
        for optimized in (False, True):
            np.testing.assert_array_equal(model_checks.outputs(before, feed, optimized)[0],
                                          model_checks.outputs(after, feed, optimized)[0])


@pytest.mark.parametrize("act, rule", [("Relu(c)", "relu-on-codes"), ("Clip(c, lo, hi)", "clip-on-codes")])
def test_an_activation_before_a_mid_range_zero_point_runs_on_codes_and_the_conv_is_integer(act, rule):
    proto = _model(act=act, s2=0.02, z2=128, hi=1.5)  # symmetric: half the codes never used after a Relu
    assert "QLinearConv" not in model_checks.ort_optimized_op_types(proto)  # a float FusedConv before
    fixed, report, count = model_checks.apply_reporting_rules(proto, activation_on_codes_rules)
    assert count == 1 and [c.rule for c in report.changes] == [rule] and report.changes[0].exact
    on_codes = model_checks.producer_of(fixed, model_checks.producer_of(fixed, "y").input[0])
    assert on_codes.op_type == ("Max" if rule == "relu-on-codes" else "Clip")
    assert model_checks.producer_of(fixed, on_codes.input[0]).op_type == "QuantizeLinear"
    assert model_checks.ort_optimized_op_types(fixed)["QLinearConv"] == 1
    _assert_bit_exact(proto, fixed, scale=3.0)  # a wide feed: the Q saturates, and the Clip's top cuts


@pytest.mark.parametrize("act, rule", [("Relu(d1)", "relu-island-on-codes"), ("Clip(d1, lo, hi)", "clip-island-on-codes")])
def test_a_symmetric_island_with_one_grid_becomes_its_activation_on_codes(act, rule):
    proto = _model(act=act, s1=0.02, z1=128, s2=0.02, z2=128, hi=1.5)  # quantize_static's symmetric island
    fixed, report, count = model_checks.apply_reporting_rules(proto, activation_on_codes_rules)
    assert count == 1 and [c.rule for c in report.changes] == [rule]
    ops = [n.op_type for n in fixed.graph.node]
    assert ops.count("QuantizeLinear") == 2 and "Relu" not in ops and ops.count("DequantizeLinear") == 3
    assert model_checks.ort_optimized_op_types(fixed)["QLinearConv"] == 1
    _assert_bit_exact(proto, fixed, scale=3.0)


def test_an_island_whose_grids_differ_keeps_its_requantization_and_the_relu_runs_on_the_second_grid():
    proto = _model(act="Relu(d1)", s1=0.03, z1=120, s2=0.02, z2=128)
    fixed, report, count = model_checks.apply_reporting_rules(proto, activation_on_codes_rules)
    assert any("differ" in r.reason for r in report.refusals if r.rule == "relu-island-on-codes")
    assert count == 1 and [c.rule for c in report.changes] == ["relu-on-codes"]  # DQ1 -> Q2 -> Max: still exact
    assert model_checks.ort_optimized_op_types(fixed)["QLinearConv"] == 1
    _assert_bit_exact(proto, fixed, scale=3.0)


def test_a_relu_the_quantizer_absorbs_is_left_to_ort():
    proto = _model(act="Relu(c)", z2=0)  # zero point at qmin: ORT drops the Relu itself
    _, report, count = model_checks.apply_reporting_rules(proto, activation_on_codes_rules)
    assert count == 0 and not report.refusals


def test_below_opset_12_there_is_no_8_bit_max_and_the_rule_says_so():
    proto = _model(act="Relu(c)", opset=11)
    _, report, count = model_checks.apply_reporting_rules(proto, activation_on_codes_rules)
    assert count == 0 and any("opset 11" in r.reason for r in report.refusals)


@pytest.mark.parametrize("seed", range(24))
def test_property_the_activation_on_codes_is_bit_exact_for_any_grid_and_bounds(seed):
    """Random grids (uint8/int8, any zero point, any step) and Clip bounds (on, off and between grid
    points, inside and outside the range); the feed hits the rounding ties and both saturations."""
    rng = np.random.default_rng(seed)
    dtype = ["uint8", "int8"][seed % 2]
    qmin, qmax = (0, 255) if dtype == "uint8" else (-128, 127)
    # half the seeds a power-of-two step (Quark's): bounds between grid points are then exact ties
    scale = float(2.0 ** -int(rng.integers(2, 10))) if seed % 4 in (0, 3) else float(np.float32(10 ** rng.uniform(-3, 0)))
    zero_point = int(rng.integers(qmin + 1, qmax))  # not qmin: the rule applies
    # bounds inside the codes' range, on a grid point, on a tie or between (the top one past qmax at times)
    frac = rng.choice([0.0, 0.5, 1 / 3], 2)
    lo = float(min(0.0, (int(rng.integers(qmin - zero_point, 1)) + frac[0]) * scale))
    hi = float((int(rng.integers(1, qmax - zero_point + 8)) + frac[1]) * scale)
    island = seed % 3 == 0
    act = ("Clip({}, lo, hi)" if seed % 4 < 2 else "Relu({})").format("d1" if island else "c")
    proto = _model(act=act, s1=scale, z1=zero_point, s2=scale, z2=zero_point, lo=lo, hi=hi, dtype=dtype)
    fixed, report, count = model_checks.apply_reporting_rules(proto, activation_on_codes_rules)
    if count == 0:  # a Clip whose bounds the quantizer absorbs: nothing to do, and nothing claimed
        assert "Clip" in act and not report.changes
        return
    assert all(c.exact for c in report.changes)
    ties = (np.arange(-300, 300) + 0.5).astype(np.float32) * np.float32(scale)  # Conv outputs at the ties
    for optimized in (False, True):
        for feed in [*_feeds(scale * 200, 2), _tie_feed(proto, ties)]:
            np.testing.assert_array_equal(model_checks.outputs(proto, feed, optimized)[0],
                                          model_checks.outputs(fixed, feed, optimized)[0])


def _tie_feed(proto: onnx.ModelProto, ties: np.ndarray) -> dict[str, np.ndarray]:
    """A feed whose Conv outputs land near rounding ties: x solves the 1x1 Conv for the wanted outputs."""
    weights = np.array([[60, -30], [20, 90]], np.float64) * 0.01
    wanted = np.resize(ties, (2, 16)).astype(np.float64)
    x = np.linalg.solve(weights, wanted).reshape(1, 2, 4, 4)
    return {"x": (np.round(x / 0.02) * 0.02).astype(np.float32)}  # on the input grid: no input rounding

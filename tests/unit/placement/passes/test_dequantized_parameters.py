"""Tests of reading dequantized PRelu slopes and Clip bounds as constants (Quark's placement)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import kenosis_rewrite
from kenosis_rewrite.placement.passes.dequantized_parameters import RULE_NAME, FoldDequantizedParametersPass
from kenosis_rewrite.testing import model_checks

# Quark's placement: x -> Q/DQ -> Conv -> Q/DQ -> ACT -> Q/DQ -> y, every constant quantized (the
# PRelu slope per tensor, the Clip bounds each with its own grid).
QUARK_ACT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,3,4,4] x) => (float[1,3,4,4] y)
<float sx = {{0.03125}}, int8 zx = {{0}}, int8[3,3,1,1] w = {{60, -30, 20, 90, 12, -70, 5, 44, -9}},
 float sw = {{0.0078125}}, int8 zw = {{0}}, float sa = {{0.0625}}, int8 za = {{0}},
 int8[3,1,1] slope_q = {{{slope}}}, float slope_s = {{0.0078125}}, int8 slope_z = {{{slope_z}}},
 int8 lo_q = {{{lo}}}, int8 hi_q = {{{hi}}}, float bound_s = {{0.0625}}, int8 bound_z = {{0}}>
{{
  qx = QuantizeLinear(x, sx, zx)
  dx = DequantizeLinear(qx, sx, zx)
  dw = DequantizeLinear(w, sw, zw)
  c = Conv(dx, dw)
  qc = QuantizeLinear(c, sa, za)
  dc = DequantizeLinear(qc, sa, za)
  slope = DequantizeLinear(slope_q, slope_s, slope_z)
  lo = DequantizeLinear(lo_q, bound_s, bound_z)
  hi = DequantizeLinear(hi_q, bound_s, bound_z)
  a = {act}
  qa = QuantizeLinear(a, sa, za)
  y = DequantizeLinear(qa, sa, za)
}}
"""


def _model(act: str, slope: str = "10, 20, 30", slope_z: int = 0, lo: int = 0, hi: int = 96) -> onnx.ModelProto:
    """``act`` reads ``dc`` (the Conv's own Q/DQ before it) or ``c`` (the Conv directly)."""
    proto = onnx.parser.parse_model(QUARK_ACT.format(act=act, slope=slope, slope_z=slope_z, lo=lo, hi=hi))
    if "dc" not in act:
        nodes = [n for n in proto.graph.node if n.output[0] not in ("qc", "dc")]
        del proto.graph.node[:]
        proto.graph.node.extend(nodes)
    return proto


def _feeds(count: int = 4, scale: float = 2.0) -> list[dict[str, np.ndarray]]:
    return [{"x": (np.random.default_rng(seed).standard_normal((1, 3, 4, 4)) * scale).astype(np.float32)}
            for seed in range(count)]


def _assert_bit_exact(before: onnx.ModelProto, after: onnx.ModelProto, feeds=None) -> None:
    for feed in feeds or _feeds():
        for optimized in (False, True):
            np.testing.assert_array_equal(model_checks.outputs(before, feed, optimized)[0],
                                          model_checks.outputs(after, feed, optimized)[0])


def test_a_dequantized_prelu_slope_is_read_as_a_constant_and_the_prelu_leaves_orts_slow_kernel():
    proto = _model("PRelu(dc, slope)")
    out, report = model_checks.apply_pass(proto, FoldDequantizedParametersPass)
    onnx.checker.check_model(out, full_check=True)
    prelu = next(n for n in out.graph.node if n.op_type == "PRelu")
    np.testing.assert_array_equal(model_checks.initializer(out, prelu.input[1]).reshape(-1),
                                  np.float32([10, 20, 30]) * np.float32(0.0078125))
    assert [c.rule for c in report.changes] == [RULE_NAME] and report.changes[0].exact
    assert model_checks.op_types(out)["DequantizeLinear"] == model_checks.op_types(proto)["DequantizeLinear"] - 3
    _assert_bit_exact(proto, out)
    fixed, fix_report = kenosis_rewrite.fix(proto, return_report=True)  # the PRelu rule now reads the slope
    assert "PRelu" not in model_checks.op_types(fixed)
    assert "prelu-to-relu-min" in {c.rule for c in fix_report.changes}
    _assert_bit_exact(proto, fixed)


def test_dequantized_clip_bounds_are_read_as_constants_and_the_conv_before_them_runs_integer():
    proto = _model("Clip(c, lo, hi)")  # ORT fuses Conv -> Clip -> Q only with constant bounds
    assert "QLinearConv" not in model_checks.ort_optimized_op_types(proto)
    out, report = model_checks.apply_pass(proto, FoldDequantizedParametersPass)
    clip = next(n for n in out.graph.node if n.op_type == "Clip")
    assert [float(model_checks.initializer(out, name)) for name in clip.input[1:]] == [0.0, 6.0]
    assert [c.rule for c in report.changes] == [RULE_NAME] * 2
    _assert_bit_exact(proto, out)
    fixed = kenosis_rewrite.fix(proto)
    assert "QLinearConv" in model_checks.ort_optimized_op_types(fixed)
    _assert_bit_exact(proto, fixed)


def test_a_dequantized_constant_also_read_as_data_keeps_its_dequantizelinear_for_that_reader():
    proto = _model("PRelu(dc, slope)\n  b = Add(a, slope)")
    next(n for n in proto.graph.node if n.output[0] == "qa").input[0] = "b"  # y's quantizer reads the Add
    out, report = model_checks.apply_pass(proto, FoldDequantizedParametersPass)
    prelu = next(n for n in out.graph.node if n.op_type == "PRelu")
    add = next(n for n in out.graph.node if n.op_type == "Add")
    assert model_checks.producer_of(out, prelu.input[1]) is None  # an initializer now
    assert model_checks.producer_of(out, add.input[1]).op_type == "DequantizeLinear"
    assert len(report.changes) == 1
    _assert_bit_exact(proto, out)


def test_codes_float32_cannot_hold_exactly_are_left_alone():
    proto = _model("PRelu(dc, slope)")
    slope_codes = next(i for i in proto.graph.initializer if i.name == "slope_q")
    slope_codes.CopyFrom(onnx.numpy_helper.from_array(np.array([[[10]], [[20]], [[30]]], np.int32), "slope_q"))
    zero = next(i for i in proto.graph.initializer if i.name == "slope_z")
    zero.CopyFrom(onnx.numpy_helper.from_array(np.array(0, np.int32), "slope_z"))
    onnx.checker.check_model(proto, full_check=True)
    out, report = model_checks.apply_pass(proto, FoldDequantizedParametersPass)
    assert not report.changes and model_checks.op_types(out) == model_checks.op_types(proto)


@pytest.mark.parametrize("seed", range(16))
def test_property_the_folded_parameters_are_bit_exact_for_any_codes_grid_and_zero_point(seed):
    """Random slope codes and zero points (per channel and uniform, a zero point off 0 so that a
    ``q * s - z * s`` form would differ), random Clip bound codes around and across the activation's
    grid; feeds at several magnitudes so that both Clip bounds and the PRelu's negative side are hit."""
    rng = np.random.default_rng(seed)
    uniform = seed % 4 == 0
    codes = np.full(3, rng.integers(-128, 128)) if uniform else rng.integers(-128, 128, 3)
    slope_z = int(rng.integers(-20, 21))
    lo, hi = sorted(int(v) for v in rng.integers(-128, 128, 2))
    act = "PRelu(dc, slope)" if seed % 2 == 0 else "Clip(dc, lo, hi)"
    proto = _model(act, slope=", ".join(str(int(v)) for v in codes), slope_z=slope_z, lo=lo, hi=hi)
    out, report = model_checks.apply_pass(proto, FoldDequantizedParametersPass)
    assert report.changes and all(c.exact for c in report.changes)
    feeds = [*_feeds(2, 0.5), *_feeds(2, 4.0)]
    _assert_bit_exact(proto, out, feeds)
    fixed = kenosis_rewrite.fix(proto, verify=False)  # and the rules the constants let in, unguarded
    _assert_bit_exact(proto, fixed, feeds)

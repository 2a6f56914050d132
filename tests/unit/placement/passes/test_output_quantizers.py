"""Tests of the output quantizer given to weighted ops that have none (NNCF/OpenVINO placement)."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import onnx_ir as ir

import kenosis_rewrite
from kenosis_rewrite.core import fidelity, interleaved_timing
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.placement.passes.output_quantizers import (
    RULE_NAME,
    QuantizeWeightedOutputsPass,
    candidates,
    covering_grid,
    measure_output_ranges,
)
from kenosis_rewrite.placement.passes.saturation import activation_bounds
from kenosis_rewrite.testing import model_checks

# DQ -> Conv -> BN -> HardSwish -> Q: the Conv has no output quantizer (OpenVINO fuses the activation).
MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 2, 6, 6] x) => (float[1, 3, 6, 6] y)
<float sx = {0.02}, uint8 zx = {128}, int8[3, 2, 3, 3] wq = {%s}, float[3] ws = {0.01, 0.02, 0.015},
 int8[3] wz = {0, 0, 0}, float[3] g = {1.0, -0.5, 2.0}, float[3] b = {0.1, 0.0, -0.1}, float[3] mu = {0.0, 0.1, 0.0},
 float[3] var = {1.0, 1.0, 0.5}, float sy = {0.03}, uint8 zy = {20}>
{
  q = QuantizeLinear(x, sx, zx)
  d = DequantizeLinear(q, sx, zx)
  w = DequantizeLinear <axis: int = 0> (wq, ws, wz)
  c = Conv <pads: ints = [1, 1, 1, 1]> (d, w)
  n = BatchNormalization(c, g, b, mu, var)
  h = HardSwish(n)
  qy = QuantizeLinear(h, sy, zy)
  y = DequantizeLinear(qy, sy, zy)
}
"""


def _model() -> onnx.ModelProto:
    weights = np.random.default_rng(0).integers(-127, 128, 54)
    return onnx.parser.parse_model(MODEL % ", ".join(str(int(v)) for v in weights))


def _feeds(n: int = 4) -> list[dict]:
    return [{"x": np.random.default_rng(seed).standard_normal((1, 2, 6, 6)).astype(np.float32)} for seed in range(n)]


def _quantizer_of(fixed: onnx.ModelProto, name: str) -> tuple[float, int]:
    q = next(n for n in fixed.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == name)
    return float(model_checks.initializer(fixed, q.input[1])), int(model_checks.initializer(fixed, q.input[2]))


def _grid(lo: float, hi: float) -> float:
    return float(covering_grid(lo, hi, 0, 255)[0])


# the quantizer after the HardSwish: sy = 0.03, zy = 20 over [-0.6, 7.05]; HardSwish is 0 below -3 and
# above 3 equals its input, so the bounds for the Conv output are [-3, 7.05]
BOUNDS = (-3.0, 235 * 0.03)


def test_the_quantizer_goes_after_the_bn_with_the_measured_range_within_the_bounds():
    proto = _model()
    model = ir.serde.deserialize_model(proto)
    assert [n.op_type for n in candidates(model.graph)] == ["Conv"]
    ranges = measure_output_ranges(proto, _feeds())
    assert list(ranges) == ["n"]
    report = FixReport()
    QuantizeWeightedOutputsPass(ranges, report)(model)
    fixed = ir.serde.serialize_model(model)
    onnx.checker.check_model(fixed, full_check=True)
    assert report.change_counts() == {RULE_NAME: 1}
    lo, hi = max(ranges["n"][0], BOUNDS[0]), min(ranges["n"][1], BOUNDS[1])
    scale = _grid(lo, hi)
    assert _quantizer_of(fixed, "n")[0] == np.float32(scale)
    # the stated bound: one step of the new grid at most, times HardSwish's slope, + one output step
    for feed in _feeds():
        before, after = model_checks.outputs(proto, feed, optimized=False)[0], model_checks.outputs(fixed, feed, optimized=False)[0]
        assert np.max(np.abs(after - before)) <= 1.5 * scale + 0.03 + 1e-6


def test_fix_with_calibration_runs_the_conv_as_an_integer_kernel_and_bn_is_folded():
    proto = _model()
    assert kenosis_rewrite.explain(proto).integer_mac_fraction == 0.0
    # the rules' own result (the guard measures on this host's kernels: below)
    fixed, report = kenosis_rewrite.fix(proto, calibration=_feeds(), return_report=True, verify=False)
    assert report.change_counts().get(RULE_NAME) == 1, report.summary()
    assert report.change_counts().get("fold-batchnorm-into-conv") == 1
    assert kenosis_rewrite.explain(fixed).integer_mac_fraction == 1.0
    assert model_checks.graph_cosine(proto, fixed, _feeds()) > 0.999
    guarded, guarded_report = kenosis_rewrite.fix(proto, calibration=_feeds(), return_report=True)
    if interleaved_timing.u8s8_saturates() and "fold-batchnorm-into-conv" not in guarded_report.change_counts():
        assert any("without VNNI" in note for note in guarded_report.notes), guarded_report.summary()
    else:
        assert guarded.SerializeToString() == fixed.SerializeToString()


def test_without_calibration_the_hardswish_quantizer_bounds_give_the_range():
    proto = _model()
    fixed, report = kenosis_rewrite.fix(proto, return_report=True, verify=False)
    assert report.change_counts().get(RULE_NAME) == 1, report.summary()
    assert not any("pass calibration=" in note for note in report.notes)
    assert kenosis_rewrite.explain(fixed).integer_mac_fraction == 1.0
    scale, zero_point = _quantizer_of(fixed, "n")
    assert scale == np.float32(_grid(*BOUNDS)) and zero_point == covering_grid(*BOUNDS, 0, 255)[1]
    assert (255 - zero_point) * scale >= BOUNDS[1] and -zero_point * scale <= BOUNDS[0]
    # inputs far beyond the bounds: what saturates the HardSwish's quantizer still does, exactly
    wide = [{"x": 4.0 * f["x"]} for f in _feeds()]
    for feed in _feeds() + wide:
        before, after = model_checks.outputs(proto, feed, optimized=False)[0], model_checks.outputs(fixed, feed, optimized=False)[0]
        assert np.max(np.abs(after - before)) <= 1.5 * scale + 0.03 + 1e-6


def _hardswish_codes(scale_in, zero_in, scale_out, zero_out, x):
    """Codes of the quantizer after HardSwish, with and without a quantizer (scale_in, zero_in) before it."""
    def q(v, s, z):
        return np.clip(np.rint(v / s) + z, 0, 255)
    def hardswish(v):
        return v * np.clip(v / 6 + 0.5, 0, 1)
    rounded = (q(x, scale_in, zero_in) - zero_in) * scale_in
    return q(hardswish(x), scale_out, zero_out), q(hardswish(rounded), scale_out, zero_out)


def test_hardswish_bounds_are_exact_in_saturation_and_one_step_inside_for_any_output_quantizer():
    """Property: for output quantizers of every zero point and scale, the grid over the bounds moves
    the HardSwish's output codes by at most 1.5 * s_in / s_out + 1, and not at all half a step beyond the bounds."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        scale_out, zero_out = float(rng.uniform(0.002, 0.1)), int(rng.integers(0, 256))
        lo, hi = (0 - zero_out) * scale_out, (255 - zero_out) * scale_out
        a, b = activation_bounds("HardSwish", 1 / 6, 0.5, lo, hi)
        scale_in, zero_in = covering_grid(a, b, 0, 255)
        scale_in = float(scale_in)
        x = rng.uniform(a - 20, b + 20, 4000)
        exact, with_grid = _hardswish_codes(scale_in, zero_in, scale_out, zero_out, x)
        assert np.max(np.abs(exact - with_grid)) <= 1.5 * scale_in / scale_out + 1
        beyond = (x < min(a, 0.0) - scale_in / 2) | (x > b + scale_in / 2)
        np.testing.assert_array_equal(exact[beyond], with_grid[beyond])


def test_hardsigmoid_bounds_are_where_it_meets_its_quantizer_range():
    assert activation_bounds("HardSigmoid", 0.25, 0.5, 0.0, 1.0) == (-2.0, 2.0)
    assert activation_bounds("HardSigmoid", 0.25, 0.5, 0.0, 0.75) == (-2.0, 1.0)  # saturates the quantizer from 0.75 on


SILU = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 2, 6, 6] x) => (float[1, 3, 6, 6] y)
<float sx = {0.02}, uint8 zx = {128}, int8[3, 2, 1, 1] wq = {5, -3, 7, 1, -2, 4}, float ws = {0.05}, int8 wz = {0},
 float sy = {0.03}, uint8 zy = {20}>
{
  q = QuantizeLinear(x, sx, zx)
  d = DequantizeLinear(q, sx, zx)
  w = DequantizeLinear(wq, ws, wz)
  c = Conv(d, w)
  e = LeakyRelu(c)
  qy = QuantizeLinear(e, sy, zy)
  y = DequantizeLinear(qy, sy, zy)
}
"""


def test_without_calibration_an_unbounded_activation_is_left_with_a_note():
    """Abs has no value beyond which the downstream code stops changing: no grid without data."""
    fixed, report = kenosis_rewrite.fix(onnx.parser.parse_model(SILU.replace("LeakyRelu(c)", "Abs(c)")), return_report=True)
    assert RULE_NAME not in report.change_counts()
    assert any("pass calibration=" in note for note in report.notes)
    assert kenosis_rewrite.explain(fixed).integer_mac_fraction == 0.0


def test_without_calibration_a_leaky_relu_is_bounded_by_the_quantizer_after_it():
    """LeakyRelu(c) = 0.2 c below 0: below lo / 0.2 the quantizer after it clamps every value. (With a
    slope of 0.01 the bound is sound too, but a grid over [lo / 0.01, hi] would be 100 times wider than
    the quantizer it feeds, and is not made: saturation.MAX_SPREAD.)"""
    model = onnx.parser.parse_model(SILU.replace("LeakyRelu(c)", "LeakyRelu <alpha: float = 0.2> (c)"))
    fixed, report = kenosis_rewrite.fix(model, return_report=True)
    changes = [c for c in report.changes if c.rule == RULE_NAME]
    assert len(changes) == 1 and "LeakyRelu then a quantizer over" in changes[0].detail
    assert kenosis_rewrite.explain(fixed).integer_mac_fraction == 1.0
    feed = {"x": np.random.default_rng(3).uniform(-2, 2, (1, 2, 6, 6)).astype(np.float32)}
    np.testing.assert_allclose(model_checks.outputs(fixed, feed)[0], model_checks.outputs(model, feed)[0], atol=0.03 + 1e-6)


# NNCF's YOLOv8 C2f form: two dequantized tensors concatenated, read by a Conv; nothing quantizes the Concat.
CONCAT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 2, 6, 6] x) => (float[1, 3, 6, 6] y)
<float sa = {0.02}, float sb = {0.05}, uint8 za = {128}, int8[3, 4, 1, 1] wq = {5, -3, 7, 1, -2, 4, 6, -8, 3, 3, -1, 2},
 float ws = {0.05}, int8 wz = {0}, float sy = {0.03}, uint8 zy = {128}, float sm = {0.03}, uint8 zm = {20}>
{
  qa = QuantizeLinear(x, sa, za)
  da = DequantizeLinear(qa, sa, za)
  e = Exp(x)
  qb = QuantizeLinear(e, sb, za)
  db = DequantizeLinear(qb, sb, za)
  cat = Concat <axis: int = 1> (da, db)
  w = DequantizeLinear(wq, ws, wz)
  c = Conv(cat, w)
  s = Sigmoid(c)
  m = Mul(c, s)
  qm = QuantizeLinear(m, sm, zm)
  y = DequantizeLinear(qm, sm, zm)
}
"""


def test_a_concat_of_dequantized_tensors_feeding_a_conv_gets_an_input_quantizer():
    proto = onnx.parser.parse_model(CONCAT)
    feeds = [{"x": np.random.default_rng(seed).uniform(-1, 1, (1, 2, 6, 6)).astype(np.float32)} for seed in range(4)]
    ranges = measure_output_ranges(proto, feeds)
    assert set(ranges) == {"cat", "c"}  # the Concat output (input site) and the Conv output
    fixed, report = kenosis_rewrite.fix(proto, calibration=feeds, return_report=True, verify=False)
    assert report.change_counts().get(RULE_NAME) == 2, report.summary()
    optimized = model_checks.ort_optimized_op_types(fixed)
    assert optimized["QLinearConcat"] == 1 and optimized["QLinearConv"] == 1 and optimized["Conv"] == 0
    assert model_checks.graph_cosine(proto, fixed, feeds) > 0.999


def test_nncf_c2f_block_runs_all_integer_after_fix_and_keeps_nncf_fidelity():
    """NNCF 3.4 output of a YOLOv8 C2f-style block (tests/fixtures): DQ before Split, float Concat of inputs
    that share one (unified) scale, no output Qs."""
    fixtures = pathlib.Path(__file__).resolve().parents[3] / "fixtures"
    qdq, fp32 = onnx.load(fixtures / "c2fish_nncf3.4.onnx"), onnx.load(fixtures / "c2fish_fp32.onnx")
    assert kenosis_rewrite.explain(qdq).integer_mac_fraction == 0.0
    rng = np.random.default_rng(7)
    feeds = [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(8)]
    calibration, held_out = feeds[:6], feeds[6:]
    # the rules' own result, and what the graph computes
    fixed, report = kenosis_rewrite.fix(qdq, float_model=fp32, calibration=calibration, return_report=True, verify=False)
    counts = report.change_counts()
    assert counts.get("move-dq-past-split") == 1 and counts.get(RULE_NAME) == 5, report.summary()
    assert counts.get("move-dq-forward") == 1  # the Concat runs on the uint8 tensors, no quantizer of its own
    assert kenosis_rewrite.explain(fixed).integer_mac_fraction == 1.0
    assert model_checks.ort_optimized_op_types(fixed)["QLinearConcat"] == 0
    assert model_checks.graph_cosine(fp32, fixed, held_out) >= model_checks.graph_cosine(fp32, qdq, held_out) - 0.002
    # as this host runs it, with the guard: kept where the integer kernels reproduce the graph
    guarded, guarded_report = kenosis_rewrite.fix(qdq, float_model=fp32, calibration=calibration, return_report=True)
    if interleaved_timing.u8s8_saturates() and RULE_NAME not in guarded_report.change_counts():
        assert any("without VNNI" in note for note in guarded_report.notes), guarded_report.summary()
        return
    assert guarded.SerializeToString() == fixed.SerializeToString()
    scores = fidelity.compare_to_float(fp32, {"nncf": qdq, "fixed": guarded}, held_out)
    assert scores["fixed"]["cosine"] >= scores["nncf"]["cosine"] - model_checks.saturation_tolerance(0.002), scores


SPPF = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 2, 6, 6] x) => (float[1, 3, 6, 6] y)
<float sx = {0.02}, uint8 zx = {128}, int8[3, 6, 1, 1] wq = {3, -7, 5, 2, 1, -1, 4, 4, -2, 6, 0, 1, -3, 2, 2, 5, -1, 7},
 float ws = {0.05}, int8 wz = {0}, float sm = {0.03}, uint8 zm = {20}>
{
  q = QuantizeLinear(x, sx, zx)
  d = DequantizeLinear(q, sx, zx)
  m1 = MaxPool <kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]> (d)
  m2 = MaxPool <kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]> (m1)
  cat = Concat <axis: int = 1> (d, m1, m2)
  w = DequantizeLinear(wq, ws, wz)
  c = Conv(cat, w)
  s = Sigmoid(c)
  m = Mul(c, s)
  qm = QuantizeLinear(m, sm, zm)
  y = DequantizeLinear(qm, sm, zm)
}
"""


def test_an_sppf_concat_of_one_dequantized_tensor_needs_no_quantizer_of_its_own():
    """NNCF's YOLOv8 SPPF: MaxPools of one dequantized tensor and their Concat stay float. The Concat's
    inputs share one grid (seen through the MaxPools), so only the Conv output gets a quantizer and
    move-dq-forward puts the DQ at the Conv exactly: no extra rounding at the Concat."""
    proto = onnx.parser.parse_model(SPPF)
    feeds = [{"x": np.random.default_rng(seed).uniform(-1, 1, (1, 2, 6, 6)).astype(np.float32)} for seed in range(4)]
    assert set(measure_output_ranges(proto, feeds)) == {"c"}
    fixed, report = kenosis_rewrite.fix(proto, calibration=feeds, return_report=True, verify=False)
    counts = report.change_counts()
    assert counts.get(RULE_NAME) == 1 and counts.get("move-dq-forward") == 3, report.summary()
    optimized = model_checks.ort_optimized_op_types(fixed)
    assert optimized["QLinearConv"] == 1 and optimized["Conv"] == 0 and optimized["QLinearConcat"] == 0
    assert model_checks.graph_cosine(proto, fixed, feeds) > 0.999


# NNCF's output of a Paddle export (opset 13, no HardSwish op): x * clip(x + 3, 0, 6) / 6 after the Conv
PADDLE_HARDSWISH = """
<ir_version: 8, opset_import: ["" : 13]>
g (float[1, 2, 6, 6] x) => (float[1, 3, 6, 6] y)
<float sx = {0.02}, uint8 zx = {128}, int8[3, 2, 3, 3] wq = {%s}, float[3] ws = {0.01, 0.02, 0.015},
 int8[3] wz = {0, 0, 0}, float three = {3.0}, float zero = {0.0}, float six = {6.0}, float sy = {0.03}, uint8 zy = {20}>
{
  q = QuantizeLinear(x, sx, zx)
  d = DequantizeLinear(q, sx, zx)
  w = DequantizeLinear <axis: int = 0> (wq, ws, wz)
  c = Conv <pads: ints = [1, 1, 1, 1]> (d, w)
  a = Add(c, three)
  k = Clip(a, zero, six)
  %s
  qy = QuantizeLinear(h, sy, zy)
  y = DequantizeLinear(qy, sy, zy)
}
"""
DIVIDE_LAST = "m = Mul(c, k)\n  h = Div(m, six)"
DIVIDE_FIRST = "g6 = Div(k, six)\n  h = Mul(g6, c)"


def test_a_hardswish_written_as_arithmetic_bounds_the_conv_output_in_either_order():
    weights = ", ".join(str(int(v)) for v in np.random.default_rng(0).integers(-127, 128, 54))
    for body in (DIVIDE_LAST, DIVIDE_FIRST):
        proto = onnx.parser.parse_model(PADDLE_HARDSWISH % (weights, body))
        assert kenosis_rewrite.explain(proto).integer_mac_fraction == 0.0
        fixed, report = kenosis_rewrite.fix(proto, return_report=True, verify=False)
        assert report.change_counts().get(RULE_NAME) == 1, report.summary()
        assert kenosis_rewrite.explain(fixed).integer_mac_fraction == 1.0
        scale = _quantizer_of(fixed, "c")[0]
        assert scale == np.float32(_grid(*BOUNDS))
        wide = [{"x": 4.0 * f["x"]} for f in _feeds()]
        for feed in _feeds() + wide:
            before = model_checks.outputs(proto, feed, optimized=False)[0]
            after = model_checks.outputs(fixed, feed, optimized=False)[0]
            assert np.max(np.abs(after - before)) <= 1.5 * scale + 0.03 + 1e-6


def test_arithmetic_that_is_not_a_hardswish_gets_no_bounds():
    weights = ", ".join(str(int(v)) for v in np.random.default_rng(0).integers(-127, 128, 54))
    # x * clip(x + 3, 0, 6) / 5 is no HardSwish: its quantizer bounds nothing known
    proto = onnx.parser.parse_model(PADDLE_HARDSWISH.replace("six = {6.0}", "six = {6.0}, float five = {5.0}")
                                    % (weights, "m = Mul(c, k)\n  h = Div(m, five)"))
    fixed, report = kenosis_rewrite.fix(proto, return_report=True)
    assert RULE_NAME not in report.change_counts()
    assert any("pass calibration=" in note for note in report.notes)


def test_bounds_through_an_increasing_affine_after_the_hardswish_are_exact_in_saturation():
    """Property (Paddle's ``HardSwish -> Mul(a > 0) -> Add(b) -> Q``): the bounds of the quantizer's range
    mapped back through the affine clip the HardSwish's input without changing any code."""
    def hardswish(v):
        return v * np.clip(v / 6 + 0.5, 0, 1)
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(300):
        scale_out, zero_out = float(rng.uniform(0.002, 0.1)), int(rng.integers(0, 256))
        slope, shift = float(rng.uniform(0.01, 3.0)), float(rng.uniform(-1.0, 1.0))
        lo, hi = (0 - zero_out) * scale_out, (255 - zero_out) * scale_out
        lo_act, hi_act = (lo - shift) / slope, (hi - shift) / slope
        if not hi_act >= 0:
            continue
        a, b = activation_bounds("HardSwish", 1 / 6, 0.5, lo_act, hi_act)
        x = rng.uniform(a - 20, b + 20, 4000)
        def codes(v):
            return np.clip(np.rint((slope * hardswish(v) + shift) / scale_out) + zero_out, 0, 255)
        beyond = (x < min(a, 0.0) - 1e-6) | (x > b + 1e-6)
        np.testing.assert_array_equal(codes(x)[beyond], codes(np.clip(x, a, b))[beyond])
        checked += 1
    assert checked > 100


# opset 12 (no per-channel DequantizeLinear) and one weight scale: the BatchNormalization's channel
# scales (0.5 to 2.8) cannot fold into it, so the Conv cannot get the Q right after it
UNFOLDABLE = MODEL.replace('"" : 17', '"" : 12').replace("float[3] ws = {0.01, 0.02, 0.015}", "float ws = {0.015}") \
    .replace("int8[3] wz = {0, 0, 0}", "int8 wz = {0}").replace("DequantizeLinear <axis: int = 0> (wq, ws, wz)",
                                                                 "DequantizeLinear(wq, ws, wz)") \
    .replace("h = HardSwish(n)", "h = HardSigmoid(n)")


def test_a_quantizer_after_a_batchnorm_that_does_not_fold_is_removed_again():
    """NNCF's PP-OCRv3 rec at opset 12: the quantizer put after the BN for the fold to follow is one
    rounding and two ops more when the fold refuses (the Conv stays float): removed, and the graph
    is the input's."""
    proto = onnx.parser.parse_model(UNFOLDABLE % ", ".join(str(int(v)) for v in np.random.default_rng(0).integers(-127, 128, 54)))
    onnx.checker.check_model(proto, full_check=True)
    fixed, report = kenosis_rewrite.fix(proto, calibration=_feeds(), return_report=True, verify=False)
    assert RULE_NAME not in report.change_counts(), report.summary()
    assert "fold-batchnorm-into-conv" not in report.change_counts()
    assert any(r.rule == RULE_NAME and "did not fold" in r.reason for r in report.refusals), report.summary()
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == "n" for n in fixed.graph.node)
    # the input's graph, but for the float Conv's weights, now float constants, and its input quantizer,
    # which served only it (float-weights-for-float-kernels, float-kernels-read-float)
    assert set(report.change_counts()) == {"float-weights-for-float-kernels", "float-kernels-read-float"}, report.summary()
    assert next(n for n in fixed.graph.node if n.op_type == "Conv").input[0] == "x"
    dropped = {"q", "d", "w"}  # the input's round trip and the weight's DequantizeLinear
    assert [n.op_type for n in fixed.graph.node] == [n.op_type for n in proto.graph.node if n.output[0] not in dropped]
    unrounded = onnx.parser.parse_model(UNFOLDABLE.replace("(d, w)", "(x, w)") % ", ".join(
        str(int(v)) for v in np.random.default_rng(0).integers(-127, 128, 54)))
    for feed in _feeds():  # the input without that rounding, to the summation order (one output step at most)
        np.testing.assert_allclose(model_checks.outputs(fixed, feed)[0], model_checks.outputs(unrounded, feed)[0],
                                   rtol=0, atol=0.03 + 1e-6)
    # what the pass inserts before the folds run, without the pipeline: the quantizer after the BN
    model = ir.serde.deserialize_model(proto)
    QuantizeWeightedOutputsPass(measure_output_ranges(proto, _feeds()), FixReport())(model)
    assert any(n.op_type == "QuantizeLinear" and n.inputs[0].name == "n" for n in model.graph)


def _blind_model() -> onnx.ModelProto:
    """MODEL with a detector-like head: Sigmoid(y - 14) quantized over [0, 1]. On random feeds the
    probabilities round to 0 everywhere, so the guard's cosines there measure nothing."""
    text = MODEL.replace("=> (float[1, 3, 6, 6] y)", "=> (float[1, 3, 6, 6] out)")
    text = text.replace("float sy = {0.03}, uint8 zy = {20}>", "float sy = {0.03}, uint8 zy = {20}, float big = {14.0},\n"
                        " float sp = {0.00392157}, uint8 zp = {0}>")
    text = text.replace("  y = DequantizeLinear(qy, sy, zy)\n}", "  y = DequantizeLinear(qy, sy, zy)\n  z = Sub(y, big)\n"
                        "  p = Sigmoid(z)\n  qp = QuantizeLinear(p, sp, zp)\n  out = DequantizeLinear(qp, sp, zp)\n}")
    weights = np.random.default_rng(0).integers(-127, 128, 54)
    return onnx.parser.parse_model(text % ", ".join(str(int(v)) for v in weights))


def test_a_guard_blind_on_made_up_feeds_leaves_the_rule_out_and_says_how_to_apply_it():
    """The rule adds roundings whose cost compounds (PP-OCRv5's DB detector from NNCF: 0.851 -> 0.780
    against FP32 over 34 layers); where the guard's made-up feeds cannot show it, it is not applied."""
    proto = _blind_model()
    unguarded, unguarded_report = kenosis_rewrite.fix(proto, return_report=True, verify=False)
    assert unguarded_report.change_counts().get(RULE_NAME) == 1  # the rule itself applies here
    fixed, report = kenosis_rewrite.fix(proto, return_report=True)
    assert RULE_NAME not in report.change_counts(), report.summary()
    assert any(r.rule == RULE_NAME and "made-up feeds" in r.reason and "calibration=" in r.reason for r in report.refusals)
    assert "fold-batchnorm-into-conv" in report.change_counts()  # the other rules stay
    onnx.checker.check_model(fixed, full_check=True)
    # the caller's feeds are data: the guard measures on them and keeps what passes
    calibrated, calibrated_report = kenosis_rewrite.fix(proto, calibration=_feeds(), return_report=True)
    assert calibrated_report.change_counts().get(RULE_NAME) == 1, calibrated_report.summary()
    # and a second fix() of the blind result finds nothing more to do
    again = kenosis_rewrite.fix(fixed)
    assert again.SerializeToString() == fixed.SerializeToString()


def test_a_grid_that_cannot_reach_both_ends_is_refused_not_searched_forever():
    """A range so lopsided that the zero point lands on qmax while hi > 0 (a PRelu slope near 0 from
    below bounds its input at hi / slope): no 8-bit grid reaches both ends, so there is none."""
    assert covering_grid(-70000.0, 7.0, 0, 255) is None
    assert covering_grid(float("-inf"), 7.0, 0, 255) is None
    scale, zero_point = covering_grid(-3.0, 7.05, 0, 255)
    assert (255 - zero_point) * float(scale) >= 7.05 and (0 - zero_point) * float(scale) <= -3.0


# a detector-like score head: DQ -> Conv -> Relu -> Q/DQ -> Conv(bias -2) -> Reshape -> scores. On
# calibration feeds in [0, 1] every score is negative; on an object (x in [3, 4]) they are positive.
HEAD_MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 1, 4, 4] x) => (float[1, 16] scores)
<float sx = {0.02}, uint8 zx = {0}, int8[2, 1, 1, 1] w1 = {50, -40}, float w1s = {0.02}, int8 w1z = {0},
 float sh = {0.05}, uint8 zh = {0}, int8[1, 2, 1, 1] w2 = {60, 30}, float w2s = {0.02}, int8 w2z = {0},
 float[1] b2 = {-2.0}, int64[2] shape = {1, 16}>
{
  q = QuantizeLinear(x, sx, zx)
  d = DequantizeLinear(q, sx, zx)
  wa = DequantizeLinear(w1, w1s, w1z)
  c1 = Conv(d, wa)
  h = Relu(c1)
  qh = QuantizeLinear(h, sh, zh)
  dh = DequantizeLinear(qh, sh, zh)
  wb = DequantizeLinear(w2, w2s, w2z)
  c2 = Conv(dh, wb, b2)
  scores = Reshape(c2, shape)
}
"""


def test_a_measured_range_does_not_clamp_the_models_answer():
    """A range measured on calibration feeds is what they showed: at a tensor that reaches a graph
    output with no quantizer on the way it would clamp the answer itself (MediaPipe's face detector
    by NNCF, calibrated on scenes without faces: every positive face score became 0). The head stays
    float, with the reason; quantizers inside the model are the C2f test's above."""
    proto = onnx.parser.parse_model(HEAD_MODEL)
    rng = np.random.default_rng(0)
    calibration = [{"x": rng.uniform(0, 1, (1, 1, 4, 4)).astype(np.float32)} for _ in range(8)]
    obj = {"x": rng.uniform(3, 4, (1, 1, 4, 4)).astype(np.float32)}
    # what the calibration feeds measured at the head, and a quantizer there would clamp to: [lo, 0]
    assert measure_output_ranges(proto, calibration)["c2"][1] < 0
    assert model_checks.outputs(proto, obj, optimized=False)[0].min() > 0
    for verify in (False, True):
        fixed, report = kenosis_rewrite.fix(proto, calibration=calibration, return_report=True, verify=verify)
        onnx.checker.check_model(fixed, full_check=True)
        assert RULE_NAME not in report.change_counts(), report.summary()
        [refusal] = [r.reason for r in report.refusals if r.rule == RULE_NAME]
        assert "output 'c2' reaches the graph output 'scores'" in refusal and "of one sign only" in refusal
        before, after = (model_checks.outputs(m, obj, optimized=False)[0] for m in (proto, fixed))
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


def test_a_range_of_both_signs_on_the_answer_keeps_its_quantizer_and_says_where_it_is():
    """Calibration feeds that show the head's scores of both signs: its quantizer clamps only beyond
    them, and stays; the change says it sits on the model's answer (the guard undoes those first)."""
    proto = onnx.parser.parse_model(HEAD_MODEL)
    rng = np.random.default_rng(1)
    calibration = [{"x": rng.uniform(0, 3, (1, 1, 4, 4)).astype(np.float32)} for _ in range(8)]
    lo, hi = measure_output_ranges(proto, calibration)["c2"]
    assert lo < 0 < hi
    fixed, report = kenosis_rewrite.fix(proto, calibration=calibration, return_report=True, verify=False)
    [change] = [c for c in report.changes if c.rule == RULE_NAME]
    assert "on the model's answer ('scores')" in change.detail, report.summary()
    assert model_checks.ort_optimized_op_types(fixed)["QLinearConv"] == 2


# NNCF's transformer placement: DQ -> MatMul -> Add(bias) -> Gelu -> Q: no quantizer after the MatMul.
MATMUL_MODEL = """
<ir_version: 9, opset_import: ["" : 20]>
g (float[1, 4, 8] x) => (float[1, 4, 6] y)
<float sx = {0.02}, uint8 zx = {128}, int8[8, 6] wq = {%s}, float[6] ws = {0.01, 0.02, 0.015, 0.01, 0.012, 0.02},
 int8[6] wz = {0, 0, 0, 0, 0, 0}, float[6] bias = {0.1, 0.0, -0.1, 0.2, 0.05, -0.05}, float sy = {0.01}, uint8 zy = {20}>
{
  q = QuantizeLinear(x, sx, zx)
  d = DequantizeLinear(q, sx, zx)
  w = DequantizeLinear <axis: int = 1> (wq, ws, wz)
  m = MatMul(d, w)
  a = Add(m, bias)
  h = Gelu(a)
  qy = QuantizeLinear(h, sy, zy)
  y = DequantizeLinear(qy, sy, zy)
}
"""


def test_a_matmul_gets_no_output_quantizer_it_already_runs_as_an_integer_kernel():
    """ORT runs DQ -> MatMul with a float output as MatMulIntegerToFloat (with its bias once
    ``integer-matmul-bias`` writes it out): a quantizer after it would add a rounding and no integer
    MACs (ViT-S by NNCF lost 0.0125 on its worst photo to 60 of them)."""
    weights = np.random.default_rng(1).integers(-127, 128, 48)
    qdq = onnx.parser.parse_model(MATMUL_MODEL % ", ".join(str(int(v)) for v in weights))
    feeds = [{"x": np.random.default_rng(seed).standard_normal((1, 4, 8)).astype(np.float32)} for seed in range(4)]
    assert candidates(ir.serde.deserialize_model(qdq).graph) == []
    fixed, report = kenosis_rewrite.fix(qdq, calibration=feeds, return_report=True)
    assert report.change_counts().get(RULE_NAME, 0) == 0 and report.change_counts()["integer-matmul-bias"] == 1
    assert [n.input[0] for n in fixed.graph.node if n.op_type == "QuantizeLinear"] == ["x", "h"]
    assert "MatMulIntegerToFloat" in model_checks.ort_optimized_op_types(fixed)
    for feed in feeds:  # no rounding added: the input's codes, but for float32 ties
        before, after = model_checks.outputs(qdq, feed)[0], model_checks.outputs(fixed, feed)[0]
        assert np.max(np.abs(before - after)) <= 0.01 + 1e-6 and np.mean(before == after) > 0.95

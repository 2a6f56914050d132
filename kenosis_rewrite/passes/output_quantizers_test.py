"""Tests of the output quantizer given to weighted ops that have none (NNCF/OpenVINO placement)."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import onnx_ir as ir

import kenosis_rewrite
from kenosis_rewrite import _testing, _timing, fidelity
from kenosis_rewrite.passes.output_quantizers import RULE_NAME, QuantizeWeightedOutputsPass, candidates, measure_output_ranges
from kenosis_rewrite.report import FixReport

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


def test_the_quantizer_goes_after_the_bn_with_the_measured_range():
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
    q = next(n for n in fixed.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "n")
    lo, hi = min(ranges["n"][0], 0.0), max(ranges["n"][1], 0.0)
    assert float(_testing.initializer(fixed, q.input[1])) == np.float32((hi - lo) / 255)
    # the stated bound: inside the measured range, one rounding of at most half a step more
    scale = (hi - lo) / 255
    for feed in _feeds():
        before, after = _testing.outputs(proto, feed, optimized=False)[0], _testing.outputs(fixed, feed, optimized=False)[0]
        hardswish_slope = 1.5  # |d HardSwish / dx| <= 1.5
        assert np.max(np.abs(after - before)) <= hardswish_slope * scale / 2 + 0.03 + 1e-6  # + one output step


def test_fix_with_calibration_runs_the_conv_as_an_integer_kernel_and_bn_is_folded():
    proto = _model()
    assert kenosis_rewrite.explain(proto).integer_mac_fraction == 0.0
    # the rules' own result (the guard measures on this host's kernels: below)
    fixed, report = kenosis_rewrite.fix(proto, calibration=_feeds(), return_report=True, verify=False)
    assert report.change_counts().get(RULE_NAME) == 1, report.summary()
    assert report.change_counts().get("fold-batchnorm-into-conv") == 1
    assert kenosis_rewrite.explain(fixed).integer_mac_fraction == 1.0
    assert _testing.graph_cosine(proto, fixed, _feeds()) > 0.999
    guarded, guarded_report = kenosis_rewrite.fix(proto, calibration=_feeds(), return_report=True)
    if _timing.u8s8_saturates() and "fold-batchnorm-into-conv" not in guarded_report.change_counts():
        assert any("without VNNI" in note for note in guarded_report.notes), guarded_report.summary()
    else:
        assert guarded.SerializeToString() == fixed.SerializeToString()


def test_without_calibration_fix_says_what_it_needs_and_changes_nothing_there():
    fixed, report = kenosis_rewrite.fix(_model(), return_report=True)
    assert RULE_NAME not in report.change_counts()
    assert any("pass calibration=" in note for note in report.notes)


# NNCF's YOLOv8 C2f form: two dequantized tensors concatenated, read by a Conv; nothing quantizes the Concat.
CONCAT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 2, 6, 6] x) => (float[1, 3, 6, 6] y)
<float sa = {0.02}, float sb = {0.05}, uint8 za = {128}, int8[3, 4, 1, 1] wq = {5, -3, 7, 1, -2, 4, 6, -8, 3, 3, -1, 2},
 float ws = {0.05}, int8 wz = {0}, float sy = {0.03}, uint8 zy = {128}>
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
  y = Mul(c, s)
}
"""


def test_a_concat_of_dequantized_tensors_feeding_a_conv_gets_an_input_quantizer():
    proto = onnx.parser.parse_model(CONCAT)
    feeds = [{"x": np.random.default_rng(seed).uniform(-1, 1, (1, 2, 6, 6)).astype(np.float32)} for seed in range(4)]
    ranges = measure_output_ranges(proto, feeds)
    assert set(ranges) == {"cat", "c"}  # the Concat output (input site) and the Conv output
    fixed, report = kenosis_rewrite.fix(proto, calibration=feeds, return_report=True, verify=False)
    assert report.change_counts().get(RULE_NAME) == 2, report.summary()
    optimized = _testing.ort_optimized_op_types(fixed)
    assert optimized["QLinearConcat"] == 1 and optimized["QLinearConv"] == 1 and optimized["Conv"] == 0
    assert _testing.graph_cosine(proto, fixed, feeds) > 0.999


def test_nncf_c2f_block_runs_all_integer_after_fix_and_keeps_nncf_fidelity():
    """NNCF 3.4 output of a YOLOv8 C2f-style block (tests/fixtures): DQ before Split, float Concat of inputs
    that share one (unified) scale, no output Qs."""
    fixtures = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures"
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
    assert _testing.ort_optimized_op_types(fixed)["QLinearConcat"] == 0
    assert _testing.graph_cosine(fp32, fixed, held_out) >= _testing.graph_cosine(fp32, qdq, held_out) - 0.002
    # as this host runs it, with the guard: kept where the integer kernels reproduce the graph
    guarded, guarded_report = kenosis_rewrite.fix(qdq, float_model=fp32, calibration=calibration, return_report=True)
    if _timing.u8s8_saturates() and RULE_NAME not in guarded_report.change_counts():
        assert any("without VNNI" in note for note in guarded_report.notes), guarded_report.summary()
        return
    assert guarded.SerializeToString() == fixed.SerializeToString()
    scores = fidelity.compare_to_float(fp32, {"nncf": qdq, "fixed": guarded}, held_out)
    assert scores["fixed"]["cosine"] >= scores["nncf"]["cosine"] - _testing.saturation_tolerance(0.002), scores


SPPF = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 2, 6, 6] x) => (float[1, 3, 6, 6] y)
<float sx = {0.02}, uint8 zx = {128}, int8[3, 6, 1, 1] wq = {3, -7, 5, 2, 1, -1, 4, 4, -2, 6, 0, 1, -3, 2, 2, 5, -1, 7},
 float ws = {0.05}, int8 wz = {0}>
{
  q = QuantizeLinear(x, sx, zx)
  d = DequantizeLinear(q, sx, zx)
  m1 = MaxPool <kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]> (d)
  m2 = MaxPool <kernel_shape: ints = [3, 3], pads: ints = [1, 1, 1, 1]> (m1)
  cat = Concat <axis: int = 1> (d, m1, m2)
  w = DequantizeLinear(wq, ws, wz)
  c = Conv(cat, w)
  s = Sigmoid(c)
  y = Mul(c, s)
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
    optimized = _testing.ort_optimized_op_types(fixed)
    assert optimized["QLinearConv"] == 1 and optimized["Conv"] == 0 and optimized["QLinearConcat"] == 0
    assert _testing.graph_cosine(proto, fixed, feeds) > 0.999

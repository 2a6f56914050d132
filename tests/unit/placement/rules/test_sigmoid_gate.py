"""Tests of the SiLU/GLU gate quantization rule."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import pytest

from kenosis_rewrite import fix
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.placement.rules.sigmoid_gate import RULE_NAME, sigmoid_gate_rules
from kenosis_rewrite.testing import model_checks, toy_models

FIXTURES = pathlib.Path(__file__).resolve().parents[3] / "fixtures"

SILU = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,8,8] x, float[1,4,8,8] f) => (float[1,4,8,8] y)
<float sx = {{0.05}}, uint8 zx = {{100}}, float sy = {{0.03}}, uint8 zy = {{20}}>
{{
  qx = QuantizeLinear(x, sx, zx)
  dx = DequantizeLinear(qx, sx, zx)
  s = Sigmoid(dx)
  m = Mul({first}, {second})
  qm = QuantizeLinear(m, sy, zy)
  y = DequantizeLinear(qm, sy, zy)
}}
"""


def _apply(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, FixReport]:
    report = FixReport()
    fixed, count = model_checks.apply_rules(proto, sigmoid_gate_rules(report))
    assert count == len(report.changes)
    return fixed, report


@pytest.mark.parametrize("first, second", [("dx", "s"), ("s", "dx")])
def test_the_gate_gets_a_fixed_range_quantizer_and_ort_runs_silu_in_integer(first, second):
    proto = onnx.parser.parse_model(SILU.format(first=first, second=second))
    fixed, report = _apply(proto)
    assert [c.rule for c in report.changes] == [RULE_NAME]
    gate_q = next(n for n in fixed.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "s")
    assert model_checks.initializer(fixed, gate_q.input[1]) == np.float32(1 / 255)
    assert model_checks.initializer(fixed, gate_q.input[2]) == 0
    mul = next(n for n in fixed.graph.node if n.op_type == "Mul")
    assert mul.input[[first, second].index("dx")] == "dx"  # factor order kept
    before, after = model_checks.ort_optimized_op_types(proto), model_checks.ort_optimized_op_types(fixed)
    assert "QLinearSigmoid" not in before and before["Sigmoid"] == 1
    assert after["QLinearSigmoid"] == 1 and after["QLinearMul"] == 1 and after["Sigmoid"] == 0
    rng = np.random.default_rng(0)
    for _ in range(4):
        feed = {"x": rng.uniform(-6, 6, (1, 4, 8, 8)).astype(np.float32), "f": np.zeros((1, 4, 8, 8), np.float32)}
        dx = np.clip(np.rint(feed["x"] / 0.05) + 100, 0, 255) * 0.05 - 5.0
        a, b = (model_checks.outputs(m, feed, optimized=False)[0] for m in (proto, fixed))
        # the gate moves at most 1/510, the product at most |dx|/510, then one output rounding more
        assert np.all(np.abs(a - b) <= np.abs(dx) / 510 + 0.03 + 1e-6)


def test_a_float_factor_is_refused_with_a_reason():
    proto = onnx.parser.parse_model(SILU.format(first="f", second="s"))
    fixed, report = _apply(proto)
    assert not report.changes
    assert [r.reason for r in report.refusals] == [
        "the other factor is not a per-tensor 8-bit DequantizeLinear (ORT would not fuse the Mul)"]


def test_quantize_static_placement_already_has_the_gate_quantizer():
    float_model = toy_models.build("conv_silu")
    qdq = ort_quantize.quantize_with_ort(float_model, toy_models.random_feeds(float_model, 2), "default")
    _, report = _apply(qdq)
    assert not report.changes and not report.refusals


def test_fix_of_nncf_yolov8_block_runs_every_silu_in_integer_and_keeps_fidelity():
    """NNCF 3.4 fixture (C2f block): no quantizer after any Conv or Sigmoid."""
    qdq, fp32 = onnx.load(FIXTURES / "c2fish_nncf3.4.onnx"), onnx.load(FIXTURES / "c2fish_fp32.onnx")
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(10)]
    fixed, report = fix(qdq, calibration=feeds[:6], return_report=True)
    assert report.change_counts()[RULE_NAME] == 4
    kernels = model_checks.ort_optimized_op_types(fixed)
    # the fifth SiLU is the model's output: no quantizer after its product, it stays float
    assert kernels["QLinearSigmoid"] == 4 and kernels["Sigmoid"] == 1
    assert model_checks.graph_cosine(fp32, fixed, feeds[6:]) >= model_checks.graph_cosine(fp32, qdq, feeds[6:]) - 0.002

"""Tests of BatchNormalization folding into quantized Convs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.placement.rules.batchnorm_folding import RULE_NAME, batchnorm_rules
from kenosis_rewrite.testing import model_checks, toy_models


def _apply(proto):
    return model_checks.apply_reporting_rules(proto, batchnorm_rules)


@pytest.mark.parametrize("config", ["u8s8", "default", "pc", "convmm"])
def test_batchnorm_folds_into_integer_weights_scales_and_bias(config):
    float_model = toy_models.build("conv_bn")
    feeds = toy_models.random_feeds(float_model, 12)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds[:6], config)
    before = model_checks.ort_optimized_op_types(qdq)
    assert "BatchNormalization" in before
    fixed, report, count = _apply(qdq)
    folded = 0 if config == "convmm" else 2  # convmm does not quantize the BN outputs: refused
    assert count == folded and [c.rule for c in report.changes] == [RULE_NAME] * folded
    if config == "convmm":
        assert {r.reason.split(":")[0] for r in report.refusals} == {"the BatchNormalization output is not quantized"}
        return
    assert "BatchNormalization" not in model_checks.op_types(fixed)
    for conv in (n for n in fixed.graph.node if n.op_type == "Conv"):
        weight_dq = model_checks.producer_of(fixed, conv.input[1])
        weights = model_checks.initializer(fixed, weight_dq.input[0])
        assert weights.dtype == np.int8 and np.abs(weights).max() <= 127
    optimized = model_checks.ort_optimized_op_types(fixed)
    assert "BatchNormalization" not in optimized
    assert optimized["QLinearConv"] == 3
    scores = fidelity.compare_to_float(float_model, {"input": qdq, "fixed": fixed}, feeds[6:])
    assert scores["fixed"]["sqnr_db"] >= scores["input"]["sqnr_db"] - 0.1, scores


def test_folding_matches_float_batchnorm_on_the_same_integer_weights():
    """Without any activation quantization in between, the fold is the BN itself (float32 rounding only)."""
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,3,3] x) => (float[1,2,3,3] y)
    <int8[2,2,1,1] w = {60, -128, 20, 90}, float sw = {0.01}, int8 zw = {0},
     float[2] gamma = {-0.5, 2.0}, float[2] beta = {0.1, -0.2}, float[2] mean = {0.3, 0.0}, float[2] var = {1.0, 4.0}>
    { dw = DequantizeLinear(w, sw, zw)  c = Conv(x, dw)  y = BatchNormalization(c, gamma, beta, mean, var) }""")
    fixed, report, count = _apply(proto)
    assert count == 1
    assert "saturated" in report.changes[0].detail  # the -128 in the negated channel
    conv = next(n for n in fixed.graph.node if n.op_type == "Conv")
    weight_dq = model_checks.producer_of(fixed, conv.input[1])
    np.testing.assert_array_equal(model_checks.initializer(fixed, weight_dq.input[0]).reshape(2, 2), [[-60, 127], [20, 90]])
    np.testing.assert_allclose(model_checks.initializer(fixed, weight_dq.input[1]),
                               [0.01 * 0.5 / np.sqrt(1 + 1e-5), 0.01 * 2 / np.sqrt(4 + 1e-5)], rtol=1e-6)
    feed = {"x": np.random.default_rng(0).standard_normal((1, 2, 3, 3)).astype(np.float32)}
    # channel 0 differs by the saturated weight only (0.01 * 0.5 * x[1]); channel 1 is exact to float32.
    before, after = model_checks.outputs(proto, feed)[0], model_checks.outputs(fixed, feed)[0]
    np.testing.assert_allclose(after[0, 1], before[0, 1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(after[0, 0], before[0, 0], atol=0.005 * np.abs(feed["x"][0, 1]).max() + 1e-5)


def test_non_constant_batchnorm_is_refused_with_reason():
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,3,3] x, float[2] gamma) => (float[1,2,3,3] y)
    <int8[2,2,1,1] w = {60, -30, 20, 90}, float sw = {0.01}, int8 zw = {0},
     float[2] beta = {0.1, -0.2}, float[2] mean = {0.3, 0.0}, float[2] var = {1.0, 4.0}>
    { dw = DequantizeLinear(w, sw, zw)  c = Conv(x, dw)  y = BatchNormalization(c, gamma, beta, mean, var) }""")
    _, report, count = _apply(proto)
    assert count == 0
    assert [r.reason for r in report.refusals] == ["BatchNormalization parameters are not constants"]


def _opset12_conv_q_bn(gamma: list[float]) -> onnx.ModelProto:
    """``DQ(w) -> Conv -> Q -> DQ -> BatchNormalization -> Q -> DQ`` at opset 12 (no per-axis DQ),
    per-tensor int8 weights, BN scales ``gamma`` (unit variance, zero mean)."""
    g = ", ".join(f"{v:g}" for v in gamma)
    return onnx.parser.parse_model(f"""
    <ir_version: 7, opset_import: ["" : 12]>
    g (float[1,2,4,4] x) => (float[1,3,4,4] y)
    <int8[3,2,1,1] w = {{60, -128, 20, 90, -45, 127}}, float sw = {{0.01}}, int8 zw = {{0}},
     float sm = {{0.02}}, uint8 zm = {{128}}, float so = {{0.05}}, uint8 zo = {{128}},
     float[3] gamma = {{{g}}}, float[3] beta = {{0.1, -0.2, 0.3}}, float[3] mean = {{0.0, 0.0, 0.0}},
     float[3] var = {{1.0, 1.0, 1.0}}>
    {{ dw = DequantizeLinear(w, sw, zw)  c = Conv(x, dw)  qc = QuantizeLinear(c, sm, zm)  dc = DequantizeLinear(qc, sm, zm)
       b = BatchNormalization(dc, gamma, beta, mean, var)  qb = QuantizeLinear(b, so, zo)  y = DequantizeLinear(qb, so, zo) }}""")


def test_before_opset_13_a_fold_onto_a_coarser_one_scale_grid_is_refused():
    """Opset 12 has no per-axis DequantizeLinear: the folded weights share one scale, set by the
    channel of largest |a| * max|w|. Where another channel's step on it would be coarser than its
    own step through the BN, the fold is refused (PP-OCRv3's recognizer lost 0.26 cosine to it)."""
    varied, report, count = _apply(_opset12_conv_q_bn([0.05, 1.0, 3.0]))
    assert count == 0 and "BatchNormalization" in model_checks.op_types(varied)
    assert [r.reason.split(" would ")[0] for r in report.refusals] == [
        "opset 12 has no per-channel DequantizeLinear, and one weight scale for the folded channels (|a| from 0.05 to 3)"]
    # equal |a| (signs may differ): one scale is each channel's own step times |a|, so it folds
    equal = _opset12_conv_q_bn([-1.5, 1.5, 1.5])
    fixed, report, count = _apply(equal)
    assert count == 1 and "BatchNormalization" not in model_checks.op_types(fixed)
    feed = {"x": np.random.default_rng(0).uniform(-1, 1, (1, 2, 4, 4)).astype(np.float32)}
    reference = model_checks.outputs(equal, feed)[0]
    # the Q/DQ before the BN is gone and the weights are on the same grid: at most an output step apart
    # (its removed rounding, 1.5 * 0.02 / 2, and the output's own step, 0.05)
    assert np.abs(model_checks.outputs(fixed, feed)[0] - reference).max() <= 0.05 + 1.5 * 0.01 + 1e-6

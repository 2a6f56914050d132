"""Tests of folding constant Mul/Div/Add/Sub after a quantized Conv into its weight scales and bias."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import kenosis_rewrite
from kenosis_rewrite.placement.rules.conv_affine_folding import RULE_NAME, conv_affine_rules
from kenosis_rewrite.testing import model_checks

_SX = 0.02


def _paddle_layer(chain: str, outputs: str = "float[1, 3, 6, 6] y", extra: str = "") -> onnx.ModelProto:
    """NNCF's quantization of a Paddle PP-LCNetV3 layer: ``DQ(x), DQ(w) -> Conv`` (no bias), then
    ``chain`` from ``c`` to ``y``; bias ``b`` [3], shape ``s`` = [1, -1, 1, 1], per-channel int8 weights."""
    weights = ", ".join(str(int(v)) for v in np.random.default_rng(0).integers(-127, 128, 54))
    return onnx.parser.parse_model(f"""
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 2, 6, 6] x) => ({outputs})
<float sx = {{{_SX}}}, uint8 zx = {{128}}, int8[3, 2, 3, 3] wq = {{{weights}}}, float[3] ws = {{0.01, 0.02, 0.015}},
 int8[3] wz = {{0, 0, 0}}, float[3] b = {{0.4, -1.2, 0.05}}, int64[4] s = {{1, -1, 1, 1}}, float[1] a1 = {{0.6180311}},
 float[1] c1 = {{0.18770795}}, float[1] a2 = {{0.19788554}}, float[1] c2 = {{-0.19166602}}, float sy = {{0.01}}, uint8 zy = {{20}}
 {extra}>
{{
  q = QuantizeLinear(x, sx, zx)
  d = DequantizeLinear(q, sx, zx)
  w = DequantizeLinear <axis: int = 0> (wq, ws, wz)
  c = Conv <pads: ints = [1, 1, 1, 1]> (d, w)
  {chain}
}}""")


_AFFINE_CHAIN = "rb = Reshape(b, s)  e = Add(c, rb)  m = Mul(e, a1)  y = Add(m, c1)"


def _feeds(n: int = 4) -> list[dict]:
    return [{"x": np.random.default_rng(seed).standard_normal((1, 2, 6, 6)).astype(np.float32)} for seed in range(n)]


def _apply(proto):
    return model_checks.apply_reporting_rules(proto, conv_affine_rules)


def test_a_bias_and_affine_chain_folds_into_the_conv_within_one_bias_step():
    proto = _paddle_layer(_AFFINE_CHAIN + "  qz = QuantizeLinear(y, sy, zy)  z = DequantizeLinear(qz, sy, zy)",
                          outputs="float[1, 3, 6, 6] z")
    fixed, report, count = _apply(proto)
    assert count == 3 and [c.rule for c in report.changes] == [RULE_NAME] * 3
    conv = next(n for n in fixed.graph.node if n.op_type == "Conv")
    assert conv.output[0] == "y" and not {"Add", "Mul"} & set(model_checks.op_types(fixed))
    weight_dq = model_checks.producer_of(fixed, conv.input[1])
    # the integer weights are kept; the scales took the Mul
    np.testing.assert_array_equal(model_checks.initializer(fixed, weight_dq.input[0]), model_checks.initializer(proto, "wq"))
    new_scales = model_checks.initializer(fixed, weight_dq.input[1])
    np.testing.assert_allclose(new_scales, np.array([0.01, 0.02, 0.015]) * 0.6180311, rtol=1e-6)
    bias_dq = model_checks.producer_of(fixed, conv.input[2])
    assert model_checks.initializer(fixed, bias_dq.input[0]).dtype == np.int32  # QLinearConv's bias
    # the bias grid's error (at most one step of _SX * new_scales, far below the output step 0.01)
    # moves a code of the quantizer after it by at most one step
    for feed in _feeds():
        before, after = model_checks.outputs(proto, feed)[0], model_checks.outputs(fixed, feed)[0]
        assert np.all(np.abs(after - before) <= 0.01 + 1e-6)


def test_without_a_quantizer_after_it_the_folded_conv_keeps_a_float_bias_to_float32_rounding():
    """The Conv runs float in ORT either way: an int32 bias would add a rounding the input did not have."""
    proto = _paddle_layer(_AFFINE_CHAIN)
    fixed, report, count = _apply(proto)
    assert count == 3 and all("bias float" in c.detail for c in report.changes[-1:])
    conv = next(n for n in fixed.graph.node if n.op_type == "Conv")
    assert model_checks.producer_of(fixed, conv.input[2]) is None
    assert model_checks.initializer(fixed, conv.input[2]).dtype == np.float32
    for feed in _feeds():
        before, after = model_checks.outputs(proto, feed)[0], model_checks.outputs(fixed, feed)[0]
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chain,a,c", [
    ("y = Mul(k, c)", [-0.5, 2.0, 0.25], [0, 0, 0]),
    ("y = Div(c, k)", [-2.0, 0.5, 4.0], [0, 0, 0]),
    ("y = Add(k, c)", [1, 1, 1], [-0.5, 2.0, 0.25]),
    ("y = Sub(c, k)", [1, 1, 1], [0.5, -2.0, -0.25]),
])
def test_each_op_folds_as_its_per_channel_affine_either_operand_order(chain, a, c):
    proto = _paddle_layer(chain, extra=", float[3, 1, 1] k = {-0.5, 2.0, 0.25}")
    fixed, _, count = _apply(proto)
    conv = next(n for n in fixed.graph.node if n.op_type == "Conv")
    assert count == 1 and conv.output[0] == "y" and not {"Add", "Mul", "Sub", "Div"} & set(model_checks.op_types(fixed))
    conv_only = _paddle_layer("y = Identity(c)")
    for feed in _feeds():
        expected = np.array(a).reshape(1, 3, 1, 1) * model_checks.outputs(conv_only, feed)[0] + np.array(c).reshape(1, 3, 1, 1)
        after = model_checks.outputs(fixed, feed)[0]
        # the negated channel: a -128 weight saturates to 127 (none here: weights from -127); bias: half a step
        step = _SX * np.array([0.01, 0.02, 0.015]).reshape(1, 3, 1, 1) * np.abs(np.array(a)).reshape(1, 3, 1, 1)
        assert np.all(np.abs(after - expected) <= step / 2 + 1e-5 * np.abs(expected) + 1e-6)


@pytest.mark.parametrize("chain,extra,reason", [
    ("y = Add(c, k)", ", float[1, 1, 6, 6] k = {" + ", ".join(["0.5"] * 36) + "}", "varies along another axis"),
    ("y = Div(c, k)", ", float[3, 1, 1] k = {1, 0, 3}", "a Div by a constant with a zero"),
])
def test_what_is_not_a_per_channel_affine_of_the_conv_output_is_refused_with_reason(chain, extra, reason):
    proto = _paddle_layer(chain, extra=extra)
    _, report, count = _apply(proto)
    assert count == 0
    assert any(reason in r.reason for r in report.refusals), [r.reason for r in report.refusals]


@pytest.mark.parametrize("chain,outputs", [
    ("y = Mul(c, a1)  z = Relu(c)", "float[1, 3, 6, 6] y, float[1, 3, 6, 6] z"),  # the Conv output read twice
    ("y = Sub(a1, c)", "float[1, 3, 6, 6] y"),  # a1 - c: not c's affine with a positive slope here, and c the subtrahend
    ("y = Div(a1, c)", "float[1, 3, 6, 6] y"),  # the divisor
])
def test_what_the_fold_cannot_keep_does_not_match(chain, outputs):
    proto = _paddle_layer(chain, outputs=outputs)
    fixed, _, count = _apply(proto)
    assert count == 0
    np.testing.assert_array_equal(model_checks.outputs(fixed, _feeds(1)[0])[0], model_checks.outputs(proto, _feeds(1)[0])[0])


def test_fix_runs_the_nncf_layer_as_qlinearconv_and_keeps_its_outputs():
    """The whole PP-LCNetV3 layer as NNCF leaves it: after fix() the chain is in the Conv, the Conv has
    the quantizer the HardSwish's bounds give it, and ORT runs it as QLinearConv."""
    proto = _paddle_layer(_AFFINE_CHAIN.replace("y = Add(m, c1)", "p = Add(m, c1)")
                          + "  h = HardSwish(p)  n = Mul(h, a2)  o = Add(n, c2)  qy = QuantizeLinear(o, sy, zy)"
                          + "  y = DequantizeLinear(qy, sy, zy)")
    assert "QLinearConv" not in model_checks.ort_optimized_op_types(proto)
    fixed, report = kenosis_rewrite.fix(proto, return_report=True)
    counts = report.change_counts()
    assert counts.get(RULE_NAME) == 3 and counts.get("quantize-weighted-outputs") == 1, report.summary()
    assert model_checks.ort_optimized_op_types(fixed)["QLinearConv"] == 1
    assert kenosis_rewrite.explain(fixed).integer_mac_fraction == 1.0
    onnx.checker.check_model(fixed, full_check=True)
    before = np.concatenate([model_checks.outputs(proto, f)[0].ravel() for f in _feeds(8)])
    after = np.concatenate([model_checks.outputs(fixed, f)[0].ravel() for f in _feeds(8)])
    assert float(before @ after / np.linalg.norm(before) / np.linalg.norm(after)) > 0.999


def test_quantize_static_chains_fold_through_their_quantizers_and_stay_as_faithful():
    """quantize_static quantizes each op of Paddle's chain on its own (its Reshape'd bias too, as an
    activation): the folds go through those Q/DQ, and ORT runs one QLinearConv per layer instead of a
    QLinearConv and three elementwise ops, each between its own Q/DQ."""
    import pathlib

    from kenosis_rewrite.core import fidelity, ort_quantize

    float_model = onnx.load(pathlib.Path(__file__).resolve().parents[3] / "fixtures" / "lcnetish_fp32.onnx")
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(10)]
    qdq = ort_quantize.quantize_with_ort(float_model, feeds[:6], "pc")
    before = model_checks.ort_optimized_op_types(qdq)
    fixed, report = kenosis_rewrite.fix(qdq, return_report=True)
    assert report.change_counts().get(RULE_NAME) == 15, report.summary()  # 5 layers x (bias, Mul, Add)
    after = model_checks.ort_optimized_op_types(fixed)
    assert after["QLinearConv"] == before["QLinearConv"] == 6
    elementwise = ("Add", "Mul", "QLinearAdd", "QLinearMul")
    assert sum(after[op] for op in elementwise) == sum(before[op] for op in elementwise) - 15, (before, after)
    assert after["QuantizeLinear"] < before["QuantizeLinear"] - 15, (before, after)
    scores = fidelity.compare_to_float(float_model, {"input": qdq, "fixed": fixed}, feeds[6:])
    assert scores["fixed"]["cosine"] >= scores["input"]["cosine"] - 0.002, scores

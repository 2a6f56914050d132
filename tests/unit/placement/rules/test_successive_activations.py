"""Tests of collapsing two clamping activations in a row."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import kenosis_rewrite
from kenosis_rewrite.placement.rules.successive_activations import RULE_NAME, successive_activation_rules
from kenosis_rewrite.testing import model_checks
from kenosis_rewrite.testing.fuzz_configs import quantize_with_config

_CALLS = {"Relu": ("Relu(x)", "Relu(t)"), "Clip": ("Clip(x, lo1, hi1)", "Clip(t, lo2, hi2)")}


def _pair(first: str, second: str, lo1=-1.0, hi1=2.0, lo2=0.5, hi2=6.0) -> onnx.ModelProto:
    return onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3,5] x) => (float[2,3,5] y)
    <float lo1 = {{{lo1}}}, float hi1 = {{{hi1}}}, float lo2 = {{{lo2}}}, float hi2 = {{{hi2}}}>
    {{ t = {_CALLS[first][0]}
       y = {_CALLS[second][1]} }}""")


def _apply(proto):
    return model_checks.apply_reporting_rules(proto, successive_activation_rules)


def _assert_bit_identical(a, b):
    rng = np.random.default_rng(0)
    # values on and around every bound, and far outside them
    edges = np.array([-7, -1, -0.5, 0, 0.5, 1, 2, 6, 7], np.float32)
    for x in (rng.standard_normal((2, 3, 5)).astype(np.float32) * 4, np.resize(edges, (2, 3, 5))):
        np.testing.assert_array_equal(model_checks.outputs(a, {"x": x})[0], model_checks.outputs(b, {"x": x})[0])


@pytest.mark.parametrize(("first", "second", "expected"), [
    ("Relu", "Relu", ("Relu", None)),
    ("Relu", "Clip", ("Clip", (0.5, 6.0))),
    ("Clip", "Relu", ("Clip", (0.0, 2.0))),
    ("Clip", "Clip", ("Clip", (0.5, 2.0))),
])
def test_two_activations_become_one_with_the_intersected_bounds_exactly(first, second, expected):
    proto = _pair(first, second)
    fixed, report, count = _apply(proto)
    assert count == 1
    (node,) = fixed.graph.node
    op_type, bounds = expected
    assert node.op_type == op_type
    if bounds is not None:
        constants = {init.name: float(onnx.numpy_helper.to_array(init)) for init in fixed.graph.initializer}
        assert (constants[node.input[1]], constants[node.input[2]]) == bounds
    assert [(c.rule, c.exact) for c in report.changes] == [(RULE_NAME, True)]
    onnx.checker.check_model(fixed, full_check=True)
    _assert_bit_identical(proto, fixed)


def test_a_relu_under_a_clip_that_only_clamps_at_zero_becomes_one_relu():
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3,5] x) => (float[2,3,5] y) <float zero = {0.0}> { t = Clip(x, zero) y = Relu(t) }""")
    fixed, _, count = _apply(proto)
    assert count == 1 and model_checks.op_types(fixed) == {"Relu": 1}
    _assert_bit_identical(proto, fixed)


def test_before_opset_11_the_clip_bounds_are_attributes():
    proto = onnx.parser.parse_model("""
    <ir_version: 5, opset_import: ["" : 10]>
    g (float[2,3,5] x) => (float[2,3,5] y) { t = Clip<min = -1.0, max = 2.0>(x) y = Relu(t) }""")
    fixed, _, count = _apply(proto)
    assert count == 1
    (node,) = fixed.graph.node
    assert node.op_type == "Clip" and {a.name: a.f for a in node.attribute} == {"min": 0.0, "max": 2.0}
    onnx.checker.check_model(fixed, full_check=True)
    _assert_bit_identical(proto, fixed)


def test_disjoint_bounds_and_shared_intermediates_are_refused_with_a_reason():
    fixed, report, count = _apply(_pair("Clip", "Clip", lo1=-3.0, hi1=-1.0, lo2=0.0, hi2=6.0))
    assert count == 0 and "do not overlap" in report.refusals[0].reason
    shared = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3] x) => (float[2,3] y, float[2,3] z) { t = Relu(x) y = Relu(t) z = Neg(t) }""")
    fixed, report, count = _apply(shared)
    assert count == 0 and model_checks.op_types(fixed) == {"Relu": 2, "Neg": 1}  # Neg(t) needs the first Relu
    variable = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3] x, float hi) => (float[2,3] y) { t = Relu(x) y = Clip(x, , hi) }""".replace("Clip(x", "Clip(t"))
    fixed, report, count = _apply(variable)
    assert count == 0 and "is not a constant" in report.refusals[0].reason


def test_quantized_relus_in_a_row_fold_into_one_integer_conv_bit_for_bit():
    """quantize_static keeping removable activations, int8: Conv -> Q/DQ -> Relu -> Q/DQ -> Relu ->
    Q/DQ. Folding the islands left Conv -> Relu -> Relu -> Q, which ORT ran as a float FusedConv
    (fuzz seed 9535320); one Relu lets it fuse the Conv into a QLinearConv again."""
    weights = ", ".join(f"{v:.3f}" for v in np.random.default_rng(1).standard_normal(108))
    float_model = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,3,8,8] x) => (float[1,4,8,8] y)
    <float[4,3,3,3] w = {{{weights}}}>
    {{ c = Conv<pads = [1, 1, 1, 1]>(x, w)  r = Relu(c)  y = Relu(r) }}""")
    feeds = [{"x": np.random.default_rng(seed).standard_normal((1, 3, 8, 8)).astype(np.float32)} for seed in range(4)]
    config = {"activation_type": "QInt8", "weight_type": "QInt8", "per_channel": False, "reduce_range": False,
              "calibrate_method": "MinMax", "extra_options": {"WeightSymmetric": True, "QDQKeepRemovableActivations": True},
              "use_contrib_ops": False, "qparams_as_constant_nodes": False}
    qdq = quantize_with_config(float_model, config, feeds)
    assert model_checks.op_types(qdq)["Relu"] == 2
    fixed, report = kenosis_rewrite.fix(qdq, return_report=True, verify=False)
    assert report.change_counts()[RULE_NAME] == 1
    assert model_checks.op_types(fixed)["Relu"] == 1
    optimized = model_checks.ort_optimized_op_types(fixed)
    assert optimized["QLinearConv"] == 1 and "FusedConv" not in optimized
    for feed in feeds:
        np.testing.assert_array_equal(model_checks.outputs(qdq, feed)[0], model_checks.outputs(fixed, feed)[0])

"""Tests of the pass-through parameter alignment pass."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.placement.passes.qparam_propagation import RULE_NAME, PassThroughQParamsPass
from kenosis_rewrite.testing import model_checks

CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,8,8] x) => (float[1,2,{out}] y)
<float s1 = {{0.05}}, uint8 z1 = {{0}}, float s2 = {{0.07}}, uint8 z2 = {{{z2}}}, int64[2] shape = {{1, -1}}>
{{
  r = Relu(x)
  q1 = QuantizeLinear(r, s1, z1)
  d1 = DequantizeLinear(q1, s1, z1)
  p = {op}
  q2 = QuantizeLinear(p, s2, z2)
  y = DequantizeLinear(q2, s2, z2)
}}
"""


def _apply(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, FixReport]:
    return model_checks.apply_pass(proto, PassThroughQParamsPass)


@pytest.mark.parametrize(
    "op, out",
    [("MaxPool<kernel_shape=[2,2], strides=[2,2]>(d1)", "4,4"), ("Transpose<perm=[0,1,3,2]>(d1)", "8,8")],
)
def test_output_quantizer_takes_input_parameters_and_values_survive_exactly(op, out):
    proto = onnx.parser.parse_model(CHAIN.format(op=op, out=out, z2=3))
    fixed, report = _apply(proto)
    q2, y = model_checks.producer_of(fixed, "q2"), model_checks.producer_of(fixed, "y")
    assert q2.input[1:] == ["s1", "z1"] and y.input[1:] == ["s1", "z1"]
    assert [c.rule for c in report.changes] == [RULE_NAME]
    feed = {"x": np.random.default_rng(0).uniform(-1, 14, (1, 2, 8, 8)).astype(np.float32)}
    # y must equal the pass-through op applied to the dequantized input, with no further rounding.
    reference = onnx.parser.parse_model(CHAIN.format(op=op, out=out, z2=3).replace(
        "q2 = QuantizeLinear(p, s2, z2)\n  y = DequantizeLinear(q2, s2, z2)", "y = Identity(p)"))
    np.testing.assert_array_equal(model_checks.outputs(reference, feed)[0], model_checks.outputs(fixed, feed)[0])
    assert not np.array_equal(model_checks.outputs(proto, feed)[0], model_checks.outputs(fixed, feed)[0])


def test_dtype_mismatch_is_refused_with_reason():
    text = CHAIN.format(op="MaxPool<kernel_shape=[2,2], strides=[2,2]>(d1)", out="4,4", z2=3).replace(
        "uint8 z2 = {3}", "int8 z2 = {3}")
    fixed, report = _apply(onnx.parser.parse_model(text))
    assert report.refusals[0].reason == "input is UINT8, output quantizer is INT8"
    assert model_checks.producer_of(fixed, "q2").input[1] == "s2"


def test_aligned_chain_is_left_alone():
    text = CHAIN.format(op="MaxPool<kernel_shape=[2,2], strides=[2,2]>(d1)", out="4,4", z2=0).replace(
        "q2 = QuantizeLinear(p, s2, z2)", "q2 = QuantizeLinear(p, s1, z1)").replace(
        "y = DequantizeLinear(q2, s2, z2)", "y = DequantizeLinear(q2, s1, z1)")
    _, report = _apply(onnx.parser.parse_model(text))
    assert not report.changes and not report.refusals


RESIZE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,4,4] x) => (float[1,2,8,8] y)
<float s1 = {0.05}, uint8 z1 = {0}, float s2 = {0.07}, uint8 z2 = {3}, float[4] scales = {1, 1, 2, 2}>
{
  r = Relu(x)
  q1 = QuantizeLinear(r, s1, z1)
  d1 = DequantizeLinear(q1, s1, z1)
  p = Resize<mode="MODE">(d1, "", scales)
  q2 = QuantizeLinear(p, s2, z2)
  y = DequantizeLinear(q2, s2, z2)
}
"""


def test_nearest_resize_is_pass_through_and_linear_resize_is_not():
    feed = {"x": np.random.default_rng(0).uniform(-1, 14, (1, 2, 4, 4)).astype(np.float32)}
    nearest = onnx.parser.parse_model(RESIZE.replace("MODE", "nearest"))
    fixed, report = _apply(nearest)
    assert model_checks.producer_of(fixed, "q2").input[1:] == ["s1", "z1"], report.summary()
    reference = onnx.parser.parse_model(RESIZE.replace("MODE", "nearest").replace(
        "q2 = QuantizeLinear(p, s2, z2)\n  y = DequantizeLinear(q2, s2, z2)", "y = Identity(p)"))
    np.testing.assert_array_equal(model_checks.outputs(reference, feed)[0], model_checks.outputs(fixed, feed)[0])
    # ORT drops the aligned Q/DQ and resizes the uint8 tensor
    assert model_checks.ort_optimized_op_types(fixed)["DequantizeLinear"] < model_checks.ort_optimized_op_types(nearest)["DequantizeLinear"]
    fixed, report = _apply(onnx.parser.parse_model(RESIZE.replace("MODE", "linear")))
    assert not report.changes and model_checks.producer_of(fixed, "q2").input[1] == "s2"  # interpolates: new values


UNIFIED_CONCAT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,4,4] x, float[1,2,8,8] skip) => (float[1,4,8,8] y)
<float s1 = {0.05}, uint8 z1 = {0}, float s2 = {0.07}, uint8 z2 = {0}, float[4] scales = {1, 1, 2, 2}>
{
  q1 = QuantizeLinear(x, s1, z1)
  d1 = DequantizeLinear(q1, s1, z1)
  p = Resize<mode="nearest">(d1, "", scales)
  q2 = QuantizeLinear(p, s2, z2)
  d2 = DequantizeLinear(q2, s2, z2)
  qs = QuantizeLinear(skip, s2, z2)
  ds = DequantizeLinear(qs, s2, z2)
  y = Concat<axis=1>(d2, ds)
}
"""


def test_an_output_feeding_a_concat_with_unified_scales_is_not_aligned():
    """NNCF gives every Concat input one scale; aligning the Resize would break that and leave the Concat float."""
    fixed, report = _apply(onnx.parser.parse_model(UNIFIED_CONCAT))
    assert not report.changes and "unified" in report.refusals[0].reason
    assert model_checks.producer_of(fixed, "q2").input[1] == "s2"
    different = UNIFIED_CONCAT.replace("qs = QuantizeLinear(skip, s2, z2)\n  ds = DequantizeLinear(qs, s2, z2)",
                                       "qs = QuantizeLinear(skip, s1, z1)\n  ds = DequantizeLinear(qs, s1, z1)")
    fixed, report = _apply(onnx.parser.parse_model(different))
    assert [c.rule for c in report.changes] == [RULE_NAME]

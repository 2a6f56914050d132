"""Tests of a pass-through op reading the codes of the quantizer its input already has (INC's BlazeFace)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import kenosis_rewrite
from kenosis_rewrite.placement.passes.shared_quantizer import RULE_NAME, SharedQuantizerPass
from kenosis_rewrite.testing import model_checks

# INC's placement of BlazeFace's residual branch: the Relu's output is quantized for the depthwise Conv
# that reads it, and the MaxPool that also reads it only after the pool (``q2``), with the same parameters.
BRANCH = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,8,8] x) => (float[1,4,4,4] y, float[1,4,H,W] z)
<float sx = {{0.03125}}, uint8 zx = {{128}}, int8[4,4,1,1] w = {{{weights}}}, float sw = {{0.0078125}},
 int8 zw = {{0}}, float s1 = {{{s1}}}, uint8 z1 = {{{z1}}}, float s2 = {{{s2}}}, uint8 z2 = {{{z2}}},
 int8[4,1,3,3] v = {{{depthwise}}}, float sv = {{0.015625}}>
{{
  qx = QuantizeLinear(x, sx, zx)
  dx = DequantizeLinear(qx, sx, zx)
  dw = DequantizeLinear(w, sw, zw)
  c = Conv(dx, dw)
  r = Relu(c)
  q1 = QuantizeLinear(r, s1, z1)
  d1 = DequantizeLinear(q1, s1, z1)
  dv = DequantizeLinear(v, sv, zw)
  {depthwise_out} = Conv <group = 4, pads = [1, 1, 1, 1], strides = [2, 2]> (d1, dv)
  p = {pass_through}
  q2 = QuantizeLinear(p, s2, z2)
  d2 = DequantizeLinear(q2, s2, z2)
  z = Identity(d2)
}}
"""
MAXPOOL = "MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (r)"


def _model(pass_through: str = MAXPOOL, s2: float = 0.0625, z2: int = 0, s1: float = 0.0625, z1: int = 0,
           seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    text = BRANCH.format(
        pass_through=pass_through, s1=s1, z1=z1, s2=s2, z2=z2,
        depthwise_out="y", weights=", ".join(map(str, rng.integers(-127, 128, 16))),
        depthwise=", ".join(map(str, rng.integers(-127, 128, 36))),
    )
    return onnx.parser.parse_model(text)


def _feeds(count: int = 4, scale: float = 2.0, shift: float = 0.0) -> list[dict[str, np.ndarray]]:
    return [{"x": (np.random.default_rng(seed).standard_normal((1, 4, 8, 8)) * scale + shift).astype(np.float32)}
            for seed in range(count)]


def _assert_bit_exact(before: onnx.ModelProto, after: onnx.ModelProto, feeds=None) -> None:
    for feed in feeds or _feeds():
        for optimized in (False, True):
            for want, got in zip(model_checks.outputs(before, feed, optimized), model_checks.outputs(after, feed, optimized)):
                np.testing.assert_array_equal(want, got)


def test_a_maxpool_reads_the_codes_of_the_quantizer_its_input_has_and_runs_on_them():
    proto = _model()
    assert "MaxPool" in model_checks.ort_optimized_op_types(proto)  # ORT leaves the shared Relu's MaxPool float
    out, report = model_checks.apply_pass(proto, SharedQuantizerPass)
    onnx.checker.check_model(out, full_check=True)
    pool = next(n for n in out.graph.node if n.op_type == "MaxPool")
    assert model_checks.producer_of(out, pool.input[0]).output[0] == "q1"
    assert model_checks.op_types(out)["QuantizeLinear"] == model_checks.op_types(proto)["QuantizeLinear"] - 1
    assert [c.rule for c in report.changes] == [RULE_NAME] and report.changes[0].exact
    optimized = model_checks.ort_optimized_op_types(out)
    assert "MaxPool" not in optimized and optimized["NhwcMaxPool"] == 1, optimized  # ORT's uint8 pool
    assert "Relu" not in optimized  # the Relu now feeds only its quantizer, which absorbs it
    _assert_bit_exact(proto, out)


@pytest.mark.parametrize("pass_through", [
    "Transpose <perm = [0, 1, 3, 2]> (r)",
    "Reshape (r, shape)",
])
def test_data_movement_reads_the_shared_codes_too(pass_through):
    proto = _model(pass_through)
    if "shape" in pass_through:  # an 8x8 map read back as itself: a Reshape with a constant shape
        shape = onnx.helper.make_tensor("shape", onnx.TensorProto.INT64, [4], [1, 4, 8, 8])
        proto.graph.initializer.append(shape)
    out, report = model_checks.apply_pass(proto, SharedQuantizerPass)
    onnx.checker.check_model(out, full_check=True)
    assert [c.rule for c in report.changes] == [RULE_NAME]
    _assert_bit_exact(proto, out)


@pytest.mark.parametrize(("change", "why"), [
    ({"s2": 0.05}, "another scale"),
    ({"z2": 3}, "another zero point"),
])
def test_a_quantizer_with_other_parameters_is_left_alone(change, why):
    proto = _model(**change)
    out, report = model_checks.apply_pass(proto, SharedQuantizerPass)
    assert not report.changes, why
    assert model_checks.op_types(out) == model_checks.op_types(proto)


def test_a_pool_read_by_a_float_op_or_a_quantizer_that_is_a_graph_output_is_left_alone():
    read_twice = _model()
    read_twice.graph.node.append(onnx.helper.make_node("Relu", ["p"], ["p_float"]))
    read_twice.graph.output.append(onnx.helper.make_tensor_value_info("p_float", onnx.TensorProto.FLOAT, ["N", 4, "H", "W"]))
    codes_out = _model()
    codes_out.graph.output.append(onnx.helper.make_tensor_value_info("q2", onnx.TensorProto.UINT8, ["N", 4, "H", "W"]))
    for proto in (read_twice, codes_out):
        out, report = model_checks.apply_pass(proto, SharedQuantizerPass)
        assert not report.changes
        assert model_checks.op_types(out) == model_checks.op_types(proto)


def test_fix_takes_the_pool_onto_the_shared_codes_bit_exactly():
    proto = _model()
    fixed, report = kenosis_rewrite.fix(proto, return_report=True)
    assert RULE_NAME in {c.rule for c in report.changes}
    assert "MaxPool" not in model_checks.ort_optimized_op_types(fixed)
    _assert_bit_exact(proto, fixed)


@pytest.mark.parametrize("seed", range(12))
def test_property_sharing_the_codes_is_bit_exact_over_grids_zero_points_and_pools(seed):
    rng = np.random.default_rng(1000 + seed)
    scale = float(np.float32(2.0 ** rng.uniform(-7, -2)))
    zero_point = int(rng.integers(0, 256))
    kernel, stride = (int(k) for k in rng.choice([(2, 2), (3, 2), (3, 1), (2, 1)]))
    pool = f"MaxPool <kernel_shape = [{kernel}, {kernel}], strides = [{stride}, {stride}]> (r)"
    proto = _model(pool, s1=scale, z1=zero_point, s2=scale, z2=zero_point, seed=seed)
    out, report = model_checks.apply_pass(proto, SharedQuantizerPass)
    assert [c.rule for c in report.changes] == [RULE_NAME]
    feeds = _feeds(3, scale=float(rng.uniform(0.5, 6.0)), shift=float(rng.uniform(-1, 1)))
    _assert_bit_exact(proto, out, feeds)

"""Tests of the int8 -> uint8 activation retyping pass."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.placement.passes.activation_u8 import RULE_NAME, ActivationInt8ToUint8Pass
from kenosis_rewrite.testing import model_checks, toy_models


def _apply(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, FixReport]:
    return model_checks.apply_pass(proto, ActivationInt8ToUint8Pass)


@pytest.mark.parametrize("name", ["resnetish", "conv_silu", "concat", "matmul_relu"])
def test_every_activation_becomes_uint8_weights_stay_int8_outputs_bit_identical(name):
    float_model = toy_models.build(name)
    feeds = toy_models.random_feeds(float_model, 4)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds, "default")
    fixed, report = _apply(qdq)
    initializers = {t.name: t for t in fixed.graph.initializer}
    for node in fixed.graph.node:
        if node.op_type == "QuantizeLinear":
            assert initializers[node.input[2]].data_type == onnx.TensorProto.UINT8, node.name
    weight_dqs = [n for n in fixed.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in initializers
                  and initializers[n.input[0]].data_type == onnx.TensorProto.INT8]
    assert weight_dqs, "weights must stay int8"
    assert report.change_counts()[RULE_NAME] >= 3
    for feed in feeds:
        for a, b in zip(model_checks.outputs(qdq, feed, optimized=False), model_checks.outputs(fixed, feed, optimized=False)):
            np.testing.assert_array_equal(a, b)


def test_fan_out_tensors_leave_float_kernels_on_ort():
    float_model = toy_models.build("resnetish")
    qdq = ort_quantize.quantize_with_ort(float_model, toy_models.random_feeds(float_model, 4), "default")
    assert model_checks.ort_optimized_op_types(qdq)["Conv"] > 0  # the problem: int8 fan-out runs float
    fixed, _ = _apply(qdq)
    optimized = model_checks.ort_optimized_op_types(fixed)
    assert optimized["Conv"] == 0 and optimized["Add"] == 0
    assert optimized["QLinearConv"] == 7 and optimized["QLinearAdd"] == 3


INT8_OUTPUT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4] x) => (int8[1,4] q, float[1,4] y)
<float s = {0.1}, int8 z = {3}>
{
  a = Relu(x)
  q = QuantizeLinear(a, s, z)
  y = DequantizeLinear(q, s, z)
}
"""


def test_int8_graph_output_is_refused_with_reason():
    proto = onnx.parser.parse_model(INT8_OUTPUT)
    fixed, report = _apply(proto)
    assert [r.reason for r in report.refusals if r.rule == RULE_NAME] == [
        "int8 tensor 'q' is a graph output; its type is part of the model's interface"
    ]
    assert not report.changes
    assert fixed.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.INT8


ADD_CONSTANT = """
<ir_version: 8, opset_import: ["" : 21]>
g (float[1,4] x) => (float[1,4] y)
<float s = {0.1}, int8 z = {-5}, int8[1,4] c = {-128, -3, 0, 127}, float sc = {0.02}, int8 zc = {0}>
{
  a = Relu(x)
  qa = QuantizeLinear(a, s, z)
  da = DequantizeLinear(qa, s, z)
  dc = DequantizeLinear(c, sc, zc)
  sum = Add(da, dc)
  qs = QuantizeLinear(sum, s)
  ds = DequantizeLinear(qs, s)
  y = Identity(ds)
}
"""


def test_activation_constants_and_zero_point_less_quantizers_are_retyped_exactly():
    proto = onnx.parser.parse_model(ADD_CONSTANT)
    # Q without zero point defaults to uint8; force the int8 case through output_dtype (opset 21).
    quantize = model_checks.producer_of(proto, "qs")
    quantize.attribute.append(onnx.helper.make_attribute("output_dtype", onnx.TensorProto.INT8))
    onnx.checker.check_model(proto)
    fixed, report = _apply(proto)
    constant_dq = model_checks.producer_of(fixed, "dc")
    np.testing.assert_array_equal(model_checks.initializer(fixed, constant_dq.input[0]), [[0, 125, 128, 255]])
    assert model_checks.initializer(fixed, constant_dq.input[2]) == 128
    qs = model_checks.producer_of(fixed, "qs")
    assert model_checks.initializer(fixed, qs.input[2]) == 128
    assert [a.i for a in qs.attribute if a.name == "output_dtype"] == [onnx.TensorProto.UINT8]
    assert len(report.changes) == 3
    feed = {"x": np.array([[0.0, 1.3, 12.7, 40.0]], np.float32)}
    np.testing.assert_array_equal(
        model_checks.outputs(proto, feed, optimized=False)[0], model_checks.outputs(fixed, feed, optimized=False)[0]
    )


def test_weights_shared_with_activation_uses_stay_int8():
    float_model = toy_models.build("gemm_relu")
    qdq = ort_quantize.quantize_with_ort(float_model, toy_models.random_feeds(float_model, 4), "default")
    fixed, _ = _apply(qdq)
    gemm = next(n for n in fixed.graph.node if n.op_type == "Gemm")
    weight_dq = model_checks.producer_of(fixed, gemm.input[1])
    assert model_checks.initializer(fixed, weight_dq.input[0]).dtype == np.int8


PER_AXIS_AFTER_AVERAGE_POOL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,4,4] x) => (float[1,2,2,2] y)
<float s = {0.05}, int8 z = {0}, float[2] sc = {0.02, 0.04}, int8[2] zc = {-3, 5}>
{
  qx = QuantizeLinear(x, s, z)
  dx = DequantizeLinear(qx, s, z)
  p = AveragePool <kernel_shape = [2, 2], strides = [2, 2]> (dx)
  qp = QuantizeLinear <axis = 1> (p, sc, zc)
  dp = DequantizeLinear <axis = 1> (qp, sc, zc)
  y = Relu(dp)
}
"""


def test_per_axis_activation_next_to_an_average_pool_stays_int8():
    """NNCF puts per-channel Qs after AveragePool (afis 1.2.7's fingerprint net); in uint8 ONNX
    Runtime fuses DQ -> AveragePool -> Q into QLinearAveragePool, which refuses per-axis
    parameters, so the whole model failed to load. The per-tensor input Q still becomes uint8."""
    proto = onnx.parser.parse_model(PER_AXIS_AFTER_AVERAGE_POOL)
    fixed, report = _apply(proto)
    assert [r.reason.split(":")[0] for r in report.refusals if r.rule == RULE_NAME] == [
        "per-axis int8 tensor 'qp' next to an AveragePool"]
    assert len([c for c in report.changes if c.rule == RULE_NAME]) == 1  # qx, per-tensor
    model_checks.ort_optimized_op_types(fixed)  # loads with every optimization on
    feed = {"x": np.random.default_rng(0).uniform(-2, 2, (1, 2, 4, 4)).astype(np.float32)}
    np.testing.assert_array_equal(model_checks.outputs(fixed, feed)[0], model_checks.outputs(proto, feed)[0])


def test_a_weight_read_through_identity_nodes_stays_int8_and_fix_is_idempotent():
    """An int8 weight constant read by its MatMuls through Identity nodes (a weight shared by several
    layers, as PyTorch exports it): not an activation-typed constant. A second fix() of NNCF's
    chython-rxnmap retyped 8 such weights to uint8 (u8u8 MatMuls) after the first folded them."""
    import onnx_ir as ir  # noqa: PLC0415

    import kenosis_rewrite  # noqa: PLC0415

    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,4] x) => (float[2,4] y)
    <int8[4,4] wq = {1, -2, 3, -4, 5, -6, 7, -8, 9, -10, 11, -12, 13, -14, 15, -16}, float ws = {0.02}, int8 wz = {0},
     float xs = {0.05}, uint8 xz = {128}>
    { w = DequantizeLinear(wq, ws, wz)  w1 = Identity(w)  w2 = Identity(w)
      xq = QuantizeLinear(x, xs, xz)  xd = DequantizeLinear(xq, xs, xz)
      h = MatMul(xd, w1)  hq = QuantizeLinear(h, xs, xz)  hd = DequantizeLinear(hq, xs, xz)
      y = MatMul(hd, w2) }""")
    model = ir.serde.deserialize_model(proto)
    report = FixReport()
    ActivationInt8ToUint8Pass(report)(model)
    assert not [c for c in report.changes if "constant" in c.detail]
    assert model.graph.initializers["wq"].const_value.dtype == ir.DataType.INT8
    fixed = kenosis_rewrite.fix(proto)
    again, second = kenosis_rewrite.fix(fixed, return_report=True)
    assert not second.changes
    assert again.SerializeToString() == fixed.SerializeToString()

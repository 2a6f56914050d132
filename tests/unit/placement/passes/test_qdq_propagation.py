"""Tests of DQ-forward / Q-backward propagation and redundant pair removal."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.placement.passes.qdq_propagation import DequantizeForwardPass, QuantizeBackwardPass, RedundantQDQPass
from kenosis_rewrite.testing import model_checks

CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,4,4] x) => (float[1,2,2,2] y)
<float s = {0.05}, int8 z = {0}>
{
  q1 = QuantizeLinear(x, s, z)
  d1 = DequantizeLinear(q1, s, z)
  m = MaxPool<kernel_shape=[2,2], strides=[2,2]>(d1)
  q2 = QuantizeLinear(m, s, z)
  y = DequantizeLinear(q2, s, z)
}
"""


def _apply(proto, *passes):
    model = ir.serde.deserialize_model(proto)
    for p in passes:
        p(model)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    return out


def _feed():
    return {"x": np.random.default_rng(0).uniform(-3, 3, (1, 2, 4, 4)).astype(np.float32)}


def test_dq_forward_then_redundant_removal_runs_maxpool_on_int8_exactly():
    proto = onnx.parser.parse_model(CHAIN)
    out = _apply(proto, DequantizeForwardPass(), RedundantQDQPass())
    assert model_checks.op_types(out) == {"QuantizeLinear": 1, "MaxPool": 1, "DequantizeLinear": 1}
    pool = next(n for n in out.graph.node if n.op_type == "MaxPool")
    assert model_checks.producer_of(out, pool.input[0]).op_type == "QuantizeLinear"
    np.testing.assert_array_equal(model_checks.outputs(out, _feed())[0], model_checks.outputs(proto, _feed())[0])


def test_q_backward_through_float_maxpool_is_exact():
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,4,4] x) => (float[1,2,2,2] y)
    <float s = {0.05}, int8 z = {3}>
    { r = Relu(x)  m = MaxPool<kernel_shape=[2,2], strides=[2,2]>(r)
      q = QuantizeLinear(m, s, z)  y = DequantizeLinear(q, s, z) }""")
    out = _apply(proto, QuantizeBackwardPass())
    pool = next(n for n in out.graph.node if n.op_type == "MaxPool")
    assert model_checks.producer_of(out, pool.input[0]).op_type == "QuantizeLinear"
    np.testing.assert_array_equal(model_checks.outputs(out, _feed())[0], model_checks.outputs(proto, _feed())[0])


def test_concat_with_equal_parameters_runs_on_int8_and_different_ones_stay():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2] a, float[1,2] b) => (float[1,4] y)
    <float s = {0.05}, float t = {T}, int8 z = {0}>
    { qa = QuantizeLinear(a, s, z)  da = DequantizeLinear(qa, s, z)
      qb = QuantizeLinear(b, t, z)  db = DequantizeLinear(qb, t, z)
      y = Concat<axis=1>(da, db) }"""
    same = _apply(onnx.parser.parse_model(text.replace("T", "0.05")), DequantizeForwardPass())
    assert model_checks.producer_of(same, "y").op_type == "DequantizeLinear"
    different = _apply(onnx.parser.parse_model(text.replace("T", "0.07")), DequantizeForwardPass())
    assert model_checks.producer_of(different, "y").op_type == "Concat"


def test_redundant_pair_with_different_parameters_is_kept():
    proto = onnx.parser.parse_model(CHAIN.replace("q2 = QuantizeLinear(m, s, z)", "q2 = QuantizeLinear(m, s2, z)")
                                    .replace("y = DequantizeLinear(q2, s, z)", "y = DequantizeLinear(q2, s2, z)")
                                    .replace("int8 z = {0}>", "int8 z = {0}, float s2 = {0.07}>"))
    out = _apply(proto, DequantizeForwardPass(), RedundantQDQPass())
    assert model_checks.op_types(out)["QuantizeLinear"] == 2  # requantization stays
    np.testing.assert_array_equal(model_checks.outputs(out, _feed())[0], model_checks.outputs(proto, _feed())[0])


SPLIT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,4,4] x) => (float[1,2,4,4] y, float[1,2,4,4] t)
<float s = {0.05}, uint8 z = {128}, int64[2] parts = {2, 2}, int8[2,2,1,1] wq = {3, -7, 5, 2}, float ws = {0.1}, int8 wz = {0}>
{
  q = QuantizeLinear(x, s, z)
  d = DequantizeLinear(q, s, z)
  a, b = Split <axis: int = 1> (d, parts)
  w = DequantizeLinear(wq, ws, wz)
  c = Conv(a, w)
  t = Identity(b)
  qy = QuantizeLinear(c, s, z)
  y = DequantizeLinear(qy, s, z)
}
"""


def test_split_runs_on_the_quantized_tensor_with_one_dq_per_used_output_exactly():
    from kenosis_rewrite.placement.passes.qdq_propagation import DequantizeAfterSplitPass  # noqa: PLC0415

    proto = onnx.parser.parse_model(SPLIT)
    out, report = model_checks.apply_pass(proto, DequantizeAfterSplitPass)
    assert report.change_counts() == {"move-dq-past-split": 1}
    split = next(n for n in out.graph.node if n.op_type == "Split")
    assert split.input[0] == "q"  # reads the quantized tensor
    readers = {n.op_type for n in out.graph.node if set(n.input) & set(split.output)}
    assert readers == {"DequantizeLinear"}
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    assert model_checks.producer_of(out, conv.input[0]).op_type == "DequantizeLinear"  # ORT can fuse the Conv
    assert model_checks.ort_optimized_op_types(out)["QLinearConv"] == 1
    feed = {"x": np.random.default_rng(1).uniform(-6, 6, (1, 4, 4, 4)).astype(np.float32)}
    for before, after in zip(model_checks.outputs(proto, feed, optimized=False), model_checks.outputs(out, feed, optimized=False)):
        np.testing.assert_array_equal(before, after)


SPPF = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2,6,6] x) => (float[1,3,6,6] y, float[1,2,6,6] t)
<float s = {0.05}, uint8 z = {128}, int8[3,6,1,1] wq = {3, -7, 5, 2, 1, -1, 4, 4, -2, 6, 0, 1, -3, 2, 2, 5, -1, 7},
 float ws = {0.1}, int8 wz = {0}>
{
  q = QuantizeLinear(x, s, z)
  d = DequantizeLinear(q, s, z)
  m1 = MaxPool<kernel_shape=[3,3], pads=[1,1,1,1]>(d)
  m2 = MaxPool<kernel_shape=[3,3], pads=[1,1,1,1]>(m1)
  cat = Concat<axis=1>(d, m1, m2)
  w = DequantizeLinear(wq, ws, wz)
  c = Conv(cat, w)
  qc = QuantizeLinear(c, s, z)
  y = DequantizeLinear(qc, s, z)
  m3 = MaxPool<kernel_shape=[3,3], pads=[1,1,1,1]>(d)
  q3 = QuantizeLinear(m3, s, z)
  t = DequantizeLinear(q3, s, z)
}
"""


def test_float_consumers_only_moves_dq_past_an_sppf_to_the_conv_and_leaves_quantized_outputs_exactly():
    """NNCF's YOLOv8 SPPF: MaxPools and a Concat of one dequantized tensor, all float, feed a Conv."""
    proto = onnx.parser.parse_model(SPPF)
    out = _apply(proto, DequantizeForwardPass(ops=frozenset({"MaxPool", "Concat"}), float_consumers_only=True))
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    assert model_checks.producer_of(out, conv.input[0]).op_type == "DequantizeLinear"
    assert model_checks.producer_of(out, model_checks.producer_of(out, conv.input[0]).input[0]).op_type == "Concat"
    # the MaxPool whose output a Q reads is ORT's own QDQ node unit: left as it was
    assert model_checks.producer_of(out, model_checks.producer_of(out, "q3").input[0]).input[0] == "d"
    assert model_checks.op_types(out)["MaxPool"] == 3
    feed = {"x": np.random.default_rng(0).uniform(-3, 3, (1, 2, 6, 6)).astype(np.float32)}
    # the graph computes the same function (ORT's integer kernel rounds its own way: compare graphs unoptimized)
    for before, after in zip(model_checks.outputs(proto, feed, optimized=False), model_checks.outputs(out, feed, optimized=False)):
        np.testing.assert_array_equal(after, before)
    optimized = model_checks.ort_optimized_op_types(out)
    assert optimized["QLinearConv"] == 1 and optimized["Conv"] == 0, optimized  # on the quantized Concat
    assert model_checks.ort_optimized_op_types(proto)["Conv"] == 1  # before: float Conv on the float Concat

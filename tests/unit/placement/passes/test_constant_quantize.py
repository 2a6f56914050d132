"""Tests of offline quantization of constants."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.placement.passes.constant_quantize import RULE_NAME, FoldConstantQuantizePass
from kenosis_rewrite.testing import model_checks


def test_quantize_of_a_constant_node_becomes_an_integer_initializer_exactly():
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,3,3] x) => (float[1,2,3,3] y)
    <float s = {0.25}, int8 z = {3}>
    { w = Constant<value = float[2,2,1,1] {0.625, -0.375, 0.125, 0.875}>()
      qw = QuantizeLinear(w, s, z)  dw = DequantizeLinear(qw, s, z)  y = Conv(x, dw) }""")
    model = ir.serde.deserialize_model(proto)
    report = FixReport()
    FoldConstantQuantizePass(report)(model)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    assert "QuantizeLinear" not in model_checks.op_types(out)
    dq = model_checks.producer_of(out, "dw")
    # 2.5 -> 2, -1.5 -> -2, 0.5 -> 0, 3.5 -> 4: round half to even, as QuantizeLinear does
    np.testing.assert_array_equal(model_checks.initializer(out, dq.input[0]).reshape(-1), [5, 1, 3, 7])
    assert [c.rule for c in report.changes] == [RULE_NAME]
    feed = {"x": np.random.default_rng(0).standard_normal((1, 2, 3, 3)).astype(np.float32)}
    np.testing.assert_array_equal(model_checks.outputs(out, feed)[0], model_checks.outputs(proto, feed)[0])


def _shared_weight_model() -> onnx.ModelProto:
    """A weight shared through Identity nodes, each use with its own Q/DQ (NNCF's output of an
    ALBERT-style encoder exported by PyTorch: chython-rxnmap 2.0)."""
    rng = np.random.default_rng(0)
    codes = rng.integers(-127, 128, (8, 8)).astype(np.int8)
    scale = (rng.uniform(0.01, 0.02, 8)).astype(np.float32)
    weights = ", ".join(str(int(v)) for v in codes.reshape(-1))
    scales = ", ".join(repr(float(v)) for v in scale)
    return onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x) => (float[2,8] y)
    <int8[8,8] wq = {{{weights}}}, float[8] ws = {{{scales}}}, int8[8] wz = {{0, 0, 0, 0, 0, 0, 0, 0}},
     float[8] ws2 = {{{", ".join(repr(float(v) * 1.5) for v in scale)}}}, float xs = {{0.05}}, uint8 xz = {{128}}>
    {{ w = DequantizeLinear <axis: int = 1> (wq, ws, wz)
      w1 = Identity(w)  w2 = Identity(w)  w3 = Identity(w)
      q1 = QuantizeLinear <axis: int = 1> (w1, ws, wz)  d1 = DequantizeLinear <axis: int = 1> (q1, ws, wz)
      q2 = QuantizeLinear <axis: int = 1> (w2, ws, wz)  d2 = DequantizeLinear <axis: int = 1> (q2, ws, wz)
      q3 = QuantizeLinear <axis: int = 1> (w3, ws2, wz)  d3 = DequantizeLinear <axis: int = 1> (q3, ws2, wz)
      xq = QuantizeLinear(x, xs, xz)  xd = DequantizeLinear(xq, xs, xz)
      h1 = MatMul(xd, d1)  hq = QuantizeLinear(h1, xs, xz)  hd = DequantizeLinear(hq, xs, xz)
      h2 = MatMul(hd, d2)  gq = QuantizeLinear(h2, xs, xz)  gd = DequantizeLinear(gq, xs, xz)
      y = MatMul(gd, d3) }}""")


def test_a_weight_shared_through_identity_nodes_is_quantized_once_offline_for_each_grid():
    proto = _shared_weight_model()
    onnx.checker.check_model(proto, full_check=True)
    model = ir.serde.deserialize_model(proto)
    report = FixReport()
    FoldConstantQuantizePass(report)(model)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    assert [c.rule for c in report.changes] == [RULE_NAME] * 3
    ops = model_checks.op_types(out)
    assert ops["Identity"] == 0 and ops["QuantizeLinear"] == 3  # only the activations' Qs are left
    sources = [model_checks.producer_of(out, name).input[0] for name in ("d1", "d2", "d3")]
    assert sources[0] == sources[1] != sources[2]  # equal codes share one initializer; another grid its own
    np.testing.assert_array_equal(model_checks.initializer(out, sources[0]), model_checks.initializer(proto, "wq"))
    rng = np.random.default_rng(1)
    for _ in range(3):  # exact: the same computation, done once
        feed = {"x": rng.standard_normal((2, 8)).astype(np.float32)}
        np.testing.assert_array_equal(model_checks.outputs(out, feed, optimized=False)[0],
                                      model_checks.outputs(proto, feed, optimized=False)[0])

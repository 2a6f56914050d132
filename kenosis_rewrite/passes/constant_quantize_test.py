"""Tests of offline quantization of constants."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite import _testing
from kenosis_rewrite.passes.constant_quantize import RULE_NAME, FoldConstantQuantizePass
from kenosis_rewrite.report import FixReport


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
    assert "QuantizeLinear" not in _testing.op_types(out)
    dq = _testing.producer_of(out, "dw")
    # 2.5 -> 2, -1.5 -> -2, 0.5 -> 0, 3.5 -> 4: round half to even, as QuantizeLinear does
    np.testing.assert_array_equal(_testing.initializer(out, dq.input[0]).reshape(-1), [5, 1, 3, 7])
    assert [c.rule for c in report.changes] == [RULE_NAME]
    feed = {"x": np.random.default_rng(0).standard_normal((1, 2, 3, 3)).astype(np.float32)}
    np.testing.assert_array_equal(_testing.outputs(out, feed)[0], _testing.outputs(proto, feed)[0])

"""Tests of shape-of-codes: a quantized tensor's run-time shape is read from its codes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kenosis_rewrite.placement.rules.shape_of_dequantized import RULE_NAME, shape_of_codes_rules
from kenosis_rewrite.testing import model_checks


def _model(reader: str, *, per_axis: bool = False, other_reader: bool = True) -> onnx.ModelProto:
    """``x -> Q -> DQ``; the DQ's output flattened to ``[batch, -1]`` by a ``reader``-computed shape
    (``Shape <start, end>`` or ``Size``), and (``other_reader``) also read by a Relu, as a Conv would:
    the rule matches a DequantizeLinear of any number of readers."""
    axis = " <axis = 1>" if per_axis else ""
    params = ("float[3] s = {0.05, 0.1, 0.02}, uint8[3] z = {3, 128, 200}" if per_axis
              else "float s = {0.05}, uint8 z = {128}")
    if reader == "Shape":
        computed = """
      dims = Shape <start = 0, end = 1> (d)
      target = Concat <axis = 0> (dims, minus_one)"""
    else:
        computed = """
      count = Size(d)
      count_1d = Unsqueeze(count, zero_axis)
      target = Concat <axis = 0> (one, count_1d)"""
    other = "\n      r = Relu(d)" if other_reader else ""
    outputs = "float[N, 36] y, float[N, 3, 3, 4] r" if other_reader else "float[N, 36] y"
    return onnx.parser.parse_model(f"""
    <ir_version: 10, opset_import: ["" : 21]>
    g (float[N, 3, 3, 4] x) => ({outputs})
    <{params}, int64[1] minus_one = {{-1}}, int64[1] one = {{1}}, int64[1] zero_axis = {{0}}>
    {{
      q = QuantizeLinear{axis} (x, s, z)
      d = DequantizeLinear{axis} (q, s, z){computed}
      y = Reshape(d, target){other}
    }}""")


@pytest.mark.parametrize("reader", ["Shape", "Size"])
@pytest.mark.parametrize("per_axis", [False, True])
@pytest.mark.parametrize("other_reader", [True, False])
def test_the_shape_is_read_from_the_codes_bit_for_bit(reader, per_axis, other_reader):
    model = _model(reader, per_axis=per_axis, other_reader=other_reader)
    rewritten, report, count = model_checks.apply_reporting_rules(model, shape_of_codes_rules)
    assert count == 1
    assert [c.rule for c in report.changes] == [RULE_NAME] and report.changes[0].exact
    node = next(n for n in rewritten.graph.node if n.op_type == reader)
    assert model_checks.producer_of(rewritten, node.input[0]).op_type == "QuantizeLinear"
    if reader == "Shape":  # start and end kept
        assert {a.name: a.i for a in node.attribute} == {"start": 0, "end": 1}
    batch = 1 if reader == "Size" else 2  # Size counts the batch too: one row per batch of one
    feed = {"x": np.random.default_rng(0).normal(0, 3, (batch, 3, 3, 4)).astype(np.float32)}
    for optimized in (False, True):
        for got, want in zip(model_checks.outputs(rewritten, feed, optimized), model_checks.outputs(model, feed, optimized)):
            np.testing.assert_array_equal(got, want)


def test_a_shape_not_of_a_dequantized_tensor_is_left_alone():
    model = onnx.parser.parse_model("""
    <ir_version: 10, opset_import: ["" : 21]>
    g (float[N, 4] x) => (float[N, 4] y)
    <int64[1] zero = {0}>
    {
      r = Relu(x)
      s = Shape(r)
      y = Reshape(r, s)
    }""")
    _, report, count = model_checks.apply_reporting_rules(model, shape_of_codes_rules)
    assert count == 0 and not report.changes

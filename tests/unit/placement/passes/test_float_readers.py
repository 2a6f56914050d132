"""Tests of the float-readers pass: ops that run in float read the float tensor, not its QDQ copy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kenosis_rewrite import quantize
from kenosis_rewrite.placement.passes.float_readers import RULE_NAME, FloatReadersReadFloatPass
from kenosis_rewrite.testing import model_checks

# x is quantized for the MatMul; a residual Sum (float) and a QDQ Add unit (integer) read the same
# DQ; the DQ of `x` is also a graph output (left alone)
GRAPH = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[2,8] x, float[2,8] r) => (float[2,8] m, float[2,8] s, float[2,8] u, float[2,8] xdq)
<float xs = {0.05}, uint8 xz = {128}, int8[8,8] wq = {WEIGHTS}, float ws = {0.01}, int8 wz = {0},
 float us = {0.1}, uint8 uz = {128}>
{
  xq = QuantizeLinear(x, xs, xz)
  xdq = DequantizeLinear(xq, xs, xz)
  w = DequantizeLinear(wq, ws, wz)
  m = MatMul(xdq, w)
  s = Sum(xdq, m)
  a = Add(xdq, r)
  aq = QuantizeLinear(a, us, uz)
  u = DequantizeLinear(aq, us, uz)
}
"""


def _model() -> onnx.ModelProto:
    weights = np.random.default_rng(0).integers(-100, 100, 64)
    return onnx.parser.parse_model(GRAPH.replace("WEIGHTS", ", ".join(map(str, weights))))


def _producer_inputs(model: onnx.ModelProto) -> dict[str, list[str]]:
    return {out: list(node.input) for node in model.graph.node for out in node.output}


def test_float_reader_reads_float_and_integer_readers_keep_the_dq():
    original = _model()
    rewired, report = model_checks.apply_pass(original, FloatReadersReadFloatPass)
    inputs = _producer_inputs(rewired)
    assert inputs["s"] == ["x", "m"]  # the residual Sum reads x itself
    assert inputs["m"][0] == "xdq"  # the MatMul (MatMulIntegerToFloat in ORT) keeps its DQ
    assert inputs["a"][0] == "xdq"  # Add -> Q is a QDQ unit (QLinearAdd): keeps its DQ
    assert [c.rule for c in report.changes] == [RULE_NAME]
    assert not report.changes[0].exact
    onnx.checker.check_model(rewired, full_check=True)
    rng = np.random.default_rng(1)
    for _ in range(4):
        feed = {name: rng.standard_normal((2, 8)).astype(np.float32) * 3 for name in ("x", "r")}
        before = dict(zip(("m", "s", "u", "xdq"), model_checks.outputs(original, feed)))
        after = dict(zip(("m", "s", "u", "xdq"), model_checks.outputs(rewired, feed)))
        for name in ("m", "u", "xdq"):  # what runs integer, and the graph output, are untouched
            np.testing.assert_array_equal(after[name], before[name])
        np.testing.assert_array_equal(after["s"], feed["x"] + after["m"])  # exactly the float tensor
        assert not np.array_equal(after["s"], before["s"])  # ... which the input model rounded


def test_nothing_to_do_leaves_the_model_unchanged():
    model = onnx.parser.parse_model(GRAPH.replace("WEIGHTS", ", ".join(["1"] * 64)).replace("s = Sum(xdq, m)", "s = Sum(x, m)"))
    rewired, report = model_checks.apply_pass(model, FloatReadersReadFloatPass)
    assert not report.changes
    assert _producer_inputs(rewired) == _producer_inputs(model)


def _post_ln_block(hidden: int = 32) -> onnx.ModelProto:
    """x -> LN -> h; h -> Linear -> Gelu -> Linear -> Add(h, .) -> LN: a BERT-style (post-LN) block,
    whose residual reads the tensor the MatMul is quantized on. Symbolic dims: the MatMuls stay MatMuls."""
    rng = np.random.default_rng(3)
    make, init = onnx.helper.make_node, onnx.numpy_helper.from_array
    inits = [init(np.ones(hidden, np.float32), "g"), init(np.zeros(hidden, np.float32), "b"),
             init((rng.standard_normal((hidden, 4 * hidden)) / np.sqrt(hidden)).astype(np.float32), "w1"),
             init((0.1 * rng.standard_normal(4 * hidden)).astype(np.float32), "b1"),
             init((rng.standard_normal((4 * hidden, hidden)) / np.sqrt(4 * hidden)).astype(np.float32), "w2"),
             init((0.1 * rng.standard_normal(hidden)).astype(np.float32), "b2")]
    nodes = [make("LayerNormalization", ["x", "g", "b"], ["h"], axis=-1),
             make("MatMul", ["h", "w1"], ["m1"]), make("Add", ["m1", "b1"], ["a1"]), make("Gelu", ["a1"], ["g1"]),
             make("MatMul", ["g1", "w2"], ["m2"]), make("Add", ["m2", "b2"], ["a2"]),
             make("Add", ["h", "a2"], ["res"]), make("LayerNormalization", ["res", "g", "b"], ["y"], axis=-1)]
    vi = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(nodes, "post_ln", [vi("x", onnx.TensorProto.FLOAT, ["batch", "seq", hidden])],
                                   [vi("y", onnx.TensorProto.FLOAT, ["batch", "seq", hidden])], inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_weighted_plan_leaves_dqs_to_the_matmuls_only(seed):
    model = _post_ln_block()
    rng = np.random.default_rng(seed)
    feeds = [{"x": (rng.standard_normal((1, 8, 32)) * 2).astype(np.float32)} for _ in range(16)]
    quantized, report = quantize(model, feeds, calibration_samples=16, plan="weighted", return_report=True)
    consumers: dict[str, list[str]] = {}
    for node in quantized.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node.op_type)
    integer_inputs = {name for node in quantized.graph.node if node.op_type == "MatMulInteger" for name in node.input[:2]}
    dequantized = [out for node in quantized.graph.node if node.op_type == "DequantizeLinear"
                   and node.input[0] not in {i.name for i in quantized.graph.initializer if i.data_type == onnx.TensorProto.INT32}
                   for out in node.output]
    assert dequantized or integer_inputs
    for name in dequantized:  # each DQ feeds a weighted op only: nothing float reads a rounded copy
        assert set(consumers[name]) <= {"MatMul", "Gemm"}, (name, consumers[name])
    for name in integer_inputs:  # integer-matmul-bias: the quantized codes go to MatMulInteger only
        assert set(consumers[name]) == {"MatMulInteger"}, (name, consumers[name])
    assert any(c.rule == RULE_NAME for c in report.changes)
    held_out = [{"x": (rng.standard_normal((1, 8, 32)) * 2).astype(np.float32)} for _ in range(4)]
    assert model_checks.graph_cosine(model, quantized, held_out) >= 0.999

"""Tests of Transpose sinking past elementwise ops (FP32 canonicalization)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxscript.rewriter import RewriteRuleSet
from onnxscript.rewriter.rules.common import no_op_transpose_rule, transpose_transpose_rule

from kenosis_rewrite.canonicalization.rules.transpose_sinking import transpose_sinking_rules
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.testing import model_checks

NHWC = [1, 7, 5, 6]
TO_NCHW, TO_NHWC = [0, 3, 1, 2], [0, 2, 3, 1]


def _model(nodes, inits, out_shape):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, NHWC)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def _sink(model):
    cancel = RewriteRuleSet([transpose_transpose_rule, no_op_transpose_rule])
    return model_checks.apply_rules(model, transpose_sinking_rules(), cancel)


def _run(model, x):
    return fidelity.run(model, [{"x": x}], optimized=False)[0][0]


@pytest.mark.parametrize("constant_shape", [(6,), (1, 1, 1, 6), (5, 6), (), (7, 5, 6)])
@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("constant_first", [False, True])
def test_nhwc_pair_around_elementwise_cancels_bit_exactly(constant_shape, op_type, constant_first):
    rng = np.random.default_rng(0)
    constant = rng.uniform(0.5, 2, constant_shape).astype(np.float32)
    operands = ["k", "t"] if constant_first else ["t", "k"]
    nodes = [
        helper.make_node("Transpose", ["x"], ["t0"], perm=TO_NCHW),
        helper.make_node("Transpose", ["t0"], ["t"], perm=TO_NHWC),  # stands for NCHW work, here none
        helper.make_node(op_type, operands, ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("Clip", ["r", "lo", "hi"], ["c"]),
        helper.make_node("Transpose", ["c"], ["y"], perm=TO_NCHW),
    ]
    inits = [numpy_helper.from_array(constant, "k"), numpy_helper.from_array(np.float32(0.1), "lo"),
             numpy_helper.from_array(np.float32(1.5), "hi")]
    model = _model(nodes, inits, [1, 6, 7, 5])
    out, count = _sink(model)
    assert count > 0
    assert [n.op_type for n in out.graph.node if n.op_type != "Identity"] == [op_type, "Relu", "Clip", "Transpose"]
    x = rng.normal(0, 1, NHWC).astype(np.float32)
    np.testing.assert_array_equal(_run(out, x), _run(model, x))


def test_one_constant_shared_by_two_sinks_gets_one_copy_per_site():
    """A ViT's attention scale is one Constant read after two Transposes: each sink needs its own
    transposed copy (a shared name once left a node reading an initializer that did not exist)."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t1"], perm=TO_NCHW),
        helper.make_node("Div", ["t1", "k"], ["a"]),
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t2"], perm=TO_NCHW),
        helper.make_node("Div", ["t2", "k"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.arange(1, 7, dtype=np.float32).reshape(6, 1, 1), "k")]
    model = _model(nodes, inits, [1, 6, 7, 5])
    out, count = _sink(model)  # full_check inside: every input is defined
    assert count == 2
    x = np.random.default_rng(1).normal(0, 1, NHWC).astype(np.float32)
    np.testing.assert_array_equal(_run(out, x), _run(model, x))


def test_constant_of_higher_rank_is_refused():
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=TO_NCHW), helper.make_node("Add", ["t", "k"], ["y"])]
    inits = [numpy_helper.from_array(np.ones((2, 1, 6, 7, 5), np.float32), "k")]
    model = _model(nodes, inits, [2, 1, 6, 7, 5])
    out, count = _sink(model)
    assert count == 0 and [n.op_type for n in out.graph.node] == ["Transpose", "Add"]


def test_transpose_with_another_reader_is_not_duplicated():
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=TO_NCHW),
        helper.make_node("Relu", ["t"], ["r"]),
        helper.make_node("Add", ["r", "t"], ["y"]),
    ]
    model = _model(nodes, [], [1, 6, 7, 5])
    out, count = _sink(model)
    assert count == 0 and [n.op_type for n in out.graph.node].count("Transpose") == 1

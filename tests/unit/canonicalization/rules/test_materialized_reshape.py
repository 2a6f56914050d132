"""Tests of Reshape(x, computed) -> Reshape(x, Constant(dims)) where the output's shape is known, in any opset."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.canonicalization.rules.materialized_reshape import materialized_reshape_rules
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.testing import model_checks


def _view(opset: int, declared: list, x_shape=("N", 4, 10, 4), rest=(4, 4, 10)) -> onnx.ModelProto:
    """``x.view(x.shape[0], *rest)``, the view's shape declared as ``declared`` (what inference knows)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axis0"], ["n1"]),
        helper.make_node("Concat", ["n1", "rest"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["v"]),
        helper.make_node("Relu", ["v"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * 4)],
        [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array([0], np.int64), "axis0"),
         numpy_helper.from_array(np.array(rest, np.int64), "rest")],
        value_info=[helper.make_tensor_value_info("v", TensorProto.FLOAT, declared)] if declared else [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _reshape(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(node for node in model.graph.node if node.op_type == "Reshape")


@pytest.mark.parametrize(("opset", "allowzero"), [(13, None), (14, 1), (17, 1)])
def test_the_target_becomes_a_constant_valid_in_the_model_opset(opset, allowzero):
    model = _view(opset, ["N", 4, 4, 10])
    out, count = model_checks.apply_rules(model, materialized_reshape_rules())  # full_check: valid in its opset
    assert count == 1
    reshape = _reshape(out)
    attributes = {a.name: a.i for a in reshape.attribute}
    assert attributes.get("allowzero") == allowzero
    target = next(n for n in out.graph.node if reshape.input[1] in n.output)
    assert target.op_type == "Constant" and numpy_helper.to_array(target.attribute[0].t).tolist() == [-1, 4, 4, 10]
    for batch in (1, 3):  # ORT loads it, and every batch gives the input model's output
        feed = [{"x": np.random.default_rng(batch).normal(0, 1, (batch, 4, 10, 4)).astype(np.float32)}]
        np.testing.assert_array_equal(fidelity.run(out, feed)[0][0], fidelity.run(model, feed)[0][0])


@pytest.mark.parametrize(("declared", "x_shape", "rest", "opset", "why"), [
    (None, ("N", 4, 10, 4), (4, 4, 10), 13, "the output's shape is unknown"),
    (["N", "M", 4, 10], ("N", "M", 10, 4), (4, 4, 10), 17, "two symbolic dims"),
    (["N", 0, 4, 10], ("N", 0, 10, 4), (0, 4, 10), 13, "a 0 dim means 'copy' before opset 14"),
])
def test_refusals(declared, x_shape, rest, opset, why):
    _, count = model_checks.apply_rules(_view(opset, declared, x_shape, rest), materialized_reshape_rules())
    assert count == 0, why

"""Tests of :func:`kenosis_rewrite.core.ort_sessions.computing_only`: the probe computes the named tensors as the
whole model does, without the nodes they do not need."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.core import ort_sessions


def _model() -> onnx.ModelProto:
    """x -> Conv -> Relu (``body``) -> Conv -> Add(skip from an If reading ``scaled``) -> y; the
    If's branches read ``scaled`` from the outer graph only."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), f"w{i}") for i in (0, 1)]
    branch = [helper.make_graph([helper.make_node(op, ["scaled"], [f"{name}_out"])], name, [],
                                [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)])
              for op, name in (("Relu", "then"), ("Neg", "else"))]
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["conv0"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv0"], ["body"]),
        helper.make_node("Mul", ["x", "two"], ["scaled"]),
        helper.make_node("ReduceMax", ["x"], ["peak"], keepdims=0),
        helper.make_node("Greater", ["peak", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["branch"], then_branch=branch[0], else_branch=branch[1]),
        helper.make_node("Conv", ["body", "w1"], ["conv1"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["conv1", "branch"], ["y"]),
    ]
    constants = [numpy_helper.from_array(np.array(value, np.float32), name) for name, value in (("two", 2.0), ("zero", 0.0))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
                              initializer=[*weights, *constants])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _outputs(model: onnx.ModelProto, names: list[str], feed: dict) -> list[np.ndarray]:
    return ort_sessions.session(model).run(names, feed)


def _exposing(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names)
    return exposed


@pytest.mark.parametrize("names", [["body"], ["branch"], ["branch", "body"], ["conv0", "scaled"]])
def test_the_probe_computes_the_named_tensors_as_the_whole_model(names):
    model = _model()
    feed = {"x": np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    probe = ort_sessions.computing_only(model, names)
    assert [output.name for output in probe.graph.output] == names
    for ours, whole in zip(_outputs(probe, names, feed), _outputs(_exposing(model, names), names, feed)):
        np.testing.assert_array_equal(ours, whole)
    kept = [node.op_type for node in probe.graph.node]
    assert "Add" not in kept and kept.count("Conv") == 1 - ("body" not in names and "conv0" not in names)
    if "branch" in names:  # the If's branches read "scaled" from outside: its producer stays
        assert "Mul" in kept
    # the second Conv's weight went with it; the graph inputs stay (feeds name them all)
    assert "w1" not in {tensor.name for tensor in probe.graph.initializer}
    assert [value.name for value in probe.graph.input] == ["x"]


def test_the_model_itself_is_not_changed():
    model = _model()
    before = model.SerializeToString()
    ort_sessions.computing_only(model, ["body"])
    assert model.SerializeToString() == before

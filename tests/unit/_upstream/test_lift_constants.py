"""LiftAllConstantsPass gives onnx_ir's LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)
model, and runs as the model as given does."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
from onnx_ir.passes import common as common_passes

from kenosis_rewrite._upstream import lift_constants
from kenosis_rewrite._upstream.lift_constants import LiftAllConstantsPass


def _model() -> onnx.ModelProto:
    """Constants of every attribute kind, one read twice, one in an If branch, one a graph output."""
    value = onnx.numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    branch = oh.make_graph(
        [oh.make_node("Constant", [], ["inner"], value=onnx.numpy_helper.from_array(np.ones(3, np.float32))),
         oh.make_node("Add", ["x", "inner"], ["then_out"])],
        "then", [], [oh.make_tensor_value_info("then_out", onnx.TensorProto.FLOAT, [2, 3])])
    other = oh.make_graph([oh.make_node("Identity", ["x"], ["else_out"])], "else", [],
                          [oh.make_tensor_value_info("else_out", onnx.TensorProto.FLOAT, [2, 3])])
    nodes = [
        oh.make_node("Constant", [], ["c_tensor"], value=value),
        oh.make_node("Constant", [], ["c_float"], value_float=2.0),
        oh.make_node("Constant", [], ["c_floats"], value_floats=[1.0, 2.0, 3.0]),
        oh.make_node("Constant", [], ["c_int"], value_int=1),
        oh.make_node("Constant", [], ["c_ints"], value_ints=[2, 3]),
        oh.make_node("Constant", [], ["c_string"], value_string="label"),
        oh.make_node("Constant", [], ["c_out"], value_float=7.0),
        oh.make_node("Add", ["x", "c_floats"], ["a"]),
        oh.make_node("Mul", ["a", "c_float"], ["b"]),
        oh.make_node("Reshape", ["b", "c_ints"], ["r"]),
        oh.make_node("Add", ["r", "c_tensor"], ["s"]),
        oh.make_node("Mul", ["s", "c_tensor"], ["y"]),
        oh.make_node("Cast", ["c_int"], ["flag"], to=onnx.TensorProto.BOOL),
        oh.make_node("If", ["flag"], ["z"], then_branch=branch, else_branch=other),
        oh.make_node("Identity", ["c_string"], ["label"]),
    ]
    graph = oh.make_graph(nodes, "constants", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3]),
                           oh.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 3]),
                           oh.make_tensor_value_info("label", onnx.TensorProto.STRING, []),
                           oh.make_tensor_value_info("c_out", onnx.TensorProto.FLOAT, [])])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def _lifted(lift: ir.passes.PassBase, proto: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    model = ir.serde.deserialize_model(proto)
    modified = lift(model).modified
    return ir.serde.serialize_model(model), modified


def test_lifts_what_onnx_irs_pass_lifts_into_the_same_model():
    proto = _model()
    ours, ours_modified = _lifted(LiftAllConstantsPass(), proto)
    theirs, theirs_modified = _lifted(common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0), proto)
    assert ours_modified and theirs_modified
    assert ours.SerializeToString() == theirs.SerializeToString()
    ops = [node.op_type for node in ours.graph.node]
    assert ops.count("Constant") == 1  # the graph output's stays a node
    assert {init.name for init in ours.graph.initializer} >= {"c_tensor", "c_float", "c_floats", "c_int", "c_ints", "c_string"}
    branches = {a.name: a.g for a in next(node for node in ours.graph.node if node.op_type == "If").attribute}
    inner = branches["then_branch"]
    assert [node.op_type for node in inner.node] == ["Add"] and [init.name for init in inner.initializer] == ["inner"]
    onnx.checker.check_model(ours, full_check=True)
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    expected = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = ort.InferenceSession(ours.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)


def test_takes_the_deserialised_tensor_itself_and_the_hook_it_overrides_exists():
    """The override is onnx_ir's private hook: renamed, ours would silently be onnx_ir's slow path."""
    assert callable(getattr(common_passes.LiftConstantsToInitializersPass, "_constant_node_attribute_to_tensor", None))
    model = ir.serde.deserialize_model(_model())
    node = next(node for node in model.graph if node.op_type == "Constant" and "value" in node.attributes)
    tensor = node.attributes["value"].value
    assert isinstance(tensor, lift_constants._TENSOR_CLASSES)
    LiftAllConstantsPass()(model)
    assert model.graph.initializers["c_tensor"].const_value is tensor
    assert LiftAllConstantsPass()(model).modified is False  # nothing left to lift but the output's

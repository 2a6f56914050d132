"""Float16 graphs made float32 exactly, their float16 inputs and outputs kept through Casts.

Node by node (no float16 left inside, every constant its exact float32 value, type attributes and
subgraphs converted, the boundary Casts) and numerically with ONNX Runtime (the float16 interface
gives back the float32 graph's outputs rounded to float16, bit for bit; against the float16
model, within float16 rounding).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.canonicalization import float16
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.ort_quantize import quantize_with_ort
from kenosis_rewrite.testing import toy_models
from kenosis_rewrite.testing.float16_models import FLOAT16_QDQ_OPSET, float16_feeds, float16_model

HALF, SINGLE = TensorProto.FLOAT16, TensorProto.FLOAT


def _cnn16() -> onnx.ModelProto:
    """Conv/Relu/MaxPool/residual Add/GlobalAveragePool/Gemm, every float tensor float16."""
    return float16_model(toy_models.build("resnetish"))


def _run(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    return fidelity.session(model, optimized=False).run(None, feed)


def _elem_types(proto: onnx.ModelProto) -> set[int]:
    """Element types of every typed value and initializer of the main graph."""
    values = [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]
    return {v.type.tensor_type.elem_type for v in values} | {t.data_type for t in proto.graph.initializer}


def _exotic16() -> onnx.ModelProto:
    """float16 made by type attributes and constants, an If whose branches hold float16, an int64 output.

    y = If(flag, then: x + c_then, else: x * c_else) + Constant + ConstantOfShape + max(Cast(Shape(x), FLOAT16))
    """
    def branch(name: str, op: str, value: float) -> onnx.GraphProto:
        const = numpy_helper.from_array(np.full((1, 4), value, np.float16), f"c_{name}")
        return helper.make_graph([helper.make_node(op, ["x", f"c_{name}"], [f"out_{name}"])], name, [],
                                 [helper.make_tensor_value_info(f"out_{name}", HALF, [1, 4])], [const])

    nodes = [
        helper.make_node("If", ["flag"], ["branched"], then_branch=branch("then", "Add", 0.5),
                         else_branch=branch("else", "Mul", -2.0)),
        helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.full((1, 4), 0.25, np.float16))),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=numpy_helper.from_array(np.ones(1, np.float16))),
        helper.make_node("Cast", ["shape"], ["shape16"], to=HALF),
        helper.make_node("ReduceMax", ["shape16"], ["largest"], keepdims=0),
        helper.make_node("Sum", ["branched", "k", "ones"], ["summed"]),
        helper.make_node("Add", ["summed", "largest"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "exotic", [helper.make_tensor_value_info("x", HALF, [1, 4]),
                                                helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", HALF, [1, 4]),
                               helper.make_tensor_value_info("shape", TensorProto.INT64, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def test_float16_cnn_becomes_float32_exactly():
    given = _cnn16()
    model = ir.serde.deserialize_model(given)
    interface = float16.to_float32(model)
    converted = ir.serde.serialize_model(model)
    onnx.checker.check_model(converted, full_check=True)
    assert interface.inputs == ("x",) and interface.outputs == (given.graph.output[0].name,)
    assert interface.initializers == len(given.graph.initializer) and interface.attributes == 0
    assert not float16.has_float16(model) and HALF not in _elem_types(converted)
    # every constant keeps its value: float16 -> float32 is exact
    before = {t.name: numpy_helper.to_array(t) for t in given.graph.initializer}
    for tensor in converted.graph.initializer:
        array = numpy_helper.to_array(tensor)
        assert array.dtype == np.float32 and np.array_equal(array, before[tensor.name].astype(np.float32))
    assert [n.op_type for n in converted.graph.node] == [n.op_type for n in given.graph.node]
    # numerically: the float16 model's outputs, up to its float16 roundings
    feed16 = float16_feeds(toy_models.random_feeds(toy_models.build("resnetish"), 1))[0]
    theirs = _run(given, feed16)[0].astype(np.float64)
    ours = _run(converted, {"x": feed16["x"].astype(np.float32)})[0].astype(np.float64)
    assert np.max(np.abs(ours - theirs)) <= 2e-3 * np.max(np.abs(theirs))


def test_cast_interface_gives_back_float16_bit_for_bit():
    given = _cnn16()
    model = ir.serde.deserialize_model(given)
    interface = float16.to_float32(model)
    float32_graph = ir.serde.serialize_model(model)
    float16.cast_interface(model, interface)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    assert [(v.name, v.type) for v in out.graph.input] == [(v.name, v.type) for v in given.graph.input]
    assert [(v.name, v.type.tensor_type.elem_type) for v in out.graph.output] == [
        (v.name, v.type.tensor_type.elem_type) for v in given.graph.output]
    first, last = out.graph.node[0], out.graph.node[-1]
    assert (first.op_type, list(first.input), first.attribute[0].i) == ("Cast", ["x"], SINGLE)
    assert (last.op_type, list(last.output), last.attribute[0].i) == ("Cast", [given.graph.output[0].name], HALF)
    assert sum(n.op_type == "Cast" for n in out.graph.node) == 2
    for feed in float16_feeds(toy_models.random_feeds(toy_models.build("resnetish"), 3, seed=5)):
        result = _run(out, feed)[0]
        inside = _run(float32_graph, {"x": feed["x"].astype(np.float32)})[0]
        assert result.dtype == np.float16 and np.array_equal(result, inside.astype(np.float16))


def test_type_attributes_constants_and_subgraphs_are_converted():
    given = _exotic16()
    model = ir.serde.deserialize_model(given)
    interface = float16.to_float32(model)
    assert interface.inputs == ("x",) and interface.outputs == ("y",)  # "flag" and the int64 "shape" are not
    assert interface.initializers == 2 and interface.attributes == 3  # If's two constants; Constant, ConstantOfShape, Cast
    assert not float16.has_float16(model)
    converted = ir.serde.serialize_model(model)
    nodes = {n.op_type: n for n in converted.graph.node}
    assert helper.get_attribute_value(nodes["Cast"].attribute[0]) == SINGLE
    assert helper.get_attribute_value(nodes["Constant"].attribute[0]).data_type == SINGLE
    assert helper.get_attribute_value(nodes["ConstantOfShape"].attribute[0]).data_type == SINGLE
    for attribute in nodes["If"].attribute:
        assert all(t.data_type == SINGLE for t in attribute.g.initializer)
        assert all(o.type.tensor_type.elem_type == SINGLE for o in attribute.g.output)
    float16.cast_interface(model, interface)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    assert [v.type.tensor_type.elem_type for v in out.graph.output] == [HALF, TensorProto.INT64]
    x = np.array([[0.1, -1.5, 3.0, 7.25]], np.float16)
    for flag in (True, False):
        feed = {"x": x, "flag": np.array(flag)}
        expected, got = _run(given, feed), _run(out, feed)
        assert got[0].dtype == np.float16 and np.array_equal(got[1], expected[1])
        np.testing.assert_allclose(got[0].astype(np.float32), expected[0].astype(np.float32), rtol=2e-3)


def test_float32_models_are_left_alone():
    given = toy_models.build("resnetish")
    model = ir.serde.deserialize_model(given)
    before = ir.serde.serialize_model(model).SerializeToString()
    assert float16.to_float32(model) is None and not float16.has_float16(model)
    assert ir.serde.serialize_model(model).SerializeToString() == before


def test_float32_feeds_converts_the_float16_inputs_only():
    interface = float16.Float16Interface(inputs=("x",), outputs=())
    x16 = np.array([1.0, 65504.0, 6e-8, -0.333], np.float16)
    ids = np.arange(3, dtype=np.int64)
    other16 = np.ones(2, np.float16)
    fed = float16.float32_feeds([{"x": x16, "ids": ids, "other": other16}, {"x": x16.astype(np.float32)}], interface)
    assert fed[0]["x"].dtype == np.float32 and np.array_equal(fed[0]["x"], x16.astype(np.float32))
    assert fed[0]["ids"] is ids and fed[0]["other"] is other16
    assert fed[1]["x"].dtype == np.float32


def test_float16_scales_are_found():
    fp32 = toy_models.build("conv_relu")
    qdq = quantize_with_ort(fp32, toy_models.random_feeds(fp32, 4))
    assert not float16.has_float16_scales(ir.serde.deserialize_model(qdq))
    assert float16.has_float16_scales(ir.serde.deserialize_model(float16_model(qdq, opset=FLOAT16_QDQ_OPSET)))
    # a float16 float model has no scales at all
    assert not float16.has_float16_scales(ir.serde.deserialize_model(_cnn16()))


def test_an_input_that_is_also_an_output_stays_both():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "through",
                              [helper.make_tensor_value_info("x", HALF, [2])],
                              [helper.make_tensor_value_info("y", HALF, [2]), helper.make_tensor_value_info("x", HALF, [2])])
    given = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = ir.serde.deserialize_model(given)
    float16.cast_interface(model, float16.to_float32(model))
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    assert [(v.name, v.type.tensor_type.elem_type) for v in out.graph.output] == [("y", HALF), ("x", HALF)]
    x = np.array([-1.5, 2.25], np.float16)
    y, through = _run(out, {"x": x})
    assert np.array_equal(y, np.maximum(x, 0)) and np.array_equal(through, x)

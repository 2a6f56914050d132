"""Tests of the per-channel affine folds into Conv/Gemm (FP32 canonicalization)."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.canonicalization.rules.channel_affine import channel_affine_rules
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.testing import model_checks

C_IN, C_OUT, SIZE = 4, 6, 9


def _model(nodes, initializers, x_shape, y_shape, opset=17):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _apply(model):
    return model_checks.apply_rules(model, channel_affine_rules())


def _outputs(model, x):
    return fidelity.run(model, [{"x": x}], optimized=False)[0][0]


def _constant(rng, shape, op):
    values = rng.uniform(0.5, 2.0, shape) * rng.choice([-1, 1], shape) if op in ("Mul", "Div") else rng.normal(0, 1, shape)
    return values.astype(np.float32)


CHANNEL_SHAPES = [(1, C_OUT, 1, 1), (C_OUT, 1, 1), (), (1,)]
CASES = list(itertools.product([1, 2, C_IN], [True, False], [0, 1], ["Mul", "Div", "Add", "Sub"], range(len(CHANNEL_SHAPES))))


@pytest.mark.parametrize(("group", "with_bias", "pad", "affine", "shape_index"), CASES)
def test_affine_after_conv_folds_and_keeps_outputs(group, with_bias, pad, affine, shape_index):
    rng = np.random.default_rng(len(CASES) + shape_index)
    out_channels = C_OUT if group != C_IN else C_IN * 2
    shape = tuple(out_channels if d == C_OUT else d for d in CHANNEL_SHAPES[shape_index])
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (out_channels, C_IN // group, 3, 3)).astype(np.float32), "w")]
    conv_inputs = ["x", "w"]
    if with_bias:
        inits.append(numpy_helper.from_array(rng.normal(0, 1, (out_channels,)).astype(np.float32), "b"))
        conv_inputs.append("b")
    inits.append(numpy_helper.from_array(_constant(rng, shape, affine), "k"))
    nodes = [
        helper.make_node("Conv", conv_inputs, ["c"], kernel_shape=[3, 3], pads=[pad] * 4, group=group),
        helper.make_node(affine, ["c", "k"], ["y"]),
    ]
    size = SIZE - 2 + 2 * pad
    model = _model(nodes, inits, [1, C_IN, SIZE, SIZE], [1, out_channels, size, size])
    out, count = _apply(model)
    assert count == 1 and [n.op_type for n in out.graph.node] == ["Conv"]
    x = rng.normal(0, 1, (1, C_IN, SIZE, SIZE)).astype(np.float32)
    ref = _outputs(model, x)
    np.testing.assert_allclose(_outputs(out, x), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_constant_first_mul_and_add_fold():
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (C_OUT, C_IN, 1, 1)).astype(np.float32), "w"),
        numpy_helper.from_array(_constant(rng, (1, C_OUT, 1, 1), "Mul"), "s"),
        numpy_helper.from_array(_constant(rng, (1, C_OUT, 1, 1), "Add"), "t"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]),
        helper.make_node("Mul", ["s", "c"], ["m"]),
        helper.make_node("Add", ["t", "m"], ["y"]),
    ]
    model = _model(nodes, inits, [1, C_IN, SIZE, SIZE], [1, C_OUT, SIZE, SIZE])
    out, count = _apply(model)
    assert count == 2 and [n.op_type for n in out.graph.node] == ["Conv"]
    x = rng.normal(0, 1, (1, C_IN, SIZE, SIZE)).astype(np.float32)
    np.testing.assert_allclose(_outputs(out, x), _outputs(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("shape", "why"),
    [((SIZE,), "last axis: [C] broadcasts along W, not the channels"), ((1, 1, SIZE, 1), "varies along H"),
     ((2, C_OUT, 1, 1), "broadcasts the batch")],
)
def test_constants_that_vary_along_other_axes_are_refused(shape, why):
    rng = np.random.default_rng(2)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (C_OUT, C_IN, 1, 1)).astype(np.float32), "w"),
        numpy_helper.from_array(_constant(rng, shape, "Add"), "k"),
    ]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]), helper.make_node("Add", ["c", "k"], ["y"])]
    batch = 2 if shape[0] == 2 else 1
    model = _model(nodes, inits, [1, C_IN, SIZE, SIZE], [batch, C_OUT, SIZE, SIZE])
    out, count = _apply(model)
    assert count == 0, why
    assert [n.op_type for n in out.graph.node] == ["Conv", "Add"]


def test_shared_weights_and_conv_outputs_with_other_readers_are_refused():
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (C_IN, C_IN, 1, 1)).astype(np.float32), "w"),
        numpy_helper.from_array(_constant(rng, (1, C_IN, 1, 1), "Mul"), "s"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], kernel_shape=[1, 1]),
        helper.make_node("Mul", ["c1", "s"], ["m"]),
        helper.make_node("Conv", ["m", "w"], ["c2"], kernel_shape=[1, 1]),  # shares w
        helper.make_node("Add", ["c2", "c1"], ["y"]),  # c1 read twice
    ]
    model = _model(nodes, inits, [1, C_IN, SIZE, SIZE], [1, C_IN, SIZE, SIZE])
    out, count = _apply(model)
    assert count == 0 and len(out.graph.node) == 4


@pytest.mark.parametrize(("affine", "pad", "group"), list(itertools.product(["Mul", "Div", "Add", "Sub"], [0, 1], [1, 2, C_IN])))
def test_affine_before_conv_folds_where_padding_allows(affine, pad, group):
    rng = np.random.default_rng(4)
    out_channels = C_OUT if group != C_IN else C_IN * 2
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (out_channels, C_IN // group, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.normal(0, 1, (out_channels,)).astype(np.float32), "b"),
        numpy_helper.from_array(_constant(rng, (1, C_IN, 1, 1), affine), "k"),
    ]
    nodes = [
        helper.make_node(affine, ["x", "k"], ["a"]),
        helper.make_node("Conv", ["a", "w", "b"], ["y"], kernel_shape=[3, 3], pads=[pad] * 4, group=group),
    ]
    size = SIZE - 2 + 2 * pad
    model = _model(nodes, inits, [1, C_IN, SIZE, SIZE], [1, out_channels, size, size])
    out, count = _apply(model)
    folds = affine in ("Mul", "Div") or pad == 0  # a padded border reads zeros, not the shift
    assert count == int(folds)
    assert [n.op_type for n in out.graph.node] == (["Conv"] if folds else [affine, "Conv"])
    x = rng.normal(0, 1, (1, C_IN, SIZE, SIZE)).astype(np.float32)
    ref = _outputs(model, x)
    np.testing.assert_allclose(_outputs(out, x), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize(("affine", "trans_b", "beta"), list(itertools.product(["Mul", "Div", "Add", "Sub"], [0, 1], [1.0, 0.5])))
def test_affine_after_gemm_folds(affine, trans_b, beta):
    rng = np.random.default_rng(5)
    weights = rng.normal(0, 0.5, (C_OUT, C_IN) if trans_b else (C_IN, C_OUT)).astype(np.float32)
    inits = [
        numpy_helper.from_array(weights, "w"),
        numpy_helper.from_array(rng.normal(0, 1, (C_OUT,)).astype(np.float32), "b"),
        numpy_helper.from_array(_constant(rng, (1, C_OUT), affine), "k"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=trans_b, beta=beta),
        helper.make_node(affine, ["g", "k"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, C_IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, C_OUT])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out, count = _apply(model)
    assert count == 1 and [n.op_type for n in out.graph.node] == ["Gemm"]
    x = rng.normal(0, 1, (3, C_IN)).astype(np.float32)
    ref = _outputs(model, x)
    np.testing.assert_allclose(_outputs(out, x), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

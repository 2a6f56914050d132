"""Tests of Slice(Shape(x)) -> Shape(x, start, end) and Gather(Shape(x), i) -> the static dims."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.canonicalization.rules.shape_slices import shape_slice_rules, static_dim_rules
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.testing import model_checks


def _model(starts, ends, axes=None, steps=None, opset=17):
    inits = [numpy_helper.from_array(np.array([starts], np.int64), "s"), numpy_helper.from_array(np.array([ends], np.int64), "e")]
    inputs = ["shape", "s", "e"]
    if axes is None and steps is not None:
        axes = 0  # steps is the fifth input: axes must be given
    if axes is not None:
        inits.append(numpy_helper.from_array(np.array([axes], np.int64), "a"))
        inputs.append("a")
    if steps is not None:
        inits.append(numpy_helper.from_array(np.array([steps], np.int64), "st"))
        inputs.append("st")
    nodes = [helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Slice", inputs, ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 5])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [None])], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _rewrite(model):
    return model_checks.apply_rules(model, shape_slice_rules())


@pytest.mark.parametrize(("starts", "ends", "axes", "steps"),
                         [(2, 4, None, None), (1, 9223372036854775807, 0, 1), (-2, 4, None, 1), (0, -1, 0, None)])
def test_slice_of_shape_becomes_bounded_shape_with_the_same_values(starts, ends, axes, steps):
    model = _model(starts, ends, axes, steps)
    out, count = _rewrite(model)
    assert count == 1 and [n.op_type for n in out.graph.node] == ["Shape"]
    x = np.zeros((2, 3, 8, 5), np.float32)
    np.testing.assert_array_equal(fidelity.run(out, [{"x": x}])[0][0], fidelity.run(model, [{"x": x}])[0][0])


@pytest.mark.parametrize(("kwargs", "why"), [({"steps": 2}, "step"), ({"opset": 13}, "no start/end before opset 15")])
def test_refusals(kwargs, why):
    out, count = _rewrite(_model(0, 4, **kwargs))
    assert count == 0, why


def _gather_model(indices, shape_bounds=None, extra_reader=True):
    """``Gather(Shape(x), indices)`` (x: [N, 3, 8, 5]), the Shape also read by a Size-like Slice."""
    attributes = {} if shape_bounds is None else dict(zip(("start", "end"), shape_bounds))
    nodes = [helper.make_node("Shape", ["x"], ["shape"], **attributes),
             helper.make_node("Gather", ["shape", "i"], ["y"], axis=0)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.INT64, list(np.shape(indices)))]
    if extra_reader:
        nodes.append(helper.make_node("Identity", ["shape"], ["all_dims"]))
        outputs.append(helper.make_tensor_value_info("all_dims", TensorProto.INT64, [None]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 5])], outputs,
        [numpy_helper.from_array(np.array(indices, np.int64), "i")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("indices", "bounds"), [(2, None), ([2, 3], None), (-1, None), ([[1], [3]], None), (0, (2, 4)),
                                                 (-2, (1, None))])
def test_gather_of_static_dims_becomes_their_value(indices, bounds):
    model = _gather_model(indices, None if bounds is None else tuple(b for b in bounds if b is not None))
    out, count = model_checks.apply_rules(model, static_dim_rules())
    assert count == 1
    assert "Gather" not in [n.op_type for n in out.graph.node]
    assert "Shape" in [n.op_type for n in out.graph.node]  # kept for its other reader
    x = np.zeros((2, 3, 8, 5), np.float32)
    for got, want in zip(fidelity.run(out, [{"x": x}])[0], fidelity.run(model, [{"x": x}])[0]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("indices", [0, [0, 2], 7])
def test_gather_of_a_symbolic_or_missing_dim_is_left_alone(indices):
    _, count = model_checks.apply_rules(_gather_model(indices), static_dim_rules())
    assert count == 0


@pytest.mark.parametrize(("starts", "ends", "axes", "steps", "opset"), [(2, 4, None, None, 13), (-2, 9223372036854775807, 0, 1, 14),
                                                                       (1, 4, None, 2, 17), (3, 1, 0, -1, 13)])
def test_slice_of_static_dims_becomes_their_values_in_any_opset(starts, ends, axes, steps, opset):
    model = _model(starts, ends, axes, steps, opset=opset)
    out, count = model_checks.apply_rules(model, static_dim_rules())
    assert count == 1 and "Slice" not in [n.op_type for n in out.graph.node]
    x = np.zeros((2, 3, 8, 5), np.float32)
    np.testing.assert_array_equal(fidelity.run(out, [{"x": x}])[0][0], fidelity.run(model, [{"x": x}])[0][0])


def test_slice_reaching_the_symbolic_batch_is_left_alone():
    _, count = model_checks.apply_rules(_model(0, 2, opset=13), static_dim_rules())
    assert count == 0

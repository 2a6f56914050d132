"""Tests of Slice(Shape(x)) -> Shape(x, start, end)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite import _testing, fidelity
from kenosis_rewrite.rules.shape_slices import shape_slice_rules


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
    return _testing.apply_rules(model, shape_slice_rules())


@pytest.mark.parametrize(("starts", "ends", "axes", "steps"), [(2, 4, None, None), (1, 9223372036854775807, 0, 1), (-2, 4, None, 1), (0, -1, 0, None)])
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

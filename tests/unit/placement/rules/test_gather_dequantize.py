"""Tests of gather-before-dequantize: a quantized table is gathered, then only the rows read are dequantized."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.placement.rules.gather_dequantize import RULE_NAME, gather_dequantize_rules
from kenosis_rewrite.testing import model_checks

VOCAB, DIM = 11, 6


def _model(*, dtype: str, scale_axis: int | None, gather_axis: int, ids_shape: list[int], zero: bool,
           extra_reader: bool = False, seed: int = 0) -> onnx.ModelProto:
    """``y = Gather(DQ(table_q), ids)``: per-tensor parameters (``scale_axis`` None) or per-axis."""
    rng = np.random.default_rng(seed)
    np_type = np.int8 if dtype == "int8" else np.uint8
    info = np.iinfo(np_type)
    table = rng.integers(info.min, info.max + 1, (VOCAB, DIM)).astype(np_type)
    count = 1 if scale_axis is None else table.shape[scale_axis]
    scale = rng.uniform(0.01, 0.2, count).astype(np.float32)
    zp = (np.zeros(count) if zero else rng.integers(info.min, info.max + 1, count)).astype(np_type)
    if scale_axis is None:
        scale, zp = scale.reshape(()), zp.reshape(())
    attributes = {} if scale_axis is None else {"axis": scale_axis}
    nodes = [helper.make_node("DequantizeLinear", ["table_q", "scale", "zp"], ["table"], **attributes),
             helper.make_node("Gather", ["table", "ids"], ["y"], axis=gather_axis)]
    y_shape = [*ids_shape, DIM] if gather_axis == 0 else [VOCAB, *ids_shape]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)]
    if extra_reader:
        nodes.append(helper.make_node("ReduceSum", ["table"], ["total"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("total", TensorProto.FLOAT, []))
    graph = helper.make_graph(
        nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, ids_shape)], outputs,
        [numpy_helper.from_array(table, "table_q"), numpy_helper.from_array(scale, "scale"),
         numpy_helper.from_array(zp, "zp")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _ids(shape: list[int], size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-size, size, shape).astype(np.int64)  # negatives too


def _assert_bit_exact(original: onnx.ModelProto, rewritten: onnx.ModelProto, ids_shape, size) -> None:
    for seed in range(3):
        feed = {"ids": _ids(ids_shape, size, seed)}
        for optimized in (False, True):
            for got, want in zip(model_checks.outputs(rewritten, feed, optimized), model_checks.outputs(original, feed, optimized)):
                np.testing.assert_array_equal(got, want)


CASES = list(itertools.product(("int8", "uint8"), (None, 0, 1), (0, 1), ([5], [2, 3]), (True, False)))


@pytest.mark.parametrize(("dtype", "scale_axis", "gather_axis", "ids_shape", "zero"), CASES)
def test_gather_moves_before_the_dequantize_bit_exactly(dtype, scale_axis, gather_axis, ids_shape, zero):
    original = _model(dtype=dtype, scale_axis=scale_axis, gather_axis=gather_axis, ids_shape=ids_shape, zero=zero)
    rewritten, report, count = model_checks.apply_reporting_rules(original, gather_dequantize_rules)
    producers = {out: node for node in rewritten.graph.node for out in node.output}
    refused_axis = scale_axis == gather_axis == 1  # per-axis parameters on a gathered axis other than 0
    if refused_axis:
        assert count == 0 and [r.rule for r in report.refusals] == [RULE_NAME]
        assert "gathered axis" in report.refusals[0].reason
        return
    assert count == 1 and [c.rule for c in report.changes] == [RULE_NAME] and report.changes[0].exact
    gathers = [node for node in rewritten.graph.node if node.op_type == "Gather"]
    # the codes are gathered straight from the integer table; no DQ reads the whole table any more
    assert any(list(node.input) == ["table_q", "ids"] for node in gathers)
    assert not any(node.op_type == "DequantizeLinear" and node.input[0] == "table_q" for node in rewritten.graph.node)
    if scale_axis == gather_axis == 0:  # per-row parameters: gathered with the rows, DQ written out
        assert producers["y"].op_type == "Mul"
        assert ("Sub" in model_checks.op_types(rewritten)) == (not zero)
    else:
        dq = producers["y"]
        assert dq.op_type == "DequantizeLinear"
        if scale_axis is not None:  # the channel axis moves past the index dims
            expected = scale_axis if scale_axis < gather_axis else scale_axis + len(ids_shape) - 1
            assert helper.get_attribute_value(dq.attribute[0]) == expected
    size = VOCAB if gather_axis == 0 else DIM
    _assert_bit_exact(original, rewritten, ids_shape, size)


def test_a_table_dequantized_for_another_reader_too_is_left():
    original = _model(dtype="int8", scale_axis=None, gather_axis=0, ids_shape=[4], zero=True, extra_reader=True)
    rewritten, report, count = model_checks.apply_reporting_rules(original, gather_dequantize_rules)
    # (onnxscript's matcher already declines a match whose inner value has outside readers)
    assert count == 0 and not report.changes
    assert model_checks.op_types(rewritten) == model_checks.op_types(original)

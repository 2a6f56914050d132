"""Tests of the int8 Q/DQ put after data movement that reaches a float reader."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import kenosis_rewrite
from kenosis_rewrite.placement.passes.requantize_after_movement import RULE_NAME, RequantizeAfterDataMovementPass
from kenosis_rewrite.testing import model_checks

MODEL = """
<ir_version: 10, opset_import: ["" : {opset}]>
g (float[1, 4, 3, 3] x) => (float[1, 9, 4] y)
<{qtype} z = {{{zero}}}, float s = {{0.05}}, int64[3] shape = {{1, 4, 9}}>
{{
  q = QuantizeLinear(x, s, z)
  d = DequantizeLinear(q, s, z)
  {chain}
  y = Sigmoid(t)
}}
"""
CHAINS = {
    "reshape-transpose": "r = Reshape(d, shape)\n  t = Transpose <perm: ints = [0, 2, 1]> (r)",
    "maxpool-reshape-transpose": "p = MaxPool <kernel_shape: ints = [1, 1]> (d)\n  r = Reshape(p, shape)\n"
                                 "  t = Transpose <perm: ints = [0, 2, 1]> (r)",
}


def _model(chain: str = "reshape-transpose", opset: int = 21, qtype: str = "int8", zero: int = 3) -> onnx.ModelProto:
    return onnx.parser.parse_model(MODEL.format(opset=opset, qtype=qtype, zero=zero, chain=CHAINS[chain]))


def _feeds() -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"x": (3.0 * rng.standard_normal((1, 4, 3, 3))).astype(np.float32)} for _ in range(3)]


@pytest.mark.parametrize("chain", list(CHAINS))
def test_the_pair_goes_after_the_chain_bit_exactly_and_ort_runs_it(chain):
    proto = _model(chain)
    fixed, report = model_checks.apply_pass(proto, RequantizeAfterDataMovementPass)
    assert report.change_counts() == {RULE_NAME: 1}
    ops = [node.op_type for node in fixed.graph.node]
    assert ops[-3:] == ["QuantizeLinear", "DequantizeLinear", "Sigmoid"], ops
    added = fixed.graph.node[-3]
    assert list(added.input[1:]) == ["s", "z"] and added.input[0] == "t"
    for feed in _feeds():  # exact: every value after the chain is on the grid
        np.testing.assert_array_equal(model_checks.outputs(proto, feed, optimized=False)[0],
                                      model_checks.outputs(fixed, feed, optimized=False)[0])
        model_checks.outputs(fixed, feed)  # ORT_ENABLE_ALL builds and runs
    again, report = model_checks.apply_pass(fixed, RequantizeAfterDataMovementPass)
    assert not report.changes  # the chain now ends in a Q


def test_the_original_form_is_what_ort_x86_refuses():
    """Documents the ORT behaviour the pass exists for; skipped where ORT does not refuse it."""
    try:
        model_checks.session(_model())
    except (ort.capi.onnxruntime_pybind11_state.Fail, RuntimeError) as error:
        assert "output_dtype" in str(error)
    else:
        pytest.skip("this onnxruntime build accepts DQ(int8) -> Reshape -> Transpose -> Sigmoid at ORT_ENABLE_ALL")


@pytest.mark.parametrize("variant", [dict(opset=13), dict(qtype="uint8", zero=128)])
def test_left_alone_before_opset_21_and_on_uint8(variant):
    proto = _model(**variant)
    fixed, report = model_checks.apply_pass(proto, RequantizeAfterDataMovementPass)
    assert not report.changes
    assert [n.op_type for n in fixed.graph.node] == [n.op_type for n in proto.graph.node]


def test_fix_for_the_npu_target_keeps_the_int8_chain_runnable():
    """The fuzz case the pass came from, in small: symmetric int8 activations (npu) retype a uint8
    DQ that a Reshape -> Transpose carries to a float op; fix() must still give a model ORT runs."""
    proto = _model(qtype="uint8", zero=128)
    fixed, report = kenosis_rewrite.fix(proto, target="npu", verify=False, return_report=True)
    assert report.change_counts().get("symmetric-int8-activations", 0) >= 1, report.summary()
    assert report.change_counts().get(RULE_NAME) == 1, report.summary()
    for feed in _feeds():
        model_checks.outputs(fixed, feed)


SHARED_DQ_MODEL = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[1, 4, 3, 3] x) => (float[1, 9, 4] y, int64[4] n)
<int8 z = {3}, float s = {0.05}, int64[3] shape = {1, 4, 9}>
{
  q = QuantizeLinear(x, s, z)
  d = DequantizeLinear(q, s, z)
  r = Reshape(d, shape)
  t = Transpose <perm: ints = [0, 2, 1]> (r)
  y = Sigmoid(t)
  n = Shape(d)
}
"""


def test_a_chain_from_a_dequantize_with_other_readers_gets_the_pair_too():
    """Fuzz seed 30000982 (npu, guard on: undone): the DQ feeding Transpose -> MatMul was read by a
    Shape as well. ORT gives each reader its own DQ and propagates the Transpose's, so the pass must
    not stop at a DQ with several readers."""
    proto = onnx.parser.parse_model(SHARED_DQ_MODEL)
    try:
        model_checks.session(proto)
    except (ort.capi.onnxruntime_pybind11_state.Fail, RuntimeError) as error:
        assert "output_dtype" in str(error)  # the ORT defect, reached through a shared DQ
    fixed, report = model_checks.apply_pass(proto, RequantizeAfterDataMovementPass)
    assert report.change_counts() == {RULE_NAME: 1}
    ops = {node.output[0]: (node.op_type, list(node.input)) for node in fixed.graph.node}
    assert ops["n"] == ("Shape", ["d"])  # the other reader keeps the DQ
    requantized = ops["y"][1][0]
    assert ops[requantized][0] == "DequantizeLinear" and ops[ops[requantized][1][0]] == ("QuantizeLinear", ["t", "s", "z"])
    for feed in _feeds():
        for before, after in zip(model_checks.outputs(proto, feed, optimized=False), model_checks.outputs(fixed, feed, optimized=False)):
            np.testing.assert_array_equal(before, after)
        model_checks.outputs(fixed, feed)  # ORT_ENABLE_ALL builds and runs


OUTPUT_CHAIN_MODEL = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[4, 3] x) => (float[4, 3, 1] y)
<int8 z = {3}, float s = {0.05}, int64[3] shape = {4, 3, 1}>
{
  q = QuantizeLinear(x, s, z)
  d = DequantizeLinear(q, s, z)
  y = Reshape(d, shape)
}
"""


def test_a_chain_into_a_graph_output_gets_the_pair_and_the_output_keeps_its_name():
    """An sklearn MLP (surfaces-onnx-files 0.0.1) ends in ``Add -> Reshape -> output``: ORT propagates
    the DQ into the output as well and refuses the session, so quantize(target="npu") and
    quantize(target="ort-cpu-arm") raised RuntimeMeasurementError on it."""
    proto = onnx.parser.parse_model(OUTPUT_CHAIN_MODEL)
    try:
        model_checks.session(proto)
    except (ort.capi.onnxruntime_pybind11_state.Fail, RuntimeError) as error:
        assert "output_dtype" in str(error)
    fixed, report = model_checks.apply_pass(proto, RequantizeAfterDataMovementPass)
    assert report.change_counts() == {RULE_NAME: 1}
    assert [o.name for o in fixed.graph.output] == ["y"]
    producers = {name: node for node in fixed.graph.node for name in node.output}
    assert producers["y"].op_type == "DequantizeLinear"
    assert producers[producers["y"].input[0]].op_type == "QuantizeLinear"
    rng = np.random.default_rng(0)
    for _ in range(3):
        feed = {"x": (3.0 * rng.standard_normal((4, 3))).astype(np.float32)}
        np.testing.assert_array_equal(model_checks.outputs(proto, feed, optimized=False)[0],
                                      model_checks.outputs(fixed, feed, optimized=False)[0])
        model_checks.outputs(fixed, feed)  # ORT_ENABLE_ALL builds and runs
    again, report = model_checks.apply_pass(fixed, RequantizeAfterDataMovementPass)
    assert not report.changes

"""3-D Convs go back to float on ORT CPU targets; fix() is never returned slower than its input.

Node by node (no integer 3-D Conv left, 2-D Convs untouched) and numerically (against FP32 and the
input). Speed is a benchmark's question: here the speed check's decision is driven by a stand-in
timing, so the test says what fix() does with a verdict, not what this host measures.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import kenosis_rewrite
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.ort_quantize import quantize_with_ort
from kenosis_rewrite.placement import speed_check
from kenosis_rewrite.placement.passes.float_3d_conv import Float3DConvPass
from kenosis_rewrite.testing.model_checks import apply_pass


def _model() -> onnx.ModelProto:
    """Conv3D(1x5x5) -> Relu -> Reshape to 2-D -> Conv2D -> Relu."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((4, 2, 1, 5, 5)) * 0.2).astype(np.float32), "w3"),
             numpy_helper.from_array((rng.standard_normal((4, 8, 3, 3)) * 0.2).astype(np.float32), "w2"),
             numpy_helper.from_array(np.array([1, 8, 12, 12], np.int64), "shape")]
    nodes = [helper.make_node("Conv", ["x", "w3"], ["c3"], pads=[0, 2, 2, 0, 2, 2], name="conv3d"),
             helper.make_node("Relu", ["c3"], ["r3"], name="relu3d"),
             helper.make_node("Reshape", ["r3", "shape"], ["flat"], name="reshape"),
             helper.make_node("Conv", ["flat", "w2"], ["c2"], pads=[1, 1, 1, 1], name="conv2d"),
             helper.make_node("Relu", ["c2"], ["y"], name="relu2d")]
    graph = helper.make_graph(nodes, "conv3d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 2, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 12, 12])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(n: int = 6):
    return [{"x": np.random.default_rng(i).standard_normal((1, 2, 2, 12, 12)).astype(np.float32)} for i in range(n)]


def _weight_ranks(model: onnx.ModelProto) -> dict[str, int]:
    producers = {out: node for node in model.graph.node for out in node.output}
    initializers = {init.name: len(init.dims) for init in model.graph.initializer}
    ranks = {}
    for node in model.graph.node:
        if node.op_type == "Conv":
            weight = producers.get(node.input[1])
            name = weight.input[0] if weight is not None and weight.op_type == "DequantizeLinear" else node.input[1]
            ranks[node.name] = (initializers[name], weight is not None and weight.op_type == "DequantizeLinear")
    return ranks


def test_the_3d_conv_runs_float_and_the_2d_conv_stays_quantized():
    float_model = _model()
    qdq = quantize_with_ort(float_model, _feeds(4), "u8s8_pc")
    assert all(quantized for _, quantized in _weight_ranks(qdq).values())
    rewritten, report = apply_pass(qdq, Float3DConvPass)
    ranks = _weight_ranks(rewritten)
    assert ranks["conv3d"] == (5, False) and ranks["conv2d"] == (4, True)
    assert report.change_counts() == {"float-3d-conv": 1}
    reference = fidelity.run(float_model, _feeds())
    before = fidelity.scores(reference, fidelity.run(qdq, _feeds()))["cosine"]
    after = fidelity.scores(reference, fidelity.run(rewritten, _feeds()))["cosine"]
    assert after >= before - 1e-4  # the removed roundings can only bring it nearer FP32 (here: not further)
    fixed, fix_report = kenosis_rewrite.fix(qdq, return_report=True)
    assert "float-3d-conv" in fix_report.change_counts()
    onnx.checker.check_model(fixed, full_check=True)


def test_an_output_the_speed_check_finds_slower_is_undone_rule_by_rule(monkeypatch):
    qdq = quantize_with_ort(_model(), _feeds(4), "u8s8_pc")
    _, normal = kenosis_rewrite.fix(qdq, return_report=True)
    assert normal.changes
    monkeypatch.setattr(speed_check, "input_latency_ms", lambda model, feed: 10.0)
    monkeypatch.setattr(speed_check, "slower", lambda before, after, feed: "the output ran slower (stand-in timing)")
    fixed, report = kenosis_rewrite.fix(qdq, return_report=True)
    assert not report.changes  # every candidate was slower: the input as it was
    assert any("speed check: the output ran slower (stand-in timing)" in note for note in report.notes)
    assert fixed.SerializeToString() == qdq.SerializeToString() or fidelity.scores(
        fidelity.run(qdq, _feeds()), fidelity.run(fixed, _feeds()))["cosine"] > 0.99999


def test_models_outside_the_timing_window_are_not_timed():
    assert not speed_check.worth_timing(None)
    assert not speed_check.worth_timing(0.5) and not speed_check.worth_timing(500.0)
    assert speed_check.worth_timing(10.0)

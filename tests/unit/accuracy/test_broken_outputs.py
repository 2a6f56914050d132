"""No output left broken: quantize() finds, by measuring, the layer that breaks a small output."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import kenosis_rewrite
from kenosis_rewrite.accuracy import broken_outputs
from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.core.report import FixReport


def _two_headed(seed: int) -> onnx.ModelProto:
    """x -> Conv A (8 channels, channel 0 about 300x the others) -> Conv B -> y_big (the image-sized
    output, read mostly from channel 0) and -> Conv C -> GlobalAveragePool -> y_small (8 values, read
    from the small channels only): one per-tensor grid for A's output crushes what C reads."""
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32)
    a[0] *= 300.0
    b = rng.normal(0, 0.3, (16, 8, 1, 1)).astype(np.float32)
    c = rng.normal(0, 0.5, (8, 8, 1, 1)).astype(np.float32)
    c[:, 0] = 0.0
    nodes = [
        helper.make_node("Conv", ["x", "wa"], ["t"], pads=[1, 1, 1, 1], name="conv_a"),
        helper.make_node("Conv", ["t", "wb"], ["y_big"], name="conv_b"),
        helper.make_node("Conv", ["t", "wc"], ["u"], name="conv_c"),
        helper.make_node("GlobalAveragePool", ["u"], ["p"]),
        helper.make_node("Flatten", ["p"], ["y_small"]),
    ]
    graph = helper.make_graph(
        nodes, "two_headed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y_big", TensorProto.FLOAT, [1, 16, 16, 16]),
         helper.make_tensor_value_info("y_small", TensorProto.FLOAT, [1, 8])],
        [numpy_helper.from_array(w, n) for w, n in ((a, "wa"), (b, "wb"), (c, "wc"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(seed: int, n: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(0, 1, (1, 3, 16, 16)).astype(np.float32)} for _ in range(n)]


def _reads_float(model: onnx.ModelProto, name: str) -> bool:
    producers = {o: n for n in model.graph.node for o in n.output}
    node = next(n for n in model.graph.node if n.name == name)
    return node.input[0] not in producers or producers[node.input[0]].op_type != "DequantizeLinear"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_layer_that_breaks_a_small_output_returns_to_fp32_and_the_output_holds(seed):
    model, feeds, held_out = _two_headed(seed), _feeds(seed, 8), _feeds(100 + seed, 6)
    raw = ort_quantize.quantize_with_ort(model, feeds, "u8s8_pc")
    measure = broken_outputs._Measure(model, feeds)
    big_before, small_before = measure.cosines(raw)
    assert small_before < broken_outputs.BROKEN_COSINE <= big_before  # the pooled cosine would not show it
    mended, report = ir.serde.deserialize_model(raw), FixReport()
    assert broken_outputs.mend_broken_outputs(mended, model, feeds, report) >= 1
    out = ir.serde.serialize_model(mended)
    onnx.checker.check_model(out, full_check=True)
    # node by node: each layer kept reads float now, and the report says why
    for change in report.changes:
        assert change.rule == broken_outputs.RULE_NAME and change.where in {"conv_a", "conv_c"}
        assert "y_small" in change.detail and "with this layer in FP32" in change.detail
        assert _reads_float(out, change.where)
    # numerically, on feeds the search never saw
    reference = fidelity.run(model, held_out)
    big, small = broken_outputs.per_output_cosines(reference, fidelity.run(out, held_out))
    raw_big, raw_small = broken_outputs.per_output_cosines(reference, fidelity.run(raw, held_out))
    assert small >= 0.95 > raw_small and big >= raw_big - 0.002


def test_quantize_leaves_no_output_broken():
    model, feeds, held_out = _two_headed(3), _feeds(3, 8), _feeds(103, 6)
    quantized, report = kenosis_rewrite.quantize(model, calibration=feeds, return_report=True)
    assert [c.rule for c in report.changes].count(broken_outputs.RULE_NAME) >= 1
    big, small = broken_outputs.per_output_cosines(fidelity.run(model, held_out), fidelity.run(quantized, held_out))
    assert small >= 0.95 and big >= 0.99


def test_healthy_outputs_cost_one_measurement_and_change_nothing():
    model, feeds = _two_headed(0), _feeds(0, 8)
    raw = ir.serde.deserialize_model(kenosis_rewrite.quantize(model, calibration=feeds))
    before = ir.serde.serialize_model(raw).SerializeToString()
    report = FixReport()
    assert broken_outputs.mend_broken_outputs(raw, model, feeds, report) == 0 and not report.changes
    assert ir.serde.serialize_model(raw).SerializeToString() == before


def test_a_gain_within_the_outputs_rounding_noise_keeps_no_layer(monkeypatch):
    """A broken output whose cosine its own roundings move as far as a layer in FP32 lifts it (a text
    detector's map on images without text) is not repaired by that layer: nothing is kept. The same
    model with its real noise (a smooth one, below the gain) keeps the layer."""
    model, feeds = _two_headed(0), _feeds(0, 8)
    raw = ort_quantize.quantize_with_ort(model, feeds, "u8s8_pc")
    measure = broken_outputs._Measure(model, feeds)
    noise = measure.noise(raw, measure.run(raw))
    assert noise[1] < broken_outputs.MIN_GAIN  # smooth: the gain the other test measures is not noise
    monkeypatch.setattr(broken_outputs._Measure, "noise", lambda self, proto, runs: [0.0, 0.9])
    mended, report = ir.serde.deserialize_model(raw), FixReport()
    assert broken_outputs.mend_broken_outputs(mended, model, feeds, report) == 0 and not report.changes
    monkeypatch.setattr(broken_outputs._Measure, "noise", lambda self, proto, runs: [0.0, noise[1]])
    assert broken_outputs.mend_broken_outputs(ir.serde.deserialize_model(raw), model, feeds, FixReport()) >= 1

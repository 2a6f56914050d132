"""Tests of activation equalization: node by node (only the producer's and the depthwise readers'
weights and bias change, by the stated factors) and numerically against ONNX Runtime (the FP32
function is unchanged on the calibration feeds and up to HEADROOM x the calibrated maxima; the
equalized tensor is stretched as stated; quantizing it loses less)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.accuracy.equalization import (
    HEADROOM,
    MAX_SCALE,
    MIN_VALUES,
    RULE_NAME,
    channel_scales,
    equalize,
    find_chains,
)
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.quantization.pipeline import quantize
from kenosis_rewrite.testing import model_checks

CHANNELS = 8
SIZE = 24  # 576 positions per feed: over MIN_VALUES with 4 feeds


def _model(activation: str = "clip", reader: str = "depthwise", size: int = SIZE) -> onnx.ModelProto:
    """x -> 1x1 Conv (channel gains 1/16 .. 1) -> activation -> reader -> y."""
    rng = np.random.default_rng(0)
    gains = np.geomspace(1 / 16, 1, CHANNELS).reshape(CHANNELS, 1, 1, 1)
    initializers = [
        numpy_helper.from_array((rng.uniform(0.2, 1.0, (CHANNELS, 3, 1, 1)) * gains).astype(np.float32), "w1"),
        numpy_helper.from_array(np.abs(rng.normal(0, 0.01, CHANNELS)).astype(np.float32), "b1"),
        numpy_helper.from_array(np.array(0.0, np.float32), "low"), numpy_helper.from_array(np.array(6.0, np.float32), "high"),
    ]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], name="producer")]
    if activation == "clip":
        nodes.append(helper.make_node("Clip", ["h", "low", "high"], ["t"], name="relu6"))
    elif activation == "relu":
        nodes.append(helper.make_node("Relu", ["h"], ["t"], name="relu"))
    elif activation == "sigmoid":
        nodes.append(helper.make_node("Sigmoid", ["h"], ["t"], name="sigmoid"))
    source = "h" if activation == "none" else "t"
    if reader == "depthwise":
        initializers.append(numpy_helper.from_array(rng.normal(0, 1, (CHANNELS, 1, 3, 3)).astype(np.float32), "w2"))
        nodes.append(helper.make_node("Conv", [source, "w2"], ["y"], name="reader", group=CHANNELS, pads=[1, 1, 1, 1]))
    else:
        initializers.append(numpy_helper.from_array(rng.normal(0, 1, (CHANNELS, CHANNELS, 1, 1)).astype(np.float32), "w2"))
        nodes.append(helper.make_node("Conv", [source, "w2"], ["y"], name="reader"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, CHANNELS, size, size])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _feeds(n: int, seed: int, size: int = SIZE, spread: float = 4.0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.uniform(0, spread, (1, 3, size, size)).astype(np.float32)} for _ in range(n)]


def _channel_max(model: onnx.ModelProto, tensor: str, feeds) -> np.ndarray:
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend([onnx.ValueInfoProto(name=tensor)])
    return np.max([np.abs(model_checks.outputs(probe, f, optimized=False)[0]).max(axis=(0, 2, 3)) for f in feeds], axis=0)


@pytest.mark.parametrize("activation", ["clip", "relu", "none"])
def test_equalized_model_computes_the_same_function_and_stretches_channels(activation):
    float_model, feeds = _model(activation), _feeds(4, seed=0)
    snapshot = float_model.SerializeToString()
    report = FixReport()
    equalized, count = equalize(float_model, feeds, report)
    assert float_model.SerializeToString() == snapshot  # a copy is returned
    assert count == 1 and report.change_counts() == {RULE_NAME: 1}
    onnx.checker.check_model(equalized, full_check=True)

    # node by node: same nodes; w1, b1 scaled by k per output channel, w2 by 1/k, nothing else
    assert [(n.op_type, list(n.input), list(n.output)) for n in float_model.graph.node] == \
           [(n.op_type, list(n.input), list(n.output)) for n in equalized.graph.node]
    tensor = "h" if activation == "none" else "t"
    reach = _channel_max(float_model, tensor, feeds)
    factors = channel_scales(reach, 6.0 if activation == "clip" else None)
    assert factors.min() >= 1 and factors.max() == pytest.approx(MAX_SCALE)
    before = {i.name: numpy_helper.to_array(i) for i in float_model.graph.initializer}
    after = {i.name: numpy_helper.to_array(i) for i in equalized.graph.initializer}
    np.testing.assert_allclose(after["w1"], before["w1"] * factors.reshape(-1, 1, 1, 1), rtol=1e-6)
    np.testing.assert_allclose(after["b1"], before["b1"] * factors, rtol=1e-6)
    np.testing.assert_allclose(after["w2"], before["w2"] / factors.reshape(-1, 1, 1, 1), rtol=1e-6)
    assert all(np.array_equal(after[k], before[k]) for k in before if k not in ("w1", "b1", "w2"))

    # numeric, with ORT: the channels are stretched as stated, the output is the same on the
    # calibration feeds and on new feeds up to HEADROOM x the calibrated maxima (the feeds x HEADROOM:
    # non-negative biases, so no channel goes further)
    np.testing.assert_allclose(_channel_max(equalized, tensor, feeds), reach * factors, rtol=1e-5)
    stretched = [{"x": f["x"] * np.float32(HEADROOM)} for f in feeds]
    for feed in [*feeds, *stretched]:
        np.testing.assert_allclose(model_checks.outputs(equalized, feed, optimized=False)[0],
                                   model_checks.outputs(float_model, feed, optimized=False)[0], rtol=1e-4, atol=1e-4)


def test_clip_bound_leaves_room_for_new_data():
    reach = np.array([6.0, 4.0, 1.5, 0.5, 0.0])
    factors = channel_scales(reach, bound=6.0)
    assert factors.tolist() == [1.0, 1.0, 2.0, 2.0, 1.0]  # 4 * 1.5 = 6: stretched would reach the bound
    assert np.all(reach * factors * HEADROOM <= np.maximum(6.0, reach * HEADROOM) + 1e-9)
    assert channel_scales(np.array([3.0, 0.3]), bound=None).tolist() == [1.0, MAX_SCALE]


def test_tensors_with_other_readers_or_activations_are_left_alone():
    for model in (_model("sigmoid"), _model("clip", reader="dense")):
        assert find_chains(model) == []
        equalized, count = equalize(model, _feeds(4, seed=0))
        assert count == 0 and equalized.SerializeToString() == model.SerializeToString()
    small = _model("relu", size=8)  # 64 positions x 4 feeds < MIN_VALUES: a maximum not to trust
    assert 64 * 4 < MIN_VALUES and len(find_chains(small)) == 1
    assert equalize(small, _feeds(4, seed=0, size=8))[1] == 0


def test_quantized_equalized_model_is_closer_to_fp32():
    float_model, feeds = _model("clip"), _feeds(8, seed=2)
    plain = quantize(float_model, feeds, equalization=False)
    equalized, report = quantize(float_model, feeds, equalization=True, return_report=True)
    assert report.change_counts().get(RULE_NAME) == 1
    assert model_checks.op_types(plain) == model_checks.op_types(equalized)  # numbers change, not the graph
    scores = fidelity.compare_to_float(float_model, {"plain": plain, "equalized": equalized}, _feeds(6, seed=3))
    assert scores["equalized"]["sqnr_db"] > scores["plain"]["sqnr_db"]


def test_maxima_observed_from_other_runs_replace_its_own(monkeypatch):
    from kenosis_rewrite.accuracy import equalization
    from kenosis_rewrite.canonicalization import pipeline  # noqa: PLC0415

    model, feeds = _model(), _feeds(4, seed=1)
    own, own_count = equalize(model, feeds)
    observed = equalization.ChannelMaxima()
    prepared = pipeline.prepare_serialized(model, feeds, FixReport(target="prepare"), observer=observed)
    assert observed.runs == len(feeds) and observed.of(["t"], len(feeds)) is not None
    proto = ir.serde.serialize_model(prepared)
    monkeypatch.setattr(equalization, "_channel_maxima", lambda *a: pytest.fail("ran the model again"))
    shared, shared_count = equalize(proto, feeds, observed=observed)
    assert shared_count == own_count == 1
    for ours, theirs in zip(shared.graph.initializer, own.graph.initializer):
        np.testing.assert_allclose(numpy_helper.to_array(ours), numpy_helper.to_array(theirs), rtol=1e-5)
    assert equalization.ChannelMaxima().of(["t"], len(feeds)) is None  # nothing seen: the model runs


def test_observed_maxima_are_discarded_when_prepare_keeps_the_original(monkeypatch):
    from kenosis_rewrite.accuracy import equalization
    from kenosis_rewrite.canonicalization import pipeline  # noqa: PLC0415

    model, feeds = _model(), _feeds(4, seed=1)
    monkeypatch.setattr(pipeline, "PREPARE_TOLERANCE", -1.0)  # no check passes: the original is kept
    monkeypatch.setattr(pipeline, "NOISE_FACTOR", -1.0)
    observed = equalization.ChannelMaxima()
    pipeline.prepare_serialized(model, feeds, FixReport(target="prepare"), observer=observed)
    assert observed.runs == 0 and observed.of(["t"], len(feeds)) is None


def test_an_equalized_onnx_ir_proto_is_one_onnx_ir_serialises_the_same():
    serialised = ir.serde.serialize_model(ir.serde.deserialize_model(_model()))
    equalized, count = equalize(serialised, _feeds(4, seed=1))
    assert count == 1
    again = ir.serde.serialize_model(ir.serde.deserialize_model(equalized))
    assert again.SerializeToString() == equalized.SerializeToString()

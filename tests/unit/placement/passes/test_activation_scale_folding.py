"""Tests of per-channel activation scales folded into the Convs around them (NNCF's depthwise-input form)."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kenosis_rewrite
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.placement.passes.activation_scale_folding import RULE_NAME, FoldPerChannelActivationScalesPass
from kenosis_rewrite.testing import model_checks

FIXTURES = pathlib.Path(__file__).resolve().parents[3] / "fixtures"
C = 6


def _block(
    seed: int, activation: str = "Clip", multiplier: int = 1, bias: str = "float", depthwise: bool = True,
    per_tensor_weights: bool = False, clip_max: float = 6.0, zero_points=None, zp_type=None,
) -> onnx.ModelProto:
    """DQ(x) -> Conv -> activation -> Q(per channel) -> DQ -> depthwise Conv -> Q -> DQ, as NNCF writes it."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def dq_weight(name, shape):
        ints = rng.integers(-127, 128, shape).astype(np.int8)
        if per_tensor_weights:
            scale, zp, attrs = np.float32(rng.uniform(0.002, 0.02)), np.int8(0), {}
        else:
            scale, zp, attrs = rng.uniform(0.002, 0.02, shape[0]).astype(np.float32), np.zeros(shape[0], np.int8), {"axis": 0}
        nodes.append(helper.make_node("DequantizeLinear", [const(f"{name}_q", ints), const(f"{name}_s", scale),
                                                          const(f"{name}_z", zp)], [name], **attrs))
        return name

    nodes.append(helper.make_node("QuantizeLinear", ["x", const("xs", np.float32(0.02)), const("xz", np.uint8(128))], ["xq"]))
    nodes.append(helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]))
    conv_inputs = ["xd", dq_weight("w1", (C, 3, 3, 3))]
    if bias == "float":
        conv_inputs.append(const("b1", rng.normal(0, 0.5, C).astype(np.float32)))
    elif bias == "int32":
        nodes.append(helper.make_node("DequantizeLinear", [const("b1_q", rng.integers(-500, 500, C).astype(np.int32)),
                                                          const("b1_s", np.float32(0.001))], ["b1"]))
        conv_inputs.append("b1")
    nodes.append(helper.make_node("Conv", conv_inputs, ["c1"], pads=[1, 1, 1, 1], name="producer"))
    # channel ranges far apart (what defeats one per-tensor grid)
    steps = (rng.uniform(0.2, 6.0, C) * np.geomspace(0.01, 1, C) / 255).astype(np.float32)
    if zp_type is None:
        zp_type = np.int8 if activation == "LeakyRelu" or activation is None else np.uint8
    zps = np.zeros(C, zp_type) if zero_points is None else np.asarray(zero_points, zp_type)
    pre_q = "c1"
    if activation == "Clip":
        nodes.append(helper.make_node("Clip", ["c1", const("lo", np.float32(0)), const("hi", np.float32(clip_max))], ["a1"]))
        pre_q = "a1"
    elif activation == "LeakyRelu":
        nodes.append(helper.make_node("LeakyRelu", ["c1"], ["a1"], alpha=0.1))
        pre_q = "a1"
    elif activation is not None:
        nodes.append(helper.make_node(activation, ["c1"], ["a1"]))
        pre_q = "a1"
    nodes.append(helper.make_node("QuantizeLinear", [pre_q, const("as", steps), const("az", zps)], ["aq"], axis=1, name="per_channel_q"))
    nodes.append(helper.make_node("DequantizeLinear", ["aq", "as", "az"], ["ad"], axis=1))
    if depthwise:
        nodes.append(helper.make_node("Conv", ["ad", dq_weight("w2", (C * multiplier, 1, 3, 3)),
                                               const("b2", rng.normal(0, 0.1, C * multiplier).astype(np.float32))],
                                      ["c2"], group=C, pads=[1, 1, 1, 1], name="depthwise"))
    else:
        nodes.append(helper.make_node("Conv", ["ad", dq_weight("w2", (C * multiplier, C, 1, 1))], ["c2"], name="pointwise"))
    nodes.append(helper.make_node("QuantizeLinear", ["c2", const("ys", np.float32(0.05)), const("yz", np.uint8(128))], ["yq"]))
    nodes.append(helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"]))
    graph = helper.make_graph(
        nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C * multiplier, 8, 8])], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _expose(proto: onnx.ModelProto, name: str) -> onnx.ModelProto:
    exposed = onnx.ModelProto()
    exposed.CopyFrom(proto)
    exposed.graph.output.append(helper.make_value_info(name, onnx.TypeProto()))
    return exposed


def _integers(proto: onnx.ModelProto, feed) -> np.ndarray:
    """The per-channel Q's integers (the activation tensor both models quantize)."""
    quantize = next(n for n in proto.graph.node if n.name == "per_channel_q")
    return model_checks.outputs(_expose(proto, quantize.output[0]), feed, optimized=False)[1]


def _feeds(count: int = 4):
    return [{"x": np.random.default_rng(100 + i).uniform(-2.5, 2.5, (1, 3, 8, 8)).astype(np.float32)} for i in range(count)]


@pytest.mark.parametrize("seed", range(24))
def test_folding_keeps_the_quantized_integers_over_generated_blocks(seed):
    """Property: over activations, depthwise multipliers, bias forms and weight granularity, every
    integer of the activation grid is unchanged (ties may move by one step: none allowed beyond
    1 in 10^3), and the output moves by at most one output step where they do."""
    rng = np.random.default_rng(seed)
    config = dict(
        activation=[None, "Relu", "LeakyRelu", "Clip"][seed % 4], multiplier=int(rng.integers(1, 3)),
        bias=["float", "int32", "none"][seed % 3], per_tensor_weights=bool(rng.integers(0, 2)),
    )
    proto = _block(seed, **config)
    fixed, report = model_checks.apply_pass(proto, FoldPerChannelActivationScalesPass)
    assert report.change_counts() == {RULE_NAME: 1}, (config, report.refusals)
    # node by node: the per-channel pair is per tensor, the Clip (absorbed) is gone, weights are per axis
    nodes = {n.name: n for n in fixed.graph.node}
    q = nodes["per_channel_q"]
    assert model_checks.initializer(fixed, q.input[1]).size == 1 and not q.attribute
    assert [n.op_type for n in fixed.graph.node].count("Clip") == 0
    for conv in ("producer", "depthwise"):
        weight_dq = next(n for n in fixed.graph.node if n.output[0] == nodes[conv].input[1])
        assert model_checks.initializer(fixed, weight_dq.input[1]).size == model_checks.initializer(fixed, weight_dq.input[0]).shape[0]
    for feed in _feeds():
        before, after = _integers(proto, feed), _integers(fixed, feed)
        moved = before.astype(np.int32) - after.astype(np.int32)
        assert np.abs(moved).max() <= 1 and np.count_nonzero(moved) <= max(1, before.size // 1000), config
        out_before = model_checks.outputs(proto, feed, optimized=False)[0]
        out_after = model_checks.outputs(fixed, feed, optimized=False)[0]
        if not moved.any():
            assert np.abs(out_before - out_after).max() <= 0.05 + 1e-6  # at most one output step (rounding of float products)


def test_clip_that_the_quantizer_does_not_absorb_is_refused_with_the_reason():
    proto = _block(0, activation="Clip", clip_max=0.01)  # cuts inside the widest channel's range
    fixed, report = model_checks.apply_pass(proto, FoldPerChannelActivationScalesPass)
    assert not report.changes
    assert "not positively homogeneous" in report.refusals[0].reason
    q = next(n for n in fixed.graph.node if n.name == "per_channel_q")
    assert model_checks.initializer(fixed, q.input[1]).size == C  # left per channel


def test_consumer_that_is_not_depthwise_is_refused():
    fixed, report = model_checks.apply_pass(_block(1, depthwise=False), FoldPerChannelActivationScalesPass)
    assert not report.changes and "not a depthwise Conv" in report.refusals[0].reason


def test_zero_points_that_differ_between_channels_of_a_signed_tensor_are_refused():
    proto = _block(2, activation=None, zero_points=[0, 0, 1, 0, 0, 0])
    _, report = model_checks.apply_pass(proto, FoldPerChannelActivationScalesPass)
    assert not report.changes and "zero points differ" in report.refusals[0].reason


@pytest.mark.parametrize("activation", ["Relu", "Clip"])
def test_zero_points_of_a_non_negative_tensor_move_to_qmin_with_the_values_they_held(activation):
    """NNCF's MIXED preset: int8 per-channel quantizers after Relu/Clip(0, 6), zero point 0 on some
    channels and -128 on others. Every channel moves to -128; where the old Q did not saturate, each
    dequantized value is the old one times the channel's factor S / s_c, which the Convs undo."""
    zero_points = [0, -128, 0, -128, -128, 0]
    proto = _block(3, activation=activation, zero_points=zero_points, zp_type=np.int8, clip_max=1e4)
    fixed, report = model_checks.apply_pass(proto, FoldPerChannelActivationScalesPass)
    assert report.change_counts() == {RULE_NAME: 1}, report.refusals
    assert "zero points moved to qmin" in report.changes[0].detail
    q = next(n for n in fixed.graph.node if n.name == "per_channel_q")
    assert int(model_checks.initializer(fixed, q.input[2])) == -128
    steps = model_checks.initializer(proto, "as").astype(np.float64)
    common = steps.max()
    saturated = 0
    for feed in _feeds():
        before_q = _integers(proto, feed)
        before = model_checks.outputs(_expose(proto, "ad"), feed, optimized=False)[1].astype(np.float64)
        after = model_checks.outputs(_expose(fixed, "ad"), feed, optimized=False)[1].astype(np.float64)
        rescaled = after * (steps / common)[None, :, None, None]
        kept = before_q < 127  # the old grid did not saturate there
        saturated += np.count_nonzero(~kept)
        step = np.broadcast_to(steps[None, :, None, None], before.shape)
        assert np.all(np.abs(rescaled - before)[kept] <= step[kept] * 1.001)  # a rounding tie at most
        assert np.count_nonzero(np.abs(rescaled - before)[kept] > step[kept] * 1e-3) <= max(1, before.size // 1000)
        assert np.all(rescaled[~kept] >= before[~kept] - 1e-6)  # above the old clamp: nearer the float value
    assert saturated  # the zero-point-0 channels saturated at 127 in the input somewhere


def test_nncf_depthwise_inputs_fold_exactly_and_run_as_integer_kernels():
    """NNCF 3.4 output (tests/fixtures): per-channel uint8 quantizers after Conv -> Clip(0, 6), read by depthwise Convs."""
    qdq = onnx.load(FIXTURES / "mbv2ish_nncf3.4.onnx")
    fp32 = onnx.load(FIXTURES / "mbv2ish_fp32.onnx")
    folded, report = model_checks.apply_pass(qdq, FoldPerChannelActivationScalesPass)
    assert report.change_counts() == {RULE_NAME: 2}
    feeds = [{"x": np.random.default_rng(seed).standard_normal((1, 3, 16, 16)).astype(np.float32)} for seed in range(6)]
    for feed in feeds:  # unoptimized sessions: what the graph says, bit for bit on this fixture
        np.testing.assert_array_equal(model_checks.outputs(qdq, feed, optimized=False)[0],
                                      model_checks.outputs(folded, feed, optimized=False)[0])
    assert kenosis_rewrite.explain(qdq).integer_mac_fraction < 0.5
    fixed, report = kenosis_rewrite.fix(qdq, float_model=fp32, calibration=feeds, return_report=True)
    assert report.change_counts()[RULE_NAME] == 2
    assert kenosis_rewrite.explain(fixed).integer_mac_fraction == 1.0
    scores = fidelity.compare_to_float(fp32, {"nncf": qdq, "fixed": fixed}, feeds)
    assert scores["fixed"]["cosine"] >= scores["nncf"]["cosine"] - 0.002, scores

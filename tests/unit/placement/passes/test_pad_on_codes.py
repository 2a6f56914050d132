"""move-dq-past-pad: a Pad between a DequantizeLinear and a Conv runs on the codes, exactly.

Graphs as NNCF leaves EfficientNet's ``static_padding`` exports: ``Q -> DQ -> Pad -> Conv`` with no Q/DQ
between the Pad and the Conv, per-tensor or with per-channel symmetric activation steps before a
depthwise Conv. Checked node by node and bit for bit against the input at ORT_DISABLE_ALL.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kenosis_rewrite
from kenosis_rewrite.placement.passes.qdq_propagation import DequantizeAfterPadPass
from kenosis_rewrite.testing.model_checks import apply_pass, outputs

C, H = 4, 10


def _model(mode: str = "constant", value: float | None = 0.0, per_channel: bool = False, pads=(0, 0, 1, 1, 0, 0, 1, 1),
           zero_point: int = 0, depthwise: bool = False, seed: int = 0, producer: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    scale = (rng.uniform(0.01, 0.05, C) if per_channel else np.array(0.02)).astype(np.float32)
    inits = [numpy_helper.from_array(scale, "s"),
             numpy_helper.from_array(np.full(scale.shape, zero_point, np.int8), "z"),
             numpy_helper.from_array(np.array(pads, np.int64), "pads")]
    pad_inputs = ["xdq", "pads"]
    if value is not None:
        inits.append(numpy_helper.from_array(np.array(value, np.float32), "v"))
        pad_inputs.append("v")
    groups = C if depthwise else 1
    w = rng.integers(-100, 100, (C, C // groups, 3, 3)).astype(np.int8)
    inits += [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.full(C, 0.01, np.float32), "ws"),
              numpy_helper.from_array(np.zeros(C, np.int8), "wz"),
              helper.make_tensor("ys", TensorProto.FLOAT, [], [0.05]), helper.make_tensor("yz", TensorProto.UINT8, [], [128])]
    axis = {"axis": 1} if per_channel else {}
    head = []
    if producer:  # DQ(x) -> 1x1 Conv -> Relu writes the tensor, as in an inverted-residual block
        inits += [helper.make_tensor("xs", TensorProto.FLOAT, [], [0.03]), helper.make_tensor("xz", TensorProto.UINT8, [], [128]),
                  numpy_helper.from_array(rng.integers(-100, 100, (C, C, 1, 1)).astype(np.int8), "w0"),
                  numpy_helper.from_array(np.full(C, 0.004, np.float32), "w0s"), numpy_helper.from_array(np.zeros(C, np.int8), "w0z")]
        head = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["x0q"]),
                helper.make_node("DequantizeLinear", ["x0q", "xs", "xz"], ["x0"]),
                helper.make_node("DequantizeLinear", ["w0", "w0s", "w0z"], ["w0dq"], axis=0),
                helper.make_node("Conv", ["x0", "w0dq"], ["c0"]), helper.make_node("Relu", ["c0"], ["r0"])]
    nodes = [*head, helper.make_node("QuantizeLinear", ["r0" if producer else "x", "s", "z"], ["xq"], **axis),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xdq"], **axis),
             helper.make_node("Pad", pad_inputs, ["p"], mode=mode),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wdq"], axis=0),
             helper.make_node("Conv", ["p", "wdq"], ["c"], group=groups),
             helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    graph = helper.make_graph(nodes, "pad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, H, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, None, None])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(n: int = 3):
    return [{"x": np.random.default_rng(i).uniform(-3, 3, (1, C, H, H)).astype(np.float32)} for i in range(n)]


def _assert_exact(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    for feed in _feeds():
        for a, b in zip(outputs(before, feed, optimized=False), outputs(after, feed, optimized=False)):
            np.testing.assert_array_equal(a, b)


def _pad_reads_codes_and_dq_feeds_conv(model: onnx.ModelProto) -> bool:
    producers = {out: node for node in model.graph.node for out in node.output}
    conv = next(node for node in model.graph.node if node.op_type == "Conv")
    dq = producers[conv.input[0]]
    pad = producers.get(dq.input[0])
    return dq.op_type == "DequantizeLinear" and pad is not None and pad.op_type == "Pad" and \
        producers[pad.input[0]].op_type == "QuantizeLinear"


@pytest.mark.parametrize("mode, value, zero_point", [
    ("constant", 0.0, 0), ("constant", None, 5), ("constant", 0.04, -3), ("edge", None, 0), ("reflect", None, 7),
])
def test_the_pad_moves_onto_the_codes_exactly(mode, value, zero_point):
    model = _model(mode, value, zero_point=zero_point)
    moved, report = apply_pass(model, DequantizeAfterPadPass)
    assert report.change_counts() == {"move-dq-past-pad": 1}
    assert _pad_reads_codes_and_dq_feeds_conv(moved)
    pad = next(node for node in moved.graph.node if node.op_type == "Pad")
    if mode == "constant":
        fill = next(init for init in moved.graph.initializer if init.name == pad.input[2])
        assert int(numpy_helper.to_array(fill)) == zero_point + round((value or 0.0) / 0.02)
    _assert_exact(model, moved)


def test_per_channel_steps_before_a_depthwise_conv_move_then_fold_and_the_conv_runs_integer():
    model = _model(per_channel=True, depthwise=True, producer=True)
    assert kenosis_rewrite.explain(model).integer_mac_fraction == 0.0
    fixed, report = kenosis_rewrite.fix(model, return_report=True)
    counts = report.change_counts()
    assert counts.get("move-dq-past-pad") == 1 and counts.get("fold-per-channel-activation-scales") == 1
    assert kenosis_rewrite.explain(fixed).integer_mac_fraction == 1.0
    onnx.checker.check_model(fixed, full_check=True)
    reference, ours = [outputs(model, f)[0] for f in _feeds()], [outputs(fixed, f)[0] for f in _feeds()]
    for a, b in zip(reference, ours):
        assert np.abs(a - b).max() <= 0.05 + 1e-6  # within one output step


@pytest.mark.parametrize("kwargs, reason", [
    ({"value": 0.013}, "is not a value of the quantized grid"),
    ({"per_channel": True, "value": 0.02}, "per-channel parameters with a pad value other than 0"),
    ({"per_channel": True, "pads": (0, 1, 1, 1, 0, 1, 1, 1)}, "pads the axis of the per-channel parameters"),
])
def test_what_is_not_exact_is_refused_with_its_reason(kwargs, reason):
    model = _model(**kwargs)
    moved, report = apply_pass(model, DequantizeAfterPadPass)
    assert not report.changes and reason in report.refusals[0].reason
    assert moved.SerializeToString() == model.SerializeToString() or not _pad_reads_codes_and_dq_feeds_conv(moved)


@pytest.mark.parametrize("seed", range(8))
def test_random_pads_and_fills_stay_exact(seed):
    rng = np.random.default_rng(100 + seed)
    mode = str(rng.choice(["constant", "edge", "reflect"]))
    pads = tuple(int(p) for p in [0, 0, *rng.integers(0, 3, 2), 0, 0, *rng.integers(0, 3, 2)])
    zero_point = int(rng.integers(-20, 20))
    value = float(rng.integers(-5, 5)) * 0.02 if mode == "constant" else None
    model = _model(mode, value, pads=pads, zero_point=zero_point, seed=seed)
    moved, report = apply_pass(model, DequantizeAfterPadPass)
    assert report.change_counts() == {"move-dq-past-pad": 1}
    _assert_exact(model, moved)

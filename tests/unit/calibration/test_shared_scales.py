"""Tests of shared_concat_ranges: groups, union ranges, refusals, and the quantized graph it gives."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from kenosis_rewrite import calibration as calib
from kenosis_rewrite import quantize
from kenosis_rewrite.calibration.collect import TensorRanges
from kenosis_rewrite.calibration.shared_scales import shared_concat_ranges
from kenosis_rewrite.testing import model_checks, toy_models
from kenosis_rewrite.testing.toy_models import IMAGE, C, ToyBuilder


def _c2f_like(seed: int = 0, right_gain: float = 1.0) -> onnx.ModelProto:
    """Conv -> Split (two halves) -> second half through Conv+Relu -> Concat(halves, branch) -> Conv:
    YOLOv8's C2f, where Split ties the halves to the first Conv's range."""
    b = ToyBuilder(seed)
    h = b.node("Relu", [b.conv("x", C, 2 * C)])
    b.node("Split", [h, b.const(np.array([C, C], np.int64), "sizes")], n_out=2, axis=1)
    halves = list(b.nodes[-1].output)
    branch = b.node("Relu", [b.conv(halves[1], C, C)])
    if right_gain != 1.0:
        branch = b.node("Mul", [branch, b.const(np.float32(right_gain), "gain")])
    joined = b.node("Concat", [halves[0], halves[1], branch], axis=1)
    return b.model(IMAGE, b.conv(joined, 3 * C, C, k=1))


def _ranges(model, feeds) -> TensorRanges:
    return calib.collect_ranges(model, feeds, "minmax", progress=False)


def _concat(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == "Concat")


def test_concat_group_takes_the_union_of_its_members_ranges():
    model = _c2f_like()
    ranges = _ranges(model, toy_models.random_feeds(model, 4))
    shared, decisions = shared_concat_ranges(model, ranges)
    concat = _concat(model)
    split = next(n for n in model.graph.node if n.op_type == "Split")
    members = {*concat.input, *concat.output, split.input[0]}
    assert len(decisions) == 1 and decisions[0].applied
    assert set(decisions[0].tensors) == members
    lo = min(ranges[name][0] for name in members)
    hi = max(ranges[name][1] for name in members)
    assert all(shared[name] == (lo, hi) for name in members)
    untouched = set(ranges) - members
    assert all(shared[name] == ranges[name] for name in untouched)
    assert shared.method == ranges.method and shared.samples == ranges.samples


def test_a_group_that_would_lose_too_much_resolution_is_refused():
    model = _c2f_like(right_gain=50.0)
    ranges = _ranges(model, toy_models.random_feeds(model, 4))
    shared, decisions = shared_concat_ranges(model, ranges, max_widening=4.0)
    assert len(decisions) == 1 and not decisions[0].applied
    assert "widen" in decisions[0].reason
    assert dict(shared) == dict(ranges)


def test_excluded_nodes_do_not_join_a_group():
    model = _c2f_like()
    ranges = _ranges(model, toy_models.random_feeds(model, 4))
    _, decisions = shared_concat_ranges(model, ranges, excluded_nodes=[_concat(model).name])
    assert decisions == []


def _dequantize_params(model: onnx.ModelProto, tensor: str) -> tuple[float, int]:
    """The grid ``tensor`` is on: its DequantizeLinear's, or its QuantizeLinear's where the Concat
    reads the codes (``concat-on-codes``, when every input and reader share one grid)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    node = producers[tensor]
    assert node.op_type in ("DequantizeLinear", "QuantizeLinear"), node.op_type
    return float(initializers[node.input[1]]), int(initializers[node.input[2]])


def test_quantize_puts_every_concat_input_on_one_scale_and_stays_faithful():
    model = _c2f_like(seed=3)
    feeds = toy_models.random_feeds(model, 8, seed=1)
    shared, report = quantize(model, feeds, return_report=True, bias_correction=False)
    separate = quantize(model, feeds, share_concat_ranges=False, bias_correction=False)
    assert any(c.rule == "share-concat-ranges" for c in report.changes)
    concat = _concat(shared)
    params = {_dequantize_params(shared, name) for name in concat.input}
    assert len(params) == 1, params
    assert report.change_counts().get("concat-on-codes") == 1  # one grid: ORT copies the codes
    # the unshared model gives the Concat inputs different scales: the test can fail
    assert len({_dequantize_params(separate, name) for name in _concat(separate).input}) > 1
    assert onnx.checker.check_model(shared, full_check=True) is None
    cosine_shared = model_checks.graph_cosine(model, shared, feeds)
    cosine_separate = model_checks.graph_cosine(model, separate, feeds)
    # resolution lost on the narrower inputs is bounded by the widening limit (two bits at 4x)
    assert cosine_shared > 0.999 and cosine_shared > cosine_separate - 0.002


def test_a_group_never_reaches_past_a_relu_clamp_the_quantizer_stands_for():
    """Concat(Relu(conv), conv): quantize_static deletes the Relu and lets its Q clamp at 0; a shared
    range reaching below 0 would pass the negative values the Relu removed."""
    b = ToyBuilder(0)
    rectified = b.node("Relu", [b.conv("x", C, C)])
    signed = b.conv("x", C, C)
    joined = b.node("Concat", [rectified, signed], axis=1)
    model = b.model(IMAGE, b.conv(joined, 2 * C, C, k=1))
    ranges = _ranges(model, toy_models.random_feeds(model, 4))
    assert ranges[signed][0] < 0 <= ranges[rectified][0]
    shared, decisions = shared_concat_ranges(model, ranges, max_widening=1e9)
    assert len(decisions) == 1 and not decisions[0].applied
    assert "clamp" in decisions[0].reason
    assert dict(shared) == dict(ranges)
    # and the quantized model keeps the clamp: no negative value reaches the Concat from the Relu side
    feeds = toy_models.random_feeds(model, 4, seed=2)
    quantized = quantize(model, feeds, bias_correction=False)
    assert model_checks.graph_cosine(model, quantized, feeds) > 0.999

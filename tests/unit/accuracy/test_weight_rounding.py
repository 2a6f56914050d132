"""Tests of weight rounding by output error: node by node (only integer weights change, on their own
grid) and numerically (each output channel's error on the calibration inputs, measured with ONNX
Runtime, is never above round-to-nearest's, and is lower overall on correlated inputs)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.accuracy import weight_rounding
from kenosis_rewrite.accuracy.layer_matching import first_input_readers
from kenosis_rewrite.accuracy.weight_rounding import (
    MAX_STEPS,
    RULE_NAME,
    _layer,
    _patches,
    round_weights,
    sequential_round,
)
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.quantization.pipeline import quantize
from kenosis_rewrite.testing import model_checks

SIZE = 12
_PLAIN = {"weight_rounding": False, "equalization": False}  # round-to-nearest, the FP32 weights as given


def _stem_and_depthwise(kernel: int = 3, stride: int = 2, pads=(0, 0, 1, 1), dilation: int = 1) -> onnx.ModelProto:
    """x (3 channels) -> Conv (stem, 8 channels) -> Relu -> depthwise Conv -> y."""
    rng = np.random.default_rng(0)
    stem = rng.normal(0, 1, (8, 3, kernel, kernel)).astype(np.float32)
    depthwise = rng.normal(0, 1, (8, 1, 3, 3)).astype(np.float32)
    initializers = [numpy_helper.from_array(stem, "w1"), numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "b1"),
                    numpy_helper.from_array(depthwise, "w2"), numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "b2")]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["h"], name="stem", strides=[stride, stride], pads=list(pads),
                         dilations=[dilation, dilation]),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2", "b2"], ["y"], name="depthwise", group=8, pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, "height", "width"])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _feeds(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Smooth images (neighbouring pixels correlated, as in photos): what lets rounding compensate."""
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(n):
        noise = rng.normal(0, 1, (1, 3, SIZE + 3, SIZE + 3))
        smooth = sum(noise[:, :, i : i + SIZE, j : j + SIZE] for i in range(4) for j in range(4)) / 4
        feeds.append({"x": (smooth + rng.normal(0, 0.05, smooth.shape)).astype(np.float32)})
    return feeds


def _rounded(float_model, quantized, feeds, **kwargs) -> tuple[onnx.ModelProto, FixReport]:
    model = ir.serde.deserialize_model(quantized)
    report = FixReport()
    round_weights(float_model, model, feeds, report, **kwargs)
    return ir.serde.serialize_model(model), report


def _conv(model: onnx.ModelProto, index: int) -> onnx.NodeProto:
    """The stem (0) or the depthwise (1) Conv (canonicalization may rename nodes)."""
    return [n for n in model.graph.node if n.op_type == "Conv"][index]


def _weight_params(model: onnx.ModelProto, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dq = model_checks.producer_of(model, _conv(model, index).input[1])
    return tuple(model_checks.initializer(model, name) for name in dq.input[:3])


def _with_weights(float_model: onnx.ModelProto, conv: str, weights: np.ndarray, output: str) -> onnx.ModelProto:
    """The FP32 model with ``conv``'s weights replaced and ``output`` as its only output."""
    model = onnx.ModelProto()
    model.CopyFrom(float_model)
    name = model_checks.node_by_name(model, conv).input[1]
    for init in model.graph.initializer:
        if init.name == name:
            init.CopyFrom(numpy_helper.from_array(weights.astype(np.float32), name))
    del model.graph.output[:]
    model.graph.output.extend([onnx.ValueInfoProto(name=output)])
    return model


def _channel_errors(float_model, conv: str, output: str, weights: np.ndarray, feeds) -> np.ndarray:
    """Per output channel, the squared output error of ``conv`` with ``weights`` on its FP32 inputs (ORT)."""
    reference = [model_checks.outputs(_with_weights(float_model, conv, model_checks.initializer(float_model, model_checks.node_by_name(
        float_model, conv).input[1]), output), f, optimized=False)[0] for f in feeds]
    candidate = [model_checks.outputs(_with_weights(float_model, conv, weights, output), f, optimized=False)[0] for f in feeds]
    return sum(((c - r).astype(np.float64) ** 2).sum(axis=(0, 2, 3)) for r, c in zip(reference, candidate))


@pytest.fixture(autouse=True)
def _every_position(monkeypatch):
    """H from every position of these small images, so the per-channel bound holds exactly as measured."""
    monkeypatch.setattr(weight_rounding, "MAX_POSITIONS", 10**6)


def test_only_integer_weights_change_on_their_grid_and_each_channel_error_does_not_grow():
    float_model, feeds = _stem_and_depthwise(), _feeds(8, seed=0)
    before = quantize(float_model, feeds, bias_correction=False, **_PLAIN)
    snapshot = float_model.SerializeToString()
    after, report = _rounded(float_model, before, feeds)
    assert float_model.SerializeToString() == snapshot  # the FP32 model is only read
    onnx.checker.check_model(after, full_check=True)

    # node by node: same graph; only the two integer weight tensors changed, scales and zero points not
    assert [(n.op_type, list(n.input), list(n.output)) for n in before.graph.node] == \
           [(n.op_type, list(n.input), list(n.output)) for n in after.graph.node]
    weight_names = {model_checks.producer_of(after, _conv(after, i).input[1]).input[0] for i in (0, 1)}
    changed = {i.name for i, j in zip(before.graph.initializer, after.graph.initializer)
               if i.SerializeToString() != j.SerializeToString()}
    assert changed == weight_names
    assert report.change_counts() == {RULE_NAME: 2}

    for index in (0, 1):
        data_before, scale, zero = _weight_params(before, index)
        data_after, scale_after, zero_after = _weight_params(after, index)
        assert np.array_equal(scale, scale_after) and np.array_equal(zero, zero_after)
        assert data_after.dtype == data_before.dtype == np.int8
        assert np.abs(data_after.astype(int) - data_before.astype(int)).max() <= MAX_STEPS
        assert (data_after != data_before).any()
        shape = (-1,) + (1,) * (data_before.ndim - 1)

        def dequantized(data):
            return (data.astype(np.float32) - zero.reshape(shape)) * scale.reshape(shape)

        # numeric, with ORT: each channel's output error on the FP32 inputs of the calibration feeds
        conv, output = ("stem", "h") if index == 0 else ("depthwise", "y")
        nearest = _channel_errors(float_model, conv, output, dequantized(data_before), feeds)
        rounded = _channel_errors(float_model, conv, output, dequantized(data_after), feeds)
        assert np.all(rounded <= nearest * (1 + 1e-5) + 1e-9)
        assert rounded.sum() < 0.8 * nearest.sum()  # correlated pixels: the rounding compensates


@pytest.mark.parametrize("kernel,stride,pads,dilation", [(3, 1, (1, 1, 1, 1), 1), (3, 2, (0, 0, 1, 1), 1),
                                                         (5, 2, (2, 1, 2, 1), 1), (3, 1, (2, 2, 2, 2), 2)])
def test_patches_reproduce_the_convolution_ort_runs(kernel, stride, pads, dilation):
    float_model = _stem_and_depthwise(kernel, stride, pads, dilation)
    quantized = ir.serde.deserialize_model(quantize(float_model, _feeds(2, 0), bias_correction=False, **_PLAIN))
    node = next(n for n in quantized.graph if n.op_type == "Conv" and n.name == "stem")
    layer = _layer(node, first_input_readers(float_model), {i.name: i for i in float_model.graph.initializer})
    assert not isinstance(layer, str)
    feed = _feeds(1, seed=5)[0]
    patches = _patches(layer, feed["x"][0])
    convolved = layer.weights @ patches.reshape(-1, patches.shape[-1]) + model_checks.initializer(float_model, "b1")[:, None]
    reference = model_checks.outputs(_with_weights(float_model, "stem", model_checks.initializer(float_model, "w1"), "h"), feed,
                                 optimized=False)[0]
    assert patches.shape[-1] == reference.shape[2] * reference.shape[3]  # all positions of a small image
    np.testing.assert_allclose(convolved, reference.reshape(8, -1), rtol=1e-4, atol=1e-4)


def test_sequential_round_stays_on_the_grid_and_never_loses_to_round_to_nearest_per_row():
    rng = np.random.default_rng(1)
    columns, rows = 27, 16
    mixing = rng.normal(0, 1, (columns, 4)) @ rng.normal(0, 1, (4, columns)) + 0.1 * np.eye(columns)
    inputs = rng.normal(0, 1, (4000, columns)) @ mixing  # strongly correlated columns
    hessian = inputs.T @ inputs / len(inputs)
    weights = rng.normal(0, 1, (rows, columns))
    scale = (np.abs(weights).max(axis=1, keepdims=True) / 127)
    zero = np.zeros((rows, 1))
    rounded = sequential_round(weights, hessian, scale, zero, -128, 127)
    nearest = np.clip(np.rint(weights / scale), -128, 127)
    assert np.array_equal(rounded, np.rint(rounded)) and rounded.min() >= -128 and rounded.max() <= 127
    assert np.abs(rounded - nearest).max() <= MAX_STEPS

    def error(q):
        difference = weights - q * scale
        return np.einsum("ri,ij,rj->r", difference, hessian, difference)

    assert np.all(error(rounded) <= error(nearest))
    assert error(rounded).sum() < 0.5 * error(nearest).sum()
    # per-row H (depthwise) gives the same answer as the shared one
    batched = sequential_round(weights, np.broadcast_to(hessian, (rows, columns, columns)).copy(), scale, zero, -128, 127)
    assert np.array_equal(batched, rounded)


def test_quantize_weight_rounding_is_measured_better_on_held_out_feeds_and_reported():
    float_model, feeds = _stem_and_depthwise(), _feeds(16, seed=2)
    plain = quantize(float_model, feeds, **_PLAIN)
    rounded, report = quantize(float_model, feeds, weight_rounding=True, equalization=False, return_report=True)
    onnx.checker.check_model(rounded, full_check=True)
    assert model_checks.op_types(rounded) == model_checks.op_types(plain)  # numbers change, not the graph
    assert report.change_counts().get(RULE_NAME) == 2
    held_out = _feeds(8, seed=3)
    scores = fidelity.compare_to_float(float_model, {"plain": plain, "rounded": rounded}, held_out)
    assert scores["rounded"]["sqnr_db"] > scores["plain"]["sqnr_db"]


def test_large_fan_in_layers_are_left_unless_asked_and_unmatched_ones_refused():
    # stem: 75 weights per channel, 36 positions per feed: 8 feeds give the two samples per weight it needs
    float_model, feeds = _stem_and_depthwise(kernel=5), _feeds(8, seed=0)
    before = quantize(float_model, feeds, bias_correction=False, **_PLAIN)
    after, report = _rounded(float_model, before, feeds)
    assert report.change_counts() == {RULE_NAME: 1}  # the depthwise only
    after_all, report_all = _rounded(float_model, before, feeds, max_columns=None)
    assert report_all.change_counts() == {RULE_NAME: 2}

    other = _stem_and_depthwise()  # reads another tensor: nothing to compare with
    other.graph.input[0].name = "image"
    other.graph.node[0].input[0] = "image"
    unchanged, refused = _rounded(other, before, feeds)
    assert [i.SerializeToString() for i in unchanged.graph.initializer] == [i.SerializeToString() for i in before.graph.initializer]
    assert ("stem" in {r.where for r in refused.refusals}) and not refused.changes


def test_weight_dequantize_parameters_are_read_not_written():
    float_model, feeds = _stem_and_depthwise(), _feeds(4, seed=0)
    before = ir.serde.deserialize_model(quantize(float_model, feeds, bias_correction=False, **_PLAIN))
    node = next(n for n in before.graph if n.name == "stem")
    params = qdq_params.quant_params(node.inputs[1].producer())
    round_weights(float_model, before, feeds)
    assert qdq_params.quant_params(node.inputs[1].producer()).same_as(params)


@pytest.mark.parametrize("kernel,stride,pads,dilation", [(3, 2, (0, 0, 1, 1), 1), (5, 2, (2, 1, 2, 1), 1)])
def test_inputs_gathered_from_the_calibration_run_round_as_measured_ones(monkeypatch, kernel, stride, pads, dilation):
    from kenosis_rewrite import calibration as calib

    float_model = _stem_and_depthwise(kernel, stride, pads, dilation)
    feeds = _feeds(4, 0)
    quantized = quantize(float_model, feeds, bias_correction=False, **_PLAIN)
    gathered = weight_rounding.InputMoments(float_model)
    calib.collect_ranges(float_model, feeds, "minmax", progress=False, observe=gathered.observe)
    measured, _ = _rounded(float_model, quantized, feeds)

    def no_run(*args):
        raise AssertionError("gathered layers are not run again")

    monkeypatch.setattr(weight_rounding, "_measure", no_run)
    from_calibration, report = _rounded(float_model, quantized, feeds, gathered=gathered)
    assert from_calibration.SerializeToString() == measured.SerializeToString()
    assert any(c.rule == RULE_NAME for c in report.changes)
    # the factors of H^-1 computed beforehand (quantize() does it beside quantize_static): the same
    # model, and round_weights factors nothing itself
    factors = gathered.inverse_factors()
    assert factors and all(upper is not None for upper in factors.values())

    def no_factoring(*args):
        raise AssertionError("the gathered layers' factors were given")

    # and computed on a worker thread layer by layer (quantize()): the same factors, the same model
    in_background = weight_rounding.FactorsInBackground(gathered)
    assert all(np.array_equal(in_background.get(reference), upper) for reference, upper in factors.items())
    assert in_background.get("not a layer", "absent") == "absent"
    monkeypatch.setattr(weight_rounding, "inverse_factor", no_factoring)
    prefactored, _ = _rounded(float_model, quantized, feeds, gathered=gathered, factors=factors)
    assert prefactored.SerializeToString() == measured.SerializeToString()
    progressive, _ = _rounded(float_model, quantized, feeds, gathered=gathered, factors=in_background)
    assert progressive.SerializeToString() == measured.SerializeToString()
    # what the worker raises reaches the reader
    failing = weight_rounding.FactorsInBackground(gathered)  # inverse_factor raises now
    with pytest.raises(AssertionError, match="factors were given"):
        failing.get(next(iter(factors)))


def _dense(fan_in: int = 24) -> onnx.ModelProto:
    """x [1, fan_in] -> Gemm (16 outputs) -> y: one input row per feed."""
    rng = np.random.default_rng(1)
    weights = numpy_helper.from_array(rng.normal(0, 1, (fan_in, 16)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w"], ["y"], name="dense")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, fan_in])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])], [weights])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_layer_seen_on_fewer_samples_than_twice_its_fan_in_keeps_round_to_nearest():
    """4 feeds of one row each give a rank-4 H for 24 weights per output: rounding by it would fit
    those 4 inputs (fuzz seed 3603132: cosine 0.983 against round-to-nearest's 0.996)."""
    float_model = _dense()
    rng = np.random.default_rng(2)
    feeds = [{"x": rng.normal(0, 1, (1, 24)).astype(np.float32)} for _ in range(64)]
    before = quantize(float_model, feeds[:4], bias_correction=False, **_PLAIN)
    unchanged, refused = _rounded(float_model, before, feeds[:4])
    assert [i.SerializeToString() for i in unchanged.graph.initializer] == [i.SerializeToString() for i in before.graph.initializer]
    assert not refused.changes
    assert any("4 input samples for 24 weights" in r.reason for r in refused.refusals if r.rule == RULE_NAME)
    # 48 samples, two per weight: rounded
    _, rounded = _rounded(float_model, quantize(float_model, feeds[:48], bias_correction=False, **_PLAIN), feeds[:48])
    assert rounded.change_counts() == {RULE_NAME: 1}

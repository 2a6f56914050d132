"""Tests of bias correction: node by node (only int32 biases change) and numerically (each
corrected channel's mean error within half a bias step; fidelity on held-out feeds not worse)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.accuracy.bias_correction import (
    MIN_TAPPED_OUTPUTS,
    RULE_NAME,
    SIGNIFICANCE_Z,
    _edge_reads,
    _layer,
    _mean_plan,
    _Means,
    _probe,
    _shifts,
    _tap_means,
    correct_biases,
)
from kenosis_rewrite.accuracy.layer_matching import first_input_readers
from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.quantization.pipeline import quantize
from kenosis_rewrite.testing import model_checks, toy_models

CHANNELS = 8


def _depthwise(bias: bool = True) -> onnx.ModelProto:
    """x -> depthwise 3x3 Conv -> y, channel magnitudes 1/64 .. 1: per-tensor int8 weights round
    the small channels coarsely, so each output channel's mean shifts."""
    rng = np.random.default_rng(0)
    magnitudes = np.geomspace(1 / 64, 1, CHANNELS).reshape(CHANNELS, 1, 1, 1)
    weights = (rng.uniform(0.2, 1.0, (CHANNELS, 1, 3, 3)) * magnitudes).astype(np.float32)
    initializers = [numpy_helper.from_array(weights, "w")]
    inputs = ["x", "w"]
    if bias:
        initializers.append(numpy_helper.from_array(rng.normal(0, 0.01, CHANNELS).astype(np.float32), "b"))
        inputs.append("b")
    node = helper.make_node("Conv", inputs, ["y"], group=CHANNELS, pads=[1, 1, 1, 1], name="depthwise")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, CHANNELS, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, CHANNELS, 12, 12])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _feeds(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)  # non-zero mean inputs: weight rounding shows as a mean shift
    return [{"x": rng.uniform(0, 1, (1, CHANNELS, 12, 12)).astype(np.float32)} for _ in range(n)]


def _bias_of(model: onnx.ModelProto, conv: str = "depthwise") -> tuple[np.ndarray, np.ndarray]:
    """(int32 bias, its scale) of the named Conv."""
    node = model_checks.node_by_name(model, conv)
    dq = model_checks.producer_of(model, node.input[2])
    return model_checks.initializer(model, dq.input[0]), model_checks.initializer(model, dq.input[1])


def _mean_error_per_channel(float_model, model, feeds) -> np.ndarray:
    errors = [model_checks.outputs(model, f, optimized=False)[0] - model_checks.outputs(float_model, f, optimized=False)[0]
              for f in feeds]
    return np.mean(np.concatenate(errors), axis=(0, 2, 3))


def _nodes_and_initializers(model: onnx.ModelProto):
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    return nodes, {i.name: numpy_helper.to_array(i).tolist() for i in model.graph.initializer}


def _corrected(float_model, quantized, feeds) -> tuple[onnx.ModelProto, FixReport]:
    model = ir.serde.deserialize_model(quantized)
    report = FixReport()
    correct_biases(float_model, model, feeds, report)
    return ir.serde.serialize_model(model), report


def test_depthwise_mean_shift_moves_into_the_bias_within_half_a_step():
    float_model, feeds = _depthwise(), _feeds(8, seed=0)
    before = quantize(float_model, feeds, per_channel=False, bias_correction=False)
    snapshot = float_model.SerializeToString()
    after, report = _corrected(float_model, before, feeds)
    assert float_model.SerializeToString() == snapshot  # the FP32 model is only read

    # node by node: same graph, same weights; only the int32 bias values moved
    assert [(n.op_type, list(n.input), list(n.output)) for n in before.graph.node] == \
           [(n.op_type, list(n.input), list(n.output)) for n in after.graph.node]
    changed = {i.name for i, j in zip(before.graph.initializer, after.graph.initializer)
               if i.SerializeToString() != j.SerializeToString()}
    bias_name = model_checks.producer_of(after, model_checks.node_by_name(after, "depthwise").input[2]).input[0]
    assert changed == {bias_name}
    onnx.checker.check_model(after, full_check=True)
    assert report.change_counts() == {RULE_NAME: 1}

    bias_before, scale = _bias_of(before)
    bias_after, _ = _bias_of(after)
    error_before = _mean_error_per_channel(float_model, before, feeds)
    error_after = _mean_error_per_channel(float_model, after, feeds)
    corrected = bias_after != bias_before
    assert corrected.sum() >= CHANNELS // 2
    assert np.max(np.abs(error_before) / scale) > 1  # without correction: more than a bias step off
    bound = 0.5 * scale * (1 + 1e-3) + 1e-7
    assert np.all(np.abs(error_after)[corrected] <= np.broadcast_to(bound, corrected.shape)[corrected])
    assert np.all(np.abs(error_after) <= np.abs(error_before) + 1e-7)

    held_out = _feeds(6, seed=1)
    scores = fidelity.compare_to_float(float_model, {"before": before, "after": after}, held_out)
    assert scores["after"]["sqnr_db"] > scores["before"]["sqnr_db"]


def test_the_probe_computes_only_what_the_shifts_read_and_measures_the_same():
    """A head after the corrected layer (here a Softmax) is left out of the probe, and the shifts
    equal those measured on the model without the head."""
    float_model, feeds = _depthwise(), _feeds(4, seed=0)
    with_head = onnx.ModelProto()
    with_head.CopyFrom(float_model)
    with_head.graph.node.append(helper.make_node("Softmax", ["y"], ["head"], axis=1, name="head"))
    with_head.graph.output.append(helper.make_tensor_value_info("head", TensorProto.FLOAT, [1, CHANNELS, 12, 12]))
    shifts = []
    for model in (float_model, with_head):
        quantized = ir.serde.deserialize_model(quantize(model, feeds, per_channel=False, bias_correction=False))
        float_weights = {i.name: i for i in model.graph.initializer}
        node = next(node for node in quantized.graph if node.name == "depthwise")
        layer = _layer(node, first_input_readers(model), float_weights)
        plans = [_mean_plan(layer, float_weights)]
        probe, counts = _probe(model, [layer], plans, 17)
        assert "Softmax" not in {node.op_type for node in probe.graph.node}
        assert all(o.name.startswith("kenosis_bias_shift") for o in probe.graph.output)
        assert len(probe.graph.output) == sum(counts)
        shifts.append(_shifts(model, [layer], feeds)[0])
    np.testing.assert_array_equal(shifts[0], shifts[1])


@pytest.mark.parametrize("name", ["resnetish", "conv_relu", "conv_clip", "gemm_relu", "concat"])
@pytest.mark.parametrize("per_channel", [True, False])
def test_every_corrected_layer_is_left_within_half_a_bias_step(name, per_channel):
    float_model = toy_models.build(name, seed=3)
    feeds = [{k: np.abs(v) for k, v in f.items()} for f in toy_models.random_feeds(float_model, 6, seed=4)]
    # equalization would change the FP32 weights this test compares with; weight rounding is its own test
    only = {"equalization": False, "weight_rounding": False}
    before, report = quantize(float_model, feeds, per_channel=per_channel, bias_correction=True, return_report=True, **only)
    uncorrected = quantize(float_model, feeds, per_channel=per_channel, bias_correction=False, **only)
    weighted = [n for n in before.graph.node if n.op_type in ("Conv", "Gemm")]
    assert report.change_counts().get(RULE_NAME, 0) == len(weighted) > 0
    onnx.checker.check_model(before, full_check=True)
    assert [o.shape for o in model_checks.outputs(before, feeds[0])] == [o.shape for o in model_checks.outputs(float_model, feeds[0])]
    # re-measure on the corrected model: what is left is the bias grid's rounding, or a shift
    # that was not significant over the feeds (left alone by design)
    model = ir.serde.deserialize_model(before)
    readers = first_input_readers(float_model)
    weights = {init.name: init for init in float_model.graph.initializer}
    layers = [_layer(node, readers, weights) for node in model.graph if node.op_type in ("Conv", "Gemm")]
    assert all(not isinstance(layer, str) for layer in layers)
    corrected_model = ir.serde.deserialize_model(uncorrected)
    correct_biases(float_model, corrected_model, feeds)
    # quantize() did just this
    assert _nodes_and_initializers(ir.serde.serialize_model(corrected_model)) == _nodes_and_initializers(before)
    for layer, shifts in zip(layers, _shifts(float_model, layers, feeds)):
        left = np.abs(shifts.mean(axis=0))
        rounding = left <= 0.5 * layer.bias_scale * (1 + 1e-3) + 1e-6
        not_significant = left <= SIGNIFICANCE_Z * shifts.std(axis=0, ddof=1) / np.sqrt(len(shifts)) * (1 + 1e-6)
        assert np.all(rounding | not_significant), layer.node.name
        assert rounding.mean() > 0.5, layer.node.name


def test_layers_it_cannot_correct_are_refused_with_a_reason():
    float_model, feeds = _depthwise(bias=False), _feeds(4, seed=0)
    quantized = ort_quantize.quantize_with_ort(float_model, feeds, "default")
    after, report = _corrected(float_model, quantized, feeds)
    assert _nodes_and_initializers(after) == _nodes_and_initializers(quantized)
    assert [(r.where, r.reason) for r in report.refusals] == [("depthwise", "no bias to correct")]

    other = _depthwise()  # its Conv reads another tensor: nothing to compare with
    other.graph.input[0].name = "image"
    other.graph.node[0].input[0] = "image"
    with_bias = ort_quantize.quantize_with_ort(_depthwise(), feeds, "default")
    _, report = _corrected(other, with_bias, feeds)
    assert [r.reason for r in report.refusals] == ["no FP32 Conv reading 'x' to compare with"]


def test_a_float_model_whose_layer_differs_from_the_quantized_one_is_refused():
    """quantize() folds BatchNormalization before quantizing: the raw FP32 Conv (before the BN) is
    not the layer that was quantized, and correcting toward its output would be wrong."""
    float_model = toy_models.build("conv_bn")
    feeds = toy_models.random_feeds(float_model, 4)
    quantized = quantize(float_model, feeds, bias_correction=False, equalization=False, weight_rounding=False)
    _, report = _corrected(float_model, quantized, feeds)
    # the two Convs a BatchNormalization follows are refused; the last one (no BN) is comparable
    assert len(report.refusals) == 2 and all("other weights than the quantized one" in r.reason for r in report.refusals)
    assert report.change_counts() == {RULE_NAME: 1}
    _, report = quantize(float_model, feeds, return_report=True, weight_rounding=False)  # against its own folded graph
    assert report.change_counts()[RULE_NAME] == 3


def test_quantize_reports_bias_correction_and_can_leave_it_out():
    float_model, feeds = _depthwise(), _feeds(8, seed=0)
    _, on = quantize(float_model, feeds, return_report=True)
    _, off = quantize(float_model, feeds, bias_correction=False, return_report=True)
    assert on.change_counts()[RULE_NAME] == 1 and "bias correction: 1 layers" in on.summary()
    assert RULE_NAME not in off.change_counts()


def test_scales_per_channel_and_per_tensor_are_read_from_the_bias_dequantize():
    float_model, feeds = _depthwise(), _feeds(4, seed=0)
    for per_channel in (True, False):
        quantized = quantize(float_model, feeds, per_channel=per_channel, bias_correction=False)
        model = ir.serde.deserialize_model(quantized)
        conv = next(node for node in model.graph if node.op_type == "Conv")
        layer = _layer(conv, {"x": list(float_model.graph.node)}, {i.name: i for i in float_model.graph.initializer})
        expected = qdq_params.quant_params(conv.inputs[2].producer()).scale.reshape(-1)
        assert np.array_equal(layer.bias_scale, expected.astype(np.float64))
        assert layer.bias_scale.size == (CHANNELS if per_channel else 1)


def test_a_measurement_that_cannot_run_leaves_the_model_as_quantized_and_says_why():
    float_model, feeds = _depthwise(), _feeds(2, seed=0)
    quantized = quantize(float_model, feeds, bias_correction=False)
    wrong_feeds = [{"x": np.zeros((1, CHANNELS + 1, 12, 12), np.float32)}]  # ORT refuses the shape
    after, report = _corrected(float_model, quantized, wrong_feeds)
    assert _nodes_and_initializers(after) == _nodes_and_initializers(quantized)
    assert not report.changes and any(n.startswith("bias correction skipped: ONNX Runtime") for n in report.notes)


def _random_layer(seed: int, opset: int = 17) -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """x -> one Conv (1x1 or k x k up to 5, groups, output channels around ``MIN_TAPPED_OUTPUTS``, some
    padded, auto-padded, strided or dilated) or Gemm (transB, alpha, some with beta) with a bias -> y, and non-zero-mean feeds."""
    rng = np.random.default_rng(seed)
    if seed % 4 == 3:
        rows, inputs, outputs = int(rng.integers(1, 5)), int(rng.integers(3, 12)), int(rng.integers(3, 10))
        trans_b = int(rng.integers(0, 2))
        weights = rng.normal(0, 0.5, (outputs, inputs) if trans_b else (inputs, outputs)).astype(np.float32)
        node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="layer", transB=trans_b, alpha=float(rng.uniform(0.5, 2)),
                                beta=float(rng.choice([1.0, 1.0, 1.5])))  # quantize_static folds a beta into the bias
        shape, out_shape = [rows, inputs], [rows, outputs]
    else:
        group = int(rng.choice([1, 2]))
        inputs, outputs = group * int(rng.integers(2, 5)), group * int(rng.choice([8, 32, 40]))
        kernel = [1, 1] if rng.random() < 0.5 else [int(v) for v in rng.choice([1, 2, 3, 5], 2)]
        weights = rng.normal(0, 0.5, (outputs, inputs // group, *kernel)).astype(np.float32)
        attributes = {"group": group}
        if rng.random() < 0.3:
            attributes["auto_pad"] = str(rng.choice(["VALID", "SAME_UPPER", "SAME_LOWER"]))
        elif rng.random() < 0.6:
            attributes["pads"] = [int(v) for v in rng.integers(0, 3, 4)]
        if rng.random() < 0.5:
            attributes["strides"] = [int(v) for v in rng.integers(1, 4, 2)]
        if rng.random() < 0.2 and "auto_pad" not in attributes:  # ORT: no dilations with SAME
            attributes["dilations"] = [int(v) for v in rng.integers(1, 3, 2)]
        node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="layer", **attributes)
        # some inputs smaller than twice a tap's edge (the edge strips overlap)
        shape, out_shape = [int(rng.integers(1, 3)), inputs, int(rng.integers(5, 15)), int(rng.integers(5, 15))], None
    initializers = [numpy_helper.from_array(weights, "w"),
                    numpy_helper.from_array(rng.normal(0, 0.1, outputs).astype(np.float32), "b")]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    offset = rng.normal(0, 1, (1, inputs) + (1,) * (len(shape) - 2)).astype(np.float32)
    feeds = [{"x": (rng.normal(0, 1, shape) + offset).astype(np.float32)} for _ in range(4)]
    return model, feeds


@pytest.mark.parametrize("seed", range(48))
def test_input_means_measure_the_same_shift_as_a_quantized_copy(seed):
    """The measurement from input means (no copy of the layer) against the copy's, on generated
    layers and quantize_static configurations: equal within float rounding; strided Convs, Convs
    with fewer products per input value than ``MIN_TAPPED_OUTPUTS`` and Gemms with beta are
    measured by the copy."""
    # per-tensor configurations at opset 11 too (ReduceSum's axes an attribute)
    float_model, feeds = _random_layer(seed, opset=11 if seed % 6 == 0 else 17)
    quantized = ort_quantize.quantize_with_ort(float_model, feeds, ["default", "u8s8_pc", "pc"][seed % 3])
    model = ir.serde.deserialize_model(quantized)
    float_weights = {i.name: i for i in float_model.graph.initializer}
    layer = _layer(next(n for n in model.graph if n.op_type in ("Conv", "Gemm")), first_input_readers(float_model), float_weights)
    assert not isinstance(layer, str), layer
    node = float_model.graph.node[0]
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    weights = model_checks.initializer(float_model, "w")
    if node.op_type == "Gemm":
        applies = attributes["beta"] == 1.0
        outputs = weights.shape[0] if attributes["transB"] else weights.shape[1]
    else:
        products = weights.shape[0] // attributes["group"] * weights.shape[2] * weights.shape[3]
        applies = products >= MIN_TAPPED_OUTPUTS and attributes.get("strides", [1, 1]) == [1, 1]
        outputs = weights.shape[0]
    assert (_mean_plan(layer, float_weights) is not None) == applies
    by_means, = _shifts(float_model, [layer], feeds)
    copied, = _shifts(float_model, [layer], feeds, by_means=False)
    assert by_means.shape == copied.shape == (len(feeds), outputs)
    # float32 sums over a few hundred positions, of outputs of magnitude ~1: far below one bias step
    np.testing.assert_allclose(by_means, copied, rtol=0, atol=2e-5 + 1e-4 * np.abs(copied).max())
    assert np.abs(copied).max() > 1e-4  # there was a shift to measure


def _reference_tap_means(plan: _Means, z: np.ndarray) -> np.ndarray:
    """Per channel and tap, the mean over the batch and output positions of the value the tap
    reads, from the padded input itself."""
    (top, bottom), (left, right) = plan.pads_at(z.shape[2], 0), plan.pads_at(z.shape[3], 1)
    padded = np.pad(z.astype(np.float64), [(0, 0), (0, 0), (top, bottom), (left, right)])
    (sh, sw), (dh, dw), (kh, kw) = plan.strides, plan.dilations, plan.kernel
    out_h = (padded.shape[2] - dh * (kh - 1) - 1) // sh + 1
    out_w = (padded.shape[3] - dw * (kw - 1) - 1) // sw + 1
    taps = [padded[:, :, i * dh:i * dh + sh * out_h:sh, j * dw:j * dw + sw * out_w:sw].mean(axis=(0, 2, 3))
            for i in range(kh) for j in range(kw)]
    return np.stack(taps, axis=1)


@pytest.mark.parametrize("seed", range(200))
def test_tap_means_are_the_means_each_kernel_tap_reads(seed):
    """:func:`_tap_means` (phase sums less edge strips) against the padded input read tap by tap,
    over generated Conv geometries: kernels 1-5, strides 1-3 (the arithmetic is general; the probe
    measures Convs of stride 1), dilations 1-3, explicit and automatic padding, inputs down to one
    position (strips that overlap or cover the whole input)."""
    rng = np.random.default_rng(seed)
    kernel = tuple(int(v) for v in rng.integers(1, 6, 2))
    strides = tuple(int(v) for v in rng.integers(1, 4, 2))
    dilations = tuple(int(v) for v in rng.integers(1, 4, 2)) if rng.random() < 0.3 else (1, 1)
    auto_pad = str(rng.choice(["NOTSET", "NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"]))
    pads = tuple(int(v) for v in rng.integers(0, 4, 4)) if auto_pad == "NOTSET" else (0, 0, 0, 0)
    plan = _Means(kernel=kernel, strides=strides, dilations=dilations, pads=pads, auto_pad=auto_pad)
    reach = [dilations[a] * (kernel[a] - 1) + 1 for a in (0, 1)]
    low = [max(1, reach[a] - pads[a] - pads[a + 2]) if auto_pad != "VALID" else reach[a] for a in (0, 1)]
    shape = (int(rng.integers(1, 3)), 3, int(rng.integers(low[0], low[0] + 20)), int(rng.integers(low[1], low[1] + 20)))
    z = rng.normal(0.5, 1, shape).astype(np.float32)
    rows, columns = plan.edge(0), plan.edge(1)
    totals = np.stack([z[:, :, a::strides[0], b::strides[1]].sum(axis=(2, 3)) for a in range(strides[0])
                       for b in range(strides[1])], axis=2)
    measured = _tap_means(plan, _edge_reads(plan, shape[2], 0), _edge_reads(plan, shape[3], 1), totals,
                          z[:, :, :rows], z[:, :, max(0, shape[2] - rows):], z[:, :, :, :columns], z[:, :, :, max(0, shape[3] - columns):])
    np.testing.assert_allclose(measured, _reference_tap_means(plan, z), rtol=0, atol=1e-6)


def _with_float_bias(quantized: onnx.ModelProto) -> onnx.ModelProto:
    """The layer's int32 bias DequantizeLinear replaced by its float value, as NNCF leaves biases."""
    model = ir.serde.deserialize_model(quantized)
    layer = next(n for n in model.graph if n.op_type in ("Conv", "Gemm"))
    bias_dq = layer.inputs[2].producer()
    value = qdq_params.dequantize_array(qdq_params.const_array(bias_dq.inputs[0]), qdq_params.quant_params(bias_dq))
    layer.replace_input_with(2, qdq_params.add_initializer(model.graph, ir.tensor(value), "float_bias"))
    model.graph.remove(bias_dq, safe=True)
    return ir.serde.serialize_model(model)


@pytest.mark.parametrize("seed", [s for s in range(32) if s % 4 != 3][:12] + [3, 7, 11, 15])
def test_input_means_measure_a_float_bias_layer_as_the_copy_does(seed):
    """The same comparison on layers whose bias is float (NNCF's outputs keep them so)."""
    float_model, feeds = _random_layer(seed)
    quantized = _with_float_bias(ort_quantize.quantize_with_ort(float_model, feeds, ["default", "u8s8_pc", "pc"][seed % 3]))
    model = ir.serde.deserialize_model(quantized)
    float_weights = {i.name: i for i in float_model.graph.initializer}
    layer = _layer(next(n for n in model.graph if n.op_type in ("Conv", "Gemm")), first_input_readers(float_model), float_weights)
    assert not isinstance(layer, str) and layer.bias_scale is None, layer
    by_means, = _shifts(float_model, [layer], feeds)
    copied, = _shifts(float_model, [layer], feeds, by_means=False)
    np.testing.assert_allclose(by_means, copied, rtol=0, atol=2e-5 + 1e-4 * np.abs(copied).max())

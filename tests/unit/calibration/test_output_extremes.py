"""output_value_tensors on a detector-like head, collect_ranges' ``extremes``, and quantize() keeping
the scores a calibration never saw."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import onnxruntime as ort

from kenosis_rewrite import calibration as calib
from kenosis_rewrite.calibration.output_extremes import mixed_output_concats, output_value_tensors
from kenosis_rewrite.quantization.pipeline import quantize
from kenosis_rewrite.testing import toy_models
from kenosis_rewrite.testing.toy_models import ToyBuilder

SIZE = [1, 3, 8, 8]


def _head(seed: int = 0) -> tuple[onnx.ModelProto, dict[str, str]]:
    """Backbone Conv -> Relu, then a YOLO-like head: class logits -> Sigmoid and boxes -> Mul by a
    stride, concatenated and reshaped into the graph output. Returns the model and its tensor names."""
    b = ToyBuilder(seed)
    features = b.node("Relu", [b.conv("x", 3, 8)])
    logits = b.conv(features, 8, 2, k=1)
    scores = b.node("Sigmoid", [logits])
    boxes = b.conv(features, 8, 4, k=1)
    scaled = b.node("Mul", [boxes, b.const(np.float32(8.0), "stride")])
    joined = b.node("Concat", [scaled, scores], axis=1)
    output = b.node("Reshape", [joined, b.const(np.array([1, 6, -1], np.int64), "shape")])
    names = dict(features=features, logits=logits, scores=scores, boxes=boxes, scaled=scaled, joined=joined,
                 output=output)
    return b.model({"x": SIZE}, output), names


def test_the_tensors_reaching_the_output_through_moves_and_monotone_steps_up_to_the_head_convs():
    model, t = _head()
    found = output_value_tensors(model)
    assert set(found) == {t["output"], t["joined"], t["scaled"], t["boxes"], t["scores"], t["logits"]}
    assert found[t["scores"]] == (0.0, 1.0)  # a Sigmoid's whole range
    assert all(found[name] is None for name in (t["output"], t["joined"], t["scaled"], t["boxes"], t["logits"]))
    assert t["features"] not in found  # behind the head's Convs


def test_an_affine_step_with_two_variable_inputs_ends_the_walk():
    b = ToyBuilder(1)
    left, right = b.conv("x", 3, 2), b.conv("x", 3, 2)
    total = b.node("Add", [left, right])
    model = b.model({"x": SIZE}, b.node("Sigmoid", [total]))
    assert set(output_value_tensors(model)) == {model.graph.output[0].name, total}


def test_mixed_output_concats_keep_float_the_concat_of_unlike_ranges_and_the_output_path_after_it():
    model, t = _head()
    values = output_value_tensors(model)
    names = {node.output[0]: node.name for node in model.graph.node}
    unlike = {t["scaled"]: (-10.0, 30.0), t["scores"]: (0.0, 1.0)}
    kept = mixed_output_concats(model, values, unlike)
    assert set(kept) == {names[t["joined"]], names[t["output"]]}
    assert "span 1 to 40" in kept[names[t["joined"]]] and names[t["joined"]] in kept[names[t["output"]]]
    alike = {t["scaled"]: (0.0, 3.0), t["scores"]: (0.0, 1.0)}  # within 4x: quantized as usual
    assert mixed_output_concats(model, values, alike) == {}


def test_a_layer_reading_the_mixed_concat_stays_quantizable():
    """A MatMul reading the Concat, whose output joins it on the way to the output: its output is an
    output value (the logits), but it carries nothing of the Concat's grid; kept float, ORT ran it in
    float where plain quantize_static ran it in integers (fuzz seed 20000416)."""
    b = ToyBuilder(2)
    scores = b.node("Sigmoid", [b.gemm("x", 6, 4)])
    boxes = b.node("Relu", [b.gemm("x", 6, 4)])
    joined = b.node("Concat", [scores, boxes], axis=1)
    logits = b.matmul(joined, 8, 3)
    output = b.node("Concat", [joined, logits], axis=1)
    model = b.model({"x": [1, 6]}, output)
    names = {node.output[0]: node.name for node in model.graph.node}
    kept = mixed_output_concats(model, output_value_tensors(model), {scores: (0.0, 1.0), boxes: (0.0, 9.0), logits: (-3.0, 3.0)})
    assert names[joined] in kept and names[output] in kept
    assert names[logits] not in kept


def test_collect_ranges_gives_extremes_their_min_max_and_the_others_the_method():
    model, t = _head()
    feeds = toy_models.random_feeds(model, 6, seed=3)
    histograms, _ = calib.collect_histograms(model, feeds, progress=False)
    ranges = calib.collect_ranges(model, feeds, "percentile", 90.0, progress=False, extremes={t["logits"]})
    logits = histograms[t["logits"]]
    assert ranges[t["logits"]] == (float(logits.minimum), float(logits.maximum))
    boxes = histograms[t["boxes"]]
    assert ranges[t["boxes"]] == calib.range_from_histogram(boxes, "percentile", 90.0)
    assert ranges[t["boxes"]] != (float(boxes.minimum), float(boxes.maximum))  # the method clipped it


def _scores(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)[0][0, 4:]


def test_quantize_keeps_the_rare_confident_score_a_percentile_would_clip(monkeypatch):
    """A YOLO-like head on features that are ordinary everywhere (N(0, 1)); at one of the 8 x 4096
    calibration positions every feature is 2.5, no extreme in any channel, but the class logit
    (their sum, less 12, as a detector's prior bias makes it) is 8 there and below 0 elsewhere: one
    confident score per class among 65,536 values, above the 99.99% range. As output values the
    logits keep their min/max and the scores their whole [0, 1], and the Concat joining them to the
    boxes stays float, so the score survives; with the walk stubbed out it is clamped near the
    background's best."""
    quantize_module = sys.modules["kenosis_rewrite.quantization.calibration_stage"]
    b = ToyBuilder(3)
    logits = b.node("Conv", ["x", b.const(np.ones((2, 8, 1, 1), np.float32), "w"),
                             b.const(np.full(2, -12.0, np.float32), "prior")])
    scores = b.node("Sigmoid", [logits])
    boxes = b.node("Mul", [b.conv("x", 8, 4, k=1), b.const(np.float32(8.0), "stride")])
    joined = b.node("Concat", [boxes, scores], axis=1)
    shape = b.const(np.array([1, 6, -1], np.int64), "shape")
    model = b.model({"x": [1, 8, 64, 64]}, b.node("Reshape", [joined, shape]))
    rng = np.random.default_rng(0)
    calibration = [{"x": rng.standard_normal([1, 8, 64, 64]).astype(np.float32)} for _ in range(8)]
    calibration[0]["x"][0, :, 10, 10] = 2.5
    expected = _scores(model, calibration[0])
    pixel = 10 * 64 + 10
    everywhere = np.concatenate([_scores(model, feed).ravel() for feed in calibration])
    assert expected[0, pixel] > 0.999 and np.sort(everywhere)[-3] < 0.6  # the two confident scores, then the rest

    quantized, report = quantize(model, calibration=calibration, return_report=True)
    kept = _scores(quantized, calibration[0])[0, pixel]
    monkeypatch.setattr(quantize_module, "output_value_tensors", lambda model: {})
    clipped = _scores(quantize(model, calibration=calibration), calibration[0])[0, pixel]
    assert abs(kept - expected[0, pixel]) < 0.01
    assert clipped < 0.9
    # the Concat of boxes (0 to ~140) and scores, and the Reshape after it, stay float: quantized at the
    # Concat's range, a score's step would be ~0.55
    floats = {change.where for change in report.changes if change.rule == "mixed-output-concat-float"}
    assert {node.op_type for node in model.graph.node if node.name in floats} == {"Concat", "Reshape"}
    concat = next(node for node in quantized.graph.node if node.op_type == "Concat")
    quantizers = [node for node in quantized.graph.node if node.op_type == "QuantizeLinear"]
    assert not any(node.input[0] == concat.output[0] for node in quantizers)

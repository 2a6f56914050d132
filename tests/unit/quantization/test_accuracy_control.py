"""quantize(validate=fn, max_drop=d): the user's metric held by returning the fewest ranked layers to FP32."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import kenosis_rewrite
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import KenosisError
from kenosis_rewrite.quantization import accuracy_control
from kenosis_rewrite.quantization.accuracy_control import MetricHold, output_agreement, task_agreement
from kenosis_rewrite.testing import toy_models
from kenosis_rewrite.testing.toy_models import IMAGE, ToyBuilder
from kenosis_rewrite.zoo import task_metrics


@pytest.mark.parametrize("needed", [1, 2, 3, 5, 9, 16, 17])
def test_the_search_finds_the_fewest_layers_in_logarithmically_many_evaluations(needed):
    """Called once no layer in FP32 fails (score(0) < floor): counts 1, 2, 4, ... then bisection."""
    ranked = [f"layer{i}" for i in range(17)]
    hold = MetricHold(validate=None, quantized=None, ranked=ranked)
    hold.score = lambda count: hold.scores.setdefault(count, 1.0 if count >= needed else count / 100)
    assert hold.fewest(0.5) == needed
    assert len(hold.scores) <= 2 * math.ceil(math.log2(len(ranked))) + 1


def test_the_search_says_none_when_even_every_layer_does_not_hold_the_drop():
    hold = MetricHold(validate=None, quantized=None, ranked=["a", "b", "c"])
    hold.score = lambda count: hold.scores.setdefault(count, 0.1)
    assert hold.fewest(0.5) is None


def _feeds(model: onnx.ModelProto, n: int, seed: int) -> list[dict]:
    return toy_models.random_feeds(model, n, seed=seed)


def _fragile_classifier(seed: int) -> onnx.ModelProto:
    """Conv -> Relu -> GAP -> Gemm whose Gemm has one weight of 200 on a feature that is always 0
    (its Conv channel is zero, its bias -1): FP32 ignores it, a per-tensor int8 grid over it rounds
    every other weight of the head to 0."""
    model = toy_models.build("gap_head", seed=seed)
    initializers = {init.name: init for init in model.graph.initializer}
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")

    def edit(name, change):
        array = numpy_helper.to_array(initializers[name]).copy()
        change(array)
        initializers[name].CopyFrom(numpy_helper.from_array(array, name))

    edit(conv.input[1], lambda w: w.__setitem__(0, 0.0))
    edit(conv.input[2], lambda b: b.__setitem__(0, -1.0))
    edit(gemm.input[1], lambda w: w.__setitem__((0, 0), 200.0))
    return model


@pytest.mark.parametrize("seed", [0, 1])
def test_a_classifier_gets_its_top1_agreement_back_with_the_fewest_layers_in_fp32(seed):
    float_model = _fragile_classifier(seed)
    calibration, evaluation = _feeds(float_model, 8, 0), _feeds(float_model, 32, 1)
    metric = output_agreement(float_model, evaluation)
    options = {"per_channel": False, "weight_rounding": False, "bias_correction": False}
    assert metric(kenosis_rewrite.quantize(float_model, calibration, **options)) < 0.5
    quantized, report = kenosis_rewrite.quantize(float_model, calibration, validate=metric, max_drop=0.05,
                                                  return_report=True, **options)
    assert metric(quantized) >= 0.95
    note = next(n for n in report.notes if n.startswith("validate:"))
    assert "FP32 1," in note and "1 of 2 layer(s) returned to FP32" in note and "ms at 1 thread" in note
    [gemm_name] = [c.where for c in report.changes if c.rule == accuracy_control.RULE_NAME]
    # node by node: the Conv stays integer, the Gemm reads the FP32 weights themselves
    gemm = next(n for n in quantized.graph.node if n.name == gemm_name)
    weights = {init.name: numpy_helper.to_array(init) for init in quantized.graph.initializer}
    original = next(n for n in float_model.graph.node if n.op_type == "Gemm").input[1]
    np.testing.assert_array_equal(weights[gemm.input[1]], numpy_helper.to_array(
        next(i for i in float_model.graph.initializer if i.name == original)))
    assert any(n.op_type == "DequantizeLinear" and n.output[0] in {c.input[1] for c in quantized.graph.node
               if c.op_type == "Conv"} for n in quantized.graph.node)
    onnx.checker.check_model(quantized, full_check=True)


def test_within_the_drop_nothing_returns_to_fp32_in_two_evaluations():
    float_model = toy_models.build("resnetish", seed=3)
    metric = output_agreement(float_model, _feeds(float_model, 16, 1))
    _, report = kenosis_rewrite.quantize(float_model, _feeds(float_model, 8, 0), validate=metric, max_drop=0.1,
                                         return_report=True)
    assert any("within the drop, no layer returned to FP32 (2 evaluations)" in n for n in report.notes)
    assert not [c for c in report.changes if c.rule == accuracy_control.RULE_NAME]


def _toy_detector(seed: int) -> onnx.ModelProto:
    """A grid detector: per cell of an 8x8 map, offsets, extents, a score logit and a class logit."""
    b = ToyBuilder(seed)
    h = b.node("Relu", [b.conv("x", IMAGE["x"][1], 8)])
    h = b.node("Relu", [b.conv(h, 8, 8)])
    return b.model(IMAGE, b.conv(h, 8, 6, k=1))


def _decode(run) -> task_metrics.Detections:
    out = np.asarray(run[0])[0]  # [6, H, W]
    rows, cols = np.nonzero(out[4] > 0.0)
    x1, y1 = cols + out[0, rows, cols], rows + out[1, rows, cols]
    boxes = np.stack([x1, y1, x1 + 1 + np.abs(out[2, rows, cols]), y1 + 1 + np.abs(out[3, rows, cols])], axis=1)
    return boxes.reshape(-1, 4), (out[5, rows, cols] > 0).astype(np.int64)


@pytest.mark.parametrize("seed", [5, 6])
def test_a_detector_keeps_box_f1_within_max_drop(seed):
    float_model = _toy_detector(seed)
    calibration, evaluation = _feeds(float_model, 8, 0), _feeds(float_model, 12, 2)
    metric = task_agreement(float_model, evaluation, task_metrics.detection_f1(_decode, "box F1", "toy grid"))
    assert metric(float_model) == 1.0
    assert metric(kenosis_rewrite.quantize(float_model, calibration)) < 0.996  # quantization loses boxes
    quantized, report = kenosis_rewrite.quantize(float_model, calibration, validate=metric, max_drop=0.004,
                                                  return_report=True)
    assert metric(quantized) >= 0.996
    note = next(n for n in report.notes if n.startswith("validate: FP32 1,"))
    assert "returned to FP32" in note
    assert [c.rule for c in report.changes].count(accuracy_control.RULE_NAME) >= 1
    assert [o.shape for o in fidelity.run(quantized, evaluation[:1])[0]] == \
        [o.shape for o in fidelity.run(float_model, evaluation[:1])[0]]
    onnx.checker.check_model(quantized, full_check=True)


def test_bad_options_and_a_failing_metric_are_typed_errors():
    float_model = toy_models.build("conv_relu")
    feeds = _feeds(float_model, 4, 0)
    with pytest.raises(KenosisError, match="go together"):
        kenosis_rewrite.quantize(float_model, feeds, max_drop=0.01)
    with pytest.raises(KenosisError, match="max_drop"):
        kenosis_rewrite.quantize(float_model, feeds, validate=lambda m: 1.0, max_drop=-1)

    def broken(model):
        raise ValueError("no labels here")

    with pytest.raises(KenosisError, match="validate= raised ValueError: no labels here"):
        kenosis_rewrite.quantize(float_model, feeds, validate=broken, max_drop=0.01)
    with pytest.raises(KenosisError, match="finite"):
        accuracy_control.hold_metric(float_model, float_model, None, feeds, lambda m: float("nan"), 0.0, FixReport())


def test_a_metric_is_loaded_from_a_file_or_a_module(tmp_path):
    path = tmp_path / "metric.py"
    path.write_text("def score(model):\n    return 0.5\n")
    assert accuracy_control.load_metric(f"{path}:score")(None) == 0.5
    assert accuracy_control.load_metric("math:cos")(0.0) == 1.0
    for bad in ("nothing", f"{path}:missing", "no_such_module_xyz:f"):
        with pytest.raises(KenosisError, match="--validate"):
            accuracy_control.load_metric(bad)


def test_the_command_line_takes_a_metric_from_a_file(tmp_path, capsys):
    from kenosis_rewrite.cli import main as cli

    float_model = _fragile_classifier(0)
    onnx.save(float_model, tmp_path / "fp32.onnx")
    np.savez(tmp_path / "feeds.npz", x=np.concatenate([f["x"] for f in _feeds(float_model, 16, 1)]))
    (tmp_path / "metric.py").write_text(
        "import numpy as np\n"
        "from kenosis_rewrite.core import fidelity\n"
        f"FEEDS = [{{'x': x[None]}} for x in np.load({str(tmp_path / 'feeds.npz')!r})['x']]\n"
        f"REFERENCE = [r[0].argmax(-1) for r in fidelity.run({str(tmp_path / 'fp32.onnx')!r}, FEEDS)]\n"
        "def top1(model):\n"
        "    return float(np.mean([r[0].argmax(-1) == t for r, t in zip(fidelity.run(model, FEEDS), REFERENCE)]))\n")
    out = tmp_path / "q.onnx"
    code = cli.main(["quantize", str(tmp_path / "fp32.onnx"), str(out), "--calibration", str(tmp_path / "feeds.npz"),
                     "--per-tensor", "--no-bias-correction", "--validate", f"{tmp_path / 'metric.py'}:top1",
                     "--max-drop", "0.05", "--report", "--no-progress"])
    assert code == 0
    text = capsys.readouterr().out
    assert "validate: FP32 1," in text and "returned to FP32" in text
    assert output_agreement(float_model, _feeds(float_model, 16, 1))(onnx.load(out)) >= 0.95

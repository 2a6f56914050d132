"""Never below the baseline: quantize() against plain quantize_static of the same configuration."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnxruntime.quantization import QuantFormat, QuantType

import kenosis_rewrite
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.quantization import baseline
from kenosis_rewrite.quantization.settings import QuantizeSettings
from kenosis_rewrite.testing import toy_models

OPTIONS = {"quant_format": QuantFormat.QDQ, "activation_type": QuantType.QUInt8, "weight_type": QuantType.QInt8,
           "per_channel": True, "extra_options": {"ActivationSymmetric": False, "WeightSymmetric": True}}


def _model_and_feeds(seed: int) -> tuple[onnx.ModelProto, list[dict]]:
    model = toy_models.build("conv_relu", seed=seed)
    return model, toy_models.random_feeds(model, 8, seed=seed)


def test_held_back_feeds_lie_between_two_calibration_feeds_and_are_none_of_them():
    feeds = [{"x": np.full((1, 4), float(i), np.float32), "ids": np.array([[i]], np.int64)} for i in range(5)]
    blends = baseline.held_back_feeds(feeds, 8)
    assert len(blends) == 8
    for blend in blends:
        value = float(blend["x"][0, 0])
        assert 0.0 < value < 4.0 and value not in {0.0, 1.0, 2.0, 3.0, 4.0}
        assert blend["x"].dtype == np.float32 and blend["ids"].dtype == np.int64 and int(blend["ids"][0, 0]) in range(5)


def _worse_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every activation step 8x coarser (the same graph, far less precise)."""
    worse = onnx.ModelProto()
    worse.CopyFrom(model)
    constants = {init.name for init in worse.graph.initializer}
    steps = {node.input[1] for node in worse.graph.node
             if node.op_type == "QuantizeLinear" and node.input[0] not in constants}
    for init in worse.graph.initializer:
        if init.name in steps:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(8.0), init.name))
    return worse


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_result_worse_than_plain_quantize_static_is_replaced_by_fix_of_it_and_the_report_says_so(seed):
    model, feeds = _model_and_feeds(seed)
    ours = _worse_copy(kenosis_rewrite.quantize(model, calibration=feeds, share_concat_ranges=False))
    report = FixReport()
    report.fidelity = {}
    expected = fidelity.run(model, feeds[:4])
    replacement = baseline.never_below(model, ours, feeds, expected, OPTIONS, QuantizeSettings(), report)

    assert replacement is not None
    onnx.checker.check_model(replacement, full_check=True)
    ops = [node.op_type for node in replacement.graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops and "Conv" in ops
    scores = report.baseline
    assert scores["quantize_static_cosine"] > scores["quantized_cosine"] + baseline.margin(scores["quantized_cosine"])
    assert any(note.startswith("baseline: plain quantize_static") and "instead" in note for note in report.notes)
    # numerically: closer to the model as given than the result it replaced, on feeds neither saw
    held_out = toy_models.random_feeds(model, 6, seed=100 + seed)
    reference = fidelity.run(model, held_out)
    better = fidelity.scores(reference, fidelity.run(replacement, held_out))["cosine"]
    worse = fidelity.scores(reference, fidelity.run(ours, held_out))["cosine"]
    assert better > worse
    assert report.fidelity["quantized"]["cosine"] == pytest.approx(
        fidelity.scores(expected, fidelity.run(replacement, feeds[:4]))["cosine"])


def test_a_result_at_least_as_close_as_the_baseline_is_kept_and_the_baseline_scored():
    model, feeds = _model_and_feeds(3)
    quantized, report = kenosis_rewrite.quantize(model, calibration=feeds, return_report=True)
    scores = report.baseline
    assert scores["held_back_feeds"] == 8 and 0.9 < scores["quantize_static_cosine"] <= 1.0
    assert scores["quantized_cosine"] + baseline.margin(scores["quantized_cosine"]) >= scores["quantize_static_cosine"]
    assert not any(note.startswith("baseline: plain") for note in report.notes)
    assert "beside plain quantize_static, on 8 held-back feeds: cosine" in report.summary()
    assert report.to_dict()["baseline"] == scores
    assert report.changes  # quantize()'s own result, fixed


def test_the_users_metric_decides_instead_of_the_baseline():
    model, feeds = _model_and_feeds(4)
    report = FixReport()
    report.fidelity = {}
    settings = QuantizeSettings(validate=lambda m: 1.0, max_drop=0.1)
    assert baseline.never_below(model, model, feeds, fidelity.run(model, feeds[:4]), OPTIONS, settings, report) is None
    assert any("validate= decides" in note for note in report.notes)


def test_where_the_baseline_wins_the_pipeline_retries_with_entropy_ranges_and_keeps_the_closer(monkeypatch):
    model, feeds = _model_and_feeds(5)
    poor = _worse_copy(kenosis_rewrite.quantize(model, calibration=feeds))
    real = baseline.never_below
    calls = []

    def a_poor_replacement(original, candidate, *args, **kwargs):
        calls.append(kwargs.get("settings", args[3] if len(args) > 3 else None))
        real(original, candidate, *args, **kwargs)
        return poor if len(calls) == 1 else None  # the first run "loses"; the retry stands on its own

    monkeypatch.setattr(baseline, "never_below", a_poor_replacement)
    quantized, report = kenosis_rewrite.quantize(model, calibration=feeds, return_report=True)
    assert len(calls) == 2 and calls[1].calibration_method == baseline.RETRY_METHOD
    assert any(note.startswith(f"calibration method: {baseline.RETRY_METHOD}, chosen by measuring") for note in report.notes)
    assert quantized.SerializeToString() != poor.SerializeToString()
    assert "QuantizeLinear" in {node.op_type for node in quantized.graph.node}
    held_out = toy_models.random_feeds(model, 6, seed=105)
    reference = fidelity.run(model, held_out)
    assert (fidelity.scores(reference, fidelity.run(quantized, held_out))["cosine"]
            > fidelity.scores(reference, fidelity.run(poor, held_out))["cosine"])
    # a method the caller chose is not second-guessed: the replacement stands
    calls.clear()
    chosen, chosen_report = kenosis_rewrite.quantize(model, calibration=feeds, calibration_method="percentile",
                                                     return_report=True)
    assert len(calls) == 1 and chosen.SerializeToString() == poor.SerializeToString()
    assert not any(note.startswith("calibration method: entropy") for note in chosen_report.notes)


def test_a_baseline_onnx_runtime_cannot_load_is_not_compared():
    """quantize_static writes per-channel DequantizeLinear (an ``axis``) into an opset-11 model as
    given, which ONNX Runtime refuses (ddddocr's detector, where quantize() itself moved to opset 13)."""
    model, feeds = _model_and_feeds(6)
    ours = kenosis_rewrite.quantize(model, calibration=feeds)
    model.opset_import[0].version = 11
    onnx.checker.check_model(model, full_check=True)
    report = FixReport()
    report.fidelity = {}
    expected = fidelity.run(model, feeds[:4])
    assert baseline.never_below(model, ours, feeds, expected, OPTIONS, QuantizeSettings(), report) is None
    assert any(note.startswith("baseline: quantize_static's model") and "does not run" in note for note in report.notes)
    assert report.baseline is None

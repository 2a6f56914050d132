"""Tests of the integer-kernel HardSwish decomposition."""

from __future__ import annotations

import kenosis_rewrite
from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.placement.rules.hardswish import RULE_NAME, hardswish_rules
from kenosis_rewrite.testing import model_checks, toy_models


def _apply(proto):
    return model_checks.apply_reporting_rules(proto, hardswish_rules)


def test_quantized_hardswish_runs_on_qlinear_kernels_within_about_one_step():
    float_model = toy_models.build("conv_hardswish")
    feeds = toy_models.random_feeds(float_model, 8)
    fixed = kenosis_rewrite.fix(ort_quantize.quantize_with_ort(float_model, feeds[:4], "default"))
    assert "HardSigmoid" in model_checks.ort_optimized_op_types(fixed)  # the float island
    out, report, count = _apply(fixed)
    assert count == 1 and [c.rule for c in report.changes] == [RULE_NAME]
    optimized = model_checks.ort_optimized_op_types(out)
    assert "HardSigmoid" not in optimized and optimized["QLinearMul"] == 1 and optimized["QLinearAdd"] == 1
    scores = fidelity.compare_to_float(float_model, {"island": fixed, "integer": out}, feeds[4:])
    assert scores["integer"]["cosine"] > 0.999
    assert scores["integer"]["sqnr_db"] >= scores["island"]["sqnr_db"] - 0.5  # under half an output step more


def test_int8_activations_are_refused_with_reason():
    float_model = toy_models.build("conv_hardswish")
    qdq = ort_quantize.quantize_with_ort(float_model, toy_models.random_feeds(float_model, 4), "default")
    _, report, count = _apply(qdq)  # quantize_static's int8, not yet retyped
    assert count == 0 and report.refusals[0].reason == "only per-tensor uint8 activations are decomposed"

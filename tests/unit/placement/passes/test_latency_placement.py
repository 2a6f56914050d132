"""Tests of the latency-aware placement search (decision logic on a deterministic cost model)."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

import kenosis_rewrite
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.diagnosis.explain import explain as explain_model
from kenosis_rewrite.placement.passes import latency_placement
from kenosis_rewrite.placement.passes.latency_placement import ALL_FLOAT, LatencyPlacementPass
from kenosis_rewrite.testing import model_checks, toy_models


def _fixed(name="conv_hardswish"):
    float_model = toy_models.build(name)
    feeds = toy_models.random_feeds(float_model, 4)
    return feeds, kenosis_rewrite.fix(ort_quantize.quantize_with_ort(float_model, feeds, "u8s8"))


def _cost_model(monkeypatch, cost_of_float_layer: dict[str, float], base_ms=10.0, all_float_ms=None,
                integer_hardswish_ms=0.0):
    """Replace measurement by a cost model: each float layer adds its (possibly negative) cost, and
    a model whose HardSwish runs on integer kernels costs ``integer_hardswish_ms`` more."""

    def milliseconds(model_bytes: bytes) -> float:
        model = onnx.load_from_string(model_bytes)
        types = model_checks.op_types(model)
        if all_float_ms is not None and types["QuantizeLinear"] == 0:
            return all_float_ms
        report = explain_model(model)
        hardswish = integer_hardswish_ms if types["HardSwish"] == 0 and types["QuantizeLinear"] else 0.0
        return base_ms + hardswish + sum(cost_of_float_layer.get(op.name, 0.0) for op in report.ops if op.kernel == "float")

    monkeypatch.setattr(latency_placement._Search, "compare",
                        lambda self, a, b: (milliseconds(a), milliseconds(b)))
    monkeypatch.setattr(latency_placement._Search, "estimates",
                        lambda self, variant: {name: -cost for name, cost in cost_of_float_layer.items()})


def _place(fixed, feeds, tmp_path, **kwargs):
    model = ir.serde.deserialize_model(fixed)
    report = FixReport()
    placement = LatencyPlacementPass(feeds[0], report, cache_dir=tmp_path, **kwargs)
    placement(model)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    return out, placement.result, report


def test_layers_measured_faster_in_float_go_float_others_stay_integer(monkeypatch, tmp_path):
    feeds, fixed = _fixed()
    convs = [n.name for n in fixed.graph.node if n.op_type == "Conv"]
    _cost_model(monkeypatch, {convs[0]: -2.0, convs[1]: +3.0})
    out, result, report = _place(fixed, feeds, tmp_path)
    assert result.float_layers == [convs[0]]
    kernels = {op.name: op.kernel for op in explain_model(out).ops}
    assert kernels == {convs[0]: "float", convs[1]: "integer"}
    assert result.best_ms == pytest.approx(8.0) and result.base_ms == pytest.approx(10.0)
    assert any(c.rule == "return-to-float" for c in report.changes)
    assert "latency placement: 1 layer(s) to float" in report.summary()


def test_never_slower_than_the_input(monkeypatch, tmp_path):
    feeds, fixed = _fixed()
    convs = [n.name for n in fixed.graph.node if n.op_type == "Conv"]
    _cost_model(monkeypatch, {convs[0]: +1.0, convs[1]: +1.0}, all_float_ms=12.0)
    out, result, _ = _place(fixed, feeds, tmp_path)
    assert result.float_layers == []
    assert out.SerializeToString() == ir.serde.serialize_model(ir.serde.deserialize_model(fixed)).SerializeToString()


def test_all_float_wins_when_it_is_fastest(monkeypatch, tmp_path):
    feeds, fixed = _fixed()
    convs = [n.name for n in fixed.graph.node if n.op_type == "Conv"]
    _cost_model(monkeypatch, {convs[0]: -1.0, convs[1]: +0.5}, all_float_ms=5.0)
    out, result, report = _place(fixed, feeds, tmp_path)
    assert result.float_layers == [ALL_FLOAT]
    assert model_checks.op_types(out)["QuantizeLinear"] == 0
    assert any("float is fastest here" in change.detail for change in report.changes)
    assert "whole model to float" in report.summary()


def test_decisions_are_cached_per_model_and_machine(monkeypatch, tmp_path):
    feeds, fixed = _fixed()
    convs = [n.name for n in fixed.graph.node if n.op_type == "Conv"]
    _cost_model(monkeypatch, {convs[0]: -2.0, convs[1]: +3.0})
    first, result, _ = _place(fixed, feeds, tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setattr(latency_placement._Search, "run", lambda self: pytest.fail("cache not used"))
    second, cached, report = _place(fixed, feeds, tmp_path)
    assert cached.cached and cached.float_layers == result.float_layers
    assert second.SerializeToString() == first.SerializeToString()
    assert "cached decision" in report.summary()


def test_fix_optimize_for_latency_end_to_end_keeps_contracts(tmp_path, monkeypatch):
    monkeypatch.setenv("KENOSIS_CACHE", str(tmp_path))
    float_model = toy_models.build("conv_hardswish")
    feeds = toy_models.random_feeds(float_model, 4)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds, "default")
    fixed, report = kenosis_rewrite.fix(qdq, optimize_for="latency", latency_budget_s=3, calibration=feeds,
                                        float_model=float_model, return_report=True)
    onnx.checker.check_model(fixed, full_check=True)
    assert [o.name for o in fixed.graph.output] == [o.name for o in qdq.graph.output]
    # float layers only remove roundings; integer HardSwish, if measured faster, adds under half a step
    assert report.fidelity["fixed"]["sqnr_db"] >= report.fidelity["input"]["sqnr_db"] - 0.5
    assert "latency placement:" in report.summary()
    with pytest.raises(kenosis_rewrite.KenosisError, match="optimize_for"):
        kenosis_rewrite.fix(qdq, optimize_for="size")


def test_integer_hardswish_is_chosen_first_and_weighed_against_float_layers(monkeypatch, tmp_path):
    feeds, fixed = _fixed()
    convs = [n.name for n in fixed.graph.node if n.op_type == "Conv"]
    # integer HardSwish saves 3 ms; the first layer in float would save 2 ms but turns the
    # HardSwish between the two layers back into a float island (the pair before it goes)
    _cost_model(monkeypatch, {convs[0]: -2.0, convs[1]: +1.0}, integer_hardswish_ms=-3.0)
    out, result, report = _place(fixed, feeds, tmp_path)
    assert result.integer_hardswish and result.float_layers == []
    assert result.best_ms == pytest.approx(7.0) and result.base_ms == pytest.approx(10.0)
    types = model_checks.ort_optimized_op_types(out)
    assert types["HardSwish"] + types["HardSigmoid"] == 0 and types["QLinearAdd"] == 1 and types["QLinearMul"] == 1
    assert any(c.rule == "hardswish-to-integer-ops" and not c.exact for c in report.changes)


def test_integer_hardswish_is_not_taken_when_not_faster(monkeypatch, tmp_path):
    feeds, fixed = _fixed()
    convs = [n.name for n in fixed.graph.node if n.op_type == "Conv"]
    _cost_model(monkeypatch, {convs[0]: -2.0, convs[1]: +1.0}, integer_hardswish_ms=+0.5)
    out, result, _ = _place(fixed, feeds, tmp_path)
    assert not result.integer_hardswish and result.float_layers == [convs[0]]
    assert model_checks.op_types(out)["HardSwish"] == 1


def test_an_unreadable_cached_decision_is_measured_again_and_said(monkeypatch, tmp_path):
    feeds, fixed = _fixed()
    convs = [n.name for n in fixed.graph.node if n.op_type == "Conv"]
    _cost_model(monkeypatch, {convs[0]: -2.0, convs[1]: +3.0})
    _, result, _ = _place(fixed, feeds, tmp_path)
    (path,) = tmp_path.glob("*.json")
    path.write_text('{"float_layers": [', encoding="utf-8")  # truncated by a crash
    _, again, report = _place(fixed, feeds, tmp_path)
    assert not again.cached and again.float_layers == result.float_layers
    assert "is unreadable (JSONDecodeError" in report.summary()
    _, cached, _ = _place(fixed, feeds, tmp_path)  # the file was written again
    assert cached.cached

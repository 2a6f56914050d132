"""The run-time guard: what fix() applies when the guard cannot run the input, or runs it at one level only."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx

import kenosis_rewrite
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.placement import guard
from kenosis_rewrite.testing.model_checks import outputs

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "fixtures"


def _nncf_model() -> onnx.ModelProto:
    """NNCF 3.4's output of a PP-LCNet-like block: fix() makes exact and approximate changes on it."""
    return onnx.load(FIXTURES / "lcnetish_nncf3.4.onnx")


def _approximate_rules(report) -> set[str]:
    return {change.rule for change in report.changes if not change.exact}


def test_when_the_guard_cannot_run_the_input_only_exact_rewrites_are_applied():
    qdq = _nncf_model()
    _, guarded = kenosis_rewrite.fix(qdq, return_report=True)
    approximate = _approximate_rules(guarded)
    assert approximate  # the guarded run keeps approximate rewrites it measured
    wrong_size = [{"x": np.zeros((1, 3, 17, 17), np.float32)}]  # the model takes 16 x 16: nothing runs
    fixed, report = kenosis_rewrite.fix(qdq, calibration=wrong_size, return_report=True)

    assert report.changes and all(change.exact for change in report.changes)
    held = {r.rule for r in report.refusals if r.reason.startswith("held back: not exact")}
    assert held and held <= approximate | {"quantize-weighted-outputs"}
    assert any("only exact rewrites were applied" in note and "calibration=" in note for note in report.notes)
    # exact: bit for bit the input's outputs on feeds it runs on, graph semantics (no ORT fusions)
    feeds = fidelity.random_feeds(qdq, 2)
    for feed in feeds:
        for a, b in zip(outputs(qdq, feed, optimized=False), outputs(fixed, feed, optimized=False)):
            np.testing.assert_array_equal(a, b)


def test_a_guard_that_runs_the_input_at_one_level_checks_at_that_level(monkeypatch):
    qdq = _nncf_model()
    qdq.graph.doc_string = "runs optimized only"  # kept by fix(): the rewrite needs the optimizer too
    real = guard._outputs

    def no_plain_runs_of_the_input(model, feeds, optimized):
        if not optimized and model.graph.doc_string == "runs optimized only":
            raise RuntimeError("this kernel needs the optimizer")
        return real(model, feeds, optimized)

    monkeypatch.setattr(guard, "_outputs", no_plain_runs_of_the_input)
    check = guard.Guard(qdq, [])
    assert check.unavailable == "" and check.input_plain is None and check.input_optimized is not None
    assert "ORT_DISABLE_ALL" in check.levels_note and "this kernel needs the optimizer" in check.levels_note
    fixed, report = kenosis_rewrite.fix(qdq, return_report=True)
    assert any("one optimization level only" in note for note in report.notes)
    assert _approximate_rules(report)  # still measured, so still applied
    # and it still refuses what breaks the model at the level it checks
    broken = onnx.ModelProto()
    broken.CopyFrom(fixed)
    broken.graph.output[0].name = broken.graph.node[-1].input[0]
    assert check.violation(broken, report) is not None


def test_the_guard_undoes_a_rule_only_at_the_sites_that_cost_fidelity(monkeypatch):
    """A rule the guard rejects is searched site by site: the sites whose change breaks the check stay
    undone, the rule keeps its other sites (the guard here rejects two chosen sites of 15)."""
    qdq = _nncf_model()
    rule = "fold-affine-into-conv"
    _, unguarded = kenosis_rewrite.fix(qdq, return_report=True, verify=False)
    wheres = [c.where for c in unguarded.changes if c.rule == rule]
    assert len(wheres) >= 8
    bad = {wheres[2], wheres[-1]}
    real = guard.Guard.violation

    def rejects_two_sites(self, model, report):
        if any(c.rule == rule and c.where in bad for c in report.changes):
            return "the output's cosine fell at a chosen site"
        return real(self, model, report)

    monkeypatch.setattr(guard.Guard, "violation", rejects_two_sites)
    fixed, report = kenosis_rewrite.fix(qdq, return_report=True)

    kept = {c.where for c in report.changes if c.rule == rule}
    assert kept == set(wheres) - bad
    undone = {r.where for r in report.refusals if r.rule == rule and "undone by the run-time guard at this site" in r.reason}
    assert undone == bad
    assert any(f"undone: {rule} at 2 of its {len(wheres)} sites" in note for note in report.notes)
    onnx.checker.check_model(fixed, full_check=True)
    feeds = fidelity.random_feeds(qdq, 2)
    reference, ours = fidelity.run(qdq, feeds), fidelity.run(fixed, feeds)
    assert [o.shape for o in ours[0]] == [o.shape for o in reference[0]]
    assert fidelity.scores(reference, ours)["cosine"] > 0.99

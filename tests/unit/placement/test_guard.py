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

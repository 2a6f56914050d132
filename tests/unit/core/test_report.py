"""FixReport's summary: its first line never contradicts the details under it."""

from __future__ import annotations

from kenosis_rewrite.core.report import GUARD_UNDO_REASON, FixReport


def test_no_changes_and_no_candidates_says_the_model_already_matches():
    assert "already matches every rule" in FixReport().summary().splitlines()[1]


def test_no_changes_with_candidates_left_alone_says_so():
    report = FixReport()
    report.refused("fold-x", "node_1", "zero point is not 0")
    line = report.summary().splitlines()[1]
    assert line == "  no changes: 1 candidate(s) left alone (why below)"
    assert "already matches" not in report.summary()


def test_a_rewrite_the_guard_undid_is_not_reported_as_nothing_to_do():
    report = FixReport()
    report.refused("fold-batchnorm-into-conv", "whole model", f"{GUARD_UNDO_REASON}: cosine 0.9269 < floor 0.9287")
    report.refused("fold-x", "node_1", "zero point is not 0")
    summary = report.summary()
    assert summary.splitlines()[1] == "  no changes kept: the run-time guard undid fold-batchnorm-into-conv (why below)"
    assert "already matches" not in summary and "cosine 0.9269 < floor 0.9287" in summary


def test_changes_are_counted_and_no_no_changes_line_appears():
    report = FixReport()
    report.changed("fold-x", "node_1", "folded", exact=True)
    assert "no changes" not in report.summary() and "fold-x: 1 change(s)" in report.summary()

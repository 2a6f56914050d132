"""Progress bars: on a terminal outside CI by default, none without tqdm or when not asked."""

from __future__ import annotations

import sys

import pytest

from kenosis_rewrite.core import progress


@pytest.mark.parametrize("ci, tty, expected", [("", True, True), ("true", True, False), ("", False, False),
                                               ("0", True, True)])
def test_the_command_line_default_is_a_terminal_outside_ci(monkeypatch, ci, tty, expected):
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
    assert progress.progress_default() is expected


def test_no_bar_unless_asked_and_a_bar_that_counts_when_asked(capsys):
    assert progress.progress_bar(False, total=3) is None
    assert progress.progress_bar(None, total=3) is None
    pytest.importorskip("tqdm")
    bar = progress.progress_bar(True, total=3, description="steps", unit="step", leave=True)
    bar.update(3)
    bar.close()
    assert "steps: 100%" in capsys.readouterr().err

"""One model's job, done so that a batch can stop at any point and resume: outputs appear whole or not at all.

A job runs its op with output paths inside a private folder under ``OUT/.kenosis-partial/``, then
moves what the op wrote into place, companions (external data) first and the named outputs last.
A model whose named outputs all exist is therefore done, and a rerun skips it; a job that died
half-way left only its private folder, which the next run does not read. An op is any picklable
callable ``op(model_path, *output_paths) -> str | None`` (the string: a short note for the
summary); ``op.outputs(name)``, where defined, names its outputs (default: one, ``name`` itself).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence

from kenosis_rewrite.errors import KenosisError

__all__ = ["PARTIAL_DIR", "Outcome", "Job", "plan_jobs", "run_job", "summary_table", "exit_code"]

PARTIAL_DIR = ".kenosis-partial"
STATUSES = ("ok", "skipped", "failed")


@dataclasses.dataclass
class Outcome:
    """What happened to one model: ``status`` is ``"ok"``, ``"failed"`` or ``"skipped"`` (done before)."""

    name: str
    status: str
    seconds: float = 0.0
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Job:
    """One model to run: its input path, name, final output paths and the folder to stage them in."""

    model: str
    name: str
    outputs: tuple[str, ...]
    staging: str

    def done(self) -> bool:
        """Every named output is in place (written by an earlier run)."""
        return all(os.path.exists(path) for path in self.outputs)


def output_names(op: Callable, name: str) -> list[str]:
    """The outputs (relative to the output folder) ``op`` writes for the model named ``name``."""
    outputs = getattr(op, "outputs", None)
    return list(outputs(name)) if callable(outputs) else [name]


def plan_jobs(op: Callable, models: Sequence[tuple[str, str]], out_dir: str, staging: str) -> list[Job]:
    """A :class:`Job` per ``(path, name)`` of ``models``."""
    return [Job(path, name, tuple(os.path.join(out_dir, output) for output in output_names(op, name)), staging)
            for path, name in models]


def describe(error: BaseException) -> str:
    """One line for the summary: a KenosisError's own message (written for users), else type and message."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    return first if isinstance(error, KenosisError) else f"{type(error).__name__}: {first}"


def run_job(op: Callable, job: Job) -> Outcome:
    """Run ``op`` on ``job.model`` in a private folder, then move its outputs into place.

    Every exception of the op is a failed :class:`Outcome` (one model's failure never stops the
    batch); only the death of the process running it escapes, which the engine reports.
    """
    os.makedirs(job.staging, exist_ok=True)
    work = tempfile.mkdtemp(prefix="job-", dir=job.staging)
    staged = [os.path.join(work, os.path.basename(path)) for path in job.outputs]
    start = time.perf_counter()
    try:
        try:
            note = op(job.model, *staged)
        except Exception as error:  # noqa: BLE001 - one model's crash must not stop the batch
            return Outcome(job.name, "failed", time.perf_counter() - start, describe(error))
        seconds = time.perf_counter() - start
        missing = [os.path.basename(path) for path in staged if not os.path.exists(path)]
        if missing:
            return Outcome(job.name, "failed", seconds, f"the op wrote no {', '.join(missing)}")
        _move_into_place(work, staged, job.outputs)
        note = str(note or "")
        for path, final in zip(staged, job.outputs):  # the note names where the output is now
            note = note.replace(path, final)
        return Outcome(job.name, "ok", seconds, note[:160])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _move_into_place(work: str, staged: list[str], final: tuple[str, ...]) -> None:
    """Companions first, the named outputs (what marks the job done) last, each by an atomic rename."""
    named = {os.path.basename(path) for path in staged}
    target_dir = os.path.dirname(final[0])
    for path in final:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    for entry in sorted(os.listdir(work), key=lambda f: f in named):
        os.replace(os.path.join(work, entry), os.path.join(target_dir, entry))


def summary_table(outcomes: Sequence[Outcome]) -> str:
    """Markdown table of the outcomes, then one line of totals."""
    lines = ["| model | status | seconds | detail |", "|---|---|---|---|"]
    for outcome in outcomes:
        detail = outcome.detail.replace("|", "\\|")
        lines.append(f"| {outcome.name} | {outcome.status} | {outcome.seconds:.1f} | {detail} |")
    counts = {status: sum(o.status == status for o in outcomes) for status in STATUSES}
    lines.append("")
    lines.append(", ".join(f"{count} {status}" for status, count in counts.items()))
    return "\n".join(lines) + "\n"


def exit_code(outcomes: Sequence[Outcome]) -> int:
    """0 when every model succeeded or was skipped, 1 when any failed."""
    return 1 if any(outcome.status == "failed" for outcome in outcomes) else 0

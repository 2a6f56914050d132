"""``run(models, op, out, engine=...)``: an op over many models, each failure its own, resumable.

The models (a folder, a list file, or paths) are planned as jobs (:mod:`kenosis_rewrite.batch.jobs`);
those whose outputs exist are skipped unless ``force``; the rest go to the engine, ``"local"``
(processes of this machine, :mod:`~kenosis_rewrite.batch.local_engine`) or ``"ray"`` (one Ray task
per model, :mod:`~kenosis_rewrite.batch.ray_engine`). Both run the same job function, so their
outputs are the same bytes. Progress is silent unless asked: ``progress=True`` a tqdm bar,
``"lines"`` one line per model on stderr; ``on_outcome`` is called with each outcome as it comes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from kenosis_rewrite.batch.jobs import PARTIAL_DIR, Job, Outcome, plan_jobs
from kenosis_rewrite.batch.listing import resolve_models
from kenosis_rewrite.batch.local_engine import run_local
from kenosis_rewrite.batch.ray_engine import run_ray

__all__ = ["ENGINES", "run"]

ENGINES = ("local", "ray")


def run(
    models: str | os.PathLike | Iterable,
    op: Callable,
    out: str | os.PathLike,
    *,
    engine: str = "local",
    jobs: int | None = None,
    force: bool = False,
    progress: bool | str = False,
    on_outcome: Callable[[Outcome], None] | None = None,
    ray_address: str | None = None,
    max_retries: int = 3,
    ray_remote_args: Mapping[str, Any] | None = None,
) -> list[Outcome]:
    """Run ``op`` on every model into ``out``; one :class:`Outcome` per model, sorted by name.

    Args:
        models: a folder (every ``*.onnx`` under it), a ``.txt`` list of paths, or an iterable of
            paths or ``(path, name)`` pairs. Outputs mirror the names under ``out``.
        op: ``op(model_path, *output_paths)``, picklable (:mod:`kenosis_rewrite.batch.ops`:
            ``ops.fix(target=...)``, ``ops.quantize()``, ``ops.quantize_weights(bits=4)``, or your function).
        engine: ``"local"`` (processes here) or ``"ray"``.
        jobs: local: worker processes (default 1); ray: tasks in flight at once and the CPUs of a
            local instance started for the run (default: as many as Ray schedules).
        force: redo models whose outputs exist (by default they are skipped: a rerun resumes).
        progress: False (silent), True (a tqdm bar; lines without tqdm) or ``"lines"``.
        ray_address: the cluster to use when Ray is not initialised already (default ``RAY_ADDRESS``,
            else a local instance). ``max_retries``: Ray retries of a job whose worker died.
        ray_remote_args: Ray task options (``num_cpus``, ``memory``, ``runtime_env``, ...).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    if jobs is not None and jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    out = os.fspath(out)
    planned = plan_jobs(op, resolve_models(models, exclude=out), out,
                        os.path.join(out, PARTIAL_DIR, f"{socket.gethostname()}-{os.getpid()}"))
    outcomes = {job.name: Outcome(job.name, "skipped", detail="output exists (force to redo)")
                for job in planned if not force and job.done()}
    todo = [job for job in planned if job.name not in outcomes]
    with _reporter(progress, on_outcome, len(planned), len(outcomes), engine) as report:
        try:
            for outcome in _results(engine, op, todo, jobs, ray_address, max_retries, ray_remote_args):
                outcomes[outcome.name] = outcome
                report(outcome)
        finally:
            if planned:
                shutil.rmtree(planned[0].staging, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(out, PARTIAL_DIR))  # only when no other run is staging there
    return [outcomes[job.name] for job in planned if job.name in outcomes]


def _results(engine: str, op: Callable, todo: list[Job], jobs: int | None, ray_address: str | None,
             max_retries: int, ray_remote_args: Mapping[str, Any] | None) -> Iterator[Outcome]:
    if engine == "ray":
        return run_ray(op, todo, address=ray_address, concurrency=jobs, max_retries=max_retries,
                       remote_args=ray_remote_args)
    return run_local(op, todo, jobs or 1)


@contextlib.contextmanager
def _reporter(progress: bool | str, on_outcome: Callable[[Outcome], None] | None, total: int, skipped: int,
              engine: str) -> Iterator[Callable[[Outcome], None]]:
    """A function to call with each outcome: the bar or lines ``progress`` asks for, then ``on_outcome``."""
    from kenosis_rewrite.core.progress import progress_bar  # noqa: PLC0415 - onnxruntime, only when run

    bar = progress_bar(progress is True or progress == "bar", total=total, description=f"models ({engine})",
                       unit="model", leave=True)
    lines = bool(progress) and bar is None
    counts = {"ok": 0, "failed": 0}
    if bar is not None:
        bar.update(skipped)
        bar.set_postfix_str(f"{skipped} skipped", refresh=True)
    elif lines and skipped:
        print(f"[{skipped}/{total}] skipped {skipped} model(s) already done", file=sys.stderr, flush=True)

    def report(outcome: Outcome) -> None:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
        line = f"{outcome.status} {outcome.name} ({outcome.seconds:.1f} s) {outcome.detail}"
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{counts['ok']} ok, {counts['failed']} failed, {skipped} skipped", refresh=True)
            if outcome.status == "failed":
                bar.write(line[:200], file=sys.stderr)
        elif lines:
            print(f"[{skipped + counts['ok'] + counts['failed']}/{total}] {line}"[:200], file=sys.stderr, flush=True)
        if on_outcome is not None:
            on_outcome(outcome)

    try:
        yield report
    finally:
        if bar is not None:
            bar.close()

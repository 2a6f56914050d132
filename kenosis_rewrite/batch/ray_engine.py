"""The Ray engine: one Ray task per model, on the caller's Ray cluster or on one started for the run.

Ray is an optional extra (``pip install "kenosis-rewrite[ray]"``), imported only here and only
when this engine runs. Where Ray is already initialised (``ray.init`` in the caller's own code)
the tasks go to that cluster and the connection is left open; otherwise the run connects to
``address`` (or ``RAY_ADDRESS``) or, with neither, starts a local instance of ``cpus`` CPUs (all
of this machine's by default) and shuts down what it started.

Each task runs :func:`kenosis_rewrite.batch.jobs.run_job`: the op's exceptions are failed
outcomes, never retried (they would fail again); a worker process that dies (killed, out of
memory, a node lost) is a system failure that Ray retries up to ``max_retries`` times, after which
the model fails with Ray's reason. Inputs and the output folder are paths: on a cluster of several
machines they must be visible at the same path on every node (a shared or network filesystem), as
the outputs are moved into place by the worker that made them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kenosis_rewrite.batch.jobs import Job, Outcome, run_job
from kenosis_rewrite.errors import KenosisError

__all__ = ["run_ray", "connected", "import_ray"]


def import_ray():
    """The ``ray`` module, or a KenosisError saying how to install it."""
    try:
        import ray  # noqa: PLC0415
    except ImportError:
        raise KenosisError('the Ray engine needs Ray: pip install "kenosis-rewrite[ray]" (or pick the local '
                           "engine)") from None
    return ray


@contextlib.contextmanager
def connected(address: str | None = None, cpus: int | None = None) -> Iterator[Any]:
    """Ray, initialised for the duration: the caller's connection when there is one (left open), else
    ``address`` / ``RAY_ADDRESS``, else a local instance of ``cpus`` CPUs (shut down afterwards)."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    where = {"address": address} if address else {"num_cpus": cpus, "include_dashboard": False}
    # the workers' own stderr stays on the workers: each job reports through its outcome
    ray.init(**where, logging_level=logging.ERROR, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def run_ray(op: Callable, jobs: Sequence[Job], *, address: str | None = None, concurrency: int | None = None,
            max_retries: int = 3, remote_args: Mapping[str, Any] | None = None) -> Iterator[Outcome]:
    """The outcome of each job, in the order they finish.

    ``concurrency``: at most this many tasks submitted at once (default: all, Ray schedules them by
    their resources), and the CPUs of a local instance started for the run. ``remote_args``: Ray's
    task options (``num_cpus``, default 1; ``memory``, ``resources``, ``runtime_env``, ...).
    """
    if not jobs:
        return
    with connected(address, concurrency) as ray:
        options = {"num_cpus": 1, **(remote_args or {}), "max_retries": max_retries, "retry_exceptions": False}
        task = ray.remote(run_job).options(**options)
        op_ref = ray.put(op)
        queue = iter(jobs)
        pending: dict[Any, Job] = {}

        def submit() -> None:
            job = next(queue, None)
            if job is not None:
                pending[task.remote(op_ref, job)] = job

        for _ in range(concurrency or len(jobs)):
            submit()
        try:
            while pending:
                (ready,), _ = ray.wait(list(pending), num_returns=1)
                job = pending.pop(ready)
                submit()
                yield _outcome(ray, ready, job, max_retries)
        finally:
            for ref in pending:  # interrupted: the tasks not yet finished are not wanted
                ray.cancel(ref, force=True)


def _outcome(ray, ref, job: Job, max_retries: int) -> Outcome:
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as error:
        lines = str(error).strip().splitlines()
        # a RayTaskError: the job raised what run_job does not catch (SystemExit); otherwise the worker
        # died more times than retried, or the task was lost
        what = "job raised" if isinstance(error, ray.exceptions.RayTaskError) else f"worker lost ({max_retries} retries)"
        return Outcome(job.name, "failed", detail=f"{what}: {type(error).__name__}: {lines[0] if lines else ''}"[:200])

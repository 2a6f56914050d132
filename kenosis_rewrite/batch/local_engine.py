"""The local engine: the jobs spread over ``workers`` processes of this machine.

Each worker is a fresh interpreter (``spawn``: no onnxruntime threads inherited from the parent).
A worker that dies (killed, out of memory) fails the jobs it held; the pool cannot go on after
it, so the jobs not yet started fail too, each saying so, and a rerun does them.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable, Iterator, Sequence

from kenosis_rewrite.batch.jobs import Job, Outcome, describe, run_job

__all__ = ["run_local"]


def run_local(op: Callable, jobs: Sequence[Job], workers: int = 1) -> Iterator[Outcome]:
    """The outcome of each job, in the order they finish."""
    if not jobs:
        return
    context = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=context)
    try:
        futures = {pool.submit(run_job, op, job): job for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            try:
                yield future.result()
            except Exception as error:  # noqa: BLE001 - a worker that died (killed, out of memory)
                yield Outcome(futures[future].name, "failed", detail=f"worker died: {describe(error)}")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # an interrupted batch starts nothing more

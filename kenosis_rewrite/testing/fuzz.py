"""Property fuzzing of ``fix()`` and ``quantize()`` on random small FP32 graphs.

Every case is a pure function of one integer seed: ``np.random.default_rng(seed)`` draws a small
FP32 ONNX model (:func:`random_float_model`), then an ``onnxruntime.quantization.quantize_static``
configuration (:func:`random_quant_config`); seeds from :data:`SOFTMAX_HEAD_SEEDS` (1,000,000) end
every model in a Softmax head (a DFL head on maps), seeds from :data:`QUARK_CONSTANT_SEEDS`
(10,000,000) write their PRelu slopes and Clip bounds as dequantized int8 constants, as Quark does,
and seeds from :data:`DYNAMIC_BATCH_SEEDS`
(20,000,000) are written as exported with a dynamic batch (:func:`~kenosis_rewrite.testing.fuzz_models.as_dynamic_export`:
shape arithmetic in the graph; their outputs must also run at batch 2 where the input does), and
seeds from :data:`TRANSFORMER_SEEDS` (30,000,000) are small transformer encoders, exported so.
:func:`check_fix_case` quantizes the model with that configuration and checks the properties ``fix()`` promises, for every target:

* no exception other than a :class:`~kenosis_rewrite.KenosisError` subclass;
* the caller's model is not mutated;
* the output loads and runs in ONNX Runtime CPU at ``ORT_ENABLE_ALL`` and ``ORT_DISABLE_ALL`` with
  the input's output names and shapes, and keeps its interface (inputs, outputs, opsets);
* idempotence (``fix(fix(m)) == fix(m)``) and determinism (two calls, identical bytes);
* exactness: when every change in the report says ``exact=True``, the outputs equal the input's
  bit for bit (``ORT_DISABLE_ALL``);
* fidelity: the cosine against FP32 drops by at most :data:`FIDELITY_TOLERANCE`; where the
  symmetric int8 conversion that TensorRT/NPU require ran, by at most its stated bound
  (:func:`kenosis_rewrite.placement.guard.cosine_floor`).

:func:`check_quantize_case` compares ``kenosis_rewrite.quantize()`` with plain ``quantize_static``
(uint8 activations, int8 per-channel weights). Command line::

    python -m kenosis_rewrite.testing.fuzz --seed-start 0 --cases 300 --quantize-cases 50 --jobs 2 --out r.json
    python -m kenosis_rewrite.testing.fuzz --seed-start 1000000 --cases 100     # Softmax heads
    python -m kenosis_rewrite.testing.fuzz --replay 1234 [--target tensorrt] [--dump DIR]
    python -m kenosis_rewrite.testing.fuzz --replay-quantize 1234

The pieces: :mod:`kenosis_rewrite.testing.fuzz_models` (the graphs), :mod:`kenosis_rewrite.testing.fuzz_configs`
(the quantizer configurations), :mod:`kenosis_rewrite.testing.fuzz_running` (running and comparing) and
:mod:`kenosis_rewrite.testing.fuzz_properties` (the checks of one case); this module runs many cases,
summarizes them and is the command line. Their public names stay importable from here.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings

import numpy as np
import onnx
import onnxruntime as ort

from kenosis_rewrite.testing.fuzz_configs import plain_quant_config, quantize_or_skip, quantize_with_config, random_quant_config
from kenosis_rewrite.testing.fuzz_models import N_CALIBRATION, N_FEEDS, random_float_model
from kenosis_rewrite.testing.fuzz_properties import (
    CATEGORIES,
    CATEGORY_TITLES,
    DYNAMIC_BATCH_SEEDS,
    FIDELITY_TOLERANCE,
    QUARK_CONSTANT_SEEDS,
    SOFTMAX_HEAD_SEEDS,
    TRANSFORMER_SEEDS,
    WITHIN_JITTER,
    CaseResult,
    Failure,
    TargetResult,
    _model_and_config,
    check_fix_case,
    check_quantize_case,
)
from kenosis_rewrite.testing.fuzz_running import first_line, short_traceback

__all__ = [
    "CATEGORIES", "CATEGORY_TITLES", "FIDELITY_TOLERANCE", "SOFTMAX_HEAD_SEEDS", "QUARK_CONSTANT_SEEDS", "DYNAMIC_BATCH_SEEDS",
    "TRANSFORMER_SEEDS",
    "N_CALIBRATION", "N_FEEDS", "CaseResult", "Failure", "TargetResult",
    "random_float_model", "random_quant_config", "plain_quant_config", "quantize_with_config",
    "check_fix_case", "check_quantize_case", "run_cases", "summarize", "format_summary", "main",
]


class _CaseTimeout(Exception):
    """Raised by SIGALRM when one case runs longer than its time limit."""


def _on_alarm(signum, frame):
    raise _CaseTimeout()


@contextlib.contextmanager
def _time_limit(seconds: int):
    """SIGALRM-based limit (POSIX main thread only; no limit elsewhere or when ``seconds`` is 0)."""
    usable = seconds > 0 and hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, _on_alarm) if usable else None
    if usable:
        signal.alarm(seconds)
    try:
        yield
    finally:
        if usable:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def _run_one(job: tuple[str, int, int, bool]) -> CaseResult:
    """Worker entry point: one case, every exception recorded (category ``harness`` or ``timeout``)."""
    kind, seed, limit, verify = job
    start = time.perf_counter()
    try:
        with _time_limit(limit):
            return check_fix_case(seed, verify=verify) if kind == "fix" else check_quantize_case(seed)
    except _CaseTimeout:
        case = CaseResult(seed=seed, kind=kind, config=_config_or_none(seed, kind))
        case.fail("timeout", "quantize()" if kind == "quantize" else None, f"the case ran longer than {limit} s")
    except Exception as error:  # noqa: BLE001 - a generator or harness bug must not stop the run
        case = CaseResult(seed=seed, kind=kind, config=_config_or_none(seed, kind))
        case.fail("harness", "quantize()" if kind == "quantize" else None,
                  f"{type(error).__name__}: {first_line(error)}\n{short_traceback(error)}")
    case.seconds = time.perf_counter() - start
    return case


def _config_or_none(seed: int, kind: str) -> dict | None:
    """The configuration of case ``seed`` for a harness-error report, if it can still be drawn."""
    if kind != "fix":
        return plain_quant_config()
    try:
        return _model_and_config(seed)[2]
    except Exception:  # noqa: BLE001
        return None


def _worker_init() -> None:
    ort.set_default_logger_severity(4)
    warnings.simplefilter("ignore")


def run_cases(
    seed_start: int = 0, cases: int = 100, quantize_cases: int = 0, jobs: int = 1, progress_every: int = 50,
    stream=None, case_timeout: int = 300, verify: bool = True,
) -> list[CaseResult]:
    """Run ``cases`` fix cases and ``quantize_cases`` quantize cases from ``seed_start``; results by seed.

    Each case runs in a worker process (``jobs`` > 1) under a ``case_timeout`` second limit.
    """
    stream = stream if stream is not None else sys.stdout
    work = [("fix", seed_start + i, case_timeout, verify) for i in range(cases)]
    work += [("quantize", seed_start + i, case_timeout, verify) for i in range(quantize_cases)]
    results = []
    start = time.perf_counter()

    def progress(done: int) -> None:
        if progress_every and (done % progress_every == 0 or done == len(work)):
            failed = sum(r.failed for r in results)
            skipped = sum(r.skipped for r in results)
            print(f"  {done}/{len(work)} cases, {failed} with failures, {skipped} skipped, {time.perf_counter() - start:.1f} s",
                  file=stream, flush=True)

    if jobs <= 1:
        _worker_init()
        for job in work:
            results.append(_run_one(job))
            progress(len(results))
    else:
        context = multiprocessing.get_context("spawn" if sys.platform == "darwin" else "fork")
        with context.Pool(jobs, initializer=_worker_init, maxtasksperchild=100) as pool:
            for result in pool.imap_unordered(_run_one, work, chunksize=1):
                results.append(result)
                progress(len(results))
    return sorted(results, key=lambda r: (r.kind, r.seed))


def _worst(failures: list[Failure], n: int) -> list[Failure]:
    """Biggest violations first (value), then one example per distinct rule set / message start."""
    ranked = sorted(failures, key=lambda f: (-(f.value if f.value is not None and f.value == f.value else float("inf")), f.seed))
    picked, seen = [], set()
    for failure in ranked:
        key = (failure.target, tuple(failure.rules), failure.message[:40])
        if key not in seen:
            seen.add(key)
            picked.append(failure)
        if len(picked) == n:
            break
    return picked


def summarize(results: list[CaseResult], examples: int = 4) -> dict:
    """Counts per failure category, skip rate, call counts, time per case and the worst examples."""
    fix_cases = [r for r in results if r.kind == "fix"]
    quantize_cases = [r for r in results if r.kind == "quantize"]
    by_category = {c: [f for r in results for f in r.failures if f.category == c] for c in CATEGORIES}
    typed = collections.Counter(
        t.typed_error.split(":")[0] for r in results for t in r.targets if t.typed_error
    )
    run_fix = [r for r in fix_cases if not r.skipped]

    def mean(values) -> float | None:
        values = list(values)
        return float(np.mean(values)) if values else None

    return {
        "cases": len(results),
        "fix_cases": len(fix_cases),
        "quantize_cases": len(quantize_cases),
        "skipped": sum(r.skipped for r in results),
        "skip_rate_fix": (sum(r.skipped for r in fix_cases) / len(fix_cases)) if fix_cases else 0.0,
        "skip_reasons": dict(collections.Counter(_skip_key(r.skip_reason) for r in results if r.skipped).most_common(8)),
        "fix_calls": sum(r.fix_calls for r in results),
        "quantize_calls": sum(r.quantize_calls for r in results),
        "seconds_per_fix_case": mean(r.seconds for r in run_fix),
        "seconds_per_quantize_case": mean(r.seconds for r in quantize_cases if not r.skipped),
        "cases_with_failures": sum(r.failed for r in results),
        # not failures: fix() caught a rule breaking its bound and undid it (what and why, per call)
        "guard_undos": [f"seed {r.seed} {note}" for r in results for t in r.targets for note in t.notes
                        if "run-time guard" in note],
        # not failures: a drop the input (fix) or plain quantize_static (quantize) makes as well with its
        # activation steps jittered by 1% (the graph amplifies rounding noise: its fidelity is a draw)
        "within_jitter": [f"seed {r.seed} {t.target} {note}" for r in results for t in r.targets for note in t.notes
                          if note.startswith(WITHIN_JITTER)],
        "typed_errors": dict(typed),
        "failures": {c: len(fs) for c, fs in by_category.items()},
        "failing_seeds": {c: len({(f.seed, f.target == "quantize()") for f in fs}) for c, fs in by_category.items()},
        "worst": {c: [dataclasses.asdict(f) | {"replay": f.replay} for f in _worst(fs, examples)] for c, fs in by_category.items() if fs},
    }


def _skip_key(reason: str | None) -> str:
    return (reason or "")[:110]


def format_summary(summary: dict) -> str:
    """The summary table and the worst examples of each category, as text."""
    lines = [
        "",
        f"cases: {summary['cases']} ({summary['fix_cases']} fix, {summary['quantize_cases']} quantize); "
        f"fix() calls {summary['fix_calls']}, quantize calls {summary['quantize_calls']}, "
        f"skipped {summary['skipped']} ({summary['skip_rate_fix']:.1%} of fix cases)",
    ]
    if summary["seconds_per_fix_case"] is not None:
        lines.append(f"time per fix case (4 targets, not skipped): {summary['seconds_per_fix_case']:.3f} s")
    if summary["seconds_per_quantize_case"] is not None:
        lines.append(f"time per quantize case: {summary['seconds_per_quantize_case']:.3f} s")
    for reason, count in summary["skip_reasons"].items():
        lines.append(f"  skipped {count}x: {reason}")
    if summary["typed_errors"]:
        lines.append("typed KenosisErrors (allowed): " + ", ".join(f"{k} x{v}" for k, v in summary["typed_errors"].items()))
    guard_undos = summary.get("guard_undos", [])
    lines.append(f"run-time guard undid a rule in {len(guard_undos)} fix() call(s) (not a failure: caught, undone, reported)")
    lines.extend(f"  {note[:240]}" for note in guard_undos[:8])
    within = summary.get("within_jitter", [])
    lines.append(f"drops within the input's own 1% step jitter: {len(within)} (not a failure: the graph amplifies rounding noise)")
    lines.extend(f"  {note[:300]}" for note in within[:8])
    lines += ["", f"{'failure category':48s} {'failures':>8s} {'cases':>6s}", "-" * 64]
    for key, title in CATEGORY_TITLES:
        lines.append(f"{title:48s} {summary['failures'][key]:8d} {summary['failing_seeds'][key]:6d}")
    for key, title in CATEGORY_TITLES:
        examples = summary["worst"].get(key)
        if not examples:
            continue
        lines += ["", f"== {title}: worst examples"]
        for f in examples:
            value = "" if f["value"] is None else f" [{f['value']:.4g}]"
            rules = f" rules={','.join(f['rules'])}" if f["rules"] else ""
            message = f["message"].splitlines()[0][:300]
            lines.append(f"  seed={f['seed']} target={f['target']}{value}{rules}: {message}")
            lines.append(f"      config={json.dumps(f['config'])}")
            lines.append(f"      replay: {f['replay']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _dump_case(seed: int, directory: str) -> None:
    """Write fp32.onnx, qdq.onnx (when not skipped), config.json and feeds.npz of case ``seed``."""
    os.makedirs(directory, exist_ok=True)
    fp32, feeds, config = _model_and_config(seed)
    onnx.save(fp32, os.path.join(directory, "fp32.onnx"))
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
    np.savez(os.path.join(directory, "feeds.npz"), **{f"{i}_{k}": v for i, f in enumerate(feeds) for k, v in f.items()})
    qdq, reason = quantize_or_skip(fp32, config, feeds[:N_CALIBRATION])
    if qdq is not None:
        onnx.save(qdq, os.path.join(directory, "qdq.onnx"))
    print(f"case {seed} written to {directory}" + (f" (quantize skipped: {reason})" if reason else ""))


def _replay(args) -> int:
    if args.dump:
        _dump_case(args.replay, args.dump)
    targets = (args.target,) if args.target else None
    case = check_quantize_case(args.replay_quantize) if args.replay_quantize is not None else check_fix_case(args.replay, targets)
    print(json.dumps(case.to_dict(), indent=2, default=str))
    for failure in case.failures:
        print("\nFAILURE", failure.category, "-", failure.describe())
    return 1 if case.failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kenosis_rewrite.testing.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--seed-start", type=int, default=0)
    parser.add_argument("--cases", type=int, default=100, help="fix() cases (each runs every target)")
    parser.add_argument("--quantize-cases", type=int, default=0, help="quantize() vs plain quantize_static cases")
    parser.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    parser.add_argument("--out", help="write every case result and the summary as JSON here")
    parser.add_argument("--examples", type=int, default=4, help="worst examples printed per category")
    parser.add_argument("--case-timeout", type=int, default=300, help="seconds one case may run (0: no limit)")
    parser.add_argument("--replay", type=int, help="run one fix case and print everything about it")
    parser.add_argument("--replay-quantize", type=int, help="run one quantize case and print everything about it")
    parser.add_argument("--target", help="with --replay: only this target")
    parser.add_argument("--no-guard", action="store_true", help="fix(verify=False): hold the rules themselves to their promises")
    parser.add_argument("--dump", help="with --replay: write the case's models, config and feeds to this folder")
    args = parser.parse_args(argv)
    if args.replay is not None or args.replay_quantize is not None:
        return _replay(args)
    start = time.perf_counter()
    guard = "off" if args.no_guard else "on"
    print(f"fuzzing seeds {args.seed_start}..{args.seed_start + args.cases - 1} ({args.cases} fix cases, "
          f"{args.quantize_cases} quantize cases, {args.jobs} jobs, fix() guard {guard})")
    results = run_cases(args.seed_start, args.cases, args.quantize_cases, args.jobs, case_timeout=args.case_timeout,
                        verify=not args.no_guard)
    summary = summarize(results, args.examples)
    summary["wall_seconds"] = time.perf_counter() - start
    print(format_summary(summary))
    print(f"\nwall time {summary['wall_seconds']:.1f} s")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"summary": summary, "results": [r.to_dict() for r in results]}, handle, indent=1, default=str)
        print(f"results written to {args.out}")
    return 1 if summary["cases_with_failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

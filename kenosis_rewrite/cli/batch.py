"""Many models at once: ``kenosis-rewrite fix|quantize|quantize-weights|bench`` over a folder or a list.

    kenosis-rewrite fix MODELS/ OUT/ [--jobs N] [--force] [--shard I/N] [fix options]
    kenosis-rewrite quantize-weights models.txt OUT/ --jobs 2 --bits 4
    kenosis-rewrite bench MODELS/ --out OUT/ [bench options]

The input is a folder (every ``*.onnx`` under it, recursively) or a text file listing one model
path per line (``#`` comments; relative paths are relative to the list). Each model is handled
by the single-model command in one of ``--jobs`` worker processes, so a model that fails (a
``KenosisError``, a crash in a library) is reported and the batch goes on. Outputs mirror the
input tree under ``OUT`` (bench writes ``NAME.md`` and ``NAME.json``). A model whose output is
already there is skipped (``--force`` redoes it): outputs are moved into place only when complete,
so an interrupted batch resumes where it stopped. ``--shard I/N`` takes every N-th model from the
I-th (1-based) of the sorted list: a fleet is the same command with ``--shard 1/N`` .. ``N/N`` on N
machines sharing the input and output folders (or syncing them afterwards).

Progress goes to stderr, one line per model; the summary table (markdown) to stdout. Exit code
0 when every model succeeded or was skipped, 1 when any failed, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import io
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

__all__ = ["BATCH_COMMANDS", "is_batch_input", "list_models", "batch_main"]

BATCH_COMMANDS = ("fix", "quantize", "quantize-weights", "bench")
_PARTIAL_DIR = ".kenosis-partial"


def is_batch_input(path: str) -> bool:
    """A folder or a ``.txt`` list of models (anything else is one model)."""
    return os.path.isdir(path) or (path.endswith(".txt") and os.path.isfile(path))


def list_models(source: str, exclude: str | None = None) -> list[tuple[str, str]]:
    """``(path, relative name)`` of every model of a folder or list file, sorted by name.

    ``exclude``: a folder left out of the walk (the output folder, when it sits inside the input).
    """
    if os.path.isdir(source):
        found = []
        skip = os.path.realpath(exclude) if exclude else None
        for root, dirs, files in os.walk(source):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and os.path.realpath(os.path.join(root, d)) != skip)
            found += [os.path.join(root, f) for f in files if f.endswith(".onnx")]
        return sorted((path, os.path.relpath(path, source)) for path in found)
    base = os.path.dirname(os.path.abspath(source))
    models = []
    with open(source, encoding="utf-8") as handle:
        for line in handle:
            line = line.split("#", 1)[0].strip()
            if line:
                path = line if os.path.isabs(line) else os.path.join(base, line)
                models.append((path, os.path.basename(path)))
    return sorted(models, key=lambda item: item[1])


@dataclasses.dataclass
class Outcome:
    """What happened to one model."""

    name: str
    status: str  # "ok", "failed" or "skipped"
    seconds: float = 0.0
    detail: str = ""


def _outputs(command: str, out_dir: str, name: str) -> list[str]:
    if command == "bench":
        stem = os.path.splitext(name)[0]
        return [os.path.join(out_dir, stem + ".md"), os.path.join(out_dir, stem + ".json")]
    return [os.path.join(out_dir, name)]


def _single_argv(command: str, model: str, outputs: list[str], options: list[str]) -> list[str]:
    if command == "bench":
        return ["bench", model, "--markdown", outputs[0], "--json", outputs[1], *options]
    return [command, model, outputs[0], *options]


def _run_one(single: Callable[[list[str]], int], command: str, model: str, name: str, out_dir: str, partial: str,
             options: list[str]) -> Outcome:
    """Worker: the single-model command on ``model`` (``single``: the command line's entry point, passed in
    so this module need not import it), written to a private folder, then moved into place."""
    final = _outputs(command, out_dir, name)
    work = tempfile.mkdtemp(prefix="job-", dir=partial)
    staged = [os.path.join(work, os.path.basename(path)) for path in final]
    messages = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(messages):
            code = single(_single_argv(command, model, staged, options))
    except Exception as error:  # noqa: BLE001 - one model's crash must not stop the batch
        code, messages = 1, io.StringIO(f"{type(error).__name__}: {error}")
    seconds = time.perf_counter() - start
    try:
        if code != 0:
            lines = [line for line in messages.getvalue().splitlines() if line.strip()]
            return Outcome(name, "failed", seconds, lines[-1] if lines else f"exit code {code}")
        for path in final:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        # companions (external data) first, the model (what marks the job done) last
        for entry in sorted(os.listdir(work), key=lambda f: f in {os.path.basename(p) for p in staged}):
            target = os.path.join(os.path.dirname(final[0]), entry)
            os.replace(os.path.join(work, entry), target)
        return Outcome(name, "ok", seconds, _last_line(messages.getvalue()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:120] if lines else ""


def _shard(models: list, shard: str | None) -> list:
    if not shard:
        return models
    try:
        index, count = (int(part) for part in shard.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be I/N (e.g. 1/4), got {shard!r}") from None
    if not 1 <= index <= count:
        raise ValueError(f"--shard I/N needs 1 <= I <= N, got {shard!r}")
    return models[index - 1::count]


def summary_table(outcomes: Sequence[Outcome]) -> str:
    """Markdown table of the outcomes, then one line of totals."""
    lines = ["| model | status | seconds | detail |", "|---|---|---|---|"]
    for outcome in outcomes:
        detail = outcome.detail.replace("|", "\\|")
        lines.append(f"| {outcome.name} | {outcome.status} | {outcome.seconds:.1f} | {detail} |")
    counts = {status: sum(o.status == status for o in outcomes) for status in ("ok", "skipped", "failed")}
    lines.append("")
    lines.append(", ".join(f"{count} {status}" for status, count in counts.items()))
    return "\n".join(lines) + "\n"


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"kenosis-rewrite {command}", add_help=False)
    parser.add_argument("input")
    if command == "bench":
        parser.add_argument("--out", required=True, help="folder for NAME.md and NAME.json of each model")
    else:
        parser.add_argument("output")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--shard", default=None)
    return parser


def batch_main(command: str, argv: list[str], single: Callable[[list[str]], int]) -> int:
    """Run ``command`` over the models named by ``argv``'s input (a folder or list file)."""
    args, options = _parser(command).parse_known_args(argv)
    out_dir = args.out if command == "bench" else args.output
    if args.jobs < 1:
        print(f"kenosis-rewrite {command}: error: --jobs must be >= 1", file=sys.stderr)
        return 2
    try:
        models = _shard(list_models(args.input, exclude=out_dir), args.shard)
    except (ValueError, OSError) as error:
        print(f"kenosis-rewrite {command}: error: {error}", file=sys.stderr)
        return 2
    # this run's staging folder: other machines of a fleet may be writing to the same OUT
    partial = os.path.join(out_dir, _PARTIAL_DIR, f"{socket.gethostname()}-{os.getpid()}")
    os.makedirs(partial, exist_ok=True)
    outcomes: dict[str, Outcome] = {}
    todo = []
    for path, name in models:
        if not args.force and all(os.path.exists(p) for p in _outputs(command, out_dir, name)):
            outcomes[name] = Outcome(name, "skipped", detail="output exists (--force to redo)")
        else:
            todo.append((path, name))
    total, done = len(models), len(outcomes)
    if done:
        print(f"[{done}/{total}] skipped {done} model(s) already done", file=sys.stderr)
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no inherited ORT threads
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
        futures = {pool.submit(_run_one, single, command, path, name, out_dir, partial, options): name for path, name in todo}
        for future in concurrent.futures.as_completed(futures):
            name = futures[future]
            try:
                outcome = future.result()
            except Exception as error:  # noqa: BLE001 - a worker that died (killed, out of memory)
                outcome = Outcome(name, "failed", detail=f"worker died: {type(error).__name__}: {error}")
            outcomes[name] = outcome
            done += 1
            print(f"[{done}/{total}] {outcome.status} {name} ({outcome.seconds:.1f} s) {outcome.detail}"[:200],
                  file=sys.stderr, flush=True)
    shutil.rmtree(partial, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.join(out_dir, _PARTIAL_DIR))  # only when no other run is staging there
    ordered = [outcomes[name] for _, name in models]
    sys.stdout.write(summary_table(ordered))
    return 1 if any(o.status == "failed" for o in ordered) else 0

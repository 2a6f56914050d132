"""Many models at once: ``kenosis-rewrite fix|quantize|quantize-weights|bench`` over a folder or a list.

    kenosis-rewrite fix MODELS/ OUT/ [--engine local|ray] [--jobs N] [--force] [fix options]
    kenosis-rewrite quantize MODELS/ OUT/ --engine ray [--ray-address ADDR] [--max-retries 3]
    kenosis-rewrite quantize-weights models.txt OUT/ --jobs 2 --bits 4
    kenosis-rewrite bench MODELS/ --out OUT/ [bench options]

The input is a folder (every ``*.onnx`` under it, recursively) or a text file listing one model
path per line (``#`` comments; relative paths are relative to the list). Each model runs the
single-model command (same options) as one job of :func:`kenosis_rewrite.batch.run`: on
``--engine local`` (the default) in one of ``--jobs`` worker processes of this machine (default 1);
on ``--engine ray`` as one Ray task per model, on the cluster at ``--ray-address`` or
``RAY_ADDRESS``, or on a local Ray instance started for the run (``--jobs``: its CPUs and the tasks
in flight), a task whose worker dies retried up to ``--max-retries`` times. A model that fails is
reported and the batch goes on. Outputs mirror the input tree under ``OUT`` (bench writes
``NAME.md`` and ``NAME.json``); a model whose output is there is skipped (``--force`` redoes it),
so an interrupted batch resumes where it stopped.

``--shard I/N`` (deprecated: ``--engine ray`` schedules the whole list on a cluster, with retries)
still takes every N-th model from the I-th (1-based) of the sorted list, and says it is deprecated.

Progress: a bar on a terminal (tqdm, the ``progress`` extra), one line per model on stderr otherwise
(piped, or ``CI`` set); ``--progress``/``--no-progress`` choose. The summary table (markdown) goes
to stdout. Exit code 0 when every model succeeded or was skipped, 1 when any failed, 2 for a bad
command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kenosis_rewrite.batch import ENGINES, exit_code, is_batch_input, list_models, run, summary_table
from kenosis_rewrite.batch.jobs import PARTIAL_DIR
from kenosis_rewrite.batch.ops import CommandOp
from kenosis_rewrite.core.progress import progress_default
from kenosis_rewrite.errors import KenosisError

__all__ = ["BATCH_COMMANDS", "is_batch_input", "list_models", "batch_main"]

BATCH_COMMANDS = ("fix", "quantize", "quantize-weights", "bench")
_PARTIAL_DIR = PARTIAL_DIR  # the name tests and older callers read here


def _shard(models: list, shard: str | None) -> list:
    """Every N-th model from the I-th, for ``--shard I/N`` (deprecated)."""
    if not shard:
        return models
    try:
        index, count = (int(part) for part in shard.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be I/N (e.g. 1/4), got {shard!r}") from None
    if not 1 <= index <= count:
        raise ValueError(f"--shard I/N needs 1 <= I <= N, got {shard!r}")
    return models[index - 1::count]


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"kenosis-rewrite {command}", add_help=False)
    parser.add_argument("input")
    if command == "bench":
        parser.add_argument("--out", required=True, help="folder for NAME.md and NAME.json of each model")
    else:
        parser.add_argument("output")
    parser.add_argument("--engine", choices=ENGINES, default="local")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--ray-address", default=None)
    parser.add_argument("--max-retries", type=int, default=3)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--shard", default=None)
    return parser


def batch_main(command: str, argv: list[str], single: Callable[[list[str]], int]) -> int:
    """Run ``command`` over the models named by ``argv``'s input (a folder or list file); ``single``:
    the command line's entry point, which runs each model's command."""
    args, options = _parser(command).parse_known_args(argv)
    out_dir = args.out if command == "bench" else args.output
    prefix = f"kenosis-rewrite {command}"
    if (args.jobs is not None and args.jobs < 1) or args.max_retries < 0:
        print(f"{prefix}: error: --jobs must be >= 1 and --max-retries >= 0", file=sys.stderr)
        return 2
    try:
        models = list_models(args.input, exclude=out_dir)
        if args.shard:
            print(f"{prefix}: warning: --shard is deprecated and will be removed: --engine ray runs the whole list "
                  "on a Ray cluster (RAY_ADDRESS or --ray-address), with retries", file=sys.stderr)
            models = _shard(models, args.shard)
    except (ValueError, OSError) as error:
        print(f"{prefix}: error: {error}", file=sys.stderr)
        return 2
    progress = args.progress if args.progress is not None else progress_default()
    try:
        outcomes = run(models, CommandOp(single, command, tuple(options)), out_dir, engine=args.engine,
                       jobs=args.jobs, force=args.force, progress=True if progress else "lines",
                       ray_address=args.ray_address, max_retries=args.max_retries)
    except (KenosisError, ValueError) as error:
        print(f"{prefix}: error: {error}", file=sys.stderr)
        return 1 if isinstance(error, KenosisError) else 2
    sys.stdout.write(summary_table(outcomes))
    return exit_code(outcomes)

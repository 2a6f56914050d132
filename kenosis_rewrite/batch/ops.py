"""What a batch does to each model: a library function (:func:`fix`, :func:`quantize`,
:func:`quantize_weights`), a command of the command line (:class:`CommandOp`), or any callable.

An op is called as ``op(model_path, *output_paths)`` in a worker (a process of this machine or a
Ray worker), so it must be picklable: a module-level function, or an instance of a module-level
class, such as those here. Its return value, a string or None, is the note the summary shows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from collections.abc import Callable
from typing import Any

from kenosis_rewrite.errors import KenosisError

__all__ = ["FunctionOp", "CommandOp", "fix", "quantize", "quantize_weights"]


@dataclasses.dataclass(frozen=True)
class FunctionOp:
    """``function(model_path, **options)``'s model (or the model of its ``(model, report)``) saved to the output."""

    function: Callable[..., Any]
    options: tuple[tuple[str, Any], ...] = ()

    def __call__(self, model: str, output: str) -> str:
        from kenosis_rewrite.core.model_io import save  # noqa: PLC0415

        result = self.function(model, **dict(self.options))
        save(result[0] if isinstance(result, tuple) else result, output)
        return f"wrote {os.path.basename(output)}"


def fix(**options: Any) -> FunctionOp:
    """An op that writes :func:`kenosis_rewrite.fix` of each model (``options``: fix()'s keywords)."""
    from kenosis_rewrite.placement.pipeline import fix as fix_model  # noqa: PLC0415

    return FunctionOp(fix_model, tuple(sorted(options.items())))


def quantize(**options: Any) -> FunctionOp:
    """An op that writes :func:`kenosis_rewrite.quantize` of each FP32 model."""
    from kenosis_rewrite.quantization.pipeline import quantize as quantize_model  # noqa: PLC0415

    return FunctionOp(quantize_model, tuple(sorted(options.items())))


def quantize_weights(**options: Any) -> FunctionOp:
    """An op that writes :func:`kenosis_rewrite.quantize_weights` of each float model."""
    from kenosis_rewrite.weight_only.weights import quantize_weights as quantize_model_weights  # noqa: PLC0415

    return FunctionOp(quantize_model_weights, tuple(sorted(options.items())))


@dataclasses.dataclass(frozen=True)
class CommandOp:
    """A single-model command of ``kenosis-rewrite`` (``fix``, ``quantize``, ``quantize-weights``,
    ``bench``) with its options, run by ``single`` (the command line's entry point, passed in
    because the command line sits above this package). Its stdout is dropped, its last stderr line
    is the note; a non-zero exit fails the model with that line. ``bench`` writes ``NAME.md`` and
    ``NAME.json``."""

    single: Callable[[list[str]], int]
    command: str
    options: tuple[str, ...] = ()

    def outputs(self, name: str) -> list[str]:
        if self.command == "bench":
            stem = os.path.splitext(name)[0]
            return [stem + ".md", stem + ".json"]
        return [name]

    def argv(self, model: str, outputs: list[str]) -> list[str]:
        if self.command == "bench":
            return ["bench", model, "--markdown", outputs[0], "--json", outputs[1], *self.options]
        return [self.command, model, outputs[0], *self.options]

    def __call__(self, model: str, *outputs: str) -> str:
        messages = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(messages):
            code = self.single(self.argv(model, list(outputs)))
        lines = [line for line in messages.getvalue().splitlines() if line.strip()]
        if code != 0:
            raise KenosisError(lines[-1] if lines else f"exit code {code}")
        return lines[-1] if lines else ""

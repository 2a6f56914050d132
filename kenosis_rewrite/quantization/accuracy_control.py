"""Accuracy the user defines: ``quantize(..., validate=fn, max_drop=d)``.

``fn(model) -> float`` is the user's metric (higher is better) of an ``onnx.ModelProto``: top-1 on
their validation set, box F1 against labels, a word error rate negated, anything. The quantized model
must score at least ``fn(FP32 model) - max_drop``. Where it does not, layers go back to FP32 in the
order the SNR sensitivity analysis ranks them (:mod:`kenosis_rewrite.accuracy.sensitivity`: the weakest
weight SNR or local SQNR first), and the fewest that hold the drop are kept in FP32: counts 1, 2, 4, ...
until one holds, then a bisection between the last two (about ``2 log2(k)`` evaluations for ``k``
layers, not ``k``). The metric is assumed to grow with the count, as output fidelity does; where even
every layer in FP32 does not hold the drop (the error is in the activations no layer holds), the
count with the best measured score is kept and the report says so.

The report gives the FP32 score, the quantized score before and after, the evaluations spent and
the speed the fallback cost (one interleaved single-thread timing of the model before and after it).

:func:`output_agreement` and :func:`task_agreement` make ready-made metrics from FP32's own outputs
on the user's feeds (1.0: the same answer as FP32): top-1 agreement, or a task metric of
:mod:`kenosis_rewrite.zoo.task_metrics` (box F1, text-map IoU, CTC lines).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.accuracy import sensitivity
from kenosis_rewrite.core import fidelity, interleaved_timing
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import KenosisError, one_line

__all__ = ["Metric", "MetricHold", "check_metric_options", "hold_metric", "load_metric", "output_agreement",
           "task_agreement"]

Metric = Callable[[onnx.ModelProto], float]
RULE_NAME = "keep-fp32-for-metric"


def check_metric_options(validate: Metric | None, max_drop: float | None) -> None:
    """Raise KenosisError for a ``validate``/``max_drop`` pair quantize() cannot use (before any work)."""
    if validate is None and max_drop is None:
        return
    if validate is None or max_drop is None:
        raise KenosisError("validate= and max_drop= go together: the metric, and how much of it quantization may cost")
    if not callable(validate):
        raise KenosisError(f"validate= must be a callable model -> float, got {type(validate).__name__}")
    if not (isinstance(max_drop, (int, float)) and math.isfinite(max_drop) and max_drop >= 0):
        raise KenosisError(f"max_drop= must be a finite number >= 0, got {max_drop!r}")


def _score(validate: Metric, model: onnx.ModelProto) -> float:
    try:
        value = float(validate(model))
    except Exception as error:  # noqa: BLE001 - the user's code: say where it failed, typed
        raise KenosisError(f"validate= raised {one_line(error)}") from error
    if not math.isfinite(value):
        raise KenosisError(f"validate= returned {value!r}: it must return a finite number (higher is better)")
    return value


@dataclasses.dataclass
class MetricHold:
    """The search's state: the scores measured per count of layers kept in FP32."""

    validate: Metric
    quantized: ir.Model
    ranked: list[str]
    float_weights: dict = dataclasses.field(default_factory=dict)  # per layer: its FP32 weights (or None)
    scores: dict[int, float] = dataclasses.field(default_factory=dict)

    def score(self, count: int) -> float:
        if count not in self.scores:
            variant = sensitivity.with_layers_in_fp32(self.quantized, self.ranked[:count], self.float_weights)
            self.scores[count] = _score(self.validate, variant)
        return self.scores[count]

    def fewest(self, floor: float) -> int | None:
        """The fewest layers (by rank) whose return to FP32 scores at least ``floor``; None if none does."""
        low, high = 0, 1
        while self.score(min(high, len(self.ranked))) < floor:
            if high >= len(self.ranked):
                return None
            low, high = high, high * 2
        high = min(high, len(self.ranked))
        while high - low > 1:  # score(low) < floor <= score(high)
            middle = (low + high) // 2
            low, high = (low, middle) if self.score(middle) >= floor else (middle, high)
        return high


def hold_metric(given: onnx.ModelProto, float_graph: onnx.ModelProto, model: ir.Model,
                feeds: Sequence[Mapping[str, np.ndarray]], validate: Metric, max_drop: float, report: FixReport) -> list[str]:
    """Return to FP32 (in ``model``, in place) the fewest ranked layers that keep ``validate`` within
    ``max_drop`` of the score of ``given`` (the FP32 model as the user gave it); the layers' names.
    ``float_graph``: the FP32 graph ``model`` was quantized from, for the sensitivity ranking."""
    baseline = _score(validate, given)
    floor = baseline - max_drop
    analysis = sensitivity.analyze(float_graph, model, feeds)
    ranked = [layer.name for layer in sorted(analysis, key=lambda layer: layer.score_db)]
    hold = MetricHold(validate, model, ranked, {layer.name: layer.float_weight for layer in analysis})
    quantized_score = hold.score(0)
    head = f"validate: FP32 {baseline:.6g}, quantized {quantized_score:.6g}, max_drop {max_drop:g}"
    if quantized_score >= floor:
        report.note(f"{head}: within the drop, no layer returned to FP32 (2 evaluations)")
        return []
    count = hold.fewest(floor)
    if count is None:
        count = max(hold.scores, key=lambda k: (hold.scores[k], -k))
        outcome = (f"not held by returning layers to FP32 ({hold.scores.get(len(ranked), float('nan')):.6g} with all "
                   f"{len(ranked)}); kept the best measured, {count} layer(s) at {hold.scores[count]:.6g}")
    else:
        outcome = f"{count} of {len(ranked)} layer(s) returned to FP32 -> {hold.scores[count]:.6g}"
    chosen = ranked[:count]
    before = ir.serde.serialize_model(model)
    reasons = {layer.name: f"validate= metric: weight SNR {layer.weight_snr_db:.1f} dB, local SQNR "
               f"{layer.local_sqnr_db:.1f} dB" for layer in analysis}
    sensitivity.keep_fp32(model, chosen, report, reasons, hold.float_weights, rule=RULE_NAME)
    cost = _speed_cost(before, ir.serde.serialize_model(model), feeds[0]) if chosen and feeds else ""
    report.note(f"{head}: {outcome} ({len(hold.scores) + 1} evaluations){cost}")
    return chosen


def _speed_cost(before: onnx.ModelProto, after: onnx.ModelProto, feed: Mapping[str, np.ndarray]) -> str:
    """What the fallback cost in speed: both models timed interleaved, one thread (medians)."""
    try:
        sessions = {name: interleaved_timing.session(model.SerializeToString(), 1)
                    for name, model in (("before", before), ("after", after))}
        medians = interleaved_timing.interleaved_medians(sessions, feed, seconds=0.5)
    except Exception:  # noqa: BLE001 - timing is a report line, never a failure
        return ""
    return f"; speed: {medians['before'] * 1e3:.3g} -> {medians['after'] * 1e3:.3g} ms at 1 thread (interleaved medians)"


def load_metric(spec: str) -> Metric:
    """``module:function`` or ``path/to/file.py:function`` (the CLI's ``--validate``) as a callable."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise KenosisError(f"--validate takes MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}")
    try:
        if target.endswith(".py"):
            loader = importlib.util.spec_from_file_location("kenosis_user_metric", target)
            if loader is None or loader.loader is None:
                raise FileNotFoundError(target)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        function = getattr(module, name)
    except Exception as error:  # noqa: BLE001 - the user's file or module: one typed error
        raise KenosisError(f"--validate {spec}: cannot load it ({one_line(error)})") from error
    if not callable(function):
        raise KenosisError(f"--validate {spec}: {name} is not callable")
    return function


def output_agreement(float_model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]], output: int = 0) -> Metric:
    """A metric: the share of ``feeds`` on which the model's top-1 class (argmax over the last axis of
    output ``output``, per row) equals FP32's. FP32 scores 1.0."""
    reference = [np.asarray(run[output]) for run in fidelity.run(float_model, feeds)]

    def agreement(model: onnx.ModelProto) -> float:
        runs = [np.asarray(run[output]) for run in fidelity.run(model, feeds)]
        hits = [np.mean(np.argmax(r, axis=-1) == np.argmax(o, axis=-1)) for r, o in zip(reference, runs)]
        return float(np.mean(hits))

    return agreement


def task_agreement(float_model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]], task) -> Metric:
    """A metric from a :class:`kenosis_rewrite.zoo.task_metrics.TaskMetric` (box F1, map IoU, CTC lines):
    how much of FP32's answer the model gives on ``feeds``. FP32 scores 1.0; a feed set where neither
    finds anything scores 1.0 too (nothing to disagree on)."""
    reference = fidelity.run(float_model, feeds)

    def agreement(model: onnx.ModelProto) -> float:
        value = task(reference, fidelity.run(model, feeds))
        return 1.0 if value is None else float(value)

    return agreement

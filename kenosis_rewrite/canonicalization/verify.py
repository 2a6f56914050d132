"""prepare()'s verification: the canonical graph must reproduce the original's outputs on the feeds.

First both as onnxruntime runs them (every optimization on), within a tolerance of the outputs'
magnitude, on the first feeds (every feed for a graph that routes inputs by value); failing that,
both graphs as written (optimizations off), within that tolerance or a multiple of what
onnxruntime's own optimizations change. The tolerances are the caller's
(:mod:`kenosis_rewrite.canonicalization.pipeline`: ``PREPARE_TOLERANCE``, ``NOISE_FACTOR``,
``VERIFY_FEEDS``). Declared output shapes the model contradicts are repaired on the way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.canonicalization.shapes import symbolic_inputs
from kenosis_rewrite.core import fidelity, ort_sessions
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import PrepareFailedError, RuntimeMeasurementError

__all__ = ["TensorObserver", "declared_output_repairs", "max_relative_error", "routes_by_data", "verified"]

_DATA_ROUTED_OPS = frozenset({"If", "Loop", "Scan", "NonZero", "TopK", "NonMaxSuppression", "Unique", "Compress"})


class TensorObserver(Protocol):
    """Something gathering statistics of the prepared model's tensors from the verification's runs
    (quantize(): equalization's channel maxima)."""

    def tensors(self, model: onnx.ModelProto) -> list[str]:
        """The tensors of ``model`` to show :meth:`observe` (and forget any earlier runs)."""

    def observe(self, values: Mapping[str, np.ndarray]) -> None:
        """One run's tensors, by name."""

    def discard(self) -> None:
        """Forget the runs: they were not of the model kept."""


def _with_observed(candidate: bytes, observer: TensorObserver | None) -> tuple[bytes, list[str], int | None, tuple]:
    """The candidate with ``observer``'s tensors as extra outputs, all its output names, how many
    are its own (None when there is nothing to observe: the candidate as it is), and (a probe
    computing only ``observer``'s tensors, their names) for the feeds whose outputs are not compared."""
    if observer is None:
        return candidate, [], None, (b"", [])
    proto = onnx.ModelProto.FromString(candidate)
    own = [o.name for o in proto.graph.output]
    watched = list(dict.fromkeys(observer.tensors(proto)))
    extra = [name for name in watched if name not in set(own)]
    if not extra:
        return candidate, [], None, (b"", [])
    probe = ort_sessions.computing_only(proto, watched).SerializeToString()
    proto.graph.output.extend(onnx.ValueInfoProto(name=name) for name in extra)
    return proto.SerializeToString(), [*own, *extra], len(own), (probe, watched)


def routes_by_data(model: ir.Model) -> bool:
    """Whether different inputs can take different paths through ``model`` (control flow, or tensors
    whose size depends on the values): one input's run then says nothing about another's path."""
    return any(node.op_type in _DATA_ROUTED_OPS for node in model.graph.all_nodes())


def _observe_the_rest(probe: bytes, names: list[str], feeds: Sequence[Mapping[str, np.ndarray]],
                      observer: TensorObserver) -> None:
    """Show ``observer`` the feeds not compared, from ``probe`` (only the nodes its tensors need).
    Where that fails, the observer has not seen every feed and its user measures for itself."""
    try:
        for run in fidelity.run(probe, feeds, optimized=True):
            observer.observe(dict(zip(names, run)))
    except RuntimeMeasurementError:
        pass


def verified(original: fidelity.ReferenceRuns, work: ir.Model, report: FixReport, strict: bool,
             observer: TensorObserver | None = None, *, tolerance: float, noise_factor: float,
             verify_feeds: int) -> bool:
    """Whether ``work`` reproduces the original model on its feeds (declared output shapes repaired
    on the way).

    First as both run in onnxruntime with every optimization on, as users run them: equal within
    ``tolerance`` of the outputs' magnitude on the first ``verify_feeds`` feeds verifies (the
    original's optimized runs are the ones quantize()'s final fidelity reads again). Every
    rewrite is an identity applied whatever the data, so a wrong one shows on any real input; a
    graph that routes inputs by their values (:func:`routes_by_data`) is compared on every feed,
    and an ``observer`` is shown the prepared model's runs on every feed (those not compared from a
    probe computing only its tensors, :func:`~kenosis_rewrite.core.ort_sessions.computing_only`).
    Otherwise the graphs as written are compared, both run with optimizations off, within float
    rounding or ``noise_factor`` x what onnxruntime's own optimizations change
    (:func:`_verified_as_written`, on the first ``verify_feeds`` feeds unless the graph routes by
    value). ``observer``'s tensors are exposed as extra outputs of the first check's runs of the
    prepared model (onnxruntime keeps its fusions around them: they are outputs of the nodes it
    fuses into); those runs were of this model, so they stand when either check verifies it."""
    candidate = ir.serde.serialize_model(work).SerializeToString()  # once for both sessions and the checker
    observed, names, own, (probe, watched) = _with_observed(candidate, observer)
    compared = len(original.feeds) if routes_by_data(work) else verify_feeds
    feeds = original.feeds[:compared]
    try:
        reference = original.outputs(optimized=True, count=compared)
    except RuntimeMeasurementError as error:
        report.note(f"prepare: the original model does not run on these inputs ({error}); not verified")
        return True
    try:
        # it must load with every optimization on (ORT's own fusions can fail on a graph they or we
        # rewrote: that model would not run at all)
        outputs = fidelity.run(observed, feeds, optimized=True)
        if own is not None:
            for run in outputs:
                observer.observe(dict(zip(names, run)))
            outputs = [run[:own] for run in outputs]
            _observe_the_rest(probe, watched, original.feeds[compared:], observer)
        if declared_output_repairs(work, outputs[0], report):
            candidate = ir.serde.serialize_model(work).SerializeToString()
        onnx.checker.check_model(candidate, full_check=True)
    except (RuntimeMeasurementError, onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as failure:
        return _refused(f"the prepared model fails: {failure}", report, strict)
    error = max_relative_error(reference, outputs[:len(reference)])
    if error <= tolerance:
        report.note(f"prepare: verified on {len(reference)} inputs, max error {error:.2g} of the output magnitude "
                    "(both optimized as onnxruntime runs them)")
        return True
    # the observed runs were of this model: they stand if it verifies as written
    return _verified_as_written(original, candidate, report, strict, routes_by_data(work),
                                tolerance=tolerance, noise_factor=noise_factor, verify_feeds=verify_feeds)


def _verified_as_written(original: fidelity.ReferenceRuns, candidate: bytes, report: FixReport, strict: bool,
                         every_feed: bool, *, tolerance: float, noise_factor: float, verify_feeds: int) -> bool:
    """The graphs as written (optimizations off) agree within float rounding (``tolerance``), or
    ``noise_factor`` x what onnxruntime's own optimizations change on the same inputs (outputs behind a
    steep nonlinearity amplify any rounding); on the first ``verify_feeds`` feeds, or ``every_feed``
    (a graph that routes inputs by their values)."""
    count = len(original.feeds) if every_feed else min(verify_feeds, len(original.feeds))
    feeds = original.feeds[:count]
    try:
        reference = original.outputs(optimized=False, count=count)
        # float rounding as the runtime itself has it: its own fusions (Conv+BN, ...) reorder arithmetic
        runtime_noise = max_relative_error(reference, original.outputs(optimized=True, count=count))
    except RuntimeMeasurementError as error:
        report.note(f"prepare: the original model does not run on these inputs ({error}); not verified")
        return True
    allowed = max(tolerance, noise_factor * runtime_noise)
    try:
        error = max_relative_error(reference, fidelity.run(candidate, feeds, optimized=False))
    except RuntimeMeasurementError as failure:
        return _refused(f"the prepared model fails: {failure}", report, strict)
    if error > allowed:
        return _refused(f"outputs differ by {error:.2g} of their magnitude (allowed {allowed:.2g}: float rounding, or "
                        f"{noise_factor:g}x what onnxruntime's own optimizations change, {runtime_noise:.2g})",
                        report, strict)
    report.note(f"prepare: verified on {len(feeds)} inputs, max error {error:.2g} of the output magnitude "
                f"(onnxruntime's own optimizations: {runtime_noise:.2g})")
    return True


def _refused(reason: str, report: FixReport, strict: bool) -> bool:
    """False, with ``reason`` in the report (raised with ``strict``)."""
    if strict:
        raise PrepareFailedError(f"prepare(): {reason}")
    report.note(f"prepare: {reason}; the model is used as exported")
    return False


def declared_output_repairs(model: ir.Model, observed: Sequence[np.ndarray], report: FixReport) -> bool:
    """Declare each graph output with the shape it has in ``observed``; True when any changed."""
    repaired = False
    for value, array in zip(model.graph.outputs, observed):
        declared = value.shape
        actual = np.shape(array)
        if declared is None:
            continue
        contradicts = len(declared) != len(actual) or any(
            isinstance(dim, int) and dim != size for dim, size in zip(declared, actual)
        )
        if contradicts:
            report.changed(
                "repair-declared-output-shapes", value.name,
                f"declared {list(declared)}, the model produces {list(actual)}: declaration replaced",
                exact=True,
            )
            # with symbolic inputs only the rank is known for every input the model accepts
            static = not symbolic_inputs(model)
            value.shape = ir.Shape(list(actual) if static else [None] * len(actual))
            repaired = True
    return repaired


def max_relative_error(reference: list[list[np.ndarray]], outputs: list[list[np.ndarray]]) -> float:
    """The largest absolute difference of ``outputs`` from ``reference``, relative to the largest
    magnitude of that reference output (absolute where it is all zeros); inf where a shape differs
    or a non-float output is not equal."""
    worst = 0.0
    for ref_outputs, new_outputs in zip(reference, outputs):
        for ref, new in zip(ref_outputs, new_outputs):
            ref, new = np.asarray(ref), np.asarray(new)
            if ref.shape != new.shape:
                return float("inf")
            if not np.issubdtype(ref.dtype, np.floating):
                if not np.array_equal(ref, new):
                    return float("inf")
                continue
            scale = float(np.max(np.abs(ref), initial=0.0))
            error = float(np.max(np.abs(ref.astype(np.float64) - new), initial=0.0))
            worst = max(worst, error / scale if scale > 0 else error)
    return worst

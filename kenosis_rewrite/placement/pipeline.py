"""``fix()``: a thin pipeline over the rules and passes of one target (:mod:`kenosis_rewrite.placement.targets`):
the target's passes before the rules, its rewrite rules to a fixed point, its passes after (to a
fixed point), then clean-up; then the run-time guard (:mod:`kenosis_rewrite.placement.guard`).

Order for ``ort-cpu`` (each step's module docstring states its transformation and exactness):

1. ``contrib-qdq-to-standard``, ``float-shape-arithmetic``, ``fold-constant-quantize``,
   ``activation-int8-to-uint8`` (passes): com.microsoft Q/DQ to the default domain, Q/DQ removed from
   shape arithmetic (anchors, grids: their float values exactly), Q(constant) folded, activations
   to uint8 (exact).
2. Rewrite rules to a fixed point: BatchNormalization folding, Relu/Clip island folding and zero
   points to qmin, PRelu replacement, weight-only MatMulNBits patterns.
3. ``align-pass-through-qparams``, ``requantize-stale-bias``, ``activation-before-data-movement``
   (passes): parameters changed in 2 flow through MaxPool, Reshape, ...; int32 biases follow the
   input scales; activations go in front of data movement that reads an int8 DQ.
4. Clean-up: unused nodes and initializers, topological order, stale ``output_dtype``, the
   rewriter's bookkeeping metadata, node names.
5. The guard runs input and output with ONNX Runtime and undoes a rule that broke its bound.
"""

from __future__ import annotations

import os
import warnings

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import common as common_passes
from onnxscript.rewriter import RewritePass, RewriteRuleSet

from kenosis_rewrite.calibration.feed_files import feeds_from_path, is_feed_path
from kenosis_rewrite.core import model_io
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.core import interleaved_timing
from kenosis_rewrite.errors import InvalidModelError, KenosisError, RewriteError
from kenosis_rewrite.placement.guard import Guard, candidate_undos
from kenosis_rewrite.placement.passes import output_quantizers
from kenosis_rewrite.placement.passes.output_quantizers import QuantizeWeightedOutputsPass
from kenosis_rewrite.placement.passes.per_tensor_activations import PerTensorActivationsPass
from kenosis_rewrite.placement.passes.pin_shapes import pinned_model
from kenosis_rewrite.placement.opset_upgrade import needs_per_axis_upgrade, upgraded_for_per_axis
from kenosis_rewrite.placement.passes.requantize_after_movement import RULE_NAME as REQUANTIZE_AFTER_DATA_MOVEMENT
from kenosis_rewrite.core.report import GUARD_UNDO_REASON, FixReport, Refusal
from kenosis_rewrite.graph.rule_filter import op_filtered
from kenosis_rewrite.placement.targets import TARGETS as _TARGETS
from kenosis_rewrite.placement.targets import get_target

__all__ = ["TARGETS", "FixPass", "rules", "fix", "fix_with_report", "fix_loaded", "GUARD_MAX_BYTES"]

TARGETS = tuple(_TARGETS)
_MAX_REWRITE_ROUNDS = 8
# By default the run-time guard runs on models whose tensors add up to at most this: it holds the
# input, the output and a float reference in ONNX Runtime at once (about 6x the model in memory).
GUARD_MAX_BYTES = 256 << 20
_REWRITER_METADATA_PREFIX = "pkg.onnxscript"


def _check_target(target: str) -> None:
    get_target(target)


def rules(target: str = "ort-cpu", report: FixReport | None = None) -> RewriteRuleSet:
    """The onnxscript rewrite rules of ``target``, usable in any onnxscript/onnx-ir pipeline.

    Graph-wide steps (dtype retyping, parameter propagation, bias requantization) are onnx-ir
    passes, not rules: run :class:`FixPass` for the whole transformation.
    """
    return RewriteRuleSet(get_target(target).rules(report))


def _rewrite_until_done(rule_set: RewriteRuleSet) -> ir.passes.PassManager:
    """onnxscript's ``RewritePass`` of ``rule_set``, repeated until nothing more matches (at most
    ``_MAX_REWRITE_ROUNDS`` rounds): a rewrite can create the next one's match."""
    return ir.passes.PassManager([RewritePass(rule_set)], steps=_MAX_REWRITE_ROUNDS, early_stop=True)


class CleanupPass(ir.passes.InPlacePass):
    """Drop what the rewrite left unused and the rewriter's bookkeeping; name new nodes."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        common_passes.RemoveUnusedNodesPass()(model)
        model.graph.sort()  # inserted nodes may read values a reused node defines further down
        for node in model.graph:
            # The zero point fixes a Q's type; a redundant output_dtype goes stale when ORT's own
            # int8 -> uint8 transformer retypes the zero point (ORT then refuses the model).
            if qdq_params.is_quantize(node) and "output_dtype" in node.attributes and len(node.inputs) > 2 \
                    and node.inputs[2] is not None:
                del node.attributes["output_dtype"]
        taken = {node.name for node in model.graph if node.name}
        for index, node in enumerate(model.graph):
            for key in [k for k in node.metadata_props if k.startswith(_REWRITER_METADATA_PREFIX)]:
                del node.metadata_props[key]
            if not node.name:
                name, suffix = f"{node.op_type}_kenosis_{index}", 0
                while name in taken:
                    suffix += 1
                    name = f"{node.op_type}_kenosis_{index}_{suffix}"
                node.name = name
                taken.add(name)
        common_passes.NameFixPass()(model)
        return ir.passes.PassResult(model, modified=True)


class FixPass(ir.passes.InPlacePass):
    """The whole ``fix()`` transformation of one target as an onnx-ir pass.

    Usable in ``onnx_ir.passes.PassManager`` and after ``onnxscript.optimizer.optimize``.
    """

    def __init__(
        self, target: str = "ort-cpu", report: FixReport | None = None, disabled: Iterable[str] = (),
        output_ranges: Mapping[str, tuple[float, float]] | None = None,
    ):
        super().__init__()
        _check_target(target)
        self.target = target
        self.report = report if report is not None else FixReport(target=target)
        self.disabled = frozenset(disabled)
        # measured ranges of weighted-op outputs that have no quantizer (see passes.output_quantizers)
        self.output_ranges = dict(output_ranges or {})

    def _enabled(self, steps: list) -> list:
        return [step for step in steps if getattr(step, "rule_name", getattr(step, "name", None)) not in self.disabled]

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        target = get_target(self.target)
        # weighted outputs with no quantizer get one from measured ranges or, without them, from the
        # bounds a saturating activation's quantizer puts on them (passes.output_quantizers)
        first = ([QuantizeWeightedOutputsPass(self.output_ranges, self.report)]
                 if self.output_ranges or target.facts.quantize_weighted_outputs else [])
        first = self._enabled(first)
        pre_passes = target.pre_passes(self.report)
        # after the per-axis activation quantizers became per-tensor (NNCF's at depthwise inputs): a
        # saturating activation's quantizer bounds the output before it only as one grid
        at = max((i + 1 for i, step in enumerate(pre_passes) if isinstance(step, PerTensorActivationsPass)), default=0)
        pre_passes[at:at] = first
        steps = ir.passes.Sequential(
            *self._enabled(pre_passes),
            common_passes.RemoveUnusedNodesPass(),  # rules count consumers: dead readers must go first
            # post passes move Q/DQ and change parameters, which can make a rule match again (a Clip
            # moved in front of a Reshape now follows the Conv's Q/DQ): rules and post passes are
            # repeated together until nothing changes, so a second fix() finds nothing left to do
            ir.passes.PassManager([
                _rewrite_until_done(op_filtered(self._enabled(target.rules(self.report)))),
                ir.passes.PassManager(self._enabled(target.post_passes(self.report)), steps=_MAX_REWRITE_ROUNDS),
            ], steps=_MAX_REWRITE_ROUNDS, early_stop=True),
        )
        result = steps(model)
        # the output quantizers put after a chain the folds then left: no integer kernel, one rounding more
        undone = sum(step.undo_unfolded_chains(model) for step in first)
        CleanupPass()(model)
        return ir.passes.PassResult(model, modified=result.modified or bool(undone))


def apply_rules(model: ir.Model, target: str, names: Iterable[str], report: FixReport | None = None) -> bool:
    """Apply only the rules and post passes of ``target`` named in ``names``; True when any rewrote
    ``model``. For a pipeline that ran :class:`FixPass` with them disabled and applies them last
    (quantize() lowers the integer MatMuls' bias Adds, and concatenates codes, after bias correction,
    which reads the QDQ form)."""
    wanted = frozenset(names)
    target_ = get_target(target)
    rules = [rule for rule in target_.rules(report) if rule.name in wanted]
    modified = bool(rules) and _rewrite_until_done(op_filtered(rules))(model).modified
    for step in target_.post_passes(report):
        if getattr(step, "rule_name", None) in wanted:
            modified = step(model).modified or modified
    return modified


def interface(proto: onnx.ModelProto) -> tuple:
    """What fix() promises to keep: graph inputs/outputs with their types, opsets, metadata."""
    return (
        [(v.name, v.type.SerializeToString()) for v in proto.graph.input],
        [(v.name, v.type.tensor_type.elem_type) for v in proto.graph.output],
        sorted((o.domain, o.version) for o in proto.opset_import),
        sorted((p.key, p.value) for p in proto.metadata_props),
        (proto.ir_version, proto.producer_name, proto.producer_version, proto.domain, proto.model_version),
    )


def _ort_refusal(proto: onnx.ModelProto) -> str | None:
    """Why ONNX Runtime refuses to load ``proto`` (optimizations off), or None when it loads it."""
    from kenosis_rewrite.core import ort_sessions  # noqa: PLC0415 - only for inputs that fail the checker

    options = ort_sessions.options(None, level="none", spinning=False)
    try:
        ort_sessions.session(proto, options)
    except Exception as error:  # noqa: BLE001 - ORT raises its own unexported exception types
        return str(error).splitlines()[0][:300]
    return None


def _validate(before: onnx.ModelProto, after: onnx.ModelProto, report: FixReport) -> None:
    if interface(before) != interface(after):
        raise RewriteError(
            "internal error: the rewrite changed the model's interface (inputs, outputs, opsets or "
            "metadata); no model is returned. Please report this with the model."
        )
    problem = model_io.full_check_problem(after)
    if problem is None:
        return
    input_problem = model_io.full_check_problem(before)
    if input_problem is not None:
        refusal = _ort_refusal(before)
        if refusal is not None:
            raise InvalidModelError(
                f"The input model fails the ONNX checker (full_check: {input_problem.splitlines()[0]}) and ONNX Runtime "
                f"refuses to load it ({refusal}): it is not a valid model, and no rewrite of it can be checked. If a "
                "quantizer wrote it, quantize the FP32 model again (a float16 model needs opset 19 for float16 "
                "quantization scales), or quantize it with kenosis_rewrite.quantize().")
        # The input itself fails the strict check but runs; hold the output to the same standard as the input.
        report.note("the input model fails onnx.checker full_check; the output was checked without it")
        model_io.check_model(after)
        return
    raise RewriteError(f"internal error: the rewritten model fails the ONNX checker ({problem}); no model is returned.")


OPTIMIZE_FOR = (None, "latency")


def _latency_placement(
    model: ir.Model, report: FixReport, calibration: list | None, budget_s: float, threads: int
) -> None:
    from kenosis_rewrite.core import fidelity  # noqa: PLC0415
    from kenosis_rewrite.placement.passes.latency_placement import LatencyPlacementPass  # noqa: PLC0415

    feed = calibration[0] if calibration else fidelity.random_feeds(ir.serde.serialize_model(model), 1)[0]
    LatencyPlacementPass(feed, report, budget_s=budget_s, threads=threads)(model)
    CleanupPass()(model)


def _fix_once(
    model: model_io.ModelLike | model_io.LoadedModel, target: str, disabled: frozenset[str], output_ranges: Mapping | None = None,
    held_sites: frozenset = frozenset(),
) -> tuple[model_io.LoadedModel, FixReport]:
    """FixPass on a fresh private copy of ``model`` (or on ``model`` itself when it is one already);
    ``held_sites``: (rule, site) pairs the rules leave alone."""
    loaded = model if isinstance(model, model_io.LoadedModel) else model_io.load(model, lazy=True)
    report = FixReport(target=target, held_sites=held_sites)
    for note in loaded.notes:
        report.note(note)
    FixPass(target, report, disabled, output_ranges)(loaded.model)
    return loaded, report


def _output_ranges(before: onnx.ModelProto | None, target: str, calibration: list | None, report_notes: list[str]) -> dict:
    """Ranges of weighted-op outputs that lack a quantizer, measured on the input model (ORT targets)."""
    if before is None or not get_target(target).facts.quantize_weighted_outputs:
        return {}
    sites = output_quantizers.sites(ir.serde.deserialize_model(before).graph)
    if not sites:
        return {}
    if not calibration:  # a range is a fact about data: no guessing it from synthetic inputs here
        unbounded = len({site.op.name for site in sites if output_quantizers.site_range(site, None) is None})
        if unbounded:
            report_notes.append(
                f"{output_quantizers.RULE_NAME}: {unbounded} Conv/MatMul/Gemm output(s) reach no quantizer, so ORT "
                "runs them in float; pass calibration= feeds to give them measured output quantizers"
            )
        return {}
    try:
        ranges = output_quantizers.measure_output_ranges(before, calibration[:8])
    except Exception as error:  # noqa: BLE001 - the model cannot be run: the rule does not apply
        report_notes.append(f"{output_quantizers.RULE_NAME}: could not measure output ranges ({str(error)[:200]})")
        return {}
    report_notes.append(f"{output_quantizers.RULE_NAME}: output ranges of {len(ranges)} op(s) measured on the calibration feeds")
    return ranges


# Rules that add a rounding step on a grid set from the graph alone, whose cost compounds over
# layers: kept only where the guard can measure them. On PP-OCRv5's DB text detector quantized by
# NNCF, 34 HardSwish inputs given their saturation grids took the cosine against FP32 from 0.851 to
# 0.780, which random feeds could not show (there the input's own cosine is 0.045). With
# calibration= feeds the guard measures them on data.
UNVERIFIABLE_BLIND = frozenset({output_quantizers.RULE_NAME})


def _guarded_fix(
    model: model_io.ModelLike, first: model_io.LoadedModel, target: str, guard: Guard | None, output_ranges: Mapping | None = None,
) -> tuple[model_io.LoadedModel, FixReport, onnx.ModelProto | None]:
    """FixPass on ``first`` (the caller's ``model``, loaded), then the run-time guard; rules the guard
    rejects are undone (the model is loaded again from the caller's input and rebuilt without them)
    and the report says why. Where the guard is blind (:meth:`Guard.blindness`), the rules of
    :data:`UNVERIFIABLE_BLIND` that changed the model are undone first, and stay undone."""
    loaded, report = _fix_once(first, target, frozenset(), output_ranges)
    if guard is None:
        return loaded, report, None
    after = model_io.in_memory_proto(loaded.model)
    if after is None:
        return loaded, report, after
    if guard.levels_note:
        report.note(guard.levels_note)
    if guard.unavailable:
        return _exact_only(model, loaded, report, after, target, guard, output_ranges)
    blind = guard.blindness()
    kept_out = frozenset(c.rule for c in report.changes if c.rule in UNVERIFIABLE_BLIND) if blind else frozenset()
    if kept_out:
        problem = (f"{blind}; {', '.join(sorted(kept_out))} adds roundings whose cost only data shows (pass "
                   "calibration= feeds to apply it, measured on them)")
        candidates = [frozenset(), *candidate_undos(report)]
    else:
        problem = guard.violation(after, report)
        if problem is None:
            return loaded, report, after
        candidates = candidate_undos(report)
    for disabled in [*candidates, None]:
        if disabled is None:  # nothing short of no rewrite at all passes: return the input as it was
            loaded = model_io.load(model, lazy=True)
            retry_report, retry_after = FixReport(target=target), model_io.in_memory_proto(loaded.model)
            undone = "every rewrite"
        else:
            disabled = disabled | kept_out
            loaded, retry_report = _fix_once(model, target, disabled, output_ranges)
            retry_after = model_io.in_memory_proto(loaded.model)
            if guard.violation(retry_after, retry_report) is not None:
                continue
            undone = ", ".join(sorted(disabled))
        held: frozenset = frozenset()
        at_sites = _undone_at_sites(model, target, disabled, kept_out, report, guard, output_ranges)
        if at_sites is not None:
            (loaded, retry_report, retry_after), held, undone = at_sites
            retry_report.refusals[:0] = _held_site_refusals(report, held, problem)
        else:
            retry_report.refusals[:0] = [
                Refusal(rule, "whole model", f"{GUARD_UNDO_REASON}: {problem}") for rule in sorted(disabled or ())
            ]
        retry_report.note(f"run-time guard: {problem}; undone: {undone}")
        if disabled is not None and retry_after is not None:
            loaded, retry_report, retry_after = _closing_round(loaded, retry_report, retry_after, target, guard,
                                                               output_ranges, kept_out, held)
        if target.startswith("ort-cpu") and interleaved_timing.u8s8_saturates():
            retry_report.note(
                "this host is x86 without VNNI: ORT's uint8 x int8 kernels saturate int16 pair sums here, so "
                "integer kernels lose accuracy that the same graph keeps on a VNNI host (measure there before deploying)"
            )
        return loaded, retry_report, retry_after
    raise AssertionError("unreachable")


MAX_SITE_TRIALS = 16  # fix() runs the per-site search may spend, each held to the guard


def _sites_of(report: FixReport, rule: str) -> list:
    """The sites (match roots) of ``rule``'s changes in ``report``, in order; None among them where a
    change's site is unknown (a pass's change, an unnamed root node)."""
    return list(dict.fromkeys(report.sites.get((rule, change.where)) for change in report.changes if change.rule == rule))


def _undone_at_sites(
    model: model_io.ModelLike, target: str, disabled: frozenset[str] | None, kept_out: frozenset[str], report: FixReport,
    guard: Guard, output_ranges: Mapping | None,
) -> tuple[tuple[model_io.LoadedModel, FixReport, onnx.ModelProto], frozenset, str] | None:
    """Where the guard passed with one rule undone, that rule undone only at the sites that cost the
    fidelity: the sites are released half by half (each try a fix() held to the guard) and those whose
    release fails stay held. Returns the result, the held ``(rule, site)`` pairs and what was undone;
    None where the rule's sites are unknown, or holding fewer of them does not pass."""
    rules = (disabled or frozenset()) - kept_out
    if len(rules) != 1:
        return None
    rule = next(iter(rules))
    sites = _sites_of(report, rule)
    if len(sites) < 2 or None in sites:
        return None
    held, best, trials = set(sites), None, 0

    def release(chunk: list) -> None:
        nonlocal best, trials
        if trials >= MAX_SITE_TRIALS:
            return
        trials += 1
        pairs = frozenset((rule, site) for site in held - set(chunk))
        loaded, trial_report = _fix_once(model, target, kept_out, output_ranges, pairs)
        after = model_io.in_memory_proto(loaded.model)
        if after is not None and guard.violation(after, trial_report) is None:
            held.difference_update(chunk)
            best = (loaded, trial_report, after)
        elif len(chunk) > 1:
            release(chunk[:len(chunk) // 2])
            release(chunk[len(chunk) // 2:])

    release(sites[:len(sites) // 2])  # releasing them all is what failed
    release(sites[len(sites) // 2:])
    if best is None or len(held) == len(sites):
        return None
    pairs = frozenset((rule, site) for site in held)
    return best, pairs, f"{rule} at {len(held)} of its {len(sites)} sites (kept at the others)"


def _held_site_refusals(report: FixReport, held: frozenset, problem: str) -> list[Refusal]:
    """A refusal for each change of ``report`` made at a held site: where the guard undid its rule."""
    return [Refusal(change.rule, change.where, f"{GUARD_UNDO_REASON} at this site: {problem}")
            for change in report.changes if (change.rule, report.sites.get((change.rule, change.where))) in held]


UNCHECKED_HINT = ("pass calibration= feeds the model runs on (or input_shapes= that pin its symbolic dims) so "
                  "the guard can run it and check them")


def _exact_only(
    model: model_io.ModelLike, loaded: model_io.LoadedModel, report: FixReport, after: onnx.ModelProto, target: str,
    guard: Guard, output_ranges: Mapping | None,
) -> tuple[model_io.LoadedModel, FixReport, onnx.ModelProto | None]:
    """Where the guard cannot run the input, only rewrites proven bit-exact are applied: the rules
    that made an approximate change are held back, and the report says which and how to lift that."""
    held_back = frozenset(change.rule for change in report.changes if not change.exact)
    if not held_back:
        report.note(f"{guard.unavailable}; every change is exact, so none was held back")
        return loaded, report, after
    loaded, exact_report = _fix_once(model, target, held_back, output_ranges)
    exact_report.refusals[:0] = [
        Refusal(rule, "whole model", f"held back: not exact, and {guard.unavailable}") for rule in sorted(held_back)
    ]
    exact_report.note(f"{guard.unavailable}: only exact rewrites were applied; held back: {', '.join(sorted(held_back))} "
                      f"({UNCHECKED_HINT})")
    return loaded, exact_report, model_io.in_memory_proto(loaded.model)


def _closing_round(
    loaded: model_io.LoadedModel, report: FixReport, after: onnx.ModelProto, target: str, guard: Guard,
    output_ranges: Mapping | None, kept_out: frozenset[str], held_sites: frozenset = frozenset(),
) -> tuple[model_io.LoadedModel, FixReport, onnx.ModelProto]:
    """The pipeline once more on the model the guard let through with rules undone, held to the same
    guard (the caller's input). A rule undone on the input graph can pass on the rewritten one:
    applied after the other rules moved and merged the Q/DQ, the symmetric int8 conversion no longer
    widens pairs they remove (fuzz seed 30000103). Without this round a second fix() made that
    rewrite, held only to its own input: fix() was not idempotent. The round's model is taken when
    it changed and passes; otherwise the model as it was. ``kept_out``: rules it leaves out too;
    ``held_sites``: the sites where the guard undid a rule, left alone too."""
    again, again_report = _fix_once(after, target, kept_out, output_ranges, held_sites)
    if not again_report.changes:
        return loaded, report, after
    merged = FixReport(target=target, changes=[*report.changes, *again_report.changes],
                       refusals=list(report.refusals), notes=list(report.notes), fidelity=report.fidelity)
    again_after = model_io.in_memory_proto(again.model)
    if again_after is None or guard.violation(again_after, merged) is not None:
        return loaded, report, after
    applied = {change.rule for change in again_report.changes}
    merged.refusals = [refusal for refusal in merged.refusals if refusal.rule not in applied]
    merged.note(f"run-time guard: applied to the rewritten model, {', '.join(sorted(applied))} passes it")
    again.returns = loaded.returns
    return again, merged, again_after


def fix_with_report(model: model_io.ModelLike, **options) -> tuple[onnx.ModelProto | ir.Model, FixReport]:
    """Deprecated: use ``fix(model, return_report=True)``, which returns the same ``(model, FixReport)``."""
    warnings.warn("fix_with_report() is deprecated and will be removed in the next release: "
                  "use fix(model, return_report=True)", DeprecationWarning, stacklevel=2)
    return _fixed_and_report(model, **options)


def _fixed_and_report(
    model: model_io.ModelLike,
    *,
    target: str = "ort-cpu",
    float_model: model_io.ModelLike | None = None,
    calibration: Iterable[Mapping[str, np.ndarray]] | None = None,
    optimize_for: str | None = None,
    latency_budget_s: float = 60.0,
    threads: int = 1,
    verify: bool | None = None,
    bias_correction: bool = False,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> tuple[onnx.ModelProto | ir.Model, FixReport]:
    """:func:`fix`'s model and report."""
    loaded, report, after = fix_loaded(
        model, target=target, float_model=float_model, calibration=calibration, optimize_for=optimize_for,
        latency_budget_s=latency_budget_s, threads=threads, verify=verify, bias_correction=bias_correction,
        input_shapes=input_shapes,
    )
    result = after if loaded.returns == "proto" and after is not None else model_io.to_output(loaded)
    return result, report


def _guard_applies(verify: bool | None, model: ir.Model, notes: list[str]) -> bool:
    """Whether the run-time guard runs: always with ``verify=True``, by default up to GUARD_MAX_BYTES."""
    if verify is not None:
        return verify
    if model_io.tensor_bytes(model) <= GUARD_MAX_BYTES:
        return True
    notes.append(f"the run-time guard did not run: the model's tensors exceed {GUARD_MAX_BYTES >> 20} MiB and the guard "
                "holds the model in ONNX Runtime several times (pass verify=True to run it)")
    return False


def _calibration_list(calibration, model: model_io.ModelLike) -> list | None:
    """``calibration=`` as a list of feeds: feed dicts as given, or read from a path (a ``.npz``, a folder
    of them or of images: :mod:`kenosis_rewrite.calibration.feed_files`)."""
    if calibration is None:
        return None
    if not is_feed_path(calibration):
        return list(calibration)
    if isinstance(model, onnx.ModelProto):
        graph = model
    elif isinstance(model, ir.Model):
        graph = ir.serde.serialize_model(model)
    else:
        graph = onnx.load(os.fspath(model), load_external_data=False)
    return feeds_from_path(calibration, graph)


def _loaded_input(model: model_io.ModelLike) -> tuple[model_io.ModelLike, model_io.LoadedModel, list[str]]:
    """The input loaded for rewriting, and the notes on how; a per-channel QDQ model below opset 13
    (invalid as written, refused by onnxruntime) is converted to opset 13 first (:mod:`.opset_upgrade`)."""
    try:
        return model, model_io.load(model, lazy=True), []
    except InvalidModelError as error:
        if not needs_per_axis_upgrade(error):
            raise
        upgraded, note = upgraded_for_per_axis(model, error)
        loaded = model_io.load(upgraded, lazy=True)
        if not isinstance(model, onnx.ModelProto):
            loaded.returns = "ir" if isinstance(model, ir.Model) else loaded.returns
        return upgraded, loaded, [note]


def fix_loaded(
    model: model_io.ModelLike, *, target: str = "ort-cpu", float_model: model_io.ModelLike | None = None,
    calibration: Iterable[Mapping[str, np.ndarray]] | None = None, optimize_for: str | None = None,
    latency_budget_s: float = 60.0, threads: int = 1, verify: bool | None = None, bias_correction: bool = False,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> tuple[model_io.LoadedModel, FixReport, onnx.ModelProto | None]:
    """:func:`fix` before the result is converted: ``(loaded, report, output proto or None)``.

    The output proto is None when none was built (a large model, or no step needed the model in
    memory): the CLI then writes ``loaded.model`` as it is, its unchanged weights streamed from the
    input's files.
    """
    _check_target(target)
    if optimize_for not in OPTIMIZE_FOR:
        raise KenosisError(f"optimize_for must be one of {OPTIMIZE_FOR}, got {optimize_for!r}")
    calibration = _calibration_list(calibration, model)
    if bias_correction and (float_model is None or not calibration):
        raise KenosisError("bias_correction=True needs float_model= (the FP32 original) and calibration= feeds: "
                           "the correction is the mean difference between the two on that data")
    pinning = None
    if input_shapes:
        model, pinning = pinned_model(model, input_shapes, calibration)
    model, first, notes = _loaded_input(model)
    if model_io.ALREADY_FUSED_NOTE in first.notes:  # MatMulNBits form: what fix() would make; nothing to do
        report = FixReport(target=target)
        for note in first.notes:
            report.note(note)
        return first, report, None
    guarded = _guard_applies(verify, first.model, notes)
    # the whole model in memory as a proto: only for the steps that run it in ONNX Runtime
    in_memory = guarded or float_model is not None or bool(calibration) or optimize_for is not None
    before = model_io.in_memory_proto(first.model) if in_memory else None
    float_proto = None
    if float_model is not None:
        float_proto = model_io.to_output(model_io.LoadedModel(model_io.load(float_model, require_qdq=False).model, "proto"))
    guard = None
    if guarded and before is not None:
        guard = Guard(before, calibration or [], float_model=float_proto)
    output_ranges = _output_ranges(before, target, calibration, notes)
    # the input as given (its graph alone when not in memory), taken now: the rewrite may work on
    # ``first.model`` itself
    reference = before if before is not None else model_io.graph_only_proto(first.model)
    loaded, report, after = _guarded_fix(model, first, target, guard, output_ranges)
    if in_memory and after is None:
        after = model_io.in_memory_proto(loaded.model)
    for note in notes:
        report.note(note)
    if pinning is not None:
        report.changes[:0] = pinning.changes
        report.refusals[:0] = pinning.refusals
        report.notes[:0] = pinning.notes
    if optimize_for == "latency":
        _latency_placement(loaded.model, report, calibration, latency_budget_s, threads)
        # the int8 targets' pair after data movement, where a layer put back in float left a DQ
        # chain that ORT would requantize itself and refuse
        apply_rules(loaded.model, target, (REQUANTIZE_AFTER_DATA_MOVEMENT,), report)
        after = model_io.in_memory_proto(loaded.model)
    if bias_correction:
        from kenosis_rewrite.accuracy.bias_correction import correct_biases  # noqa: PLC0415

        report.note(f"bias correction: {correct_biases(float_proto, loaded.model, calibration, report)} layers")
        after = model_io.in_memory_proto(loaded.model)
    if before is not None and after is not None:
        _validate(before, after, report)
    else:  # checked without the tensor data (see model_io.graph_only_proto): any size, no copy of the weights
        _validate(reference, model_io.graph_only_proto(loaded.model), report)
        if guarded and before is None:
            report.note("the model is larger than 2 GB: the run-time guard did not run (ONNX Runtime cannot take it "
                        "as one protobuf); its graph passed onnx.checker (full_check) without the tensor data")
    if not in_memory:
        after = None
    if float_proto is not None:
        from kenosis_rewrite.core import fidelity  # noqa: PLC0415 - only needed with a float model

        report.fidelity = fidelity.compare_to_float(float_proto, {"input": before, "fixed": after}, calibration)
    return loaded, report, after


def fix(
    model: model_io.ModelLike,
    *,
    target: str = "ort-cpu",
    float_model: model_io.ModelLike | None = None,
    calibration: Iterable[Mapping[str, np.ndarray]] | None = None,
    return_report: bool = False,
    optimize_for: str | None = None,
    latency_budget_s: float = 60.0,
    threads: int = 1,
    verify: bool | None = None,
    bias_correction: bool = False,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
):
    """Rewrite a QDQ model so that ONNX Runtime runs more of it in fused integer kernels.

    Args:
        model: the quantized (QDQ) model: ``onnx.ModelProto``, ``onnx_ir.Model`` or a path.
            The caller's object is never modified.
        target: the runtime to place Q/DQ for (``"ort-cpu"``: ONNX Runtime CPU, x86).
        float_model: optional FP32 original; when given, the report carries the fidelity
            (cosine, max abs error) of the input and the fixed model against it.
        calibration: optional real inputs: an iterable of ``{input_name: array}`` feeds, or a path to a
            ``.npz`` (one array per input name, samples along the first axis), a folder of ``.npz``
            files or a folder of images. They drive the run-time guard, the output quantizers a
            quantizer left out, and the fidelity report; random inputs when omitted.
        return_report: return ``(model, FixReport)`` instead of the model alone.
        optimize_for: ``"latency"`` adds measured placement: layers that ORT CPU runs faster in
            float on this machine are returned to float (see
            :mod:`kenosis_rewrite.placement.passes.latency_placement`); never slower than without it.
        latency_budget_s: time budget of that search (decisions are cached per model and machine).
        threads: intra-op threads the latency search measures with (match your deployment).
        verify: the run-time guard (:mod:`kenosis_rewrite.placement.guard`; by default on for models whose
            tensors add up to at most :data:`GUARD_MAX_BYTES` (256 MiB), ``True`` forces it up to
            2 GB, ``False`` turns it off): the output must run wherever the input ran, with the same output shapes, equal
            the input bit for bit where every change claims exactness, and lose at most 0.005
            cosine against the reference (FP32 when given, else the input without its roundings)
            on ``calibration`` or random feeds; rules that break this are undone and reported.
        bias_correction: with ``float_model`` and ``calibration``, also move each quantized
            Conv/Gemm's mean output shift against the FP32 model into its int32 bias
            (:mod:`kenosis_rewrite.accuracy.bias_correction`; not exact: outputs move toward FP32).
        input_shapes: ``{input_name: dims}`` to pin symbolic input dims to, folding the shape
            computations that depend on them (:mod:`kenosis_rewrite.placement.passes.pin_shapes`; a ViT's
            run-time position-embedding interpolation, for one). The result accepts only those
            shapes. Checked against the input on ``calibration`` (or random feeds of those shapes).

    Returns:
        The fixed model, of the kind given: an ``onnx_ir.Model`` for an ``onnx_ir.Model``,
        otherwise an ``onnx.ModelProto`` (a path in gives a ModelProto out), except that a model
        over 2 GB comes back as an ``onnx_ir.Model`` (save it with :func:`kenosis_rewrite.save`).
        A path whose external data exceeds 256 MiB is read lazily: its weights stay on disk,
        memory-mapped, and only the tensors a rule changes are held in memory. A model already in
        ``MatMulNBits`` form (no Q/DQ) comes back unchanged, with a note in the report.

    Raises:
        KenosisError: a subclass naming what is wrong with the input (not ONNX, no Q/DQ,
            QOperator format, unsupported opset, too large, unknown target).
    """
    fixed, report = _fixed_and_report(
        model, target=target, float_model=float_model, calibration=calibration,
        optimize_for=optimize_for, latency_budget_s=latency_budget_s, threads=threads, verify=verify,
        bias_correction=bias_correction, input_shapes=input_shapes,
    )
    return (fixed, report) if return_report else fixed

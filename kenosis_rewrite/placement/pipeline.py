"""``fix()``: a thin pipeline over the rules and passes of one target (:mod:`kenosis_rewrite.placement.targets`):
the target's passes before the rules, its rewrite rules to a fixed point, its passes after (to a
fixed point), then clean-up; then the run-time guard (:mod:`kenosis_rewrite.placement.guard`).

Order for ``ort-cpu`` (each step's module docstring states its transformation and exactness):

1. ``contrib-qdq-to-standard``, ``float-shape-arithmetic``, ``fold-constant-quantize``,
   ``fold-dequantized-parameters``, ``activation-int8-to-uint8`` (passes): com.microsoft Q/DQ to the
   default domain, Q/DQ removed from shape arithmetic (anchors, grids: their float values exactly),
   Q(constant) folded, dequantized PRelu slopes and Clip bounds read as constants, activations to
   uint8 (exact).
2. Rewrite rules to a fixed point: BatchNormalization folding, Relu/Clip island folding and zero
   points to qmin, PRelu replacement, weight-only MatMulNBits patterns.
3. ``align-pass-through-qparams``, ``pass-through-reads-shared-codes``, ``requantize-stale-bias``,
   ``activation-before-data-movement`` (passes): parameters changed in 2 flow through MaxPool,
   Reshape, ...; a MaxPool reads the codes its input's quantizer already computes when its own
   output quantizer is the same; int32 biases follow the input scales; activations go in front of
   data movement that reads an int8 DQ.
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

from kenosis_rewrite.calibration.feed_files import feeds_from_path, is_feed_path
from kenosis_rewrite.core import model_io
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import InvalidModelError, KenosisError, RewriteError
from kenosis_rewrite.placement.fix_pass import TARGETS, CallerData, CleanupPass, FixPass, _check_target, apply_rules, rules
from kenosis_rewrite.placement.guard import Guard
from kenosis_rewrite.placement.guarded import _guarded_fix, with_float_kernel_steps
from kenosis_rewrite.placement.opset_upgrade import needs_per_axis_upgrade, upgraded_for_per_axis
from kenosis_rewrite.placement.passes import output_quantizers
from kenosis_rewrite.placement.passes.pin_shapes import pinned_model
from kenosis_rewrite.placement.passes.requantize_after_movement import RULE_NAME as REQUANTIZE_AFTER_DATA_MOVEMENT
from kenosis_rewrite.placement.targets import get_target

__all__ = ["TARGETS", "FixPass", "rules", "fix", "fix_with_report", "fix_loaded", "GUARD_MAX_BYTES"]

# By default the run-time guard runs on models whose tensors add up to at most this: it holds the
# input, the output and a float reference in ONNX Runtime at once (about 6x the model in memory).
GUARD_MAX_BYTES = 256 << 20
# the target whose float kernels fix() asks this machine's ONNX Runtime about (passes.float_kernel_weights)
FLOAT_KERNEL_TARGET = "ort-cpu"
# the calibration feeds output quantizer ranges are measured on: a range from a few feeds clips the
# next input's extremes (one run each, without graph optimizations: cheap)
RANGE_FEEDS = 64


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
                f"{output_quantizers.RULE_NAME}: {unbounded} Conv output(s) reach no quantizer, so ORT "
                "runs them in float; pass calibration= feeds to give them measured output quantizers"
            )
        return {}
    try:
        ranges = output_quantizers.measure_output_ranges(before, calibration[:RANGE_FEEDS])
    except Exception as error:  # noqa: BLE001 - the model cannot be run: the rule does not apply
        report_notes.append(f"{output_quantizers.RULE_NAME}: could not measure output ranges ({str(error)[:200]})")
        return {}
    report_notes.append(f"{output_quantizers.RULE_NAME}: output ranges of {len(ranges)} op(s) measured on the calibration feeds")
    return ranges


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
    # MatMulNBits form, or all float after an earlier fix(): what fix() would make; nothing to do
    if model_io.ALREADY_FUSED_NOTE in first.notes or model_io.ALL_FLOAT_NOTE in first.notes:
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
    data = CallerData(_output_ranges(before, target, calibration, notes), calibration or ())
    # the input as given (its graph alone when not in memory), taken now: the rewrite may work on
    # ``first.model`` itself
    reference = before if before is not None else model_io.graph_only_proto(first.model)
    loaded, report, after = _guarded_fix(model, first, target, guard, data)
    if in_memory and after is None:
        after = model_io.in_memory_proto(loaded.model)
    if target == FLOAT_KERNEL_TARGET:
        after = with_float_kernel_steps(loaded, report, after, guard)
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
    if guard is not None and after is not None and report.changes:
        report.guard_fidelity = guard.fidelity_summary(after)
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
            the input bit for bit where every change claims exactness, and lose at most 0.002
            cosine per output, in the mean over feeds and on the worst feed, against a yardstick (FP32
            when given, else the input with its activation Q/DQ removed) on ``calibration`` or random
            feeds; rules that break this are undone where they cost it (per site where the rule
            records sites) and reported, with the fidelity before and after.
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

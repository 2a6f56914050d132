"""quantize_static's output made fast and faithful: placement, corrections, and the check that keeps them honest.

Stages of :func:`kenosis_rewrite.quantize` after quantize_static: :func:`placed` runs ``fix()``'s
rules and output protection, :func:`start_corrections` weight rounding and bias correction,
:func:`finished` the FP32 fallbacks, cleanup and the checker, and :func:`checked_corrections` undoes
the corrections where they grew the output's error.
"""

from __future__ import annotations

import dataclasses
import functools

import onnx
import onnx_ir as ir

from kenosis_rewrite.accuracy import sensitivity
from kenosis_rewrite.accuracy.bias_correction import RULE_NAME as BIAS_CORRECTION
from kenosis_rewrite.accuracy.bias_correction import correct_biases
from kenosis_rewrite.accuracy.broken_outputs import mend_broken_outputs
from kenosis_rewrite.accuracy.protection import OutputProtectionPass
from kenosis_rewrite.accuracy.weight_rounding import RULE_NAME as WEIGHT_ROUNDING
from kenosis_rewrite.accuracy.weight_rounding import FactorsInBackground, round_weights
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.placement.fix_pass import CleanupPass, FixPass, apply_rules
from kenosis_rewrite.placement.passes.concat_on_codes import RULE_NAME as CONCAT_ON_CODES
from kenosis_rewrite.placement.passes.dynamic_activations import DynamicActivationsPass
from kenosis_rewrite.placement.passes.float_readers import FloatReadersReadFloatPass
from kenosis_rewrite.placement.passes.output_quantizers import RULE_NAME as OUTPUT_QUANTIZERS
from kenosis_rewrite.placement.passes.requantize_after_movement import RULE_NAME as REQUANTIZE_AFTER_DATA_MOVEMENT
from kenosis_rewrite.placement.pipeline import _latency_placement
from kenosis_rewrite.placement.rules.integer_matmul_bias import RULE_NAME as INTEGER_MATMUL_BIAS
from kenosis_rewrite.quantization.accuracy_control import hold_metric
from kenosis_rewrite.quantization.calibration_stage import Calibrated
from kenosis_rewrite.quantization.configuration import Configuration
from kenosis_rewrite.quantization.graph_preparation import QuantizableGraph, mark_deleted_activations, unmark
from kenosis_rewrite.quantization.plan import WEIGHTED_PLAN_OPS, WEIGHTED_PLANS
from kenosis_rewrite.quantization.settings import (
    CORRECTION_CHECK_FEEDS,
    CORRECTION_ERROR_GROWTH,
    FIDELITY_FEEDS,
    QuantizeSettings,
)

# the integer MatMuls keep their QDQ form until bias correction and the FP32 fallbacks have read it
# and so do the Concats on one grid, until then in QDQ form too
DEFERRED_RULES = (INTEGER_MATMUL_BIAS, CONCAT_ON_CODES)


@dataclasses.dataclass
class Corrections:
    """The model before weight rounding and bias correction, and its outputs (in the background)
    on the first ``CORRECTION_CHECK_FEEDS`` feeds; None where neither ran."""

    uncorrected: onnx.ModelProto
    uncorrected_runs: fidelity.Background


def placed(qdq: onnx.ModelProto, graph: QuantizableGraph, config: Configuration, settings: QuantizeSettings,
           report: FixReport) -> ir.Model:
    """quantize_static's ``qdq`` after ``fix()``'s rules for the target (the deferred ones aside) and,
    with ``protect_outputs``, the graph outputs leaving in float."""
    model = ir.serde.deserialize_model(qdq)
    qdq_params.small_constants_as_arrays(model)
    quantized_nodes = {node.name for node in model.graph if node.name}
    mark_deleted_activations(graph.proto, model, quantized_nodes)
    # the weighted plan leaves its layers' outputs float by design: no output quantizers to add (its
    # refusals read "no range measured ... pass calibration= feeds" beside the feeds the user passed)
    planned_float = (OUTPUT_QUANTIZERS,) if config.plan in WEIGHTED_PLANS else ()
    FixPass(settings.target, report, disabled=DEFERRED_RULES + planned_float)(model)
    if config.plan in WEIGHTED_PLANS:
        FloatReadersReadFloatPass(report, integer_ops=WEIGHTED_PLAN_OPS)(model)
    if settings.protect_outputs:
        OutputProtectionPass(report, float_graph=graph.prepared.graph, quantized_nodes=quantized_nodes)(model)
        # on the int8 targets, the pair after data movement that now ends where the output's Q/DQ
        # was taken away (ORT would insert it itself, stale, and refuse the model: an sklearn MLP's
        # Add -> Reshape -> output)
        apply_rules(model, settings.target, (REQUANTIZE_AFTER_DATA_MOVEMENT,), report)
    return model


def start_corrections(model: ir.Model, graph: QuantizableGraph, calibrated: Calibrated, feeds: list[dict],
                      float_runs: fidelity.ReferenceRuns, factors: FactorsInBackground | None,
                      settings: QuantizeSettings, report: FixReport) -> Corrections | None:
    """Weight rounding and bias correction of ``model`` in place; what they started from."""
    if not settings.corrected:
        return None
    uncorrected = ir.serde.serialize_model(model)  # what the corrections start from
    if settings.weight_rounding:
        rounded = round_weights(graph.proto, model, feeds, report, gathered=calibrated.layer_inputs, factors=factors)
        report.note(f"weight rounding: {rounded} layers")
    # on the core bias correction leaves idle; not beside weight rounding, whose factors of H^-1
    # are still being computed on it
    uncorrected_runs = fidelity.Background(functools.partial(
        fidelity.run, uncorrected, float_runs.feeds[:CORRECTION_CHECK_FEEDS], one_core=True))
    if settings.bias_correction:
        corrected_layers = correct_biases(graph.proto, model, feeds, report)
        report.note(f"bias correction: {corrected_layers} layers")
    return Corrections(uncorrected, uncorrected_runs)


def _fp32_fallbacks(model: ir.Model, proto: onnx.ModelProto, feeds: list[dict], settings: QuantizeSettings,
                    report: FixReport) -> None:
    """Layers back to FP32 by SNR threshold or target cosine (sensitivity analysis)."""
    chosen, analysis, reasons, unreached = sensitivity.select_fp32_layers(
        proto, model, feeds, threshold_db=settings.snr_threshold_db, target_cosine=settings.target_cosine
    )
    sensitivity.keep_fp32(model, chosen, report, reasons, {layer.name: layer.float_weight for layer in analysis})
    report.note(f"sensitivity: {len(chosen)} of {len(analysis)} layers kept in FP32")
    if unreached:
        report.note(f"sensitivity: {unreached}")


def finished(model: ir.Model, graph: QuantizableGraph, config: Configuration, feeds: list[dict],
             float_runs: fidelity.ReferenceRuns, settings: QuantizeSettings, report: FixReport
             ) -> tuple[ir.Model, onnx.ModelProto, list]:
    """The steps after the corrections; the model, its proto and its outputs on the fidelity feeds."""
    if settings.snr_threshold_db is not None or settings.target_cosine is not None:
        _fp32_fallbacks(model, graph.proto, feeds, settings, report)
    # an output the pooled fidelity hides (a small head far below the rest) gets its culprit layer back in FP32
    mend_broken_outputs(model, graph.proto, feeds, report)
    if settings.validate is not None:
        hold_metric(float_runs.model, graph.proto, model, feeds, settings.validate, settings.max_drop, report)
    CleanupPass()(model)
    if settings.optimize_for == "latency":
        _latency_placement(model, report, feeds, settings.latency_budget_s, 1)
    # the weighted plan quantizes activations at run time: after everything that reads the QDQ form
    lowered = config.plan == "weighted" and DynamicActivationsPass(report)(model).modified
    # and that pair again where an FP32 fallback took a Q/DQ away
    if apply_rules(model, settings.target, (*DEFERRED_RULES, REQUANTIZE_AFTER_DATA_MOVEMENT), report) or lowered:
        CleanupPass()(model)
    unmark(model)
    out = ir.serde.serialize_model(model)
    out_bytes = out.SerializeToString()  # once for the checker and the session
    onnx.checker.check_model(out_bytes, full_check=True)
    return model, out, fidelity.run(out_bytes, float_runs.feeds[:FIDELITY_FEEDS])


def checked_corrections(model: ir.Model, corrections: Corrections | None, expected: list, finish,
                        report: FixReport) -> tuple[ir.Model, onnx.ModelProto, list]:
    """``finish(model)``; where the corrections grew the output's error against the model as given
    (``expected``), ``finish`` again on the model without them, reported once."""
    marks = (len(report.changes), len(report.refusals), len(report.notes))
    model, out, runs = finish(model)
    grown = (_corrections_grown_error(expected, runs, corrections.uncorrected_runs.result())
             if corrections is not None else None)
    if grown is None:
        return model, out, runs
    del report.changes[marks[0]:], report.refusals[marks[1]:], report.notes[marks[2]:]
    report.changes[:] = [change for change in report.changes if change.rule not in (WEIGHT_ROUNDING, BIAS_CORRECTION)]
    report.note(f"weight rounding and bias correction undone: on {CORRECTION_CHECK_FEEDS} calibration feeds the "
                f"output's cosine against the model as given was {grown[0]:.5f} without them and {grown[1]:.5f} with them")
    return finish(ir.serde.deserialize_model(corrections.uncorrected))


def plain_runs(float_runs: fidelity.ReferenceRuns, qdq: onnx.ModelProto | None) -> tuple[list, list | None]:
    """The outputs, on the first ``FIDELITY_FEEDS`` feeds, of the model as given and of
    quantize_static's model (None without one), computed on one core."""
    expected = float_runs.outputs(True, FIDELITY_FEEDS, one_core=True)
    return expected, None if qdq is None else fidelity.run(qdq, float_runs.feeds[:len(expected)], one_core=True)


def _corrections_grown_error(expected: list, runs: list, uncorrected_runs: list) -> tuple[float, float] | None:
    """``(cosine without, cosine with)`` when weight rounding and bias correction grew the output
    error (``1 - cosine`` against the model as given, on the first ``CORRECTION_CHECK_FEEDS`` feeds:
    ``runs`` with them, ``uncorrected_runs`` without) more than ``CORRECTION_ERROR_GROWTH`` times,
    else None. Both fit each layer on its own to the calibration feeds; on a model whose layers'
    errors do not add up independently they can move the output away, on those feeds too
    (PP-OCRv5's recognizer: 0.971 without them, 0.948 with, min/max ranges)."""
    count = len(uncorrected_runs)
    before = fidelity.scores(expected[:count], uncorrected_runs)["cosine"]
    after = fidelity.scores(expected[:count], runs[:count])["cosine"]
    return None if 1.0 - after <= CORRECTION_ERROR_GROWTH * (1.0 - before) else (before, after)

"""``quantize()``: the whole pipeline, as a layer over onnxruntime's own quantizer.

1. Calibration feeds: the user's (feed dicts, a folder of images) or self-calibration
   (:func:`kenosis_rewrite.calibration.synthetic_feeds`) when there are none.
   Activation equalization: narrow channels of a Conv output read only by depthwise Convs are
   stretched, the depthwise weights divided back (:mod:`kenosis_rewrite.accuracy.equalization`), on by default.
2. Metadata-input protection: nodes reading tensors computed only from non-image float inputs
   are excluded from quantization (:mod:`kenosis_rewrite.accuracy.protection`).
3. ``onnxruntime.quantization.quantize_static`` in the configuration that measures best for the
   target: on x86 ORT CPU uint8 activations (asymmetric, zero points represent 0.0 exactly),
   int8 symmetric weights, per-channel by default, int32 biases; symmetric int8 for TensorRT/NPU.
   Ranges come from :func:`kenosis_rewrite.calibration.collect_ranges` (min/max, percentile,
   entropy or MSE). Which ops it quantizes is the plan (:mod:`kenosis_rewrite.quantization.plan`): every op
   for CNNs, only the weighted ops' inputs for transformers (LayerNorm, Softmax, GELU, attention
   MatMuls and the MatMuls' outputs stay float, as ORT runs them best; the ops that run in float
   read the float tensors, not the quantized copies made for the MatMuls).
4. :func:`kenosis_rewrite.fix` for the target.
5. Model-output protection (outputs leave in float), on by default.
6. Weight rounding: the int8 weights of small fan-in layers (stem, depthwise) are rounded by their
   output error on the calibration inputs, GPTQ-style (:mod:`kenosis_rewrite.accuracy.weight_rounding`), on
   by default. Bias correction: each Conv/Gemm's mean output shift on the calibration feeds moves into its
   int32 bias (:mod:`kenosis_rewrite.accuracy.bias_correction`), on by default.
7. SNR sensitivity: layers below ``snr_threshold_db``, or the fewest layers that bring the output
   cosine to ``target_cosine`` on the calibration feeds, go back to FP32
   (:mod:`kenosis_rewrite.accuracy.sensitivity`).
8. Optionally, latency-aware placement (``optimize_for="latency"``).
9. Never below the baseline: plain quantize_static of the same configuration is measured beside
   the result, and where it is closer to the model as given, fix() of it is returned instead
   (:mod:`kenosis_rewrite.quantization.baseline`).

A float16 graph is made float32 exactly first and quantized as such; its float16 inputs and outputs
come back float16, a Cast at each (:mod:`kenosis_rewrite.canonicalization.float16`).

Every decision is in the returned :class:`FixReport`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite import calibration as calib
from kenosis_rewrite.accuracy import sensitivity
from kenosis_rewrite.accuracy.weight_rounding import FactorsInBackground
from kenosis_rewrite.canonicalization import float16
from kenosis_rewrite.core import fidelity, model_io
from kenosis_rewrite.core.gc_freeze import caller_objects_frozen
from kenosis_rewrite.core.ort_quantize import quiet_logger
from kenosis_rewrite.core.progress import progress_bar
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import KenosisError, ModelTooLargeError, one_line
from kenosis_rewrite.quantization import baseline, corrections
from kenosis_rewrite.quantization.accuracy_control import check_metric_options
from kenosis_rewrite.quantization.calibration_stage import Calibrated, calibrate, calibration_feeds
from kenosis_rewrite.quantization.configuration import Configuration, configure
from kenosis_rewrite.quantization.graph_preparation import canonical_graph, quantizable_graph
from kenosis_rewrite.quantization.settings import FIDELITY_FEEDS, QuantizeSettings

__all__ = ["quantize"]


@caller_objects_frozen
def quantize(
    float_model: model_io.ModelLike,
    calibration: Iterable[Mapping[str, np.ndarray]] | str | os.PathLike | None = None,
    *,
    per_channel: bool | str = True,
    target: str = "ort-cpu",
    calibration_samples: int = 32,
    calibration_method: str | None = None,
    protect_outputs: bool = True,
    protect_metadata_inputs: bool = True,
    snr_threshold_db: float | None = None,
    target_cosine: float | None = None,
    optimize_for: str | None = None,
    latency_budget_s: float = 60.0,
    seed: int = 0,
    canonicalize: bool = True,
    bias_correction: bool = True,
    weight_rounding: bool = True,
    equalization: bool = True,
    plan: str = "auto",
    share_concat_ranges: bool = True,
    compare_quantize_static: bool = False,
    return_report: bool = False,
    progress: bool = False,
    validate: Callable[[onnx.ModelProto], float] | None = None,
    max_drop: float | None = None,
):
    """Quantize an FP32 model for ``target`` and return a fixed, protected QDQ model.

    Args:
        float_model: the FP32 model (ModelProto, onnx_ir.Model or path); a float16 one is quantized
            in float32, its float16 inputs and outputs kept (calibration feeds float16 or float32).
        calibration: feed dicts, a folder of images, ``"synthetic"`` or None (self-calibration).
        per_channel: per-channel int8 weights (True, recommended), per-tensor (False), or
            ``"auto"``: per-channel only for weights it improves by >= 6 dB SNR (faster kernels elsewhere).
        target: placement target (see :mod:`kenosis_rewrite.placement.targets`).
        calibration_samples: how many calibration samples to use.
        calibration_method: ``"percentile"`` (99.99%, the default of the full plan on graphs without
            attention: measured best or equal on the zoo's CNNs, e.g. +5.4 dB SQNR on the YOLOX
            detector), ``"minmax"`` (the default wherever the graph has attention, whichever the
            plan: a transformer's outlier channels are features; with every op quantized, the ViT's
            mean heat-map cosine was 0.99648 with percentile ranges and 0.99927 with min/max, and
            PP-OCRv5's recognizer decoded 0 and 6 of 8 text lines as FP32 does), ``"entropy"``, ``"mse"``.
            Whatever the method, the tensors whose values reach a graph output unchanged in order (a
            detector head's logits, scores and boxes) take their min/max, a Sigmoid/Softmax/Tanh there
            its whole range (:mod:`kenosis_rewrite.calibration.output_extremes`).
        protect_outputs: keep graph outputs in float (on by default).
        protect_metadata_inputs: never quantize tensors computed only from non-image inputs.
        snr_threshold_db: keep in FP32 every layer whose weight SNR or local SQNR is below this.
        target_cosine: keep in FP32 the fewest layers that bring the output cosine (against FP32,
            on the calibration feeds) to this value.
        optimize_for: ``"latency"`` adds measured per-layer integer/float placement.
        canonicalize: run :func:`kenosis_rewrite.prepare` on the FP32 graph first (fold shape
            arithmetic and run-time padding, decomposed BatchNorm/HardSwish, NHWC Transposes),
            verified against the model as given on the calibration feeds.
        share_concat_ranges: give every Concat's inputs and output one range (their union), so ORT
            concatenates the quantized bytes instead of requantizing each input
            (:mod:`kenosis_rewrite.calibration.shared_scales`; YOLOv8n 1.67 -> 1.80x FP32).
        bias_correction: move each Conv/Gemm's mean output shift into its int32 bias
            (:mod:`kenosis_rewrite.accuracy.bias_correction`; on by default: measured better on the zoo,
            with real calibration photos and with self-calibration alike).
        weight_rounding: round the int8 weights of small fan-in layers by their output error on the
            calibration inputs (:mod:`kenosis_rewrite.accuracy.weight_rounding`; on by default: on 16 scenes /
            100 held-out objects, with equalization, MobileNetV2 0.99401 -> 0.99565 cosine,
            EfficientNet-Lite0 0.99312 -> 0.99762, PP-OCR cls 0.98800 -> 0.99032, PP-LCNet 0.96368
            -> 0.96376, the two detectors +0.0001; see the README). Both are undone together
            where they grow the output error (against the model as given, on the first
            ``CORRECTION_CHECK_FEEDS`` calibration feeds) more than ``CORRECTION_ERROR_GROWTH``
            times: ddddocr's YOLOX detector (84 held-out scenes: 0.99235 with them, 0.99759
            without) and PP-OCRv5's recognizer; the report says so.
        equalization: stretch the narrow channels of activations read only by depthwise Convs
            (:mod:`kenosis_rewrite.accuracy.equalization`; on by default, measured with weight_rounding above).
        plan: which ops to quantize (:mod:`kenosis_rewrite.quantization.plan`): ``"full"`` (every op, CNNs),
            ``"weighted"`` (only the inputs of constant-weight MatMul/Gemm, with their own range on
            every run, their outputs float: transformers), ``"weighted-static"`` (the same with
            calibrated input ranges), or
            ``"auto"`` (``"weighted"`` where the graph has attention).
        compare_quantize_static: also run quantize_static's own model on the feeds the result is
            checked on and report its fidelity beside the result's (``report.fidelity["quantize_static"]``).
            Off by default: a second quantized model's session and runs (EfficientNet-Lite0: 0.3 of
            2.7 s), which the model returned does not need.
        validate: the user's metric, ``fn(model: onnx.ModelProto) -> float`` (higher is better), with
            ``max_drop``: the quantized model must score at least ``fn(float_model) - max_drop``;
            where it does not, the fewest layers the SNR sensitivity ranks weakest return to FP32
            (:mod:`kenosis_rewrite.quantization.accuracy_control`, which also makes ready-made metrics:
            top-1 agreement, box F1, map IoU, CTC lines against FP32). The report gives the scores, the
            evaluations spent and the speed it cost.
        max_drop: how much of ``validate``'s score quantization may cost (with ``validate``).
        progress: a tqdm bar over the stages below (needs tqdm, the ``progress`` extra; the command
            line shows it on a terminal). Silent by default.

    Returns:
        The model (same kind as given; a path gives a ModelProto), or ``(model, FixReport)``.
    """
    settings = QuantizeSettings(
        calibration=calibration, per_channel=per_channel, target=target, calibration_samples=calibration_samples,
        calibration_method=calibration_method, protect_outputs=protect_outputs,
        protect_metadata_inputs=protect_metadata_inputs, snr_threshold_db=snr_threshold_db,
        target_cosine=target_cosine, optimize_for=optimize_for, latency_budget_s=latency_budget_s, seed=seed,
        canonicalize=canonicalize, bias_correction=bias_correction, weight_rounding=weight_rounding,
        equalization=equalization, plan=plan, share_concat_ranges=share_concat_ranges,
        compare_quantize_static=compare_quantize_static, validate=validate, max_drop=max_drop)
    with _stages(progress) as stage:
        return _quantize(float_model, settings, stage, return_report)


_STAGES = ("load", "calibration feeds", "prepare", "quantizable graph", "configure", "calibrate",
           "quantize_static", "fix", "corrections", "fidelity", "baseline")


@contextlib.contextmanager
def _stages(enabled: bool) -> Iterator[Callable[[str], None]]:
    """``stage(name)``, called as each of ``_STAGES`` starts: a bar's step when ``enabled``, else nothing."""
    bar = progress_bar(enabled, total=len(_STAGES), description="quantize", unit="stage")

    def stage(name: str) -> None:
        if bar is not None:
            bar.update(_STAGES.index(name) - bar.n)
            bar.set_postfix_str(name, refresh=True)

    try:
        yield stage
    finally:
        if bar is not None:
            bar.close()


def _quantize(float_model: model_io.ModelLike, settings: QuantizeSettings, stage: Callable[[str], None],
              return_report: bool):
    """quantize()'s body, calling ``stage`` as each stage starts."""
    stage("load")
    loaded = _loaded_float_model(float_model, settings)
    report = FixReport(target=settings.target)
    half, settings = _float32_graph(loaded.model, settings, report)
    original = ir.serde.serialize_model(loaded.model)
    stage("calibration feeds")
    feeds, source = calibration_feeds(original, settings.calibration, settings.calibration_samples, settings.seed)
    if half is not None:  # the caller's float16 arrays, for the float32 graph (exact)
        feeds = float16.float32_feeds(feeds, half)
    report.note(f"calibration: {source}")
    # the model as given on the calibration feeds: prepare() verifies against these runs, the final
    # fidelity reuses them
    float_runs = fidelity.ReferenceRuns(original, feeds)
    stage("prepare")
    prepared, maxima = canonical_graph(original, loaded.model, feeds, float_runs, settings, report)
    stage("quantizable graph")
    graph = quantizable_graph(prepared, feeds, maxima, settings, report)
    stage("configure")
    config = configure(graph.proto, graph.protected_graph, graph.per_channel, settings, report)
    stage("calibrate")
    calibrated = calibrate(graph, config, feeds, settings, report)
    # the final fidelity's runs of the model as given, on the core quantize_static's Python leaves
    # idle (started later, they took a core from bias correction's probe); float_runs is the worker's
    float_runs.prefetch((True, FIDELITY_FEEDS))
    # and weight rounding's factors of H^-1, which need only the gathered moments (LAPACK, no GIL)
    layer_inputs = calibrated.layer_inputs
    factors = FactorsInBackground(layer_inputs) if layer_inputs is not None else None
    stage("quantize_static")
    qdq = _quantize_static(calibrated, config)
    # quantize_static's own runs (when compared) after those, on the idle core while the passes
    # below hold the other with Python; float_runs is the worker's until then
    compared = qdq if settings.compare_quantize_static else None
    plain_runs = fidelity.Background(functools.partial(corrections.plain_runs, float_runs, compared))
    stage("fix")
    model = corrections.placed(qdq, graph, config, settings, report)
    stage("corrections")
    started = corrections.start_corrections(model, graph, calibrated, feeds, float_runs, factors, settings, report)
    finish = functools.partial(corrections.finished, graph=graph, config=config, feeds=feeds, float_runs=float_runs,
                               settings=settings, report=report)
    # against the model as given: canonicalization is part of what the user gets
    expected, plain = plain_runs.result()
    model, out, runs = corrections.checked_corrections(model, started, expected, finish, report)
    stage("fidelity")
    _report_fidelity(report, expected, plain, runs, settings)
    stage("baseline")
    replacement = baseline.never_below(original, out, feeds, expected, config.options, settings, report)
    if replacement is not None and settings.calibration_method is None and half is None:
        retried = _retried_with_other_ranges(float_model, settings, original, feeds, replacement, len(expected))
        if retried is not None:
            return retried if return_report else retried[0]
    if replacement is not None:
        out, model = replacement, ir.serde.deserialize_model(replacement)
    if half is not None:
        float16.cast_interface(model, half)
        out = ir.serde.serialize_model(model)
    result = model if loaded.returns == "ir" else out
    return (result, report) if return_report else result


def _retried_with_other_ranges(float_model: model_io.ModelLike, settings: QuantizeSettings, original: onnx.ModelProto,
                               feeds: list[dict], replacement: onnx.ModelProto, count: int) -> tuple | None:
    """quantize() once more with :data:`baseline.RETRY_METHOD` ranges, as ``(result, report)`` where it is
    closer to the model as given than ``replacement`` on the baseline's held-back feeds; else None."""
    try:
        result, report = _quantize(float_model, dataclasses.replace(settings, calibration_method=baseline.RETRY_METHOD),
                                   lambda name: None, True)
    except KenosisError:
        return None
    proto = result if isinstance(result, onnx.ModelProto) else ir.serde.serialize_model(result)
    theirs = baseline.held_back_cosine(original, replacement, feeds, count)
    ours = baseline.held_back_cosine(original, proto, feeds, count)
    if ours <= theirs + baseline.margin(theirs):
        return None
    report.note(f"calibration method: {baseline.RETRY_METHOD}, chosen by measuring: with the default ranges plain "
                f"quantize_static came out closer to the model as given; on {count} held-back blends of the calibration "
                f"feeds {baseline.RETRY_METHOD} ranges score {ours:.5f} against the replacement's {theirs:.5f}")
    return result, report


def _loaded_float_model(float_model: model_io.ModelLike, settings: QuantizeSettings) -> model_io.LoadedModel:
    """The FP32 model, refused early where quantize() cannot take it."""
    loaded = model_io.load(float_model, require_qdq=False)
    model_io.check_float(loaded.model, "quantize()")
    sensitivity.check_target_cosine(settings.target_cosine)  # before the work, not after it
    check_metric_options(settings.validate, settings.max_drop)
    if loaded.large:
        raise ModelTooLargeError(
            "quantize() calibrates activations by running the whole model in ONNX Runtime and quantizes it "
            "with quantize_static in memory, which a model over 2 GB does not fit. Quantize its weights "
            "with quantize_weights() (weight-only int4/int8, one weight at a time), then fix() that."
        )
    return loaded


def _float32_graph(model: ir.Model, settings: QuantizeSettings, report: FixReport
                   ) -> tuple[float16.Float16Interface | None, QuantizeSettings]:
    """A float16 ``model`` made float32 in place (None where it has no float16), and ``settings``
    with the caller's metric given the model as the caller will get it (float16 inputs and outputs)."""
    half = float16.to_float32(model)
    if half is None:
        return None, settings
    report.note(half.note("float16 graph quantized in float32") + "; fidelity is against this float32 graph")
    if settings.validate is not None:
        settings = dataclasses.replace(settings, validate=functools.partial(_float16_metric, settings.validate, half))
    return half, settings


def _float16_metric(validate: Callable[[onnx.ModelProto], float], half: float16.Float16Interface,
                    model: onnx.ModelProto) -> float:
    """``validate`` of ``model`` with its float16 inputs and outputs given back."""
    converted = ir.serde.deserialize_model(model)
    float16.cast_interface(converted, half)
    return validate(ir.serde.serialize_model(converted))


def _quantize_static(calibrated: Calibrated, config: Configuration) -> onnx.ModelProto:
    """onnxruntime's quantize_static with ``calibrated.ranges``; its failures as a KenosisError."""
    try:
        with quiet_logger():
            return calib.quantize_with_ranges(calibrated.measured, calibrated.ranges, serialised=True, **config.options)
    except KenosisError:
        raise
    except Exception as error:  # noqa: BLE001 - ORT's quantizer raises many unrelated types
        raise KenosisError(f"onnxruntime's quantize_static failed on this model: {one_line(error)}") from error


def _report_fidelity(report: FixReport, expected: list, plain: list | None, runs: list,
                     settings: QuantizeSettings) -> None:
    """The result's fidelity against the model as given (and quantize_static's, when compared)."""
    report.fidelity = {} if plain is None else {"quantize_static": fidelity.scores(expected, plain)}
    report.fidelity["quantized"] = fidelity.scores(expected, runs)
    if settings.self_calibrated:
        # the ranges and this fidelity come from made-up inputs: on real data the same model has
        # scored far lower (an LSTM state input spanning +-80: one output all zeros, 0.999 here)
        report.note("fidelity is measured on the synthetic calibration inputs, which need not drive the model "
                    "as real data does: the ranges came from them too. Pass calibration= feeds of real data (or "
                    "a folder of images) for ranges and a fidelity that hold on real inputs")

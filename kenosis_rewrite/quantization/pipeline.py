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

Every decision is in the returned :class:`FixReport`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import common as common_passes
from onnxruntime.quantization import QuantFormat, QuantType

from kenosis_rewrite.core import model_io
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.accuracy import sensitivity
from kenosis_rewrite.graph import value_range
from kenosis_rewrite import calibration as calib
from kenosis_rewrite.core.gc_freeze import caller_objects_frozen
from kenosis_rewrite.accuracy.bias_correction import RULE_NAME as BIAS_CORRECTION
from kenosis_rewrite.accuracy.bias_correction import correct_biases
from kenosis_rewrite.calibration.ort_static import ranges_the_quantizer_sets
from kenosis_rewrite.calibration.output_extremes import mixed_output_concats, output_value_tensors
from kenosis_rewrite.calibration.shared_scales import SAME_SCALE_OPS, shared_concat_ranges
from kenosis_rewrite.canonicalization.pipeline import prepare_serialized
from kenosis_rewrite.accuracy.equalization import ChannelMaxima, equalize
from kenosis_rewrite.errors import ControlFlowError, KenosisError, ModelTooLargeError, one_line
from kenosis_rewrite.core.ort_quantize import quiet_logger
from kenosis_rewrite.placement.passes.concat_on_codes import RULE_NAME as CONCAT_ON_CODES
from kenosis_rewrite.placement.passes.dynamic_activations import DynamicActivationsPass
from kenosis_rewrite.placement.passes.float_readers import FloatReadersReadFloatPass
from kenosis_rewrite._upstream.lift_constants import LiftAllConstantsPass
from kenosis_rewrite.placement.passes.output_quantizers import RULE_NAME as OUTPUT_QUANTIZERS
from kenosis_rewrite.placement.passes.requantize_after_movement import RULE_NAME as REQUANTIZE_AFTER_DATA_MOVEMENT
from kenosis_rewrite.placement.pipeline import CleanupPass, FixPass, _latency_placement, apply_rules
from kenosis_rewrite.quantization.plan import WEIGHTED_OPS, WEIGHTED_PLANS, choose_plan, has_attention, plan_options
from kenosis_rewrite.accuracy.protection import METADATA_RULE, OutputProtectionPass, protected_nodes, unshare_protected_constants
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.placement.rules.integer_matmul_bias import RULE_NAME as INTEGER_MATMUL_BIAS
from kenosis_rewrite.placement.targets import get_target
from kenosis_rewrite.accuracy.weight_rounding import RULE_NAME as WEIGHT_ROUNDING
from kenosis_rewrite.accuracy.weight_rounding import FactorsInBackground, InputMoments, round_weights

FIDELITY_FEEDS = 8  # the calibration feeds the report's fidelity compares on
# the first of them, on which weight rounding and bias correction must not move the output away: by
# more than this factor on its error (1 - cosine). Measured, 16 scenes calibrating, their error on 4
# of them against 84 held-out: YOLOX (ddddocr det) x4.4 on the 4, held-out cosine 0.99235 with them,
# 0.99759 without; PP-OCRv5 rec x6.6; PP-LCNet x1.18 (held-out 0.98965 with, 0.9891 without: noise
# on 4 feeds), the layout YOLO x1.01, the ViT x1.2 (kept)
CORRECTION_CHECK_FEEDS = 4
CORRECTION_ERROR_GROWTH = 1.5

__all__ = ["quantize", "quantize_static_options"]


def quantize_static_options(target: str, per_channel: bool) -> dict:
    """quantize_static keyword arguments that measure best for ``target``."""
    get_target(target)
    symmetric = target in ("tensorrt", "npu")
    return {
        "quant_format": QuantFormat.QDQ,
        "activation_type": QuantType.QInt8 if symmetric or target == "ort-cpu-arm" else QuantType.QUInt8,
        "weight_type": QuantType.QInt8,
        "per_channel": per_channel,
        "extra_options": {"ActivationSymmetric": symmetric, "WeightSymmetric": True},
    }


# layers worth quantizing: what a model that quantize() leaves float entirely still computes
_LAYER_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "LSTM", "GRU", "RNN"})


def _layers_in_bodies(graph: onnx.GraphProto) -> tuple[collections.Counter, list[str]]:
    """The layers (:data:`_LAYER_OPS`) inside the If/Loop/Scan bodies of ``graph``'s nodes, by op
    type, and the control-flow nodes that hold them (outermost)."""
    counts: collections.Counter = collections.Counter()
    holders: list[str] = []
    for node in graph.node:
        for attribute in node.attribute:
            for body in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs):
                inner = collections.Counter(n.op_type for n in body.node if n.op_type in _LAYER_OPS)
                nested, _ = _layers_in_bodies(body)
                if inner or nested:
                    counts += inner + nested
                    holders.append(node.name or node.op_type)
    return counts, list(dict.fromkeys(holders))


def _check_control_flow(proto: onnx.ModelProto, report: FixReport) -> None:
    """quantize_static quantizes the main graph only: refuse a model whose layers are all inside
    If/Loop/Scan bodies (the result would be the FP32 model, reported as unchanged), and say which
    layers stay float where only some are."""
    inside, holders = _layers_in_bodies(proto.graph)
    if not inside:
        return
    found = ", ".join(f"{count} {op_type}" for op_type, count in inside.most_common())
    where = ", ".join(repr(name) for name in holders[:3]) + (" ..." if len(holders) > 3 else "")
    if not any(node.op_type in _LAYER_OPS for node in proto.graph.node):
        raise ControlFlowError(
            f"quantize() has nothing to quantize outside control flow: the model's {found} are inside the bodies "
            f"of {where}, and quantize_static quantizes only the main graph, so the result would be the FP32 model. "
            "Export the network without control flow around it (one model per branch, its condition fixed, for "
            "instance), then quantize that.")
    report.note(f"quantize: {found} inside the bodies of {where} stay FP32 (quantize_static quantizes only the main graph)")


def _gemm_row_biases_as_vectors(model: ir.Model, report: FixReport) -> None:
    """A Gemm's constant ``C`` of shape ``[1, N]`` as ``[N]`` (the same broadcast onto ``(M, N)``):
    quantize_static's per-channel int32-bias check indexes ``C`` channel by channel and fails on a
    row (``ValueError: The truth value of an array ...``; ONNX Runtime's basic optimizer writes such
    a ``C`` when it fuses MatMul + Add of a ``[1, N]`` bias, as on magika 1.0.3's model)."""
    names = qdq_params.NameAllocator(model.graph)
    for node in model.graph:
        if node.op_type != "Gemm" or node.domain not in qdq_params.DEFAULT_DOMAINS or len(node.inputs) < 3:
            continue
        bias = node.inputs[2]
        if bias is None or bias.const_value is None or len(bias.const_value.shape) != 2 or bias.const_value.shape[0] != 1:
            continue
        vector = bias.const_value.numpy().reshape(-1)
        node.replace_input_with(2, qdq_params.add_initializer(model.graph, ir.tensor(vector), names.fresh(f"{bias.name}_vector")))
        report.note(f"quantize: Gemm {node.name!r} bias {list(bias.const_value.shape)} read as [{vector.size}] for quantize_static")


def _exclude(options: dict, names: Iterable[str]) -> None:
    """Add ``names`` to quantize_static's ``nodes_to_exclude`` (in order, each once)."""
    options["nodes_to_exclude"] = list(dict.fromkeys([*options.get("nodes_to_exclude", ()), *names]))


def _self_calibrated(calibration) -> bool:
    return calibration is None or (isinstance(calibration, str) and calibration == "synthetic")


def _feeds(model: onnx.ModelProto, calibration, samples: int, seed: int) -> tuple[list[dict], str]:
    if _self_calibrated(calibration):
        feeds, sizes = calib.runnable_synthetic_feeds(model, samples, seed)
        return feeds, f"synthetic ({samples} samples{'; ' + sizes if sizes else ''})"
    if isinstance(calibration, (str, os.PathLike)):
        feeds = list(calib.image_feeds(model, sorted(p for p in _image_paths(calibration)), n=samples, seed=seed))
        if not feeds:
            raise KenosisError(f"no images found under {os.fspath(calibration)!r}")
        return feeds, f"{len(feeds)} images from {os.fspath(calibration)}"
    feeds = [dict(f) for f in itertools.islice(iter(calibration), samples)]
    if not feeds:
        raise KenosisError("the calibration iterable is empty")
    return feeds, f"{len(feeds)} user feeds"


def _image_paths(folder) -> list[str]:
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise KenosisError(f"calibration {folder!r} is neither 'synthetic' nor a folder of images")
    suffixes = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
    return [os.path.join(folder, f) for f in os.listdir(folder) if f.lower().endswith(suffixes)]


SHARED_RANGE_RULE = "share-concat-ranges"
MIXED_OUTPUT_CONCAT_RULE = "mixed-output-concat-float"


def _median_per_channel_gain_db(model: onnx.ModelProto) -> float:
    """Median SNR gain of per-channel over per-tensor int8 weights, over the Conv/Gemm/MatMul weights."""
    initializers = {init.name: init for init in model.graph.initializer}
    gains = []
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm", "MatMul") and len(node.input) > 1 and node.input[1] in initializers:
            weights = onnx.numpy_helper.to_array(initializers[node.input[1]])
            if weights.ndim >= 2:
                axis = 0 if node.op_type == "Conv" else weights.ndim - 1
                gains.append(_weight_snr_db(weights, axis) - _weight_snr_db(weights, None))
    return float(np.median(gains)) if gains else 0.0


def _opset_for_per_channel(model: onnx.ModelProto, per_channel, report: FixReport) -> tuple[onnx.ModelProto, bool | str]:
    """Per-channel weights need opset 13. quantize() makes a new model, so it may convert the float
    model up, but the converter can add ops (Softmax-11 becomes Shape/Flatten/Reshape around
    Softmax-13: +11% latency measured on a PP-OCR classifier). It converts only when per-channel
    buys a median of >= 6 dB weight SNR; otherwise the weights stay per-tensor, and the report says so.
    """
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if not per_channel or opset >= qdq_params.PER_AXIS_OPSET:
        return model, per_channel
    gain = _median_per_channel_gain_db(model)
    if gain < AUTO_PER_CHANNEL_GAIN_DB:
        report.note(f"opset {opset}: per-channel weights would gain only {gain:.1f} dB median SNR; "
                    f"kept opset {opset} and per-tensor weights")
        return model, False
    try:
        converted = onnx.version_converter.convert_version(model, qdq_params.PER_AXIS_OPSET)
        onnx.checker.check_model(converted)
    except Exception as error:  # noqa: BLE001 - the converter raises many types
        report.note(f"opset {opset} could not be converted to {qdq_params.PER_AXIS_OPSET} ({error}); weights per-tensor")
        return model, False
    report.note(f"float model converted from opset {opset} to {qdq_params.PER_AXIS_OPSET} for per-channel weights "
                f"({gain:.1f} dB median weight SNR gain)")
    return converted, per_channel


AUTO_PER_CHANNEL_GAIN_DB = 6.0  # one bit: per-channel must buy at least this much weight SNR
# measured: percentile ranges on CNNs (outliers are noise), min/max on models with attention, under
# any plan (outlier channels carry the signal); see the calibration_method argument
DEFAULT_CALIBRATION_METHOD = {"full": "percentile", "weighted": "minmax", "weighted-static": "minmax"}
ATTENTION_CALIBRATION_METHOD = "minmax"


def default_calibration_method(model: onnx.ModelProto, chosen_plan: str) -> tuple[str, str]:
    """``(method, why)``: min/max where the graph has attention, whichever the plan, else the plan's
    default. Under the full plan, held-out against FP32: the ViT's heat-map cosine 0.99648 with
    percentile ranges, 0.99927 with min/max; PP-OCRv5 rec 0.849 and 0.968 (text lines decoded as
    FP32 does: 0 and 6 of 8); PP-OCRv3 rec 0.496 and 0.743."""
    if has_attention(model):
        return ATTENTION_CALIBRATION_METHOD, "attention found"
    return DEFAULT_CALIBRATION_METHOD[chosen_plan], f"the {chosen_plan} plan's default"


def _weight_snr_db(weights: np.ndarray, axis: int | None) -> float:
    """SNR of symmetric int8 rounding of ``weights``, per tensor (axis None) or per ``axis``."""
    values = weights.astype(np.float64)
    if axis is None:
        reach = np.abs(values).max()
    else:
        shape = [1] * values.ndim
        shape[axis] = -1
        reach = np.abs(np.moveaxis(values, axis, 0)).reshape(values.shape[axis], -1).max(axis=1).reshape(shape)
    scale = np.where(reach > 0, reach / 127, 1.0)
    noise = np.sum((values - np.rint(values / scale) * scale) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(values**2) / noise))


def per_channel_overrides(model: onnx.ModelProto) -> dict[str, list[dict]]:
    """``TensorQuantOverrides`` making per-channel only the weights it helps by >= 6 dB of SNR.

    Per-channel kernels cost time on ORT CPU (measured ~10% on a depthwise-heavy classifier), so
    weights whose per-tensor quantization is already accurate stay per-tensor.
    """
    initializers = {init.name: init for init in model.graph.initializer}
    overrides = {}
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm", "MatMul") or len(node.input) < 2 or node.input[1] not in initializers:
            continue
        weights = onnx.numpy_helper.to_array(initializers[node.input[1]])
        if weights.ndim < 2:
            continue
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        axis = 0 if node.op_type == "Conv" or (node.op_type == "Gemm" and trans_b) else weights.ndim - 1
        if _weight_snr_db(weights, axis) - _weight_snr_db(weights, None) >= AUTO_PER_CHANNEL_GAIN_DB:
            overrides[node.input[1]] = [{"axis": axis}]
    return overrides


def _shared_concat_ranges(model: onnx.ModelProto, ranges, excluded, report: FixReport):
    shared, decisions = shared_concat_ranges(model, ranges, excluded_nodes=excluded)
    for decision in decisions:
        if decision.applied:
            report.changed(SHARED_RANGE_RULE, decision.concat, decision.reason, exact=False)
        else:
            report.refused(SHARED_RANGE_RULE, decision.concat, decision.reason)
    return shared


def _calibrated(model: onnx.ModelProto, chosen_plan: str, options: Mapping, layer_inputs: InputMoments | None
                ) -> set[str] | None:
    """The tensors calibration must measure: every one for the full plan (None); for the weighted
    plans, the computed inputs of the ops quantize_static quantizes (their outputs stay float) and
    weight rounding's layer inputs. The rest stay inside onnxruntime's graph, free to be fused."""
    if chosen_plan not in WEIGHTED_PLANS:
        return None
    constants = {init.name for init in model.graph.initializer}
    quantized_ops, excluded = set(options["op_types_to_quantize"]), set(options.get("nodes_to_exclude", ()))
    wanted = {name for node in model.graph.node if node.op_type in quantized_ops and node.name not in excluded
              for name in node.input if name and name not in constants}
    return wanted | (layer_inputs.sources() if layer_inputs is not None else set())


def _borrowed(model: onnx.ModelProto, options: Mapping, shared_ranges: bool, layer_inputs: InputMoments | None
              ) -> dict[str, str | tuple[float, float]]:
    """Tensors calibration need not measure: quantize_static overwrites their ranges (a Relu or Clip's
    sole input takes its output's range). Not those that shared Concat ranges may read (a member of
    a Concat's group must have its own measured range), nor the layer inputs weight rounding reads."""
    borrowed = ranges_the_quantizer_sets(
        model, options.get("op_types_to_quantize"), options.get("nodes_to_quantize"), options.get("nodes_to_exclude"))
    if shared_ranges:
        grouping = SAME_SCALE_OPS | {"Concat"}
        near_groups = {name for node in model.graph.node if node.op_type in grouping
                       for name in (*node.input, *node.output)}
        borrowed = {name: source for name, source in borrowed.items() if name not in near_groups}
    kept = layer_inputs.sources() if layer_inputs is not None else set()
    return {name: source for name, source in borrowed.items() if name not in kept}


def _output_value_ranges(ranges: calib.TensorRanges, output_values: Mapping[str, tuple[float, float] | None],
                         extremes: set[str]) -> tuple[calib.TensorRanges, str]:
    """``ranges`` with each measured tensor of ``output_values`` that has a natural range given it
    (:mod:`~kenosis_rewrite.calibration.output_extremes`), and what was done (empty: nothing): how
    many took their natural range, how many their min/max (``extremes``, already in ``ranges``)."""
    natural = {name: bounds for name, bounds in output_values.items() if bounds is not None and name in ranges}
    parts = [f"{len(natural)} tensors take their activation's whole range"] if natural else []
    at_extremes = len(extremes & set(ranges))
    if at_extremes:
        parts.append(f"{at_extremes} their min/max, not {ranges.method} ranges")
    if not natural:
        return ranges, "; ".join(parts)
    return dataclasses.replace(ranges, ranges={**ranges.ranges, **natural}), "; ".join(parts)


def _mark_deleted_activations(float_proto: onnx.ModelProto, quantized: ir.Model, kept: set[str]) -> None:
    """Mark each Q whose clamp stands for a Relu/Clip quantize_static deleted from ``float_proto``
    (:func:`value_range.mark_deleted_activation`): a deleted ``Clip(-1, 1)`` leaves a Q whose range
    the graph cannot tell from a calibrated one, and a rewrite that folds through it (a BatchNorm
    into the Conv before the Clip) would drop the clamp. quantize_static renames the producer's
    output to the activation's, so the Q reads the activation's output name. ``kept``: the node
    names of quantize_static's output."""
    deleted = {node.output[0]: node.op_type for node in float_proto.graph.node
               if node.op_type in ("Relu", "Clip") and node.domain in qdq_params.DEFAULT_DOMAINS and node.name not in kept}
    for node in quantized.graph:
        if qdq_params.is_quantize(node) and node.inputs[0] is not None and node.inputs[0].name in deleted:
            value_range.mark_deleted_activation(node, deleted[node.inputs[0].name])


def _unmark(model: ir.Model) -> None:
    for node in model.graph:
        node.metadata_props.pop(value_range.DELETED_ACTIVATION_KEY, None)


def _plain_runs(float_runs: fidelity.ReferenceRuns, qdq: onnx.ModelProto | None) -> tuple[list, list | None]:
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


def _metadata_inputs(model: onnx.ModelProto) -> set[str]:
    initializers = {init.name for init in model.graph.initializer}
    if sum(value.name not in initializers for value in model.graph.input) < 2:
        return set()  # metadata inputs come beside an image; inferring the inputs runs ORT probes
    specs = calib.infer_inputs(model)
    if not any(s.kind == "image" for s in specs):
        return set()
    return {s.name for s in specs if s.kind in ("metadata", "float")}


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
):
    """Quantize an FP32 model for ``target`` and return a fixed, protected QDQ model.

    Args:
        float_model: the FP32 model (ModelProto, onnx_ir.Model or path).
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

    Returns:
        The model (same kind as given; a path gives a ModelProto), or ``(model, FixReport)``.
    """
    loaded = model_io.load(float_model, require_qdq=False)
    model_io.check_float(loaded.model, "quantize()")
    sensitivity.check_target_cosine(target_cosine)  # before the work, not after it
    if loaded.large:
        raise ModelTooLargeError(
            "quantize() calibrates activations by running the whole model in ONNX Runtime and quantizes it "
            "with quantize_static in memory, which a model over 2 GB does not fit. Quantize its weights "
            "with quantize_weights() (weight-only int4/int8, one weight at a time), then fix() that."
        )
    original = ir.serde.serialize_model(loaded.model)
    report = FixReport(target=target)
    feeds, source = _feeds(original, calibration, calibration_samples, seed)
    report.note(f"calibration: {source}")
    # the model as given on the calibration feeds: prepare() verifies against these runs, the final
    # fidelity reuses them
    float_runs = fidelity.ReferenceRuns(original, feeds)
    # equalization's channel maxima, from prepare()'s runs of the prepared model on the same feeds
    maxima = ChannelMaxima() if equalization else None
    if canonicalize:
        preparation = FixReport(target="prepare")
        # synthetic feeds have made-up sizes: they must not fix the model's input dims
        prepared = prepare_serialized(original, feeds, preparation, reference=float_runs,
                                      pin_shapes=not _self_calibrated(calibration), observer=maxima, work=loaded.model)
        report.changes.extend(preparation.changes)
        report.notes.extend(preparation.notes)
    else:
        prepared = loaded.model  # what deserialising ``original`` would give
    # Constant nodes become initializers: quantize_static then treats them as weights (int8,
    # per-channel, quantized once), not as activations re-quantized at every run.
    LiftAllConstantsPass()(prepared)
    _gemm_row_biases_as_vectors(prepared, report)
    common_passes.RemoveUnusedNodesPass()(prepared)  # the rows no Gemm reads any more
    common_passes.NameFixPass()(prepared)  # quantize_static excludes nodes by name
    proto = ir.serde.serialize_model(prepared)
    _check_control_flow(proto, report)
    if equalization:
        proto, equalized = equalize(proto, feeds, report, observed=maxima)
        report.note(f"activation equalization: {equalized} tensors")
    serialised = proto  # equalize() keeps a proto onnx_ir serialised as onnx_ir would serialise it
    proto, per_channel = _opset_for_per_channel(proto, per_channel, report)  # "auto" needs opset 13 too
    # calibration and quantize_static read the model as onnx_ir serialises it: what equalize() and
    # prepare() return already; the opset converter's proto is serialised so once, before calibration
    unconverted = proto is serialised
    auto = per_channel == "auto"
    options = quantize_static_options(target, False if auto else bool(per_channel))
    if auto:
        overrides = per_channel_overrides(proto)
        options["extra_options"]["TensorQuantOverrides"] = overrides
        report.note(f"per-channel weights where they gain >= {AUTO_PER_CHANNEL_GAIN_DB:g} dB SNR: {len(overrides)} tensors")
    chosen_plan, why = choose_plan(proto, plan)
    report.note(f"plan: {chosen_plan} ({why})")
    if calibration_method is None:
        calibration_method, why = default_calibration_method(proto, chosen_plan)
        report.note(f"calibration method: {calibration_method} ({why})")
    else:
        report.note(f"calibration method: {calibration_method} (asked for)")
    planned = plan_options(proto, chosen_plan)
    options["extra_options"].update(planned.pop("extra_options", {}))
    planned_exclusions = planned.pop("nodes_to_exclude", [])
    options.update(planned)
    metadata = _metadata_inputs(proto) if protect_metadata_inputs else set()
    # read on the prepared graph where ``proto`` is its serialisation (equalize() changes only weights)
    excluded = protected_nodes(prepared if unconverted else proto, metadata)
    unshare_protected_constants(proto, excluded)
    if excluded or planned_exclusions:
        _exclude(options, [*excluded, *planned_exclusions])
        for name in excluded:
            report.changed(METADATA_RULE, name, "reads a tensor computed from metadata inputs, tensor shapes or "
                           "only constants: not quantized", exact=True)
    # weight rounding's layer inputs, gathered from the calibration run (which computes every tensor)
    layer_inputs = InputMoments(proto) if weight_rounding else None
    # the tensors whose extremes are the answer (a detector's scores): never clipped by the method
    output_values = output_value_tensors(proto)
    clipping = calibration_method != "minmax"
    extremes = {name for name, bounds in output_values.items() if bounds is None and clipping}
    measured = proto if unconverted else model_io.to_output(model_io.load(proto, require_qdq=False))
    try:
        ranges = calib.collect_ranges(measured, feeds, calibration_method, progress=False, serialised=True,
                                      observe=layer_inputs.tasks if layer_inputs is not None else None,
                                      tensors=_calibrated(proto, chosen_plan, options, layer_inputs),
                                      borrowed=_borrowed(proto, options, share_concat_ranges and chosen_plan == "full",
                                                         layer_inputs),
                                      extremes=extremes)
    except calib.CalibrationError as error:
        if not _self_calibrated(calibration):
            raise
        sizes = ", ".join(f"{name} {list(value.shape)}" for name, value in feeds[0].items())
        raise calib.CalibrationError(
            f"{error}. Self-calibration made up the sizes of the symbolic input dims ({sizes}) and the model does "
            "not run at them: pass calibration feeds (or a folder of images) of the sizes it expects") from None
    except KenosisError:
        raise
    except Exception as error:  # noqa: BLE001 - calibration runs ORT sessions, which raise many types
        raise KenosisError(f"calibration ({calibration_method}) failed on this model: {one_line(error)}") from error
    ranges, widened = _output_value_ranges(ranges, output_values, extremes)
    if widened:
        report.note(f"{widened}: their values reach a graph output, whose rare extremes are the answer (detection "
                    "scores, text pixels)")
    if chosen_plan == "full":  # the weighted plan leaves Concats float anyway
        mixed = mixed_output_concats(proto, output_values, ranges)
        for name, reason in mixed.items():
            report.changed(MIXED_OUTPUT_CONCAT_RULE, name, reason, exact=True)
        if mixed:
            _exclude(options, mixed)
    if share_concat_ranges and chosen_plan == "full":  # the weighted plan leaves Concats float
        ranges = _shared_concat_ranges(proto, ranges, options.get("nodes_to_exclude", ()), report)
    # the final fidelity's runs of the model as given, on the core quantize_static's Python leaves
    # idle (started later, they took a core from bias correction's probe); float_runs is the worker's
    float_runs.prefetch((True, FIDELITY_FEEDS))
    # and weight rounding's factors of H^-1, which need only the gathered moments (LAPACK, no GIL)
    factors = FactorsInBackground(layer_inputs) if layer_inputs is not None else None
    try:
        with quiet_logger():
            qdq = calib.quantize_with_ranges(measured, ranges, serialised=True, **options)
    except KenosisError:
        raise
    except Exception as error:  # noqa: BLE001 - ORT's quantizer raises many unrelated types
        raise KenosisError(f"onnxruntime's quantize_static failed on this model: {one_line(error)}") from error
    # quantize_static's own runs (when compared) after those, on the idle core while the passes
    # below hold the other with Python; float_runs is the worker's until then
    plain_runs = fidelity.Background(functools.partial(_plain_runs, float_runs, qdq if compare_quantize_static else None))
    model = ir.serde.deserialize_model(qdq)
    qdq_params.small_constants_as_arrays(model)
    quantized_nodes = {node.name for node in model.graph if node.name}
    _mark_deleted_activations(proto, model, quantized_nodes)
    # the integer MatMuls keep their QDQ form until bias correction and the FP32 fallbacks have read it
    # and so do the Concats on one grid, until then in QDQ form too
    deferred = (INTEGER_MATMUL_BIAS, CONCAT_ON_CODES)
    # the weighted plan leaves its layers' outputs float by design: no output quantizers to add (its
    # refusals read "no range measured ... pass calibration= feeds" beside the feeds the user passed)
    planned_float = (OUTPUT_QUANTIZERS,) if chosen_plan in WEIGHTED_PLANS else ()
    FixPass(target, report, disabled=deferred + planned_float)(model)
    if chosen_plan in WEIGHTED_PLANS:
        FloatReadersReadFloatPass(report, integer_ops=WEIGHTED_OPS)(model)
    if protect_outputs:
        OutputProtectionPass(report, float_graph=prepared.graph, quantized_nodes=quantized_nodes)(model)
        # on the int8 targets, the pair after data movement that now ends where the output's Q/DQ
        # was taken away (ORT would insert it itself, stale, and refuse the model: an sklearn MLP's
        # Add -> Reshape -> output)
        apply_rules(model, target, (REQUANTIZE_AFTER_DATA_MOVEMENT,), report)
    corrected = weight_rounding or bias_correction
    if corrected:
        # what the corrections start from (run on the check's feeds below)
        uncorrected = ir.serde.serialize_model(model)
    if weight_rounding:
        rounded = round_weights(proto, model, feeds, report, gathered=layer_inputs,
                                factors=factors)
        report.note(f"weight rounding: {rounded} layers")
    if corrected:
        # on the core bias correction leaves idle; not beside weight rounding, whose factors of H^-1
        # are still being computed on it
        uncorrected_runs = fidelity.Background(functools.partial(
            fidelity.run, uncorrected, float_runs.feeds[:CORRECTION_CHECK_FEEDS], one_core=True))
    if bias_correction:
        corrected_layers = correct_biases(proto, model, feeds, report)
        report.note(f"bias correction: {corrected_layers} layers")

    def finish(model: ir.Model) -> tuple[ir.Model, onnx.ModelProto, list]:
        """The steps after the corrections; the model, its proto and its outputs on the fidelity feeds."""
        if snr_threshold_db is not None or target_cosine is not None:
            chosen, analysis, reasons, unreached = sensitivity.select_fp32_layers(
                proto, model, feeds, threshold_db=snr_threshold_db, target_cosine=target_cosine
            )
            sensitivity.keep_fp32(model, chosen, report, reasons)
            report.note(f"sensitivity: {len(chosen)} of {len(analysis)} layers kept in FP32")
            if unreached:
                report.note(f"sensitivity: {unreached}")
        CleanupPass()(model)
        if optimize_for == "latency":
            _latency_placement(model, report, feeds, latency_budget_s, 1)
        # the weighted plan quantizes activations at run time: after everything that reads the QDQ form
        lowered = chosen_plan == "weighted" and DynamicActivationsPass(report)(model).modified
        # and that pair again where an FP32 fallback took a Q/DQ away
        if apply_rules(model, target, (*deferred, REQUANTIZE_AFTER_DATA_MOVEMENT), report) or lowered:
            CleanupPass()(model)
        _unmark(model)
        out = ir.serde.serialize_model(model)
        out_bytes = out.SerializeToString()  # once for the checker and the session
        onnx.checker.check_model(out_bytes, full_check=True)
        return model, out, fidelity.run(out_bytes, float_runs.feeds[:FIDELITY_FEEDS])

    # against the model as given: canonicalization is part of what the user gets
    expected, plain = plain_runs.result()
    marks = (len(report.changes), len(report.refusals), len(report.notes))
    model, out, runs = finish(model)
    grown = _corrections_grown_error(expected, runs, uncorrected_runs.result()) if corrected else None
    if grown is not None:
        # the steps after the corrections again, on the model without them (reported once)
        del report.changes[marks[0]:], report.refusals[marks[1]:], report.notes[marks[2]:]
        report.changes[:] = [change for change in report.changes if change.rule not in (WEIGHT_ROUNDING, BIAS_CORRECTION)]
        report.note(f"weight rounding and bias correction undone: on {CORRECTION_CHECK_FEEDS} calibration feeds the "
                    f"output's cosine against the model as given was {grown[0]:.5f} without them and {grown[1]:.5f} with them")
        model, out, runs = finish(ir.serde.deserialize_model(uncorrected))
    report.fidelity = {} if plain is None else {"quantize_static": fidelity.scores(expected, plain)}
    report.fidelity["quantized"] = fidelity.scores(expected, runs)
    if _self_calibrated(calibration):
        # the ranges and this fidelity come from made-up inputs: on real data the same model has
        # scored far lower (an LSTM state input spanning +-80: one output all zeros, 0.999 here)
        report.note("fidelity is measured on the synthetic calibration inputs, which need not drive the model "
                    "as real data does: the ranges came from them too. Pass calibration= feeds of real data (or "
                    "a folder of images) for ranges and a fidelity that hold on real inputs")
    result = model if loaded.returns == "ir" else out
    return (result, report) if return_report else result

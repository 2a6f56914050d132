"""What quantize_static is asked to do: weight granularity, the plan, the calibration method, exclusions.

A stage of :func:`kenosis_rewrite.quantize`: :func:`configure` reads the FP32 graph quantize_static
will see and returns its keyword arguments, noting each choice and why in the report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import onnx
from onnxruntime.quantization import QuantFormat, QuantType

from kenosis_rewrite import calibration as calib
from kenosis_rewrite.accuracy.protection import METADATA_RULE, protected_nodes, unshare_protected_constants
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.placement.targets import get_target
from kenosis_rewrite.quantization.plan import choose_plan, has_attention, plan_options
from kenosis_rewrite.quantization.settings import QuantizeSettings

AUTO_PER_CHANNEL_GAIN_DB = 6.0  # one bit: per-channel must buy at least this much weight SNR
# measured: percentile ranges on CNNs (outliers are noise), min/max on models with attention, under
# any plan (outlier channels carry the signal); see the calibration_method argument
DEFAULT_CALIBRATION_METHOD = {"full": "percentile", "weighted": "minmax", "weighted-static": "minmax"}
ATTENTION_CALIBRATION_METHOD = "minmax"


@dataclasses.dataclass
class Configuration:
    """quantize_static's keyword arguments (``options``), the plan and the calibration method chosen."""

    options: dict
    plan: str
    method: str


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


def exclude(options: dict, names: Iterable[str]) -> None:
    """Add ``names`` to quantize_static's ``nodes_to_exclude`` (in order, each once)."""
    options["nodes_to_exclude"] = list(dict.fromkeys([*options.get("nodes_to_exclude", ()), *names]))


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


def opset_for_per_channel(model: onnx.ModelProto, per_channel, report: FixReport) -> tuple[onnx.ModelProto, bool | str]:
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


def _metadata_inputs(model: onnx.ModelProto) -> set[str]:
    initializers = {init.name for init in model.graph.initializer}
    if sum(value.name not in initializers for value in model.graph.input) < 2:
        return set()  # metadata inputs come beside an image; inferring the inputs runs ORT probes
    specs = calib.infer_inputs(model)
    if not any(s.kind == "image" for s in specs):
        return set()
    return {s.name for s in specs if s.kind in ("metadata", "float")}


def _plan_and_method(proto: onnx.ModelProto, settings: QuantizeSettings, options: dict, report: FixReport
                     ) -> tuple[str, str, list[str]]:
    """The plan and the calibration method (noted in the report), the plan's options merged into
    ``options``; returns the plan, the method and the nodes the plan leaves float."""
    chosen_plan, why = choose_plan(proto, settings.plan)
    report.note(f"plan: {chosen_plan} ({why})")
    calibration_method = settings.calibration_method
    if calibration_method is None:
        calibration_method, why = default_calibration_method(proto, chosen_plan)
        report.note(f"calibration method: {calibration_method} ({why})")
    else:
        report.note(f"calibration method: {calibration_method} (asked for)")
    planned = plan_options(proto, chosen_plan)
    options["extra_options"].update(planned.pop("extra_options", {}))
    planned_exclusions = planned.pop("nodes_to_exclude", [])
    options.update(planned)
    return chosen_plan, calibration_method, planned_exclusions


def configure(proto: onnx.ModelProto, protected_graph, per_channel: bool | str, settings: QuantizeSettings,
              report: FixReport) -> Configuration:
    """quantize_static's options for ``proto``: per-channel weights (``"auto"``: where they gain
    >= ``AUTO_PER_CHANNEL_GAIN_DB``), the plan's op selection, the calibration method, and the nodes
    left float (the plan's, and those reading metadata inputs, shapes or only constants, found on
    ``protected_graph``)."""
    auto = per_channel == "auto"
    options = quantize_static_options(settings.target, False if auto else bool(per_channel))
    if auto:
        overrides = per_channel_overrides(proto)
        options["extra_options"]["TensorQuantOverrides"] = overrides
        report.note(f"per-channel weights where they gain >= {AUTO_PER_CHANNEL_GAIN_DB:g} dB SNR: {len(overrides)} tensors")
    chosen_plan, calibration_method, planned_exclusions = _plan_and_method(proto, settings, options, report)
    metadata = _metadata_inputs(proto) if settings.protect_metadata_inputs else set()
    excluded = protected_nodes(protected_graph, metadata)
    unshare_protected_constants(proto, excluded)
    if excluded or planned_exclusions:
        exclude(options, [*excluded, *planned_exclusions])
        for name in excluded:
            report.changed(METADATA_RULE, name, "reads a tensor computed from metadata inputs, tensor shapes or "
                           "only constants: not quantized", exact=True)
    return Configuration(options, chosen_plan, calibration_method)

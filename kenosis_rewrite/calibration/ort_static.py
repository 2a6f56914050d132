"""onnxruntime's ``quantize_static`` for ranges already computed, its per-channel weight
parameters computed a whole tensor at a time.

:func:`quantize_static_qdq` is ``quantize_static``'s QDQ path for a calibration cache (its steps,
in its order: load with shape inference, opset update, argument checks, quantizer, save) with
:class:`~kenosis_rewrite.calibration.channel_quantizer.ChannelVectorisedQDQQuantizer`, which
computes plain per-channel weight parameters with array operations, on a model wrapper whose name
lookups are indexed (:mod:`kenosis_rewrite.calibration.ort_indexed_model`). Anything else it does
not handle (SmoothQuant, float8, QOperator, an ORT without the quantizer internals this relies on:
:mod:`kenosis_rewrite._upstream.ort_quantizer`) goes to ``quantize_static`` itself. The output
model is the same, byte for byte (the tests compare them).
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.calibrate import load_tensors_data
from onnxruntime.quantization.quant_utils import add_infer_metadata, load_model_with_shape_infer, update_opset_version
from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

from kenosis_rewrite._upstream import ort_quantizer
from kenosis_rewrite.calibration.channel_quantizer import (
    ChannelVectorisedQDQQuantizer,
    channel_quant_params,
    quantize_channels,
)

__all__ = ["ChannelVectorisedQDQQuantizer", "channel_quant_params", "handles", "quantize_channels",
           "quantize_static_qdq", "quantize_static_qdq_proto", "ranges_the_quantizer_sets"]


def _handled(quant_format, activation_type, weight_type, calibrate_method, extra_options) -> bool:
    return (quant_format is QuantFormat.QDQ and calibrate_method == CalibrationMethod.MinMax
            and QuantType.QFLOAT8E4M3FN not in (activation_type, weight_type)
            and not (extra_options or {}).get("SmoothQuant", False)
            and ort_quantizer.quantizer_hooks_available())


def _orts_defaults(extra_options, nodes_to_exclude, nodes_to_quantize, op_types_to_quantize):
    """quantize_static's defaults for its optional arguments."""
    if not op_types_to_quantize:
        op_types_to_quantize = list(set(list(QLinearOpsRegistry.keys()) + list(QDQRegistry.keys())))
    return extra_options or {}, nodes_to_exclude or [], nodes_to_quantize or [], op_types_to_quantize


def ranges_the_quantizer_sets(model: onnx.ModelProto, op_types_to_quantize=None, nodes_to_quantize=None,
                              nodes_to_exclude=None) -> dict[str, str | tuple[float, float]]:
    """Top-level tensors whose calibrated range quantize_static overwrites before it reads it (its
    ``adjust_tensor_ranges``), each -> the tensor whose range it takes, or the fixed range: the input
    of a quantized Relu or Clip that nothing else reads takes the activation's output range, and a
    quantized Softmax's output is [0, 1]. Measuring these is wasted work (often a third of a CNN's
    activation bytes). Consumers are counted in subgraphs too, so a tensor is named only where ORT
    counts no more consumers than this does; graph inputs and outputs are never named."""
    _, nodes_to_exclude, nodes_to_quantize, op_types_to_quantize = _orts_defaults(
        None, nodes_to_exclude, nodes_to_quantize, op_types_to_quantize)
    excluded, op_types = set(nodes_to_exclude), set(op_types_to_quantize)

    def quantized(node: onnx.NodeProto) -> bool:  # ORT's should_quantize_node
        return ((not nodes_to_quantize or node.name in nodes_to_quantize) and node.op_type in op_types
                and node.name not in excluded)

    readers: dict[str, int] = {}
    for graph in _graphs(model.graph):
        for node in graph.node:
            for name in node.input:
                readers[name] = readers.get(name, 0) + 1
    boundary = {value.name for value in (*model.graph.input, *model.graph.output)}
    candidates: list[tuple[str, str | tuple[float, float]]] = []
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or not quantized(node) or not node.input or not node.output:
            continue
        if node.op_type in ("Relu", "Clip") and node.input[0] not in boundary and readers.get(node.input[0]) == 1:
            candidates.append((node.input[0], node.output[0]))
        elif node.op_type == "Softmax" and node.output[0] not in boundary:
            candidates.append((node.output[0], (0.0, 1.0)))
    # ORT adjusts in node order, reading the source's range as it stands then: a source that is
    # adjusted itself (Relu -> Clip) or a tensor adjusted twice must keep its measured range
    sources = {source for _, source in candidates if isinstance(source, str)}
    named = collections.Counter(name for name, _ in candidates)
    return {name: source for name, source in candidates if name not in sources and named[name] == 1}


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _graphs(sub)


def _quantized(model: onnx.ModelProto, tensors_range, calibrate_method, quant_format, op_types_to_quantize, per_channel,
               reduce_range, activation_type, weight_type, nodes_to_quantize, nodes_to_exclude, extra_options):
    """quantize_static's steps after loading the shape-inferred ``model`` and reading the ranges: opset
    update, argument checks, quantizer; the quantizer's ONNXModel (not yet sorted or saved)."""
    extra_options, nodes_to_exclude, nodes_to_quantize, op_types_to_quantize = _orts_defaults(
        extra_options, nodes_to_exclude, nodes_to_quantize, op_types_to_quantize)
    updated = update_opset_version(
        model, weight_type, activation_type,
        tensor_quant_overrides=extra_options.get("TensorQuantOverrides"), block_size=extra_options.get("BlockSize", 0),
    )
    model = updated if updated is not model else model
    if tensors_range.calibration_method != calibrate_method:
        raise ValueError(f"calibration cache made with {tensors_range.calibration_method}, not {calibrate_method}")
    ort_quantizer.check_static_quant_arguments(quant_format, activation_type, weight_type)
    with ort_quantizer.indexed_initializer_lookups():
        quantizer = ChannelVectorisedQDQQuantizer(
            model, per_channel, reduce_range, weight_type, activation_type, tensors_range,
            nodes_to_quantize, nodes_to_exclude, op_types_to_quantize, extra_options,
        )
        quantizer.quantize_model()
    return quantizer.model


def quantize_static_qdq(
    model_input: str | os.PathLike,
    model_output: str | os.PathLike,
    calibration_cache_path: str | os.PathLike,
    quant_format=QuantFormat.QDQ,
    op_types_to_quantize=None,
    per_channel=False,
    reduce_range=False,
    activation_type=QuantType.QInt8,
    weight_type=QuantType.QInt8,
    nodes_to_quantize=None,
    nodes_to_exclude=None,
    use_external_data_format=False,
    calibrate_method=CalibrationMethod.MinMax,
    calibration_providers=None,
    extra_options=None,
) -> None:
    """``quantize_static(model_input, model_output, None, calibration_cache_path=..., ...)`` with
    :class:`ChannelVectorisedQDQQuantizer` (see the module docstring)."""
    if not _handled(quant_format, activation_type, weight_type, calibrate_method, extra_options):
        quantize_static(model_input, model_output, None, quant_format=quant_format,
                        op_types_to_quantize=op_types_to_quantize, per_channel=per_channel, reduce_range=reduce_range,
                        activation_type=activation_type, weight_type=weight_type, nodes_to_quantize=nodes_to_quantize,
                        nodes_to_exclude=nodes_to_exclude, use_external_data_format=use_external_data_format,
                        calibrate_method=calibrate_method, calibration_providers=calibration_providers,
                        extra_options=extra_options, calibration_cache_path=calibration_cache_path)
        return
    model = load_model_with_shape_infer(Path(model_input))
    quantized = _quantized(model, load_tensors_data(calibration_cache_path), calibrate_method, quant_format,
                           op_types_to_quantize, per_channel, reduce_range, activation_type, weight_type,
                           nodes_to_quantize, nodes_to_exclude, extra_options)
    quantized.save_model_to_file(model_output, use_external_data_format)


def handles(quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax, extra_options=None, use_external_data_format=False, **_) -> bool:
    """Whether :func:`quantize_static_qdq_proto` takes these quantize_static arguments (otherwise only
    the file-based :func:`quantize_static_qdq` does, through quantize_static itself)."""
    return not use_external_data_format and _handled(quant_format, activation_type, weight_type, calibrate_method,
                                                     extra_options)


# floating-point initializers with more elements than this are left out of the copy shape inference
# serialises: weights, whose values no shape inference reads (shape inputs are small integers);
# only where they hold this many elements in all (below, the copy's bookkeeping costs more: PP-OCR
# cls's 0.3 MB, 1.1 against 2.2 ms)
_INFERENCE_WEIGHT_ELEMENTS = 1024
_INFERENCE_WEIGHTS_LEFT_OUT = 1 << 18
_FLOAT_TENSOR_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                                 onnx.TensorProto.DOUBLE})


def shape_inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes(model)``, the same model, without serialising the weights
    for it: the large floating-point initializers of the main graph enter the copy it infers as
    graph inputs of their type and shape (all that inference reads of a weight), and go back into
    the result in their place (infer_shapes copies the whole model through its serialisation: 24 of
    EfficientNet-Lite0's 26 ms). The tests compare the two byte for byte."""
    source = model.graph
    weights = [init for init in source.initializer
               if init.data_type in _FLOAT_TENSOR_TYPES and int(np.prod(init.dims)) > _INFERENCE_WEIGHT_ELEMENTS]
    if sum(int(np.prod(init.dims)) for init in weights) < _INFERENCE_WEIGHTS_LEFT_OUT:
        return onnx.shape_inference.infer_shapes(model)
    light = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            _copy_field(light, field, value)
    for field, value in source.ListFields():
        if field.name != "initializer":
            _copy_field(light.graph, field, value)
    declared = {value.name for value in source.input}
    left_out = {id(init) for init in weights}
    light.graph.initializer.extend(init for init in source.initializer if id(init) not in left_out)
    light.graph.input.extend(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
                             for init in weights if init.name not in declared)
    inferred = onnx.shape_inference.infer_shapes(light)
    del inferred.graph.input[len(source.input):]
    del inferred.graph.initializer[:]
    inferred.graph.initializer.extend(source.initializer)
    return inferred


def _copy_field(message, field, value) -> None:
    """``message``'s field set to a copy of ``value`` (another message's, of the same type)."""
    target = getattr(message, field.name)
    if hasattr(target, "extend"):  # a repeated field
        target.extend(value)
    elif field.message_type is not None:
        target.CopyFrom(value)
    else:
        setattr(message, field.name, value)


def quantize_static_qdq_proto(
    model: onnx.ModelProto,
    tensors_range,
    quant_format=QuantFormat.QDQ,
    op_types_to_quantize=None,
    per_channel=False,
    reduce_range=False,
    activation_type=QuantType.QInt8,
    weight_type=QuantType.QInt8,
    nodes_to_quantize=None,
    nodes_to_exclude=None,
    calibrate_method=CalibrationMethod.MinMax,
    calibration_providers=None,
    extra_options=None,
) -> onnx.ModelProto:
    """:func:`quantize_static_qdq` in memory, for arguments it :func:`handles`: ``model`` (not
    changed) and ranges (ORT's ``TensorsData``) in, the quantized model out; the same model as through
    files (``quantize_static``'s load with shape inference and save, without the disk: shape inference
    on the proto, ORT's inference metadata added, the graph sorted as its save sorts it)."""
    inferred = shape_inferred(model)
    add_infer_metadata(inferred)
    quantized = _quantized(inferred, tensors_range, calibrate_method, quant_format, op_types_to_quantize, per_channel,
                           reduce_range, activation_type, weight_type, nodes_to_quantize, nodes_to_exclude,
                           extra_options)
    quantized.topological_sort()
    for initializer in quantized.model.graph.initializer:
        quantized.check_initializer(initializer, "end")  # what its save checks (float8 NaNs)
    return quantized.model

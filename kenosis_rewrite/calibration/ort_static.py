"""onnxruntime's ``quantize_static`` for ranges already computed, its per-channel weight
parameters computed a whole tensor at a time.

ORT's ``QDQQuantizer`` computes each per-channel weight's scale and zero point one channel at a
time in Python (a ``compute_data_quant_params`` call per output channel: 17,000 calls on
MobileNetV2, a third of ``quantize_static``), then quantizes those weights one channel per call
again. :class:`ChannelVectorisedQDQQuantizer` computes the common case (symmetric
int8/uint8/int16/uint16 per-channel weights, no per-channel range overrides, no minimum real
range, no blocks) with array operations, element for element the same arithmetic, and leaves
every other tensor to ORT's own code.

:func:`quantize_static_qdq` is ``quantize_static``'s QDQ path for a calibration cache (its steps,
in its order: load with shape inference, opset update, argument checks, quantizer, save) with
that quantizer; anything else it does not handle (SmoothQuant, float8, QOperator, an ORT without
the quantizer internals this relies on) goes to ``quantize_static`` itself. The output model is
the same, byte for byte (the tests compare them).
"""

from __future__ import annotations

import collections
import collections.abc
import importlib
import os
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization import base_quantizer, onnx_model, qdq_quantizer, quant_utils
from onnxruntime.quantization.operators import conv as conv_operator
from onnxruntime.quantization.operators import gemm as gemm_operator
from onnxruntime.quantization.operators import matmul as matmul_operator
from onnxruntime.quantization.calibrate import load_tensors_data
from onnxruntime.quantization.onnx_model import ONNXModel
from onnxruntime.quantization.quant_utils import (
    ONNX_TYPE_TO_NP_TYPE,
    add_infer_metadata,
    TENSOR_NAME_QUANT_SUFFIX,
    get_qmin_qmax_for_qType,
    load_model_with_shape_infer,
    normalize_axis,
    update_opset_version,
)
from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

__all__ = ["ChannelVectorisedQDQQuantizer", "channel_quant_params", "handles", "quantize_channels", "quantize_static_qdq",
           "quantize_static_qdq_proto", "ranges_the_quantizer_sets"]

_VECTORISED_TYPES = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16)
_RANGE_OVERRIDES = ("rmin", "rmax")
_INT32_BIAS_EPSILON = 1.0001  # ORT's multiplicative_epsilon: the bias scale's margin over the int32 range


def channel_quant_params(data: np.ndarray, axis: int, quant_type: int, reduce_range: bool) -> tuple[np.ndarray, np.ndarray]:
    """(zero points, scales) of symmetric per-channel quantization of float32 ``data`` along ``axis``:
    what ORT's ``compute_data_quant_params`` / ``compute_scale_zp`` give channel by channel, as arrays."""
    qmin, qmax = get_qmin_qmax_for_qType(quant_type, reduce_range, symmetric=True)
    channels = np.moveaxis(data, axis, 0).reshape(data.shape[axis], -1)
    rmin = np.minimum(channels.min(axis=1), np.array(0, dtype=data.dtype))
    rmax = np.maximum(channels.max(axis=1), np.array(0, dtype=data.dtype))
    absmax = np.maximum(np.abs(rmin), np.abs(rmax))
    rmin, rmax = -absmax, +absmax
    spread = rmax.astype(np.float64) - rmin.astype(np.float64)
    scale = spread / (np.array(qmax, dtype=np.float64) - np.array(qmin, dtype=np.float64))
    too_small = scale < np.finfo(data.dtype).tiny  # ORT: scale 1, zero point 0
    middle = np.array(np.round((qmin + qmax) / np.array(2.0, dtype=np.float64)), dtype=qmin.dtype)
    zero_point = np.where(too_small, np.array(0, dtype=qmin.dtype), middle).astype(qmin.dtype)
    stored = np.where(too_small, np.array(1.0, dtype=data.dtype), scale.astype(data.dtype)).astype(data.dtype)
    return zero_point, stored


def quantize_channels(data: np.ndarray, axis: int, quant_type: int, zero_point: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Float32 ``data`` quantized along ``axis``: ORT's ``quantize_nparray`` of each channel, concatenated."""
    shape = [1] * data.ndim
    shape[axis] = -1
    qmin, qmax = get_qmin_qmax_for_qType(quant_type, reduce_range=False, symmetric=False)
    values = np.asarray((data.astype(np.float32) / scale.reshape(shape)).round() + zero_point.reshape(shape))
    np.clip(values, qmin, qmax, out=values)
    return values.astype(ONNX_TYPE_TO_NP_TYPE[quant_type])


class _Initializers(collections.abc.Sequence):
    """A :class:`_ScanningONNXModel`'s initializers as ORT's quantizer reads them (it iterates over
    them, and passes them to ``find_by_name``), with the model's indexed lookup beside."""

    def __init__(self, model: "_ScanningONNXModel"):
        self._model = model

    def __len__(self) -> int:
        return len(self._model.model.graph.initializer)

    def __getitem__(self, index):
        return self._model.model.graph.initializer[index]

    def __iter__(self):
        return iter(self._model.model.graph.initializer)

    def first_named(self, name: str) -> onnx.TensorProto | None:
        return self._model.get_initializer(name)


_ORTS_FIND_BY_NAME = quant_utils.find_by_name
# the ORT quantization modules that call find_by_name on ``model.initializer()`` (onnxruntime 1.32)
_FIND_BY_NAME_CALLERS = (base_quantizer, qdq_quantizer, onnx_model, conv_operator, gemm_operator, matmul_operator)


def _find_by_name(item_name, item_list):
    """ORT's ``find_by_name`` (the first item of that name, or None); on a :class:`_Initializers`,
    a dictionary lookup instead of a walk over every initializer (ORT looks up each tensor it
    quantizes several times: 4,086 walks over 200-odd initializers on PP-OCR cls, half of its
    quantize_static)."""
    if isinstance(item_list, _Initializers):
        return item_list.first_named(item_name)
    return _ORTS_FIND_BY_NAME(item_name, item_list)


def _use_indexed_initializer_lookups() -> None:
    """Point ORT's quantizer modules at :func:`_find_by_name`, once. It dispatches on its argument
    alone and is ORT's own function on anything but a :class:`_Initializers`, which only
    :class:`_ScanningONNXModel` hands out: every other quantization in the process sees ORT's
    behaviour, whichever thread runs it, and nothing is held between calls."""
    for module in _FIND_BY_NAME_CALLERS:
        if getattr(module, "find_by_name", None) is _ORTS_FIND_BY_NAME:
            module.find_by_name = _find_by_name


class _ScanningONNXModel(ONNXModel):
    """ORT's ``ONNXModel``, its name lookups indexed. ORT finds an initializer by walking all of
    them in Python (``add_initializer``, and ``get_initializer`` for each DequantizeLinear added) and
    rewires a tensor's readers by walking every input of every node (``replace_input_of_all_nodes``),
    once per tensor it quantizes: quadratic in the graph (0.22 s of YOLOv8n's 0.44 s
    quantize_static). Here both are dictionaries, built on first use and kept in step by every
    ``ONNXModel`` method that adds, removes, reorders or rewires nodes or initializers (the only ways
    the QDQ quantizer changes the graph); a count that no longer matches the graph rebuilds them.
    The same lookups, replacements and initializers, hence the same model (the tests compare it
    byte for byte with quantize_static's)."""

    def __init__(self, model: onnx.ModelProto):
        super().__init__(model)
        # ORT checks only float8 initializers (for NaN bytes), and the quantizations handled here add none
        self._float8_free = all(init.data_type != onnx.TensorProto.FLOAT8E4M3FN for init in model.graph.initializer)
        self._by_name: dict[str, onnx.TensorProto] | None = None  # the first initializer of each name
        self._by_name_count = 0
        self._repeated_names: set[str] = set()  # names more than one initializer has (invalid, but ORT copes)
        self._readers: dict[str, list[onnx.NodeProto]] | None = None  # a superset of each tensor's readers
        self._readers_count = 0

    def _initializer_index(self) -> dict[str, onnx.TensorProto]:
        initializers = self.model.graph.initializer
        if self._by_name is None or self._by_name_count != len(initializers):
            self._by_name, self._repeated_names = {}, set()
            for init in initializers:
                self._index_initializer(init)
            self._by_name_count = len(initializers)
        return self._by_name

    def _index_initializer(self, init: onnx.TensorProto) -> None:
        if init.name in self._by_name:
            self._repeated_names.add(init.name)
        else:
            self._by_name[init.name] = init

    def _appended_initializer(self, init: onnx.TensorProto) -> None:
        self.model.graph.initializer.append(init)
        if self._by_name is not None and self._by_name_count == len(self.model.graph.initializer) - 1:
            self._index_initializer(self.model.graph.initializer[-1])  # the graph's copy
            self._by_name_count += 1

    def _reader_index(self) -> dict[str, list[onnx.NodeProto]]:
        nodes = self.model.graph.node
        if self._readers is None or self._readers_count != len(nodes):
            self._readers = collections.defaultdict(list)
            for node in nodes:
                for name in dict.fromkeys(node.input):
                    self._readers[name].append(node)
            self._readers_count = len(nodes)
        return self._readers

    def _forget_indices(self) -> None:
        self._by_name = self._readers = None

    def reader_count(self, name: str) -> int:
        """``len(input_name_to_nodes()[name])`` (ORT's: one entry per input of a node that reads
        ``name``), from the reader index instead of a map of the whole graph built for one name."""
        readers = {id(node): node for node in self._reader_index().get(name, ())}  # a superset, repeats
        return sum(1 for node in readers.values() for input_name in node.input if input_name == name)

    def get_initializer(self, name):
        return self._initializer_index().get(name)

    def initializer(self):
        return _Initializers(self)

    def add_initializer(self, tensor):
        if tensor.name not in self._initializer_index():
            self._check_init(tensor)
            self._appended_initializer(tensor)

    def initializer_extend(self, inits):
        """ORT's, without checking every initializer already there again at each call (quadratic: a
        bias's three tensors each walked them all); those checks pass on a model without float8 ones."""
        if not self._float8_free:
            super().initializer_extend(inits)
            self._forget_indices()
            return
        if len(inits) == 0:
            raise ValueError("Can add an empty list.")
        for init in inits:
            self._check_init(init)
            self._appended_initializer(init)

    def add_node(self, node):
        super().add_node(node)
        nodes = self.model.graph.node
        if self._readers is not None and self._readers_count == len(nodes) - 1:
            for name in dict.fromkeys(nodes[-1].input):
                self._readers[name].append(nodes[-1])  # the graph's copy
            self._readers_count += 1

    def replace_node_input(self, node, old_input_name, new_input_name):
        ONNXModel.replace_node_input(node, old_input_name, new_input_name)
        if self._readers is not None:
            self._readers[new_input_name].append(node)

    def replace_input_of_all_nodes(self, old_input_name, new_input_name):
        readers = self._reader_index()
        for node in readers.pop(old_input_name, ()):
            ONNXModel.replace_node_input(node, old_input_name, new_input_name)  # no-op where rewired since
            readers[new_input_name].append(node)

    def replace_output_of_all_nodes(self, old_output_name, new_output_name):
        """ORT's, the names compared in the node's own container before a call per node (once per
        removable Relu/Clip, each a walk over the graph)."""
        for node in self.model.graph.node:
            if old_output_name in node.output:
                ONNXModel.replace_node_output(node, old_output_name, new_output_name)

    def replace_input_of_nodes(self, old_input_name, new_input_name, node_names_set):
        super().replace_input_of_nodes(old_input_name, new_input_name, node_names_set)
        self._forget_indices()

    def remove_node(self, node):
        super().remove_node(node)
        self._readers = None

    def remove_initializer(self, tensor):
        count = len(self.model.graph.initializer)
        super().remove_initializer(tensor)
        removed = len(self.model.graph.initializer) == count - 1
        if (self._by_name is not None and removed and self._by_name_count == count
                and tensor.name not in self._repeated_names):
            # ORT removes the first initializer equal to ``tensor``: the one of its name
            del self._by_name[tensor.name]
            self._by_name_count -= 1
        elif removed:
            self._by_name = None

    def clean_initializers(self):
        try:
            return super().clean_initializers()
        finally:
            self._forget_indices()

    def topological_sort(self):
        super().topological_sort()
        self._forget_indices()

    def replace_gemm_with_matmul(self):
        super().replace_gemm_with_matmul()
        self._forget_indices()

    def remove_unused_constant(self):
        super().remove_unused_constant()
        self._forget_indices()


class ChannelVectorisedQDQQuantizer(qdq_quantizer.QDQQuantizer):
    """ORT's ``QDQQuantizer``, its plain per-channel weight parameters computed by :func:`channel_quant_params`,
    its model a :class:`_ScanningONNXModel`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = _ScanningONNXModel(self.model.model)  # ONNXModel holds nothing else

    def _vectorisable_axis(self, tensor_name: str, tensor_info, initializer: onnx.TensorProto | None) -> int | None:
        """The normalised channel axis where ORT's per-channel branch would run with plain arguments; None elsewhere."""
        if initializer is None or initializer.data_type != onnx.TensorProto.FLOAT or self.min_real_range is not None:
            return None
        if self.tensor_quant_overrides.overrides_scale_zp(tensor_name):
            return None
        overrides = self.tensor_quant_overrides.get(tensor_name, [{}])
        if not overrides or "quant_type" in overrides[0] or any(key in o for o in overrides for key in _RANGE_OVERRIDES):
            return None
        is_weight = tensor_info.tensor_type is qdq_quantizer.QDQQuantTensorType.WEIGHT
        quant_type = self.weight_qType if is_weight else self.activation_qType
        axis = overrides[0].get("axis", tensor_info.axis)
        if axis is None or quant_type not in _VECTORISED_TYPES or (is_weight and self.block_size > 0):
            return None
        if not overrides[0].get("symmetric", True):
            return None
        valid, axis = normalize_axis(axis, len(initializer.dims))
        if not valid or not initializer.dims[axis] or 0 in initializer.dims:
            return None
        return axis

    def adjust_tensor_ranges(self):
        """ORT's, the model's map of each tensor's readers built once, not once per Relu/Clip: the
        method reads the graph and changes only the ranges (``tensors_range``)."""
        readers = self.model.input_name_to_nodes()
        self.model.input_name_to_nodes = lambda: readers
        try:
            super().adjust_tensor_ranges()
        finally:
            del self.model.input_name_to_nodes

    def try_replacing_upstream_output(self, upstream_output_name, output_name):
        """ORT's (onnxruntime 1.32; a removable Relu/Clip's input takes its output's name), its
        count of the input's readers from :meth:`_ScanningONNXModel.reader_count`: ORT mapped every
        tensor of the graph to its readers to count one tensor's, for each such activation (a
        quarter of PP-OCR cls's quantize_static)."""
        if (
            output_name in self.quantization_params
            and self.quantization_params[output_name].converted is None
            and self.quantization_params[upstream_output_name].converted is None
            and self.model.reader_count(upstream_output_name) == 1
            and not self.model.is_graph_output(upstream_output_name)
            and not self.model.is_graph_input(upstream_output_name)
        ):
            self.model.replace_output_of_all_nodes(upstream_output_name, output_name)
            if upstream_output_name in self.tensors_to_quantize:
                del self.tensors_to_quantize[upstream_output_name]
            return True
        return False

    def _calc_initializer_quant_params(self) -> dict:
        initializers = {init.name: init for init in self.model.initializer()}
        vectorised = {}
        for name, info in self.tensors_to_quantize.items():
            initializer = initializers.get(name)
            axis = self._vectorisable_axis(name, info, initializer)
            if axis is None:
                continue
            is_weight = info.tensor_type is qdq_quantizer.QDQQuantTensorType.WEIGHT
            quant_type = self.weight_qType if is_weight else self.activation_qType
            reduce_range = self.tensor_quant_overrides.get(name, [{}])[0].get("reduce_range", self.reduce_range)
            data = qdq_quantizer.tensor_proto_to_array(initializer)
            zero_point, scale = channel_quant_params(data, axis, quant_type, reduce_range)
            vectorised[name] = qdq_quantizer.QuantizationParams(zero_point=zero_point, scale=scale,
                                                               quant_type=quant_type, axis=axis)
        every_tensor = self.tensors_to_quantize
        self.tensors_to_quantize = {k: v for k, v in every_tensor.items() if k not in vectorised}
        try:
            computed = super()._calc_initializer_quant_params()
        finally:
            self.tensors_to_quantize = every_tensor
        # ORT's order: the order of tensors_to_quantize
        return {name: vectorised.get(name, computed.get(name)) for name in every_tensor
                if name in vectorised or name in computed}

    def _adjust_weight_scale_for_int32_bias(self, input_scale, weight_scale, weight_name, bias_tp, is_per_channel):
        """ORT's method, its per-channel loop (a dozen numpy scalar operations per output channel:
        11,000 channels on EfficientNet-Lite0) as array operations in the types each of its steps
        has; ORT's own code for a per-tensor, float16 or mismatched scale. Like ORT's, it updates
        ``weight_scale`` in place and returns it."""
        bias = qdq_quantizer.tensor_proto_to_array(bias_tp)
        if (not is_per_channel or weight_scale.ndim != 1 or not weight_scale.size or weight_scale.dtype != np.float32
                or bias.shape != weight_scale.shape or bias.dtype != np.float32):
            return super()._adjust_weight_scale_for_int32_bias(input_scale, weight_scale, weight_name, bias_tp,
                                                               is_per_channel)
        int32_info = np.iinfo(np.int32)
        qrange = np.array(int32_info.max, dtype=np.float64) - np.array(int32_info.min + 1, dtype=np.float64)
        # ORT's `1.0001 * (2.0 * |bias[i]|)` on a numpy scalar: float32 under numpy 2's promotion,
        # float64 under numpy 1's; the division by the float64 qrange is float64 either way
        product_type = (_INT32_BIAS_EPSILON * (2.0 * np.abs(bias[0]))).dtype
        doubled = 2.0 * np.abs(bias).astype(product_type)
        smallest_valid = (_INT32_BIAS_EPSILON * doubled).astype(product_type).astype(np.float64) / qrange
        weight_scale_fp64 = weight_scale.astype(np.float64)
        candidate = np.float64(input_scale.item()) * weight_scale_fp64
        too_small = (candidate < smallest_valid) & (candidate > 0.0)
        if not too_small.any():
            return False, weight_scale
        ratio = smallest_valid[too_small] / candidate[too_small]
        weight_scale[too_small] = (weight_scale_fp64[too_small] * ratio).astype(weight_scale.dtype)
        return True, weight_scale

    def _add_qdq_nodes_for_initializer(self, weight_proto: onnx.TensorProto):
        """ORT's method (quantized weight -> DequantizeLinear), a per-channel weight quantized by
        :func:`quantize_channels`; ORT's own code for everything else."""
        name = weight_proto.name
        params = self.initializer_quant_params.get(name)
        if (name in self.quantized_value_map or self.add_qdq_pair_to_weight or params is None
                or params.get("axis") is None or params.get("block_size", 0)
                or params["quant_type"] not in _VECTORISED_TYPES or weight_proto.data_type != onnx.TensorProto.FLOAT):
            return super()._add_qdq_nodes_for_initializer(weight_proto)
        axis = params.get("axis")
        scale_zp = self._make_scale_zp_initializers(name, params)
        dequantized = qdq_quantizer.add_dequant_output_suffix(name)
        self.model.replace_input_of_all_nodes(name, dequantized)
        data = qdq_quantizer.tensor_proto_to_array(weight_proto)
        integers = quantize_channels(data, axis, params["quant_type"], params["zero_point"], params["scale"])
        quantized = onnx.numpy_helper.from_array(integers.reshape(weight_proto.dims), f"{name}{TENSOR_NAME_QUANT_SUFFIX}")
        self.model.add_initializer(quantized)
        self._create_dq_node(quantized.name, dequantized, qdq_quantizer.add_dequant_suffix(name),
                             scale_zp.scale.name, scale_zp.zero_point.name, axis=axis, block_size=0)
        value = qdq_quantizer.QuantizedValue(name, quantized.name, scale_zp.scale.name, scale_zp.zero_point.name,
                                             qdq_quantizer.QuantizedValueType.Initializer, axis=axis)
        self.quantized_value_map[name] = qdq_quantizer.QDQTensorQuantizedValue(value, None, None)


def _handled(quant_format, activation_type, weight_type, calibrate_method, extra_options) -> bool:
    return (quant_format is QuantFormat.QDQ and calibrate_method == CalibrationMethod.MinMax
            and QuantType.QFLOAT8E4M3FN not in (activation_type, weight_type)
            and not (extra_options or {}).get("SmoothQuant", False)
            and hasattr(qdq_quantizer.QDQQuantizer, "_calc_initializer_quant_params"))


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
    # the module, not the function onnxruntime.quantization re-exports under the same name
    check_arguments = importlib.import_module("onnxruntime.quantization.quantize").check_static_quant_arguments
    updated = update_opset_version(
        model, weight_type, activation_type,
        tensor_quant_overrides=extra_options.get("TensorQuantOverrides"), block_size=extra_options.get("BlockSize", 0),
    )
    model = updated if updated is not model else model
    if tensors_range.calibration_method != calibrate_method:
        raise ValueError(f"calibration cache made with {tensors_range.calibration_method}, not {calibrate_method}")
    check_arguments(quant_format, activation_type, weight_type)
    _use_indexed_initializer_lookups()
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
        quantize_static(model_input, model_output, None, quant_format=quant_format, op_types_to_quantize=op_types_to_quantize,
                        per_channel=per_channel, reduce_range=reduce_range, activation_type=activation_type,
                        weight_type=weight_type, nodes_to_quantize=nodes_to_quantize, nodes_to_exclude=nodes_to_exclude,
                        use_external_data_format=use_external_data_format, calibrate_method=calibrate_method,
                        calibration_providers=calibration_providers, extra_options=extra_options, calibration_cache_path=calibration_cache_path)
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
    return not use_external_data_format and _handled(quant_format, activation_type, weight_type, calibrate_method, extra_options)


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
                           reduce_range, activation_type, weight_type, nodes_to_quantize, nodes_to_exclude, extra_options)
    quantized.topological_sort()
    for initializer in quantized.model.graph.initializer:
        quantized._check_init(initializer, "end")  # what its save checks (float8 NaNs)
    return quantized.model

"""Per-channel weight quantization parameters a whole tensor at a time, in ORT's QDQ quantizer.

ORT's ``QDQQuantizer`` computes each per-channel weight's scale and zero point one channel at a
time in Python (a ``compute_data_quant_params`` call per output channel: 17,000 calls on
MobileNetV2, a third of ``quantize_static``), then quantizes those weights one channel per call
again. :class:`ChannelVectorisedQDQQuantizer` computes the common case (symmetric
int8/uint8/int16/uint16 per-channel weights, no per-channel range overrides, no minimum real
range, no blocks) with array operations, element for element the same arithmetic
(:func:`channel_quant_params`, :func:`quantize_channels`), and leaves every other tensor to ORT's
own code. The quantizer's private hooks come through :mod:`kenosis_rewrite._upstream.ort_quantizer`.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnxruntime.quantization import qdq_quantizer
from onnxruntime.quantization.quant_utils import (
    ONNX_TYPE_TO_NP_TYPE,
    TENSOR_NAME_QUANT_SUFFIX,
    get_qmin_qmax_for_qType,
    normalize_axis,
)

from kenosis_rewrite._upstream import ort_quantizer
from kenosis_rewrite.calibration.ort_indexed_model import ScanningONNXModel

__all__ = ["ChannelVectorisedQDQQuantizer", "channel_quant_params", "quantize_channels"]

_VECTORISED_TYPES = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16)
_RANGE_OVERRIDES = ("rmin", "rmax")
_INT32_BIAS_EPSILON = 1.0001  # ORT's multiplicative_epsilon: the bias scale's margin over the int32 range


def channel_quant_params(data: np.ndarray, axis: int, quant_type: int,
                         reduce_range: bool) -> tuple[np.ndarray, np.ndarray]:
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


def quantize_channels(data: np.ndarray, axis: int, quant_type: int, zero_point: np.ndarray,
                      scale: np.ndarray) -> np.ndarray:
    """Float32 ``data`` quantized along ``axis``: ORT's ``quantize_nparray`` of each channel, concatenated."""
    shape = [1] * data.ndim
    shape[axis] = -1
    qmin, qmax = get_qmin_qmax_for_qType(quant_type, reduce_range=False, symmetric=False)
    values = np.asarray((data.astype(np.float32) / scale.reshape(shape)).round() + zero_point.reshape(shape))
    np.clip(values, qmin, qmax, out=values)
    return values.astype(ONNX_TYPE_TO_NP_TYPE[quant_type])


class ChannelVectorisedQDQQuantizer(ort_quantizer.QDQQuantizer):
    """ORT's ``QDQQuantizer``, its plain per-channel weight parameters computed by :func:`channel_quant_params`,
    its model a :class:`~kenosis_rewrite.calibration.ort_indexed_model.ScanningONNXModel`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = ScanningONNXModel(self.model.model)  # ONNXModel holds nothing else

    def _vectorisable_axis(self, tensor_name: str, tensor_info, initializer: onnx.TensorProto | None) -> int | None:
        """The normalised channel axis where ORT's per-channel branch would run with plain arguments; None elsewhere."""
        if initializer is None or initializer.data_type != onnx.TensorProto.FLOAT or self.min_real_range is not None:
            return None
        if self.tensor_quant_overrides.overrides_scale_zp(tensor_name):
            return None
        overrides = self.tensor_quant_overrides.get(tensor_name, [{}])
        if (not overrides or "quant_type" in overrides[0]
                or any(key in o for o in overrides for key in _RANGE_OVERRIDES)):
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
        count of the input's readers from
        :meth:`~kenosis_rewrite.calibration.ort_indexed_model.ScanningONNXModel.reader_count`: ORT
        mapped every tensor of the graph to its readers to count one tensor's, for each such
        activation (a quarter of PP-OCR cls's quantize_static)."""
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

    def initializer_quant_params_of_all(self) -> dict:
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
            computed = super().initializer_quant_params_of_all()
        finally:
            self.tensors_to_quantize = every_tensor
        # ORT's order: the order of tensors_to_quantize
        return {name: vectorised.get(name, computed.get(name)) for name in every_tensor
                if name in vectorised or name in computed}

    def adjusted_weight_scale_for_int32_bias(self, input_scale, weight_scale, weight_name, bias_tp, is_per_channel):
        """ORT's method, its per-channel loop (a dozen numpy scalar operations per output channel:
        11,000 channels on EfficientNet-Lite0) as array operations in the types each of its steps
        has; ORT's own code for a per-tensor, float16 or mismatched scale. Like ORT's, it updates
        ``weight_scale`` in place and returns it."""
        bias = qdq_quantizer.tensor_proto_to_array(bias_tp)
        if (not is_per_channel or weight_scale.ndim != 1 or not weight_scale.size or weight_scale.dtype != np.float32
                or bias.shape != weight_scale.shape or bias.dtype != np.float32):
            return super().adjusted_weight_scale_for_int32_bias(input_scale, weight_scale, weight_name, bias_tp,
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

    def add_initializer_qdq_nodes(self, weight_proto: onnx.TensorProto):
        """ORT's method (quantized weight -> DequantizeLinear), a per-channel weight quantized by
        :func:`quantize_channels`; ORT's own code for everything else."""
        name = weight_proto.name
        params = self.initializer_quant_params.get(name)
        if (name in self.quantized_value_map or self.add_qdq_pair_to_weight or params is None
                or params.get("axis") is None or params.get("block_size", 0)
                or params["quant_type"] not in _VECTORISED_TYPES or weight_proto.data_type != onnx.TensorProto.FLOAT):
            return super().add_initializer_qdq_nodes(weight_proto)
        axis = params.get("axis")
        scale_zp = self.make_scale_zp_initializers(name, params)
        dequantized = qdq_quantizer.add_dequant_output_suffix(name)
        self.model.replace_input_of_all_nodes(name, dequantized)
        data = qdq_quantizer.tensor_proto_to_array(weight_proto)
        integers = quantize_channels(data, axis, params["quant_type"], params["zero_point"], params["scale"])
        quantized = onnx.numpy_helper.from_array(integers.reshape(weight_proto.dims),
                                                 f"{name}{TENSOR_NAME_QUANT_SUFFIX}")
        self.model.add_initializer(quantized)
        self.create_dq_node(quantized.name, dequantized, qdq_quantizer.add_dequant_suffix(name),
                             scale_zp.scale.name, scale_zp.zero_point.name, axis=axis, block_size=0)
        value = qdq_quantizer.QuantizedValue(name, quantized.name, scale_zp.scale.name, scale_zp.zero_point.name,
                                             qdq_quantizer.QuantizedValueType.Initializer, axis=axis)
        self.quantized_value_map[name] = qdq_quantizer.QDQTensorQuantizedValue(value, None, None)

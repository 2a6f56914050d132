"""The weight DequantizeLinear ORT's MatMulNBits reads: its constants, whether MatMulNBits can take them,
and what it computes (used by :mod:`kenosis_rewrite.placement.rules.matmul_nbits`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params

NBITS_TYPES = (ir.DataType.INT4, ir.DataType.UINT4, ir.DataType.INT8, ir.DataType.UINT8)
MIN_BLOCK = 16
MAX_BLOCK = 256  # measured on ORT 1.31.1: block_size 512 and 1024 do not fuse


@dataclasses.dataclass(frozen=True)
class WeightDQ:
    """The constants and layout of a DequantizeLinear of a constant weight."""

    node: ir.Node
    shape: tuple[int, ...]  # of the quantized data
    scale: np.ndarray
    zero_point: np.ndarray | None
    dtype: ir.DataType
    axis: int  # non-negative
    block_size: int

    @property
    def data(self) -> np.ndarray:
        """The quantized data as stored (ml_dtypes int4/uint4 for 4-bit), read only when a rewrite needs it:
        checks look at ``shape``, so matching a large model does not read (or unpack) its weights."""
        return qdq_params.const_array(self.node.inputs[0])

    @property
    def scale_type(self) -> ir.DataType:
        return float_dtype(self.scale)

    def describe(self) -> str:
        layout = f"blocked axis {self.axis} x{self.block_size}" if self.block_size else f"axis {self.axis}"
        return f"{self.dtype.name.lower()} {list(self.shape)} {layout}"


def constant_of(value: ir.Value | None) -> np.ndarray | None:
    """The constant behind ``value`` (None for graph inputs, which a caller may override)."""
    if value is None or value.is_graph_input():
        return None
    return qdq_params.const_array(value)


def weight_dq(value: ir.Value | None) -> WeightDQ | str:
    """The weight DequantizeLinear producing ``value``, or a reason why it is not one."""
    node = value.producer() if value is not None else None
    if not qdq_params.is_dequantize(node):
        return "the weight does not come from a DequantizeLinear"
    data = None if node.inputs[0] is None or node.inputs[0].is_graph_input() else \
        ir.convenience.get_const_tensor(node.inputs[0])
    scale = constant_of(node.inputs[1])
    zp_value = node.inputs[2] if len(node.inputs) > 2 else None
    zero_point = constant_of(zp_value)
    if data is None or scale is None or (zp_value is not None and zero_point is None):
        return "the DequantizeLinear's data, scale or zero point is not a constant"
    dtype = node.inputs[0].dtype or ir.DataType.UNDEFINED
    shape = tuple(int(d) for d in data.shape)
    axis = node.attributes.get_int("axis", 1)
    axis = axis + len(shape) if axis < 0 else axis
    return WeightDQ(node, shape, scale, zero_point, dtype, axis, node.attributes.get_int("block_size", 0))


def nbits_type_reason(dq: WeightDQ) -> str | None:
    """Why MatMulNBits cannot take this quantized type and scale type; None when it can."""
    if dq.dtype not in NBITS_TYPES:
        return f"{dq.dtype.name.lower()} weights: MatMulNBits takes int4/uint4/int8/uint8 only"
    if dq.scale.dtype not in (np.float32, np.float16):
        return f"{dq.scale.dtype} scales: MatMulNBits takes float32/float16 scales only"
    return None


def _expand(array: np.ndarray, dq: WeightDQ, shape: tuple[int, ...]) -> np.ndarray:
    """Scale or zero point broadcast to the data shape (per-tensor, per-axis or blocked)."""
    if array.size == 1 and not dq.block_size:
        return array.reshape(())
    if dq.block_size:
        return np.repeat(array, dq.block_size, axis=dq.axis).take(np.arange(shape[dq.axis]), axis=dq.axis)
    view = [1] * len(shape)
    view[dq.axis] = array.size
    return array.reshape(view)


def dequantize_constant(dq: WeightDQ, scale: np.ndarray | None = None) -> np.ndarray:
    """What DequantizeLinear computes: ``(data - zp) * scale`` in float32, rounded to the scale's type."""
    scale = dq.scale if scale is None else scale
    data = dq.data.astype(np.float32)
    zero_point = 0.0 if dq.zero_point is None else _expand(dq.zero_point.astype(np.float32), dq, data.shape)
    product = (data - zero_point) * _expand(scale.astype(np.float32), dq, data.shape)
    return product.astype(scale.dtype)


def fusible_block(dq: WeightDQ) -> bool:
    """Whether ORT's MatMulNBits fusion takes this block size (a power of two in [MIN_BLOCK, MAX_BLOCK])."""
    block = dq.block_size
    return MIN_BLOCK <= block <= MAX_BLOCK and not block & (block - 1)


def float_dtype(array: np.ndarray) -> ir.DataType:
    """The ONNX float type of a scale array (float16 or float32)."""
    return ir.DataType.FLOAT16 if array.dtype == np.float16 else ir.DataType.FLOAT

"""Small helpers to read QuantizeLinear/DequantizeLinear parameters from an onnx-ir graph."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.core.op_tables import (  # noqa: F401 - WEIGHTED_OPS re-exported: it was defined here
    DEFAULT_DOMAINS,
    DEQUANTIZE,
    PER_AXIS_OPSET,
    QUANTIZE,
    WEIGHTED_OPS,
)

# Integer ranges of the quantized types the rules understand. Other types (float8, ...) are
# left untouched by every rule, which then refuses with a reason.
INTEGER_RANGES: dict[ir.DataType, tuple[int, int]] = {
    ir.DataType.UINT8: (0, 255),
    ir.DataType.INT8: (-128, 127),
    ir.DataType.UINT16: (0, 65535),
    ir.DataType.INT16: (-32768, 32767),
    ir.DataType.UINT4: (0, 15),
    ir.DataType.INT4: (-8, 7),
}
EIGHT_BIT = (ir.DataType.UINT8, ir.DataType.INT8)


def is_op(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in DEFAULT_DOMAINS


def is_quantize(node: ir.Node | None) -> bool:
    return is_op(node, QUANTIZE)


def is_dequantize(node: ir.Node | None) -> bool:
    return is_op(node, DEQUANTIZE)


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The constant value of ``value`` as numpy (initializer or Constant node), else None."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    return tensor.numpy()


# initializers up to this size (scales, zero points, clamp bounds) are held as read-only arrays
_SMALL_CONSTANT_ELEMENTS = 64


def small_constants_as_arrays(model: ir.Model) -> None:
    """Hold ``model``'s small initializers (scales, zero points: up to ``_SMALL_CONSTANT_ELEMENTS``)
    as numpy-backed tensors with the same values. A deserialized initializer parses its bytes again
    at every ``numpy()``, and the rules read each Q/DQ's parameters many times (4,091 parses in one
    PP-OCR cls quantize()). The arrays are read-only: a rule must build new tensors, as every rule
    does, never write into the ones it read."""
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None or isinstance(tensor, ir.Tensor) or tensor.size > _SMALL_CONSTANT_ELEMENTS:
            continue
        try:
            array = tensor.numpy()
        except Exception:  # noqa: BLE001 - an encoding numpy cannot hold (float8, 4-bit) stays as it is
            continue
        if array.dtype.kind not in "biuf":
            continue
        array.setflags(write=False)
        value.const_value = ir.Tensor(array, dtype=tensor.dtype, name=tensor.name, doc_string=tensor.doc_string)


@dataclasses.dataclass(frozen=True)
class QuantParams:
    """Scale, zero point and quantized type of one Q or DQ node (constants only)."""

    scale: np.ndarray
    zero_point: np.ndarray
    dtype: ir.DataType
    axis: int
    block_size: int

    @property
    def is_per_tensor(self) -> bool:
        return self.scale.size == 1 and self.zero_point.size == 1 and self.block_size == 0

    @property
    def qmin(self) -> int:
        return INTEGER_RANGES[self.dtype][0]

    @property
    def qmax(self) -> int:
        return INTEGER_RANGES[self.dtype][1]

    @property
    def scalar_scale(self) -> float:
        return float(self.scale.reshape(-1)[0])

    @property
    def scalar_zero_point(self) -> int:
        return int(self.zero_point.astype(np.int64).reshape(-1)[0])

    def same_as(self, other: QuantParams) -> bool:
        return (
            self.dtype == other.dtype
            and self.scale.shape == other.scale.shape
            and np.array_equal(self.scale, other.scale)
            and np.array_equal(
                self.zero_point.astype(np.int64), other.zero_point.astype(np.int64)
            )
            and self.axis == other.axis
            and self.block_size == other.block_size
        )

    def describe(self) -> str:
        if self.is_per_tensor:
            return f"{self.dtype.name.lower()} s={self.scalar_scale:.6g} zp={self.scalar_zero_point}"
        return f"{self.dtype.name.lower()} per-axis({self.axis}) x{self.scale.size}"


def _quantized_dtype(node: ir.Node) -> ir.DataType | None:
    zp = node.inputs[2] if len(node.inputs) > 2 else None
    if zp is not None:
        if zp.dtype is not None:
            return zp.dtype
        # A Constant node's output carries no type in onnx-ir: the tensor it holds does.
        tensor = ir.convenience.get_const_tensor(zp)
        if tensor is not None:
            return tensor.dtype
    if node.op_type == QUANTIZE:
        output_dtype = node.attributes.get_int("output_dtype", 0)
        if output_dtype:
            return ir.DataType(output_dtype)
        return ir.DataType.UINT8
    # DQ without zero point: the type is the type of its input.
    data = node.inputs[0]
    if data is None:
        return None
    if data.dtype is None and is_quantize(data.producer()):
        return _quantized_dtype(data.producer())
    return data.dtype


def quant_params(node: ir.Node, domains: tuple[str, ...] = DEFAULT_DOMAINS) -> QuantParams | None:
    """Parameters of a Q/DQ node, or None when the scale or zero point is not a constant."""
    if node is None or node.op_type not in (QUANTIZE, DEQUANTIZE) or node.domain not in domains:
        return None
    if len(node.inputs) < 2:
        return None
    scale = const_array(node.inputs[1])
    if scale is None:
        return None
    dtype = _quantized_dtype(node)
    if dtype is None:
        return None
    zp_value = node.inputs[2] if len(node.inputs) > 2 else None
    if zp_value is None:
        zero_point = np.zeros(scale.shape, dtype=dtype.numpy())
    else:
        zero_point = const_array(zp_value)
        if zero_point is None:
            return None
    return QuantParams(
        scale=scale,
        zero_point=zero_point,
        dtype=dtype,
        axis=node.attributes.get_int("axis", 1),
        block_size=node.attributes.get_int("block_size", 0),
    )


def per_output_column(params: QuantParams, weight_shape: tuple[int, ...], output_axis: int) -> bool:
    """Whether a 2-D weight's parameters are per tensor or per ``output_axis`` entry (its columns as
    the MatMul/Gemm reads it): what MatMulInteger's and MatMulIntegerToFloat's B parameters take."""
    if params.block_size:
        return False
    return params.is_per_tensor or (params.axis % len(weight_shape) == output_axis
                                    and params.scale.size == weight_shape[output_axis])


def column_params(values: np.ndarray, params: QuantParams) -> np.ndarray:
    """A per-tensor parameter as a scalar, a per-column one as a vector (MatMulInteger's shapes)."""
    return values.reshape(() if params.is_per_tensor else -1)


def integer_tensor(values: np.ndarray, dtype: ir.DataType, name: str) -> ir.Tensor:
    """An ir.Tensor of integer quantized type ``dtype`` holding ``values`` (already in range)."""
    lo, hi = INTEGER_RANGES[dtype]
    values = np.asarray(values)
    if values.size and (values.min() < lo or values.max() > hi):
        raise ValueError(f"values out of range for {dtype.name}")
    return ir.Tensor(values.astype(dtype.numpy()), dtype=dtype, name=name)


class NameAllocator:
    """Fresh, deterministic names for one graph: ``base``, else ``base_1``, ``base_2``...

    The one way kenosis names what it adds (onnxscript skips a new initializer whose name exists,
    and duplicate value names make an invalid model). The graph is scanned once, when the first name
    is asked for (values, initializers and node names, subgraphs included; making an allocator that
    names nothing costs nothing); a pass or rule then keeps one allocator for all it adds, so naming
    N things costs one scan, not N.
    """

    def __init__(self, graph: ir.Graph, also_taken: Iterable[str] = ()):
        """``also_taken``: names used elsewhere (the model a scratch ``graph`` will be merged into)."""
        self._graph = graph
        self._also_taken = also_taken
        self._taken: set[str] | None = None
        self._next_index: dict[str, int] = {}  # per base: every ``base_i`` below it is taken

    def _scan(self) -> set[str]:
        taken = set(self._graph.initializers)
        taken.update(self._also_taken)
        taken.update(v.name for v in self._graph.inputs if v.name)
        for node in ir.traversal.RecursiveGraphIterator(self._graph):
            taken.update(v.name for v in node.outputs if v.name)
            if node.name:
                taken.add(node.name)
        return taken

    def fresh(self, base: str) -> str:
        """``base`` when free, else the first free ``base_i`` (i = 1, 2...); the name is then taken."""
        if self._taken is None:
            self._taken = self._scan()
        if base not in self._taken:
            self._taken.add(base)
            return base
        index = self._next_index.get(base, 1)
        while f"{base}_{index}" in self._taken:
            index += 1
        self._next_index[base] = index + 1
        name = f"{base}_{index}"
        self._taken.add(name)
        return name


def add_initializer(graph: ir.Graph, tensor: ir.Tensor, name: str) -> ir.Value:
    value = ir.Value(
        name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor
    )
    graph.register_initializer(value)
    return value


def set_per_tensor_params(
    graph: ir.Graph, nodes, scale: float, zero_point: int, like: QuantParams, base: str, names: NameAllocator,
) -> None:
    """Give the Q/DQ ``nodes`` the per-tensor parameters ``(scale, zero_point)`` in ``like``'s types
    (new initializers ``{base}_scale`` / ``{base}_zero_point``; any ``axis`` attribute dropped)."""
    scale_name, zp_name = names.fresh(f"{base}_scale"), names.fresh(f"{base}_zero_point")
    scale_value = add_initializer(graph, ir.tensor(np.asarray(scale, dtype=like.scale.dtype), name=scale_name), scale_name)
    zp_value = add_initializer(graph, integer_tensor(np.asarray(zero_point), like.dtype, zp_name), zp_name)
    for node in nodes:
        node.replace_input_with(1, scale_value)
        if len(node.inputs) < 3:
            node.resize_inputs(3)
        node.replace_input_with(2, zp_value)
        node.attributes.pop("axis", None)


def default_opset(owner: ir.Model | ir.Graph) -> int:
    """The default-domain (``""`` or ``"ai.onnx"``) opset of a model or graph; 1 when none is imported."""
    opsets = owner.opset_imports
    return opsets.get("", opsets.get("ai.onnx", 1))


def constant_maker(op, fresh, base: str):
    """``make(values, dtype, suffix)`` -> a new initializer value named ``fresh(f"{base}_{suffix}")``, for a
    rule's ``rewrite(op, ...)`` (``fresh``: e.g. ``ReportingRule.fresh_name`` bound to the graph)."""

    def make(values, dtype, suffix: str) -> ir.Value:
        name = fresh(f"{base}_{suffix}")
        return op.initializer(ir.tensor(np.asarray(values, dtype=dtype), name=name), name=name)

    return make


def shared_dequantize_params(values) -> QuantParams | None:
    """The per-tensor parameters every one of ``values`` is dequantized with, when each is written by
    a DequantizeLinear and all use the same parameters; else None."""
    producers = [v.producer() if v is not None else None for v in values]
    if not producers or not all(is_dequantize(p) for p in producers):
        return None
    params = [quant_params(p) for p in producers]
    if any(p is None or not p.is_per_tensor for p in params) or not all(p.same_as(params[0]) for p in params):
        return None
    return params[0]


def dequantize_consumers(value: ir.Value) -> list[ir.Node] | None:
    """The DequantizeLinear nodes reading ``value``; None when anything else reads it."""
    consumers = []
    for node, index in value.uses():
        if not is_dequantize(node) or index != 0:
            return None
        consumers.append(node)
    return consumers


def requantizable(output: ir.Value, what: str = "quantized tensor") -> list[ir.Node] | str:
    """The DequantizeLinear nodes that alone read quantized ``output`` (so its parameters may change
    with theirs), or why not: it is a graph output (its type and values are the interface), or
    another node reads it. ``what`` names the tensor in that reason."""
    if output.is_graph_output():
        return f"{what} {output.name!r} is a graph output"
    consumers = dequantize_consumers(output)
    if consumers is None:
        return f"{what} {output.name!r} is read by a non-DequantizeLinear node"
    return consumers


def _along_axis(array: np.ndarray, params: QuantParams, ndim: int) -> np.ndarray:
    """A scale or zero point of ``params`` shaped to broadcast against an ``ndim``-D tensor: per-axis
    parameters along ``params.axis``, per-tensor ones as they are."""
    if params.scale.size <= 1:
        return array
    shape = [1] * ndim
    shape[params.axis % ndim] = params.scale.size
    return array.reshape(shape)


def dequantize_array(data: np.ndarray, params: QuantParams) -> np.ndarray:
    """``(data - zero_point) * scale`` in float32, broadcasting per-axis parameters (not blocked)."""
    if params.block_size:
        raise ValueError("blocked parameters are not supported here")
    scale = _along_axis(params.scale.astype(np.float32), params, data.ndim)
    zero_point = _along_axis(params.zero_point.astype(np.float32), params, data.ndim)
    with np.errstate(over="ignore"):  # float32 overflows to an infinity, as DequantizeLinear's does
        return ((data.astype(np.float32) - zero_point) * scale).astype(np.float32)


def constant_or_dequantized(value: ir.Value | None, source=None) -> np.ndarray | None:
    """The value of a constant, or of a DequantizeLinear of constants (per-tensor or per-axis).
    ``source``: how to read the value behind a ``Q -> DQ`` pair (:func:`const_array` by default)."""
    array = const_array(value)
    if array is not None or value is None:
        return array
    producer = value.producer()
    if not is_dequantize(producer):
        return None
    data, params = const_array(producer.inputs[0]), quant_params(producer)
    if params is None or params.block_size:
        return None
    if data is None:  # a Constant node treated as an activation: DQ(Q(constant))
        quantize = producer.inputs[0].producer()
        values = (source or const_array)(quantize.inputs[0]) if is_quantize(quantize) else None
        q_params = quant_params(quantize) if values is not None else None
        if q_params is None or not q_params.same_as(params):
            return None
        data = quantize_array(values, params)
    return dequantize_array(data, params)


_SHAPE_OPS = ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity")


def reshaped_constant(value: ir.Value | None, depth: int = 4) -> np.ndarray | None:
    """:func:`constant_or_dequantized`, also through Reshape/Unsqueeze/Squeeze/Flatten/Identity of
    constants (Paddle exports reshape each Conv bias at run time: ``Add(conv, Reshape(b, [1, -1, 1, 1]))``),
    and through the ``Q -> DQ`` quantize_static puts after such a Reshape (read as the model computes it)."""
    # DQ(Q(a reshaped constant)): quantize_static quantizes the Reshape's output as an activation
    array = constant_or_dequantized(value, source=(lambda inner: reshaped_constant(inner, depth - 1)) if depth else None)
    if array is not None or value is None or depth == 0:
        return array
    node = value.producer()
    if node is None or node.op_type not in _SHAPE_OPS or node.domain not in DEFAULT_DOMAINS or not node.inputs:
        return None
    data = reshaped_constant(node.inputs[0], depth - 1)
    if data is None:
        return None
    second = const_array(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    try:
        if node.op_type == "Identity":
            return data
        if node.op_type == "Flatten":
            axis = node.attributes.get_int("axis", 1) % max(data.ndim, 1)
            return data.reshape(int(np.prod(data.shape[:axis])), -1)
        if node.op_type == "Reshape":
            if second is None or node.attributes.get_int("allowzero", 0):
                return None
            shape = [data.shape[i] if size == 0 else int(size) for i, size in enumerate(second.reshape(-1))]
            return data.reshape(shape)
        axes = second if second is not None else node.attributes.get_ints("axes", None)
        if node.op_type == "Squeeze":
            return np.squeeze(data, axis=None if axes is None else tuple(int(a) for a in np.reshape(axes, -1)))
        if axes is None:
            return None
        return np.expand_dims(data, tuple(int(a) for a in np.reshape(axes, -1)))
    except (ValueError, IndexError):  # a shape that does not apply: not a constant we can read
        return None


def quantize_array(values: np.ndarray, params: QuantParams) -> np.ndarray:
    """``clip(rint(values / scale) + zero_point)`` as QuantizeLinear computes it (half to even)."""
    scale = _along_axis(params.scale.astype(np.float32), params, values.ndim)
    zero_point = _along_axis(params.zero_point.astype(np.float64), params, values.ndim)
    with np.errstate(over="ignore"):  # an infinity saturates, as QuantizeLinear's does
        quantized = np.rint(values.astype(np.float32) / scale) + zero_point
    return np.clip(quantized, params.qmin, params.qmax).astype(params.dtype.numpy())

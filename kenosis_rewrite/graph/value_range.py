"""What values a tensor can take: one analysis for every rule that asks.

Rules need three facts, and each used to have its own partial answer:

* **Which ops only move values** (``op_tables.VALUE_SELECTING_OPS``, and Resize/Upsample in nearest mode): every
  output element is an element of the first input (selection, layout, max/min, nearest-neighbour
  resampling). Their outputs take only values of the input.
* **The bounds of a Clip or Relu** (:func:`activation_bounds`): Clip's bounds are inputs from
  opset 11 and attributes before; an absent bound is unbounded.
* **The interval a tensor lies in** (:func:`bounds`): a sound over-approximation by interval
  arithmetic from constants, dequantized tensors, bounded activations and value-preserving ops;
  anything the analysis does not know is unbounded, so "cannot be negative" is only said when
  it is proven.

On top of these, :func:`quantizer_clamp` answers the question every Q/DQ rewrite must ask before it
replaces or removes a QuantizeLinear: does this Q clamp values its input can take? quantize_static
deletes a Relu or Clip in front of a Q and lets the Q's clamp stand for it (zero point at qmin
after a Relu, or a range narrower than the activation's input); a rewrite that drops such a clamp
changes the function the model computes. The answer is conservative: a side is reported as clamping
unless the analysis proves no reachable value lies beyond it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.core.op_tables import DEFAULT_DOMAINS, VALUE_SELECTING_OPS
from kenosis_rewrite.graph import qdq_params

__all__ = [
    "Interval", "activation_bounds", "bounds", "can_be_negative", "quantizer_range",
    "quantizer_clamp", "implied_clamp", "is_pass_through", "absorbed_by_quantizer", "DELETED_ACTIVATION_KEY",
    "mark_deleted_activation", "round_range_bounds",
]

# Ops that only move values in one mode: nearest-neighbour resampling copies input elements
# (linear/cubic interpolate between them, and cubic can overshoot).
_NEAREST_RESAMPLING_OPS = frozenset({"Resize", "Upsample"})

# Ops whose outputs are convex combinations (averages) of input values: inside the input's hull.
_AVERAGING_OPS = frozenset({"AveragePool", "GlobalAveragePool", "ReduceMean"})

_UNBOUNDED = (-math.inf, math.inf)
_DEPTH = 24

# Node metadata on a QuantizeLinear whose clamp stands for a Relu/Clip quantize_static deleted, set
# by the caller that ran quantize_static and so knows (quantize()): the op type deleted.
DELETED_ACTIVATION_KEY = "kenosis_rewrite.deleted_activation"


@dataclasses.dataclass(frozen=True)
class Interval:
    lo: float = -math.inf
    hi: float = math.inf

    def union(self, other: Interval) -> Interval:
        return Interval(min(self.lo, other.lo), max(self.hi, other.hi))

    def clamp(self, lo: float | None, hi: float | None) -> Interval:
        """The interval after ``Clip(lo, hi)`` (None = that side unbounded)."""

        def clip(x: float) -> float:
            x = x if lo is None else max(x, lo)
            return x if hi is None else min(x, hi)

        return Interval(clip(self.lo), clip(self.hi))


def is_pass_through(node: ir.Node | None) -> bool:
    """True when every value ``node``'s first output holds is a value of its first input."""
    if node is None or node.domain not in DEFAULT_DOMAINS:
        return False
    if node.op_type in _NEAREST_RESAMPLING_OPS:
        if node.attributes.get_string("mode", "nearest") != "nearest":
            return False
    elif node.op_type not in VALUE_SELECTING_OPS:
        return False
    if node.op_type == "MaxPool" and len(node.outputs) > 1 and node.outputs[1].uses():
        return False  # the Indices output is not a value of the input
    return bool(node.inputs) and node.inputs[0] is not None


def activation_bounds(node: ir.Node) -> tuple[float | None, float | None] | str:
    """(lo, hi) of a Relu or Clip (None = unbounded), or why they are not constants.

    Clip's bounds are optional inputs from opset 11 on and ``min``/``max`` attributes before it.
    """
    if node.op_type == "Relu":
        return 0.0, None
    if node.op_type != "Clip":
        return f"{node.op_type} is not Relu or Clip"
    result = []
    for index, attribute in ((1, "min"), (2, "max")):
        value = node.inputs[index] if len(node.inputs) > index else None
        if value is None:
            result.append(node.attributes.get_float(attribute, None))
            continue
        array = qdq_params.const_array(value)
        if array is None:
            return f"Clip bound {value.name!r} is not a constant"
        result.append(float(array.reshape(-1)[0]))
    return result[0], result[1]


def absorbed_by_quantizer(activation: ir.Node, params: qdq_params.QuantParams) -> bool:
    """ORT's ReluQuantFusion / ClipQuantFusion test: the Q's own clamp makes ``activation`` redundant.

    A Relu when the zero point is qmin; a Clip when both bounds round outside the Q's range. For
    per-axis parameters, on every channel.
    """
    limits = activation_bounds(activation)
    if isinstance(limits, str) or params.block_size:
        return False
    lo, hi = limits
    scale = params.scale.astype(np.float64).reshape(-1)
    zero_point = params.zero_point.astype(np.int64).reshape(-1)
    if activation.op_type == "Relu":
        return bool(np.all(zero_point == params.qmin))
    lo_ok = lo is None or np.all(np.rint(lo / scale) + zero_point <= params.qmin)
    hi_ok = hi is None or np.all(np.rint(hi / scale) + zero_point >= params.qmax)
    return bool(lo_ok and hi_ok)


def quantizer_range(params: qdq_params.QuantParams) -> Interval:
    """The values a per-tensor Q/DQ can represent: ``[s (qmin - z), s (qmax - z)]``."""
    scale, zero_point = params.scalar_scale, params.scalar_zero_point
    return Interval(scale * (params.qmin - zero_point), scale * (params.qmax - zero_point))


def _dequantized_range(node: ir.Node, depth: int, seen: dict | None = None) -> Interval:
    params = qdq_params.quant_params(node)
    if params is None or params.block_size:
        return Interval(*_UNBOUNDED)
    data = qdq_params.const_array(node.inputs[0])
    if data is not None:
        values = qdq_params.dequantize_array(data, params)
        return Interval(float(values.min()), float(values.max())) if values.size else Interval(0.0, 0.0)
    scale = params.scale.astype(np.float64).reshape(-1)
    zero_point = params.zero_point.astype(np.float64).reshape(-1)
    representable = Interval(
        float(np.min(scale * (params.qmin - zero_point))), float(np.max(scale * (params.qmax - zero_point)))
    )
    quantize = node.inputs[0].producer() if node.inputs[0] is not None else None
    q_params = qdq_params.quant_params(quantize) if qdq_params.is_quantize(quantize) else None
    if q_params is None or not q_params.same_as(params) or not params.is_per_tensor:
        return representable
    # DQ(Q(x)) is non-decreasing in x: its values lie between the images of x's bounds.
    reach = bounds(quantize.inputs[0], depth - 1, seen)
    ends = np.array([reach.lo, reach.hi], dtype=np.float64).clip(representable.lo, representable.hi)
    low, high = qdq_params.dequantize_array(qdq_params.quantize_array(ends, params), params)
    return Interval(float(low), float(high))


def _sum(a: Interval, b: Interval) -> Interval:
    return Interval(a.lo + b.lo, a.hi + b.hi)


def _product(a: Interval, b: Interval) -> Interval:
    corners = [x * y for x in (a.lo, a.hi) for y in (b.lo, b.hi) if not (math.isinf(x) and y == 0 or math.isinf(y) and x == 0)]
    return Interval(min(corners, default=0.0), max(corners, default=0.0)) if corners else Interval(0.0, 0.0)


def bounds(value: ir.Value | None, depth: int = _DEPTH, _seen: dict | None = None) -> Interval:
    """A sound interval containing every value ``value`` can take, whatever the graph inputs.

    Looks at most ``depth`` producers up; each value is analysed once per call (graphs with
    residual joins would otherwise be walked once per path).
    """
    if value is None or depth <= 0:
        return Interval(*_UNBOUNDED)
    seen = {} if _seen is None else _seen
    if id(value) not in seen:
        seen[id(value)] = _bounds(value, depth, seen)
    return seen[id(value)]


def _bounds(value: ir.Value, depth: int, seen: dict) -> Interval:
    constant = qdq_params.const_array(value)
    if constant is not None:
        if constant.size == 0 or not np.issubdtype(constant.dtype, np.number):
            return Interval(*_UNBOUNDED)
        return Interval(float(np.min(constant)), float(np.max(constant)))
    node = value.producer()
    if node is None or node.domain not in DEFAULT_DOMAINS:
        return Interval(*_UNBOUNDED)
    op, below = node.op_type, depth - 1

    def of(index: int) -> Interval:
        return bounds(node.inputs[index] if len(node.inputs) > index else None, below, seen)

    if op == "DequantizeLinear":
        return _dequantized_range(node, below, seen)
    if op == "QuantizeLinear":
        params = qdq_params.quant_params(node)
        if params is None or not params.is_per_tensor:
            return Interval(*_UNBOUNDED)
        return Interval(params.qmin, params.qmax)
    if op in ("Relu", "Clip"):
        limits = activation_bounds(node)
        lo, hi = (None, None) if isinstance(limits, str) else limits
        if isinstance(limits, str) and op == "Clip":
            return Interval(*_UNBOUNDED)
        return of(0).clamp(lo, hi)
    if op in ("Sigmoid", "HardSigmoid", "Softmax"):
        return Interval(0.0, 1.0)
    if op == "Tanh":
        return Interval(-1.0, 1.0)
    if op in ("Abs", "Exp", "Sqrt", "Softplus"):
        return Interval(0.0, math.inf)
    if op == "HardSwish":
        inner = of(0)
        return Interval(-0.375, max(inner.hi, 0.0))
    if op == "LeakyRelu":
        inner, alpha = of(0), node.attributes.get_float("alpha", 0.01)
        if alpha < 0:
            return Interval(*_UNBOUNDED)
        return Interval(min(inner.lo * alpha, inner.lo, 0.0) if inner.lo < 0 else inner.lo, inner.hi)
    if is_pass_through(node) or op in _AVERAGING_OPS:
        return of(0)
    if op == "Resize":
        mode = node.attributes.get_string("mode", "nearest")
        return of(0) if mode in ("nearest", "linear") else Interval(*_UNBOUNDED)  # cubic overshoots
    if op in ("Concat", "Max", "Min", "Where"):
        indices = range(1, len(node.inputs)) if op == "Where" else range(len(node.inputs))
        parts = [of(i) for i in indices]
        if not parts:
            return Interval(*_UNBOUNDED)
        if op == "Max":
            return Interval(max(p.lo for p in parts), max(p.hi for p in parts))
        if op == "Min":
            return Interval(min(p.lo for p in parts), min(p.hi for p in parts))
        result = parts[0]
        for part in parts[1:]:
            result = result.union(part)
        return result
    if op == "Add" and len(node.inputs) == 2:
        return _sum(of(0), of(1))
    if op == "Mul" and len(node.inputs) == 2:
        return _product(of(0), of(1))
    if op == "Neg":
        inner = of(0)
        return Interval(-inner.hi, -inner.lo)
    return Interval(*_UNBOUNDED)


def can_be_negative(value: ir.Value | None) -> bool:
    """False only when ``value`` provably has no negative element."""
    return bounds(value).lo < 0


def quantizer_clamp(quantize: ir.Node, reach: Interval | None = None) -> tuple[float | None, float | None] | None:
    """The clamp a per-tensor QuantizeLinear applies to values its input can take.

    Returns ``(lo, hi)`` with the bound on each side where the Q cuts off reachable values (None on
    a side where it provably does not), or None when it clamps nothing reachable. ``reach`` is the
    interval of the Q's input (:func:`bounds` when not given). The test is on the integer grid, as
    the Q computes it: a value that rounds into the range is not clamped.
    Raises ValueError for parameters that are not per-tensor constants (callers refuse those first).
    """
    params = qdq_params.quant_params(quantize)
    if params is None or not params.is_per_tensor:
        raise ValueError("quantizer_clamp needs per-tensor constant parameters")
    reach = bounds(quantize.inputs[0]) if reach is None else reach
    scale, zero_point = np.float32(params.scalar_scale), params.scalar_zero_point
    limits = quantizer_range(params)

    def grid(x: float) -> float:
        with np.errstate(over="ignore"):  # beyond float32: an infinity, past either end of the grid
            return x if math.isinf(x) else float(np.rint(np.float32(x) / scale)) + zero_point

    lo = limits.lo if grid(reach.lo) < params.qmin else None
    hi = limits.hi if grid(reach.hi) > params.qmax else None
    return None if lo is None and hi is None else (lo, hi)


def _quantized_source_range(value: ir.Value | None, depth: int = _DEPTH) -> Interval:
    """The range of the dequantized tensor whose values ``value`` only moves (through pass-through
    ops), unbounded when it is anything else: the calibrated range ``value`` had upstream. Averaging
    ops do not count: their outputs' calibrated range is rightly narrower than their input's."""
    node = value.producer() if value is not None else None
    if node is None or depth <= 0:
        return Interval(*_UNBOUNDED)
    if qdq_params.is_dequantize(node):
        return _dequantized_range(node, depth - 1)
    if is_pass_through(node):
        return _quantized_source_range(node.inputs[0], depth - 1)
    return Interval(*_UNBOUNDED)


def implied_clamp(quantize: ir.Node) -> tuple[float | None, float | None] | None:
    """The clamp a rewrite must keep when it removes or re-parameterises this QuantizeLinear.

    * Zero point at qmin on an input that can be negative: the Q clamps at 0, which is how
      quantize_static keeps a Relu or Clip(0, M) it deleted. The whole range ``(0, top)`` is the
      clamp (a deleted Relu6 saturates at its top, which calibration put at the range's top).
    * A Q that cuts the range of a dequantized tensor it only receives through pass-through ops
      (``DQ -> Reshape -> Q`` with a narrower range): both were calibrated on the same values, so
      the cut is a Relu/Clip quantize_static deleted after the Reshape. That side's bound.

    * The Q carries ``DELETED_ACTIVATION_KEY`` (:func:`mark_deleted_activation`): whoever ran
      quantize_static knows it deleted an activation there, e.g. a ``Clip(-1, 1)``, whose range
      the graph alone cannot tell from a calibrated one. Every side the Q clamps.
    * The Q's grid is exactly the one quantize_static computes for a range whose bounds are both
      multiples of 1/2, one below 0 (:func:`round_range_bounds`): a ``Clip(-1, 1)`` (Hardtanh) it
      deleted, in a model whose quantizer left no mark. Calibrated data does not end on such bounds
      (a saturated Tanh does, and its Q clamps nothing it can reach). Every side the Q clamps.

    None when none holds: the Q's clamps are then only its calibrated range (of an unbounded
    tensor, or of a bounded activation such as Sigmoid whose calibrated top is below 1), and
    removing them moves the model towards FP32. Raises ValueError like :func:`quantizer_clamp`.
    """
    params = qdq_params.quant_params(quantize)
    clamp = quantizer_clamp(quantize)
    if clamp is None:
        return None
    if params.scalar_zero_point == params.qmin and clamp[0] is not None:
        return 0.0, quantizer_range(params).hi
    if DELETED_ACTIVATION_KEY in quantize.metadata_props or round_range_bounds(params) is not None:
        return clamp
    source = _quantized_source_range(quantize.inputs[0])
    cut = quantizer_clamp(quantize, source)
    if cut is None:
        return None
    lo = cut[0] if math.isfinite(source.lo) else None
    hi = cut[1] if math.isfinite(source.hi) else None
    return None if lo is None and hi is None else (lo, hi)


# a range bound is "round" when it is a multiple of this
_ROUND_STEP = 0.5


def round_range_bounds(params: qdq_params.QuantParams) -> tuple[float, float] | None:
    """``(lo, hi)``, both multiples of 1/2 with ``lo < 0 < hi``, when the per-tensor 8- or 16-bit grid of
    ``params`` is exactly what quantize_static computes for the range ``[lo, hi]`` (asymmetric:
    ``s = (hi - lo) / (qmax - qmin)``, ``z = rint(qmin - lo / s)``; symmetric ranges are the case
    ``hi = -lo`` of the same formula), else None."""
    if not params.is_per_tensor or params.qmax - params.qmin > 65535:
        return None
    scale, zero_point = float(np.float32(params.scalar_scale)), int(params.scalar_zero_point)
    if not scale > 0:
        return None
    # the nearest round bounds to the grid's ends; the scale they give must be the Q's, to float32
    # precision, which holds only when the grid's top is that round bound too
    lo = round((params.qmin - zero_point) * scale / _ROUND_STEP) * _ROUND_STEP
    hi = round((lo + scale * (params.qmax - params.qmin)) / _ROUND_STEP) * _ROUND_STEP
    if not lo < 0 < hi:
        return None
    exact_scale = (hi - lo) / (params.qmax - params.qmin)
    # the zero point within one code: onnxruntime versions round lo / s in float32 or float64,
    # where a range like [-1, 1] puts it at a half
    expected_zero = params.qmin - lo / exact_scale
    if np.float32(exact_scale) != np.float32(scale) or abs(zero_point - expected_zero) > 1.0:
        return None
    return float(lo), float(hi)


def mark_deleted_activation(quantize: ir.Node, op_type: str) -> None:
    """Record on ``quantize`` that its clamp stands for the ``op_type`` (Relu/Clip) quantize_static
    deleted in front of it, so that :func:`implied_clamp` keeps that clamp wherever a rewrite
    removes or re-parameterises the Q."""
    quantize.metadata_props[DELETED_ACTIVATION_KEY] = op_type

"""Where a saturating activation stops a quantizer's codes changing: bounds that make a grid's clamp exact.

A tensor read only by an activation whose output only quantizers with one set of per-tensor parameters
read (``Conv -> SiLU -> Q``, NNCF's and OpenVINO's placement) needs no range from data at its ends:
beyond some ``a`` and ``b`` every value gives that quantizer the code that ``a`` or ``b`` gives, so a
quantizer on the tensor may clamp there and the downstream codes do not change. The bounds, for a
downstream quantizer of step ``s`` over ``[lo, hi]`` (``lo <= 0 <= hi``):

* **HardSwish** ``x * clip(x/6 + 1/2, 0, 1)`` (one op, or Paddle's arithmetic): 0 below -3, and ``<= 0``
  below 0, which a quantizer whose range starts at 0 clamps to 0; at least ``hi`` above the root of
  ``x (x + 3) / 6 = hi`` (or ``hi`` itself from 3 on).
* **HardSigmoid** ``clip(alpha x + beta, 0, 1)``: constant beyond ``-beta / alpha`` and ``(1 - beta) / alpha``,
  meeting the range at ``(lo - beta) / alpha`` and ``(hi - beta) / alpha``.
* **SiLU** ``x * sigmoid(x)`` (Sigmoid and Mul), **GELU** (the op), **Mish** (the op): increasing and
  unbounded above: ``b`` where ``f(b) = hi`` (every larger value saturates at the top code). Below, each
  dips to a minimum ``f(m)`` (SiLU -0.2785 at -1.2785, GELU -0.1700 at -0.7518, Mish -0.3088 at -1.1924)
  and returns to 0 as ``x -> -inf``: a range that starts at 0 clamps every ``x <= 0`` to the zero point
  (``a = 0``); otherwise ``a`` is where the left branch is last at ``-0.49 s`` (every value left of it
  rounds to the zero point), or ``m`` where the whole dip is that shallow.
* **LeakyRelu** and **PRelu** (constant slopes, per channel): below 0 a channel of slope ``alpha > 0``
  falls under ``lo`` from ``lo / alpha`` on (0 where the range starts at 0), one of slope ``beta < 0``
  rises over ``hi`` from ``hi / beta`` on: ``a`` is the lowest of these over the channels; ``b = hi``.
* **Sigmoid** and **Tanh**: increasing and bounded: ``b = f^-1(hi)`` where ``hi`` is below the supremum;
  otherwise where ``f`` is past the rounding boundary of the supremum's code by ``0.01 s`` (every larger
  value takes that code); ``a`` likewise at the infimum.

Exactness of the clamp: exact in real arithmetic, with margins of 1% of a step for float32's rounding
of the activation (the bounds are found by bisection in float64). The quantizer placed on the tensor
still rounds the values inside ``[a, b]``: that is the approximation its pass states.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.placement.rules.conv_affine_folding import conv_affine

__all__ = ["SMOOTH_ACTIVATIONS", "activation_bounds", "saturating_activation", "saturation_bounds"]

_HARDSWISH_ZERO_BELOW = -3.0  # HardSwish(x) = x * clip(x / 6 + 1 / 2, 0, 1) = 0 for x <= -3
_EDGE = 0.01  # margin, in steps of the downstream grid, kept from a rounding boundary
# LeakyRelu/PRelu bounds wider than this many times the downstream quantizer's range make a grid too
# coarse to be worth a guard run (a slope of 0.01: 100 times). Not for the saturating activations:
# their wide negative ends map to values within a step of 0, where a coarse grid costs nothing.
MAX_SPREAD = 4.0
_HALF_STEP = 0.49  # a value within this many steps of 0 rounds to the zero point


def _silu(x: float) -> float:
    return x / (1.0 + math.exp(-x)) if x > -700 else 0.0


def _gelu(x: float) -> float:
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


def _mish(x: float) -> float:
    return x * math.tanh(math.log1p(math.exp(x))) if x < 30 else x


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0


# f, the minimiser of a dipping f (None: f increases everywhere), inf f, sup f
SMOOTH_ACTIVATIONS: dict[str, tuple[Callable[[float], float], float | None, float, float]] = {
    "SiLU": (_silu, -1.2784645427610738, -math.inf, math.inf),
    "Gelu": (_gelu, -0.7517915246935645, -math.inf, math.inf),
    "Mish": (_mish, -1.1923473371, -math.inf, math.inf),
    "Sigmoid": (_sigmoid, None, 0.0, 1.0),
    "Tanh": (math.tanh, None, -1.0, 1.0),
}


def _solve(f: Callable[[float], float], target: float, low: float, high: float) -> float:
    """``x`` in ``[low, high]`` with ``f(x) = target``, ``f`` increasing there (bisection, float64)."""
    for _ in range(200):
        middle = (low + high) / 2.0
        if f(middle) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2.0


def _decreasing_solve(f: Callable[[float], float], target: float, low: float, high: float) -> float:
    return _solve(lambda x: -f(x), -target, low, high)


_FAR = 60.0  # beyond this, every activation here is at its limit in float32


def smooth_bounds(kind: str, lo: float, hi: float, step: float) -> tuple[float, float]:
    """``[a, b]`` for one of :data:`SMOOTH_ACTIVATIONS` before a quantizer of step ``step`` over
    ``[lo, hi]``: see the module docstring."""
    f, dip, infimum, supremum = SMOOTH_ACTIVATIONS[kind]
    if hi < supremum:
        high = _solve(f, hi, dip if dip is not None else -_FAR, max(_FAR, hi + 1.0))
    else:
        top = step * math.floor(supremum / step + 0.5)  # the supremum's code, as a value
        high = _solve(f, min(top - (0.5 - _EDGE) * step, supremum), -_FAR, _FAR)
    if dip is not None:  # 0 from below at -inf, a minimum at ``dip``
        if lo >= 0.0:
            return 0.0, high
        depth = -f(dip)
        low = dip if depth <= _HALF_STEP * step else _decreasing_solve(f, -_HALF_STEP * step, -_FAR * 10, dip)
        return low, high
    if lo > infimum:
        return _solve(f, lo, -_FAR, _FAR), high
    bottom = step * math.ceil(infimum / step - 0.5)
    return _solve(f, max(bottom + (0.5 - _EDGE) * step, infimum), -_FAR, _FAR), high


def _scalar(value: ir.Value | None, expected: float) -> bool:
    array = qdq_params.const_array(value) if value is not None else None
    return array is not None and array.size == 1 and bool(np.isclose(float(array.reshape(-1)[0]), expected, rtol=1e-4))


def _only_use(value: ir.Value, op_type: str) -> ir.Node | None:
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    node = uses[0][0]
    return node if qdq_params.is_op(node, op_type) else None


def _decomposed_hardswish(value: ir.Value) -> ir.Value | None:
    """The output of ``x * clip(x + 3, 0, 6) / 6`` (the Div before or after the Mul) or of
    ``x * HardSigmoid(x; 1/6, 1/2)`` when the readers of ``x = value`` compute exactly that."""
    users = {node.op_type: node for node, _ in value.uses()}
    if len(users) != 2 or len(list(value.uses())) != 2 or "Mul" not in users:
        return None
    mul = users["Mul"]
    if "HardSigmoid" in users:
        gate = users["HardSigmoid"]
        if not (np.isclose(gate.attributes.get_float("alpha", 0.2), 1 / 6) and np.isclose(gate.attributes.get_float("beta", 0.5), 0.5)):
            return None
        gate_output = gate.outputs[0]
    elif "Add" in users:
        add = users["Add"]
        if not _scalar(add.inputs[1] if add.inputs[0] is value else add.inputs[0], 3.0):
            return None
        clip = _only_use(add.outputs[0], "Clip")
        if clip is None or len(clip.inputs) < 3 or not (_scalar(clip.inputs[1], 0.0) and _scalar(clip.inputs[2], 6.0)):
            return None
        gate_output = clip.outputs[0]
        divide = _only_use(gate_output, "Div")
        if divide is not None:  # clip(x + 3, 0, 6) / 6, then times x
            if not _scalar(divide.inputs[1], 6.0):
                return None
            gate_output = divide.outputs[0]
    else:
        return None
    if {id(v) for v in mul.inputs} != {id(value), id(gate_output)} or _only_use(gate_output, "Mul") is not mul:
        return None
    if gate_output.producer().op_type != "Clip":
        return mul.outputs[0]
    divide = _only_use(mul.outputs[0], "Div")  # x * clip(x + 3, 0, 6), then / 6
    return divide.outputs[0] if divide is not None and _scalar(divide.inputs[1], 6.0) else None


def _decomposed_silu(value: ir.Value) -> ir.Value | None:
    """The output of ``value * Sigmoid(value)`` when the readers of ``value`` compute exactly that."""
    uses = list(value.uses())
    users = {node.op_type: node for node, _ in uses}
    if len(uses) != 2 or set(users) != {"Sigmoid", "Mul"}:
        return None
    gate, mul = users["Sigmoid"], users["Mul"]
    if not (qdq_params.is_op(gate, "Sigmoid") and qdq_params.is_op(mul, "Mul")):
        return None
    if {id(v) for v in mul.inputs} != {id(value), id(gate.outputs[0])} or _only_use(gate.outputs[0], "Mul") is not mul:
        return None
    return mul.outputs[0]


def _negative_side_slopes(node: ir.Node) -> tuple[float, float] | None:
    """``(smallest positive slope or 0, largest negative slope or 0)`` of a LeakyRelu, or of a PRelu
    with constant slopes (a channel of slope 0 is 0 below 0 and bounds nothing)."""
    if qdq_params.is_op(node, "LeakyRelu"):
        slopes = np.array([node.attributes.get_float("alpha", 0.01)])
    elif qdq_params.is_op(node, "PRelu") and len(node.inputs) > 1:
        slopes = qdq_params.const_array(node.inputs[1])
        if slopes is None or not slopes.size:
            return None
    else:
        return None
    positive, negative = slopes[slopes > 0], slopes[slopes < 0]
    return (float(positive.min()) if positive.size else 0.0, float(negative.max()) if negative.size else 0.0)


def saturating_activation(value: ir.Value) -> tuple[str, ir.Value, float, float] | None:
    """``(kind, output, alpha, beta)`` when the readers of ``value`` compute one saturating
    activation of it: a HardSwish (one op, or written as arithmetic as Paddle exports it), a
    HardSigmoid with ``alpha > 0``, a SiLU (``x * Sigmoid(x)``), a Gelu (exact form), Mish,
    Sigmoid or Tanh op, or a LeakyRelu or PRelu with constant slopes (``alpha``: the smallest positive
    slope, ``beta``: the negative slope nearest 0, each 0 where there is none)."""
    uses = list(value.uses())
    if len(uses) == 1 and uses[0][1] == 0:
        node = uses[0][0]
        for op_type in ("Gelu", "Mish", "Sigmoid", "Tanh"):
            if qdq_params.is_op(node, op_type) and node.attributes.get_string("approximate", "none") == "none":
                return op_type, node.outputs[0], 1.0, 0.0
        if qdq_params.is_op(node, "HardSwish"):
            return "HardSwish", node.outputs[0], 1 / 6, 0.5
        if qdq_params.is_op(node, "HardSigmoid"):
            alpha, beta = node.attributes.get_float("alpha", 0.2), node.attributes.get_float("beta", 0.5)
            return ("HardSigmoid", node.outputs[0], alpha, beta) if alpha > 0 else None
        slopes = _negative_side_slopes(node)
        if slopes is not None:
            return "LeakyRelu", node.outputs[0], *slopes
    output = _decomposed_hardswish(value)
    if output is not None:
        return "HardSwish", output, 1 / 6, 0.5
    output = _decomposed_silu(value)
    return ("SiLU", output, 1.0, 0.0) if output is not None else None


def activation_bounds(kind: str, alpha: float, beta: float, lo: float, hi: float, step: float = 0.0) -> tuple[float, float]:
    """``[a, b]`` such that every ``x`` outside gives the activation a value that a quantizer of step
    ``step`` over ``[lo, hi]`` (``lo <= 0 <= hi``) codes as it codes ``clip(x, a, b)``; see the module
    docstring."""
    if kind in SMOOTH_ACTIVATIONS:
        return smooth_bounds(kind, lo, hi, step)
    if kind == "LeakyRelu":  # slope x below 0: a positive slope falls below lo, a negative one rises above hi
        ends = [lo / alpha if lo < 0 else 0.0] if alpha > 0 else []
        ends += [hi / beta] if beta < 0 else []
        return min(ends, default=0.0), hi
    if kind == "HardSwish":
        low = 0.0 if lo >= 0.0 else _HARDSWISH_ZERO_BELOW
        # x * (x + 3) / 6 = hi on the increasing branch, or x itself from x = 3 on
        high = hi if hi >= 3.0 else (-3.0 + float(np.sqrt(9.0 + 24.0 * hi))) / 2.0
        return low, high
    return (max(lo, 0.0) - beta) / alpha, (min(hi, 1.0) - beta) / alpha


# a scalar constant is a one-channel vector of a tensor of any rank up to this
_SCALAR_RANK = 8


def _scalar_affine_after(value: ir.Value) -> tuple[ir.Value, float, float]:
    """``(end, a, b)``: ``end = a * value + b`` at the end of the chain of Mul/Div by positive scalar
    constants and Add/Sub of scalar constants that alone reads ``value`` (Paddle's learnable affine
    after an activation); ``(value, 1, 0)`` without one. ``a > 0``: the chain is increasing. Each
    step is read as the Conv affine fold reads one (:func:`conv_affine`), with one channel."""
    a, b = 1.0, 0.0
    while not value.is_graph_output():
        uses = list(value.uses())
        if len(uses) != 1:
            break
        node = uses[0][0]
        step = conv_affine(node, value, 1, _SCALAR_RANK)
        if isinstance(step, str) or not step[0][0] > 0:
            break
        scale, shift = float(step[0][0]), float(step[1][0])
        a, b = a * scale, b * scale + shift
        value = node.outputs[0]
    return value, a, b


def saturation_bounds(value: ir.Value, per_channel: bool = True) -> tuple[float, float, str] | None:
    """``(a, b, why)`` when ``value`` is read only by a saturating activation whose output only
    quantizers read (one set of per-tensor parameters, or per-channel ones: the span of all their
    channels, :func:`_quantizers_span`), directly or through an increasing
    scalar affine (:func:`_scalar_affine_after`, whose inverse maps their range onto the
    activation's): values of ``value`` outside ``[a, b]`` give those quantizers the codes of ``a``
    and ``b``, so a grid for ``value`` can stop there. ``per_channel=False``: per-tensor quantizers
    only (the widest channel's bounds are a grid far coarser than a narrow channel's step)."""
    activation = saturating_activation(value)
    if activation is None:
        return None
    kind, output, alpha, beta = activation
    end, scale_after, shift_after = _scalar_affine_after(output)
    readers = [user for user, _ in end.uses()]
    if end.is_graph_output() or not readers or not all(qdq_params.is_quantize(user) for user in readers):
        return None
    span = _quantizers_span([qdq_params.quant_params(user) for user in readers])
    if span is None or (not per_channel and span[3] != "a quantizer"):
        return None
    lo, hi, scale, what = span
    through = ""
    if end is not output:
        lo, hi = (lo - shift_after) / scale_after, (hi - shift_after) / scale_after
        through = f" through {scale_after:.4g} x + {shift_after:.4g}"
        if not hi >= 0:  # the quantizer's whole range lies below what the activation reaches
            return None
    low, high = activation_bounds(kind, alpha, beta, lo, hi, scale / scale_after)
    if not low < high:
        return None
    if kind == "LeakyRelu" and max(high, 0.0) - min(low, 0.0) > MAX_SPREAD * (hi - lo):
        return None  # linear below 0 as well: a grid that wide is far coarser than the quantizer it feeds
    return low, high, f"{kind} then {what} over [{lo:.4g}, {hi:.4g}]{through}"


def _quantizers_span(params: list) -> tuple[float, float, float, str] | None:
    """``(lo, hi, step, what)``: the range every one of these quantizers' channels lies within and
    the finest step among them (one set of per-tensor parameters, or per-channel ones as NNCF puts at
    depthwise inputs). Beyond the activation's bounds for that span, each channel's codes saturate:
    the bounds of the widest channel hold for all. None for non-constant parameters or mixed types."""
    if any(p is None or p.block_size for p in params) or len({p.dtype for p in params}) != 1:
        return None
    first = params[0]
    if all(p.is_per_tensor and p.same_as(first) for p in params):
        scale, zero_point = first.scalar_scale, first.scalar_zero_point
        return (first.qmin - zero_point) * scale, (first.qmax - zero_point) * scale, scale, "a quantizer"
    lows, highs, steps = [], [], []
    for p in params:
        scale = np.asarray(p.scale, np.float64).reshape(-1)
        zero_point = np.asarray(p.zero_point, np.float64).reshape(-1)
        if scale.size == 0 or not np.all(scale > 0):
            return None
        lows.append(float(np.min((p.qmin - zero_point) * scale)))
        highs.append(float(np.max((p.qmax - zero_point) * scale)))
        steps.append(float(np.min(scale)))
    return min(lows), max(highs), min(steps), "per-channel quantizers"

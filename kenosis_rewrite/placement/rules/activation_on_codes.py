"""Apply a Relu or a Clip to the quantized codes instead of the float tensor in front of the quantizer.

Transformations (``Act`` is Relu, or Clip with constant bounds; ``Q = Q(s, z)``)::

    x -> Act -> Q                    ==>  x -> Q -> Act'(codes)          (relu-on-codes, clip-on-codes)
    x -> Q -> DQ -> Act -> Q (same s, z)  ==>  x -> Q -> Act'(codes)     (relu-island-on-codes, ...)

where ``Act'`` is ``Max(codes, z)`` for a Relu and ``Clip(codes, Q(lo), Q(hi))`` for a Clip.

Exactness: ``Q(v) = saturate(round(v / s) + z)`` never decreases as ``v`` grows, so
``Q(max(v, 0)) = max(Q(v), Q(0)) = max(Q(v), z)`` and ``Q(clip(v, lo, hi)) = clip(Q(v), Q(lo), Q(hi))``:
the result is bit-identical to the input for every input (NaN aside). In the island, ``Q(DQ(c)) = c``
for equal parameters, so the pair and the activation reduce to the same map on codes.

Why: on ORT CPU a Conv/MatMul/Gemm (or an Add, as QLinearAdd) fuses with its output Q into one
integer kernel only when nothing float sits between them, and ORT drops a Relu in front of a Q only
when the zero point is qmin. Symmetric quantizers (Quark's XINT8, quantize_static's
``ActivationSymmetric``) put the zero point mid-range, so the op ran in float (MediaPipe's face detector
by Quark: a float FusedConv for each of its 17 Relus). The max on codes is one cheap pass over 8-bit
values. Unlike ``relu-zero-point-to-qmin`` (a finer grid, approximate) it changes no rounding; it runs
first, and the finer grid is left for what it refuses.

Refused with a reason: per-axis or non-8-bit parameters, non-constant Clip bounds, opset below 12 (no
8-bit Max or Clip), island parameters that differ. Left alone: an activation the Q already absorbs
(zero point at qmin, a Clip outside the Q's range): ORT drops it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.graph.rule_base import ReportingRule, acceptance, refusal

__all__ = ["ActivationOnCodes", "ActivationIslandOnCodes", "activation_on_codes_rules", "code_bounds"]

_MIN_OPSET = 12  # Max and Clip take 8-bit integers from opset 12


def code_bounds(activation: ir.Node, params: qdq_params.QuantParams) -> tuple[int | None, int | None] | str:
    """The codes ``Q(lo)`` and ``Q(hi)`` of the activation's bounds (None: unbounded), computed as
    QuantizeLinear does (float32 division, round half to even, saturation); or why there are none."""
    bounds = value_range.activation_bounds(activation)
    if isinstance(bounds, str):
        return bounds
    scale = np.float32(params.scalar_scale)

    def code(bound: float | None) -> int | None:
        if bound is None:
            return None
        value = np.rint(np.float32(bound) / scale) + params.scalar_zero_point
        return int(np.clip(value, params.qmin, params.qmax))

    return code(bounds[0]), code(bounds[1])


class _OnCodesBase(ReportingRule):
    """Shared checks and the rewrite: the activation applied to the output Q's codes."""

    activation: str = ""
    kind: str = ""

    def __init__(self, report: FixReport | None = None):
        super().__init__(f"{self.activation.lower()}-{self.kind}on-codes", report)

    def _check_output(self, where: str, act: ir.Value, q: ir.Value) -> MatchResult:
        act_node, q_node = act.producer(), q.producer()
        params = qdq_params.quant_params(q_node)
        if params is None:
            return refusal(where, "quantization parameters are not constants")
        if not params.is_per_tensor or params.dtype not in qdq_params.EIGHT_BIT:
            return refusal(where, f"only per-tensor 8-bit activations run on codes, got {params.describe()}")
        opset = qdq_params.default_opset(q_node.graph)
        if opset < _MIN_OPSET:
            return refusal(where, f"opset {opset} has no 8-bit Max or Clip (needs {_MIN_OPSET})")
        bounds = code_bounds(act_node, params)
        if isinstance(bounds, str):
            return refusal(where, bounds)
        if value_range.absorbed_by_quantizer(act_node, params):
            return MatchResult().fail("already fused: the quantizer makes the activation redundant")
        return acceptance(where)

    def _on_codes(self, op, codes: ir.Value, act_node: ir.Node, q_node: ir.Node) -> ir.Value:
        params = qdq_params.quant_params(q_node)
        lo, hi = code_bounds(act_node, params)
        make = qdq_params.constant_maker(op, lambda base: self.fresh_name(q_node.graph, base),
                                         q_node.outputs[0].name or "codes")
        dtype = params.dtype.numpy()
        name = f"{act_node.name or self.activation}_on_codes"
        if self.activation == "Relu":
            result = op.Max(codes, make(lo, dtype, "relu_floor_code"), _name=name)
        else:
            result = op.Clip(codes, make(lo, dtype, "clip_lo_code") if lo is not None else None,
                             make(hi, dtype, "clip_hi_code") if hi is not None else None, _name=name)
        self.record(act_node.name or self.activation, f"{self.activation} on the codes of {params.describe()}: "
                    f"[{lo}, {hi if hi is not None else params.qmax}]", exact=True)
        return result


class ActivationOnCodes(_OnCodesBase):
    """``x -> Act -> Q`` ==> ``x -> Q -> Act'(codes)``; see the module docstring."""

    def pattern(self, op, x):
        activated = getattr(op, self.activation)(x, _allow_other_inputs=True, _outputs=["act"])
        return op.QuantizeLinear(activated, _allow_other_inputs=True, _outputs=["q"])

    def check(self, context, x, act, q, **_) -> MatchResult:
        del context, x
        act_node = act.producer()
        return self._check_output(act_node.name or act.name or self.activation, act, q)

    def rewrite(self, op, x, act, q, **_):
        act_node, q_node = act.producer(), q.producer()
        quantized = op.op("QuantizeLinear", x, *q_node.inputs[1:], _name=q_node.name, **dict(q_node.attributes))
        return self._on_codes(op, quantized, act_node, q_node)


class ActivationIslandOnCodes(_OnCodesBase):
    """``x -> Q -> DQ -> Act -> Q`` (equal parameters) ==> ``x -> Q -> Act'(codes)``; see the module docstring."""

    kind = "island-"

    def pattern(self, op, x):
        quantized = op.QuantizeLinear(x, _allow_other_inputs=True, _outputs=["q1"])
        dequantized = op.DequantizeLinear(quantized, _allow_other_inputs=True, _outputs=["dq1"])
        activated = getattr(op, self.activation)(dequantized, _allow_other_inputs=True, _outputs=["act"])
        return op.QuantizeLinear(activated, _allow_other_inputs=True, _outputs=["q"])

    def check(self, context, x, q1, dq1, act, q, **_) -> MatchResult:
        del context, x
        where = act.producer().name or act.name or self.activation
        params = [qdq_params.quant_params(value.producer()) for value in (q1, dq1, q)]
        if any(p is None for p in params):
            return refusal(where, "quantization parameters are not constants")
        if not (params[0].same_as(params[1]) and params[1].same_as(params[2])):
            return refusal(where, "the quantizers around the activation differ: its codes are not the same grid")
        return self._check_output(where, act, q)

    def rewrite(self, op, x, q1, act, q, **_):
        q1_node = q1.producer()  # made again: the matched nodes go, and the codes are read from the new one
        quantized = op.op("QuantizeLinear", x, *q1_node.inputs[1:], _name=q1_node.name, **dict(q1_node.attributes))
        return self._on_codes(op, quantized, act.producer(), q.producer())


class ReluOnCodes(ActivationOnCodes):
    """``x -> Relu -> Q(s, z)`` ==> ``x -> Q(s, z) -> Max(codes, z)``: exact; see the module docstring."""

    activation = "Relu"


class ClipOnCodes(ActivationOnCodes):
    """``x -> Clip(lo, hi) -> Q`` ==> ``x -> Q -> Clip(codes, Q(lo), Q(hi))``: exact; see the module docstring."""

    activation = "Clip"


class ReluIslandOnCodes(ActivationIslandOnCodes):
    """``x -> Q -> DQ -> Relu -> Q``, one grid ==> ``x -> Q -> Max(codes, z)``: exact; see the module docstring."""

    activation = "Relu"


class ClipIslandOnCodes(ActivationIslandOnCodes):
    """``x -> Q -> DQ -> Clip -> Q``, one grid ==> ``x -> Q -> Clip(codes, Q(lo), Q(hi))``: exact; see the module docstring."""

    activation = "Clip"


def activation_on_codes_rules(report: FixReport | None = None) -> RewriteRuleSet:
    """The four rules, islands first, recording into ``report`` when given."""
    return RewriteRuleSet([
        ReluIslandOnCodes.rule(report), ClipIslandOnCodes.rule(report),
        ReluOnCodes.rule(report), ClipOnCodes.rule(report),
    ])

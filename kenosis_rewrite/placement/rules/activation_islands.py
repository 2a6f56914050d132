"""Fold Relu/Clip float islands: move the activation in front of the quantizer.

Transformation (``Act`` is Relu, or Clip with lower bound 0)::

    x -> Q(s1, z1) -> DQ(s1, z1) -> Act -> Q(s2, z2) -> DQ(s2, z2) ...
    ==>
    x -> Act -> Q(s', qmin) -> DQ(s', qmin) ...

with ``s' = u / (qmax - qmin)`` where ``u`` is the largest value the old output quantizer could
represent, ``s2 * (qmax - z2)``, capped at the Clip's upper bound. Every DequantizeLinear that
read the old Q is re-pointed to ``(s', qmin)`` (``check()`` makes sure they all agree with it).

Why: on ORT CPU a Conv/MatMul/Gemm fuses with its output Q into one integer kernel only when
nothing float sits between them. With the zero point at the type minimum, ORT drops a Relu in
front of a Q (it is the Q's own clamp), and drops a Clip whose bounds lie outside the Q's range;
so the weighted op, the activation and the Q become one QLinearConv/QLinearMatMul/QGemm. Without
it, quantize_static's symmetric and keep-activation configs leave DQ -> Relu -> Q float islands,
and a zero point above qmin after Relu makes ORT run a float FusedConv (2.5-6x slower).

Exactness: Relu and Clip(0, M) are positively homogeneous, ``f(a*x) = a*f(x)`` for ``a > 0`` (up to
M), so dequantization with zero point at qmin commutes with them. The result is bit-identical to
the input QDQ model on its calibrated range when ``s' == s1 == s2`` and ``z2 == qmin`` (reported as
exact). Otherwise it is a requantization onto the grid ``s'``: the output range ``[0, u]`` is kept
and its resolution is ``(qmax - z2) / (qmax - qmin)`` times finer than before (2x for symmetric
quantization), and the pre-activation rounding and clamp of Q(s1, z1) disappear. The error against
the float model is at most ``s'/2`` per element, never more than the input model's.
A changed scale must be propagated (pass-through ops) and biases requantized downstream; ``fix()``
runs those passes after these rules.

On the ORT targets the exact rules of :mod:`.activation_on_codes` run first (the activation applied to
the Q's codes): these take what they leave, an island whose two grids differ and opsets below 12.

Refused with a reason: Clip with a lower bound other than 0 or non-constant bounds, per-axis or
non-8-bit parameters, a pre-activation tensor or quantized output read by anything else, an
output Q that is a graph output.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RULE_NAME_TAG, MatchResult, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.graph.rule_base import ReportingRule, acceptance, refusal

_RULE_NAMES = frozenset(
    {"fold-relu-island", "fold-clip-island", "relu-zero-point-to-qmin", "clip-zero-point-to-qmin"}
)

__all__ = [
    "FoldReluIsland", "FoldClipIsland", "ReluZeroPointToQmin", "ClipZeroPointToQmin", "activation_island_rules",
]


class _FoldActivationIsland(ReportingRule):
    """Shared matching, checking and rewriting of Relu and Clip islands."""

    activation: str = ""

    def __init__(self, report: FixReport | None = None):
        super().__init__(f"fold-{self.activation.lower()}-island", report)

    def pattern(self, op, x):
        quantized = op.QuantizeLinear(x, _allow_other_inputs=True, _outputs=["q1"])
        dequantized = op.DequantizeLinear(quantized, _allow_other_inputs=True, _outputs=["dq1"])
        activated = getattr(op, self.activation)(dequantized, _allow_other_inputs=True, _outputs=["act"])
        return op.QuantizeLinear(activated, _allow_other_inputs=True, _outputs=["q2"])

    def _upper_bound(self, activation: ir.Node, representable: float) -> float | str:
        return representable

    def _check_input_side(self, where: str, x, q1, dq1) -> MatchResult | None:
        """Conditions on the pre-activation Q/DQ pair; None when they hold."""
        p1, pd = qdq_params.quant_params(q1.producer()), qdq_params.quant_params(dq1.producer())
        if p1 is None or pd is None:
            return refusal(where, "quantization parameters are not constants")
        if not p1.is_per_tensor or p1.dtype not in qdq_params.EIGHT_BIT:
            return refusal(where, f"only per-tensor 8-bit activations are folded, got {p1.describe()}")
        if not pd.same_as(p1):
            return refusal(where, "the pre-activation DequantizeLinear disagrees with its QuantizeLinear")
        return None

    def check(self, context, x, act, q2, q1=None, dq1=None, **_) -> MatchResult:
        del context
        act_node, q2_node = act.producer(), q2.producer()
        where = act_node.name or act.name or self.activation
        if q2_node.metadata_props.get(RULE_NAME_TAG, "").split(",")[-1] in _RULE_NAMES:
            return MatchResult().fail("already rewritten by an activation rule in this pass")
        if q1 is not None:
            failure = self._check_input_side(where, x, q1, dq1)
            if failure is not None:
                return failure
        p2 = qdq_params.quant_params(q2_node)
        if p2 is None:
            return refusal(where, "quantization parameters are not constants")
        if not p2.is_per_tensor or p2.dtype not in qdq_params.EIGHT_BIT:
            return refusal(where, f"only per-tensor 8-bit activations are folded, got {p2.describe()}")
        if q1 is None:
            if qdq_params.is_dequantize(x.producer()):
                return refusal(where, "the activation reads a DequantizeLinear: a float island, not a fused output")
        if x.producer() is None or len(x.uses()) != 1:
            return refusal(where, f"pre-activation tensor {x.name!r} is a graph input or has other consumers")
        if q2.is_graph_output():
            return refusal(where, f"quantized output {q2.name!r} is a graph output")
        consumers = qdq_params.dequantize_consumers(q2)
        if consumers is None:
            return refusal(where, f"quantized output {q2.name!r} is read by a non-DequantizeLinear node")
        for consumer in consumers:
            params = qdq_params.quant_params(consumer)
            if params is None or not params.same_as(p2):
                return refusal(where, f"DequantizeLinear {consumer.name!r} disagrees with the output QuantizeLinear")
        representable = p2.scalar_scale * (p2.qmax - p2.scalar_zero_point)
        if representable <= 0:
            return refusal(where, f"output quantizer {p2.describe()} represents no positive value")
        upper = self._upper_bound(act_node, representable)
        if isinstance(upper, str):
            return refusal(where, upper)
        if q1 is None and value_range.absorbed_by_quantizer(act_node, p2):
            return MatchResult().fail("already fused: the quantizer makes the activation redundant")
        return acceptance(where)

    def rewrite(self, op, x, act, q2, q1=None, dq1=None, **_):
        act_node, q2_node = act.producer(), q2.producer()
        p2 = qdq_params.quant_params(q2_node)
        p1 = qdq_params.quant_params(q1.producer()) if q1 is not None else p2
        upper = self._upper_bound(act_node, p2.scalar_scale * (p2.qmax - p2.scalar_zero_point))
        new_scale = np.asarray(upper / (p2.qmax - p2.qmin), dtype=p2.scale.dtype)
        graph = q2_node.graph
        base = q2.name or "activation"
        scale_name = self.fresh_name(graph, f"{base}_folded_scale")
        zp_name = self.fresh_name(graph, f"{base}_folded_zero_point")
        scale = op.initializer(ir.tensor(new_scale.reshape(p2.scale.shape), name=scale_name), name=scale_name)
        zero_point = op.initializer(
            qdq_params.integer_tensor(np.full(p2.zero_point.shape, p2.qmin), p2.dtype, zp_name), name=zp_name
        )
        activated = op.op(
            self.activation, x, *act_node.inputs[1:], _name=act_node.name, **dict(act_node.attributes)
        )
        quantized = op.op(
            "QuantizeLinear", activated, scale, zero_point, _name=q2_node.name, **dict(q2_node.attributes)
        )
        # The DQs after the old Q are outside the matched pattern; they must read the new parameters.
        for consumer in qdq_params.dequantize_consumers(q2) or []:
            consumer.replace_input_with(1, scale)
            _set_zero_point(consumer, zero_point)
        exact = float(new_scale) == p1.scalar_scale == p2.scalar_scale and p2.scalar_zero_point == p2.qmin
        how = "exact" if exact else f"requantized: {p1.describe()} | {p2.describe()} ->"
        if q1 is None:
            how = f"requantized: {p2.describe()} ->"
        self.record(act_node.name or str(act.name),
                    f"{how} {p2.dtype.name.lower()} s={float(new_scale):.6g} zp={p2.qmin}", exact=exact)
        return quantized


def _set_zero_point(node: ir.Node, value: ir.Value) -> None:
    if len(node.inputs) < 3:
        node.resize_inputs(3)
    node.replace_input_with(2, value)


class _OutputZeroPointToQmin(_FoldActivationIsland):
    """The same requantization when nothing sits between the producer and the activation.

    ``x -> Act -> Q(s, z)`` with ``z != qmin`` ==> ``x -> Act -> Q(s', qmin)``: ORT otherwise keeps
    the activation and runs the producer as a float FusedConv (2.5-6x slower).
    """

    def __init__(self, report: FixReport | None = None):
        super().__init__(report)
        self.name = f"{self.activation.lower()}-zero-point-to-qmin"

    def pattern(self, op, x):
        activated = getattr(op, self.activation)(x, _allow_other_inputs=True, _outputs=["act"])
        return op.QuantizeLinear(activated, _allow_other_inputs=True, _outputs=["q2"])


class FoldReluIsland(_FoldActivationIsland):
    """``Q -> DQ -> Relu -> Q`` ==> ``Relu -> Q(zp = qmin)``; see the module docstring."""

    activation = "Relu"


class FoldClipIsland(_FoldActivationIsland):
    """``Q -> DQ -> Clip(0, M) -> Q`` ==> ``Clip(0, M) -> Q(zp = qmin)``; see the module docstring."""

    activation = "Clip"

    def _upper_bound(self, activation: ir.Node, representable: float) -> float | str:
        bounds = value_range.activation_bounds(activation)
        if isinstance(bounds, str):
            return bounds
        lo, hi = bounds
        if lo is None or lo != 0.0:
            return f"Clip lower bound {lo} is not 0, so Clip does not commute with dequantization"
        if hi is not None and hi <= 0:
            return f"Clip upper bound {hi} leaves no positive range"
        return representable if hi is None else min(hi, representable)


class ReluZeroPointToQmin(_OutputZeroPointToQmin):
    """``Relu -> Q(z != qmin)`` ==> ``Relu -> Q(zp = qmin)``; see the module docstring."""

    activation = "Relu"


class ClipZeroPointToQmin(_OutputZeroPointToQmin):
    """``Clip(0, M) -> Q`` whose range is not at ``[qmin, ..]`` ==> ``Q(zp = qmin)``; see above."""

    activation = "Clip"
    _upper_bound = FoldClipIsland._upper_bound


def activation_island_rules(report: FixReport | None = None) -> RewriteRuleSet:
    """The Relu and Clip rules, islands first, recording into ``report`` when given."""
    return RewriteRuleSet([
        FoldReluIsland.rule(report), FoldClipIsland.rule(report),
        ReluZeroPointToQmin.rule(report), ClipZeroPointToQmin.rule(report),
    ])

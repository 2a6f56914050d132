"""Collapse two clamping activations in a row into one.

Transformation (``First`` and ``Second`` each Relu or Clip with constant bounds)::

    x -> First -> Second ...   ==>   x -> Relu ...              (both clamp to [0, inf))
                               ==>   x -> Clip(L, H) ...        (otherwise)

with ``[L, H]`` the intersection of the two clamping intervals (Relu's is ``[0, inf)``).

Why: folding Relu/Clip islands (:mod:`kenosis_rewrite.placement.rules.activation_islands`) moves each
activation in front of its quantizer, so a chain ``Conv -> Q/DQ -> Relu -> Q/DQ -> Relu -> Q``
becomes ``Conv -> Relu -> Relu -> Q``. ONNX Runtime fuses a Conv with one Relu and its Q into a
QLinearConv, but not with two: the Conv ran as a float FusedConv where the input model ran it in
integers (fuzz seed 9535320). One activation between them restores the fusion.

Exactness: exact, bit for bit. A clamp only compares and selects: ``clamp_B(clamp_A(x)) =
clamp_{A n B}(x)`` for intervals that overlap, and the new bounds are among the old ones (or
Relu's 0), so they are representable in ``x``'s type.

Refused with a reason: bounds that are not constants, and intervals that do not overlap (the
composition is then a constant, not a clamp). Not matched: an intermediate tensor that anything
else reads or that is a graph output (it must keep its value).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import value_range
from kenosis_rewrite.graph.rule_base import ReportingRule, acceptance, refusal

RULE_NAME = "collapse-successive-activations"
_ACTIVATIONS = ("Relu", "Clip")
_CLIP_BOUNDS_AS_INPUTS_OPSET = 11  # before it, Clip's bounds are the min/max attributes

__all__ = ["RULE_NAME", "CollapseSuccessiveActivations", "successive_activation_rules"]


def _interval(node: ir.Node) -> tuple[float, float] | str:
    bounds = value_range.activation_bounds(node)
    if isinstance(bounds, str):
        return bounds
    lo, hi = bounds
    return (-math.inf if lo is None else lo), (math.inf if hi is None else hi)


class CollapseSuccessiveActivations(ReportingRule):
    """``Second(First(x))`` ==> one Relu or Clip; see the module docstring."""

    def __init__(self, first: str, second: str, report: FixReport | None = None):
        super().__init__(RULE_NAME, report)
        self.first, self.second = first, second

    def pattern(self, op, x):
        inner = getattr(op, self.first)(x, _allow_other_inputs=True, _outputs=["inner"])
        return getattr(op, self.second)(inner, _allow_other_inputs=True, _outputs=["outer"])

    def check(self, context, x, inner, outer, **_) -> MatchResult:
        del context
        where = outer.producer().name or str(outer.name)
        if x.dtype is None:
            return refusal(where, f"the type of {x.name!r} is unknown")
        if inner.is_graph_output() or len(inner.uses()) != 1:
            return refusal(where, f"{inner.name!r} is read by other nodes or is a graph output")
        intervals = [_interval(value.producer()) for value in (inner, outer)]
        for interval in intervals:
            if isinstance(interval, str):
                return refusal(where, interval)
        (lo1, hi1), (lo2, hi2) = intervals
        if max(lo1, lo2) > min(hi1, hi2):
            return refusal(where, f"[{lo1:g}, {hi1:g}] and [{lo2:g}, {hi2:g}] do not overlap: the result is a constant")
        return acceptance(where)

    def rewrite(self, op, x, inner, outer, **_):
        (lo1, hi1), (lo2, hi2) = (_interval(value.producer()) for value in (inner, outer))
        lo, hi = max(lo1, lo2), min(hi1, hi2)
        node = outer.producer()
        where = node.name or str(outer.name)
        if lo == 0.0 and hi == math.inf:
            self.record(where, f"{self.first} -> {self.second}: one Relu", exact=True)
            return op.op("Relu", x, _name=node.name)
        self.record(where, f"{self.first} -> {self.second}: one Clip({lo:g}, {hi:g})", exact=True)
        graph = node.graph
        opset = graph.opset_imports.get("", None) if graph is not None else None
        if opset is not None and opset < _CLIP_BOUNDS_AS_INPUTS_OPSET:
            attributes = {key: float(bound) for key, bound in (("min", lo), ("max", hi)) if not math.isinf(bound)}
            return op.op("Clip", x, _name=node.name, **attributes)
        dtype = x.dtype.numpy()
        bounds = []
        for bound, suffix in ((lo, "min"), (hi, "max")):
            if math.isinf(bound):
                bounds.append(None)
                continue
            name = self.fresh_name(graph, f"{where}_{suffix}")
            bounds.append(op.initializer(ir.Tensor(np.array(bound, dtype=dtype), name=name), name=name))
        while bounds and bounds[-1] is None:
            bounds.pop()
        return op.op("Clip", x, *bounds, _name=node.name)


def successive_activation_rules(report: FixReport | None = None) -> RewriteRuleSet:
    """Every pair of Relu and Clip, in that order of matching."""
    return RewriteRuleSet([CollapseSuccessiveActivations.rule(first, second, report)
                           for first, second in itertools.product(_ACTIVATIONS, repeat=2)])

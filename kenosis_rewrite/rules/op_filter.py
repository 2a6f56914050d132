"""Rule sets that try a rule only on nodes of the op type its pattern ends in.

onnxscript's ``RewriteRuleSet`` tries every rule on every node. A rule whose pattern ends in one
fixed op (``Conv``, ``Slice``, ...) fails at once on a node of another op type, but reaching that
failure costs a matcher set-up per node and rule, and a pattern with several output nodes
(onnxscript's ``SlicesSplit``) first indexes the whole graph: one scan of the graph per node.
:func:`op_filtered` wraps each such rule so that a node of another op type is refused before the
matcher runs. The rewrites are exactly those of the unwrapped set: the same nodes in the same
order, the same rules in the same order; only matches bound to fail are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
from onnxscript.rewriter import RewriteRule, RewriteRuleSet
from onnxscript.rewriter._matcher import SimplePatternMatcher
from onnxscript.rewriter._pattern_ir import StringConstantPattern

__all__ = ["op_filtered", "root_op_type"]


def root_op_type(rule: RewriteRule) -> str | None:
    """The op type every match of ``rule`` starts at (its pattern's first output node), or None
    where the rule could match other op types (a pattern op, a matcher or match of its own)."""
    if type(rule) is not RewriteRule or type(rule._matcher) is not SimplePatternMatcher:
        return None
    output_nodes = rule._target_pattern.output_nodes
    if not output_nodes or not isinstance(output_nodes[0].op, StringConstantPattern):
        return None
    return output_nodes[0].op.value()


class _OpTypeGuard:
    """``rule``, refusing without matching any node whose op type is not ``op_type``."""

    def __init__(self, rule: RewriteRule, op_type: str):
        self._rule = rule
        self._op_type = op_type

    def __getattr__(self, name: str):
        return getattr(self._rule, name)

    def __str__(self) -> str:
        return str(self._rule)

    def try_rewrite(self, model: ir.Model, graph_or_function, node: ir.Node, **kwargs):
        """None for a node of another op type (its match would fail there); the rule's rewrite otherwise."""
        if node.op_type != self._op_type:
            return None
        return self._rule.try_rewrite(model, graph_or_function, node, **kwargs)


def op_filtered(rules: RewriteRuleSet | Sequence[RewriteRule]) -> RewriteRuleSet:
    """A rule set rewriting exactly as ``rules`` (commuted already, if it commutes), faster."""
    members = rules.rules if isinstance(rules, RewriteRuleSet) else list(rules)
    guarded = []
    for rule in members:
        op_type = root_op_type(rule)
        guarded.append(rule if op_type is None else _OpTypeGuard(rule, op_type))
    return RewriteRuleSet(guarded)

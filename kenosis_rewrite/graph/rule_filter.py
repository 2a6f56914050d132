"""Rule sets that try a rule only on nodes of the op type its pattern ends in.

onnxscript's ``RewriteRuleSet`` tries every rule on every node. A rule whose pattern ends in one
fixed op (``Conv``, ``Slice``, ...) fails at once on a node of another op type, but reaching that
failure costs a matcher set-up per node and rule, and a pattern with several output nodes
(onnxscript's ``SlicesSplit``) first indexes the whole graph: one scan of the graph per node.
:func:`op_filtered` puts the rules behind one dispatcher that, for each node, tries only the rules
whose pattern can end at its op type; even a refusal per rule and node cost a Python call each
(138,000 per quantize() of PP-OCR cls, 0.1 s). Of those it skips, too, the rules whose pattern
reads an input computed by an op of a fixed type (and that op's inputs likewise, a few nodes up)
that the node's input does not come from (:func:`producer_requirements`): a matcher's set-up and
bindings cost 16 us a refusal (``Conv -> Q -> DQ -> Mul`` tried on every Mul of a quantized
graph). The rewrites are exactly those of the unwrapped set: the same nodes in the same order, the
same rules in the same order; only matches bound to fail are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
from onnxscript.rewriter import RewriteRule, RewriteRuleSet

from kenosis_rewrite._upstream import onnxscript_patterns as patterns

__all__ = ["op_filtered", "producer_requirements", "root_op_type"]


def root_op_type(rule: RewriteRule) -> str | None:
    """The op type every match of ``rule`` starts at (its pattern's first output node), or None
    where the rule could match other op types (a pattern op, a matcher or match of its own)."""
    if type(rule) is not RewriteRule or not patterns.uses_simple_matcher(rule):
        return None
    output_nodes = patterns.output_node_patterns(rule)
    if not output_nodes:
        return None
    return patterns.fixed_op_type(output_nodes[0])


_Needs = tuple  # ((input index, op type, output index, what that producer's inputs need), ...)


def producer_requirements(rule: RewriteRule, depth: int = 4) -> _Needs:
    """What the pattern's root node needs of the producers of its inputs, ``depth`` nodes up:
    ``(input index, op type, output index, that producer's own needs)`` for each input that is an
    output of a node pattern of a fixed op type. onnxscript's matcher refuses a node whose input
    there is missing, None, a graph input or constant, or another op's or output's (it matches a
    producer's op type and output index before its inputs). Empty where the root is unknown
    (:func:`root_op_type`)."""
    if root_op_type(rule) is None:
        return ()
    return _needs_of(patterns.output_node_patterns(rule)[0], depth)


def _needs_of(node_pattern, depth: int) -> _Needs:
    if depth <= 0:
        return ()
    needs = []
    for index, producer, output_index in patterns.input_producers(node_pattern):
        op_type = patterns.fixed_op_type(producer)
        if op_type is not None:
            needs.append((index, op_type, output_index, _needs_of(producer, depth - 1)))
    return tuple(needs)


def _producers_fit(node: ir.Node, needs: _Needs) -> bool:
    """Whether ``node``'s inputs come from the producers ``needs`` names (:func:`producer_requirements`)."""
    inputs = node.inputs
    for index, op_type, output_index, further in needs:
        value = inputs[index] if index < len(inputs) else None
        producer = value.producer() if value is not None else None
        if producer is None or producer.op_type != op_type or value.index() != output_index:
            return False
        if further and not _producers_fit(producer, further):
            return False
    return True


class _OpTypeDispatch:
    """The rules of a set as one member of a ``RewriteRuleSet``: on each node it tries, in the set's
    order, the rules whose pattern can end at the node's op type, and returns the first rewrite.

    ``RewriteRuleSet`` reads the applied rule's ``name``, ``remove_nodes`` and ``as_function`` right
    after the rewrite is returned: they are the last matching rule's. Before any match,
    ``remove_nodes`` is True only when it is for every rule (the set then skips its unused-node sweep
    exactly when the unwrapped set would).
    """

    def __init__(self, rules: Sequence[RewriteRule]):
        self._rules = list(rules)
        roots = [root_op_type(rule) for rule in self._rules]
        needs = [producer_requirements(rule) for rule in self._rules]
        self._any_op = [(rule, ()) for rule, root in zip(self._rules, roots) if root is None]
        self._by_op = {root: [(rule, need) for rule, other, need in zip(self._rules, roots, needs)
                              if other in (root, None)]
                       for root in roots if root is not None}
        self._matched: RewriteRule | None = None

    def __str__(self) -> str:
        return ", ".join(str(rule) for rule in self._rules)

    @property
    def name(self) -> str | None:
        return self._matched.name if self._matched is not None else None

    @property
    def remove_nodes(self) -> bool:
        if self._matched is not None:
            return self._matched.remove_nodes
        return all(rule.remove_nodes for rule in self._rules)

    @property
    def as_function(self) -> bool:
        return self._matched is not None and self._matched.as_function

    def graph_pre_visitor(self) -> None:
        for rule in self._rules:
            if rule.graph_pre_visitor:
                rule.graph_pre_visitor()

    def graph_post_visitor(self) -> None:
        for rule in self._rules:
            if rule.graph_post_visitor:
                rule.graph_post_visitor()

    def try_rewrite(self, model: ir.Model, graph_or_function, node: ir.Node, **kwargs):
        """The first rewrite of the rules that can match ``node``; None when none does."""
        tracing = kwargs.get("tracer") is not None
        for rule, needs in self._by_op.get(node.op_type, self._any_op):
            if needs and not tracing and not _producers_fit(node, needs):
                continue  # the matcher would refuse it at the node's inputs
            delta = rule.try_rewrite(model, graph_or_function, node, **kwargs)
            if delta is not None and not tracing:  # a tracer sees every rule's match, as unwrapped
                self._matched = rule
                return delta
        return None


def op_filtered(rules: RewriteRuleSet | Sequence[RewriteRule]) -> RewriteRuleSet:
    """A rule set rewriting exactly as ``rules`` (commuted already, if it commutes), faster."""
    members = rules.rules if isinstance(rules, RewriteRuleSet) else list(rules)
    return RewriteRuleSet([_OpTypeDispatch(members)])

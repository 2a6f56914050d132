"""What :mod:`kenosis_rewrite.graph.rule_filter` reads of an onnxscript rewrite rule's pattern.

onnxscript has no public API for a compiled rule's pattern: which matcher a ``RewriteRule`` uses,
its target pattern's output nodes, a node pattern's fixed op type and the producers of its inputs
live in ``onnxscript.rewriter._matcher`` and ``onnxscript.rewriter._pattern_ir`` and in private
attributes of ``RewriteRule``. The pattern objects stay opaque here: the caller passes back what
these functions return. ``tests/unit/_upstream/test_internals.py`` fails when one of them moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from onnxscript.rewriter import RewriteRule
from onnxscript.rewriter._matcher import SimplePatternMatcher
from onnxscript.rewriter._pattern_ir import NodeOutputPattern, StringConstantPattern

__all__ = ["fixed_op_type", "input_producers", "output_node_patterns", "uses_simple_matcher"]

NodePattern = Any  # onnxscript.rewriter._pattern_ir.NodePattern, opaque to the callers


def uses_simple_matcher(rule: RewriteRule) -> bool:
    """Whether ``rule`` matches with onnxscript's plain matcher (no generic or custom matcher).

    Internal: ``RewriteRule._matcher`` and ``onnxscript.rewriter._matcher.SimplePatternMatcher``
    (seen in onnxscript 0.5 - 0.7). Public replacement: none public today
    (``onnxscript.rewriter.pattern`` re-exports the class, not the rule's attribute)."""
    return type(rule._matcher) is SimplePatternMatcher


def output_node_patterns(rule: RewriteRule) -> Sequence[NodePattern]:
    """The node patterns of ``rule``'s target pattern outputs, in its order.

    Internal: ``RewriteRule._target_pattern.output_nodes`` (seen in onnxscript 0.5 - 0.7).
    Public replacement: none public today."""
    return rule._target_pattern.output_nodes


def fixed_op_type(node_pattern: NodePattern) -> str | None:
    """The op type ``node_pattern`` matches when it is one fixed string; None for any other op pattern.

    Internal: ``NodePattern.op`` and ``onnxscript.rewriter._pattern_ir.StringConstantPattern.value()``
    (seen in onnxscript 0.5 - 0.7). Public replacement: none public today."""
    op = node_pattern.op
    return op.value() if isinstance(op, StringConstantPattern) else None


def input_producers(node_pattern: NodePattern) -> list[tuple[int, NodePattern, int]]:
    """``(input index, producer node pattern, output index)`` for each input of ``node_pattern`` that
    is an output of another node pattern (exactly a ``NodeOutputPattern``, not a subclass), in input order.

    Internal: ``NodePattern.inputs``, ``onnxscript.rewriter._pattern_ir.NodeOutputPattern``, its
    ``producer()`` and ``output_index`` (seen in onnxscript 0.5 - 0.7). Public replacement: none public today."""
    return [(index, pattern.producer(), pattern.output_index)
            for index, pattern in enumerate(node_pattern.inputs) if type(pattern) is NodeOutputPattern]

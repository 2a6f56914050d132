"""Tests of the rule bases: fresh names without a rescan per name, and refusal bookkeeping."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph.rule_base import NamingRule, ReportingRule


class _Rule(ReportingRule):
    def pattern(self, op, x):
        return op.Relu(x)

    def rewrite(self, op, x):
        return op.Relu(x)


def _initializer(graph: ir.Graph, name: str) -> None:
    graph.register_initializer(ir.Value(name=name, const_value=ir.tensor(np.zeros(1, np.float32))))


def test_fresh_names_avoid_the_graph_earlier_names_and_initializers_added_since():
    x = ir.Value(name="x")
    relu = ir.node("Relu", [x], name="w_bias_node")
    relu.outputs[0].name = "y"
    graph = ir.Graph([x], relu.outputs, nodes=[relu], name="g")
    _initializer(graph, "w")
    first, second = _Rule("a"), _Rule("b")
    assert isinstance(first, NamingRule)
    assert first.fresh_name(graph, "w") == "w_1"
    assert first.fresh_name(graph, "w") == "w_2"  # handed out before
    assert first.fresh_name(graph, "y") == "y_1"  # a node output
    assert second.fresh_name(graph, "late") == "late"
    _initializer(graph, "late")  # another rule of the set adds it after ``first`` scanned the graph
    assert first.fresh_name(graph, "late") == "late_1"
    first.cleanup()
    assert first.fresh_name(graph, "w") == "w_1"  # a new application scans again


def test_refuse_accept_and_record_go_to_the_report():
    report = FixReport()
    rule = _Rule("rule", report)
    assert not rule.refuse("node", "why not")
    assert [r.reason for r in report.refusals] == ["why not"]
    assert rule.accept("node")
    assert not report.refusals
    rule.record("node", "what changed", exact=True)
    assert [c.detail for c in report.changes] == ["what changed"]
    assert not _Rule("quiet").refuse("node", "nothing recorded, the match still fails")

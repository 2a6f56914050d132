"""Tests of the one rule base: fresh names without a rescan per name, pure check results, and the
bookkeeping the base does from them (moved here from tests/unit/rules/test_reporting.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph.rule_base import ReportingRule, SiteResult, acceptance, refusal


class _Rule(ReportingRule):
    """Relu -> Identity; its check returns whatever ``decision`` is (a refusal by default)."""

    decision: MatchResult | None = None

    def pattern(self, op, x):
        return op.Relu(x, _outputs=["y"])

    def check(self, context, x, y, **_):
        return self.decision if self.decision is not None else refusal(y.producer().name, "why not")

    def rewrite(self, op, x, y, **_):
        self.record(y.producer().name, "what changed", exact=True)
        return op.Identity(x)


class _Accepting(_Rule):
    decision = acceptance("relu")


def _initializer(graph: ir.Graph, name: str) -> None:
    graph.register_initializer(ir.Value(name=name, const_value=ir.tensor(np.zeros(1, np.float32))))


def _relu_model() -> ir.Model:
    model = ir.serde.deserialize_model(onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2] x) => (float[2] y) { y = Relu(x) }"""))
    next(iter(model.graph)).name = "relu"
    return model


def test_fresh_names_avoid_the_graph_earlier_names_and_initializers_added_since():
    x = ir.Value(name="x")
    relu = ir.node("Relu", [x], name="w_bias_node")
    relu.outputs[0].name = "y"
    graph = ir.Graph([x], relu.outputs, nodes=[relu], name="g")
    _initializer(graph, "w")
    first, second = _Rule("a"), _Rule("b")
    assert first.fresh_name(graph, "w") == "w_1"
    assert first.fresh_name(graph, "w") == "w_2"  # handed out before
    assert first.fresh_name(graph, "y") == "y_1"  # a node output
    assert second.fresh_name(graph, "late") == "late"
    _initializer(graph, "late")  # another rule of the set adds it after ``first`` scanned the graph
    assert first.fresh_name(graph, "late") == "late_1"
    first.cleanup()
    assert first.fresh_name(graph, "w") == "w_1"  # a new application scans again


def test_refusal_and_acceptance_are_plain_match_results_that_name_their_site():
    refused, accepted = refusal("node", "why not"), acceptance("node")
    assert isinstance(refused, MatchResult) and isinstance(refused, SiteResult)
    assert not refused and refused.reason == "why not" and refused.where == "node"
    assert accepted and accepted.where == "node"


def test_book_lists_refusals_forgets_them_on_acceptance_and_record_lists_changes():
    report = FixReport()
    rule = _Rule("rule", report)
    rule.book(refusal("node", "why not"))
    assert [(r.rule, r.where, r.reason) for r in report.refusals] == [("rule", "node", "why not")]
    rule.book(MatchResult().fail("a failure the report does not show"))
    assert len(report.refusals) == 1
    rule.book(acceptance("node"))
    assert not report.refusals
    rule.record("node", "what changed", exact=True)
    assert [c.detail for c in report.changes] == ["what changed"]
    _Rule("quiet").book(refusal("node", "nothing recorded, the match still fails"))  # no report: no error


def test_rule_builds_a_plain_rewrite_rule_whose_condition_books_what_check_returned():
    report = FixReport()
    rule = _Rule.rule("rule", report)
    assert type(rule) is RewriteRule  # rule_filter dispatches on exactly this type
    assert RewriteRuleSet([rule]).apply_to_model(_relu_model()) == 0
    assert [(r.rule, r.where, r.reason) for r in report.refusals] == [("rule", "relu", "why not")]
    assert RewriteRuleSet([_Accepting.rule("rule", report)]).apply_to_model(_relu_model()) == 1
    assert not report.refusals  # the acceptance forgot the refusal at "relu"
    assert [(c.rule, c.where) for c in report.changes] == [("rule", "relu")]


def test_check_alone_writes_nothing():
    report = FixReport()
    rule = _Rule("rule", report)
    model = _relu_model()
    node = next(iter(model.graph))
    result = rule.check(None, x=node.inputs[0], y=node.outputs[0])
    assert not result and result.reason == "why not"
    assert not report.refusals and not report.changes

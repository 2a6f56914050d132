"""The bases of kenosis's rewrite rules: fresh names for what a rewrite adds, and reporting.

:class:`NamingRule` names new initializers and nodes with one :class:`~kenosis_rewrite.graph.qdq_params.NameAllocator`
per graph and application of the rule (built on the first name asked for, dropped when the
application ends), so N rewrites scan the graph once rather than N times. onnxscript skips a new
initializer whose name already exists, so the names must be fresh.

A :class:`ReportingRule` *refuses* a match it declines for a reason the user should see (the report lists it, and
the match fails), *accepts* one (earlier refusals at that place are forgotten: another rule or an
earlier rewrite resolved them) and *records* each change it makes, exact or not.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.core.report import FixReport

__all__ = ["NamingRule", "ReportingRule"]


class NamingRule(RewriteRuleClassBase):
    """``RewriteRuleClassBase`` whose rewrites name what they add with :meth:`fresh_name`."""

    def setup(self) -> None:
        """Called by onnxscript before the rule visits a graph: no allocator survives from another application."""
        self._allocators: dict[int, qdq_params.NameAllocator] = {}

    def cleanup(self) -> None:
        """Called by onnxscript after the rule visited a graph."""
        self._allocators = {}

    def fresh_name(self, graph: ir.Graph | None, base: str) -> str:
        """``base`` or ``base_N``: a name no value, initializer or node of ``graph`` had when this rule first
        named something in it during this application, none handed out since, and no initializer has now (other rules of the set add initializers
        while this one runs; ``graph.initializers`` is a dict, so that check stays cheap)."""
        if graph is None:
            return base
        allocators = self.__dict__.setdefault("_allocators", {})
        if id(graph) not in allocators:
            allocators[id(graph)] = qdq_params.NameAllocator(graph)
        name = allocators[id(graph)].fresh(base)
        while name in graph.initializers:
            name = allocators[id(graph)].fresh(base)
        return name


class ReportingRule(NamingRule):
    """``RewriteRuleClassBase`` with a report (None: nothing is recorded, the rule behaves the same)."""

    def __init__(self, name: str, report: FixReport | None = None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.report = report

    def refuse(self, where: str, reason: str) -> MatchResult:
        """Fail the match for ``reason`` and list it in the report as a refusal at ``where``."""
        if self.report is not None:
            self.report.refused(self.name, where, reason)
        return MatchResult().fail(reason)

    def accept(self, where: str) -> MatchResult:
        """A successful match at ``where``; refusals recorded there before are forgotten."""
        if self.report is not None:
            self.report.forget_refusals_at(self.name, where)
        return MatchResult()

    def record(self, where: str, detail: str, exact: bool) -> None:
        """List one change made at ``where`` in the report."""
        if self.report is not None:
            self.report.changed(self.name, where, detail, exact=exact)

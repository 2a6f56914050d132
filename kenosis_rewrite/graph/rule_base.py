"""The one base of kenosis's rewrite rules: pure checks, fresh names for what a rewrite adds, and the report.

Every rule of :mod:`kenosis_rewrite.placement.rules` and :mod:`kenosis_rewrite.canonicalization.rules` derives
from :class:`ReportingRule`, an onnxscript ``RewriteRuleClassBase``:

* ``check()`` is pure: it returns an onnxscript ``MatchResult`` (success, or ``.fail(reason)``) and writes
  nothing. A decision the report should show names its site: :func:`refusal` (a failure listed as a
  refusal at that site) and :func:`acceptance` (a success that forgets the rule's earlier refusals there:
  another rule or an earlier rewrite resolved them) return such results. A plain ``MatchResult`` is a
  decision the report does not show.
* :meth:`ReportingRule.rule` hands onnxscript a condition function that calls ``check()`` and books
  what it returned into the rule's report (None: nothing is booked, the rule matches the same).
* ``rewrite()`` may write: :meth:`ReportingRule.record` lists each change it makes, exact or not.
* :meth:`ReportingRule.fresh_name` names new initializers and nodes with one
  :class:`~kenosis_rewrite.graph.qdq_params.NameAllocator` per graph and application of the rule (built
  on the first name asked for, dropped when the application ends), so N rewrites scan the graph once
  rather than N times. onnxscript skips a new initializer whose name already exists, so the names
  must be fresh.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleClassBase

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params

__all__ = ["GUARD_HELD_KEY", "ReportingRule", "SiteResult", "acceptance", "guard_marks", "refusal"]

# node metadata fix() writes at the sites where its run-time guard undid rules (their names, comma-separated):
# a later fix() of its output holds them there too, so that it finds nothing left to do. Judged against
# that output, a rule can pass where it failed against the first input (fuzz seed 8600028: an accepted
# change took 0.0006, the undone fold then 0.0018 of the next budget, 0.0024 in all).
GUARD_HELD_KEY = "kenosis_rewrite.guard_held"


def guard_marks(node: ir.Node | None) -> set[str]:
    """The rules an earlier fix()'s guard undid at ``node`` (:data:`GUARD_HELD_KEY`); empty for None."""
    marks = node.metadata_props.get(GUARD_HELD_KEY, "") if node is not None else ""
    return set(filter(None, marks.split(",")))


def _site(context) -> str | None:
    """The site of a match: its root node's name (None where the node has none, or no context)."""
    root = getattr(context, "root", None)
    return root.name or None if root is not None else None


class SiteResult(MatchResult):
    """An onnxscript ``MatchResult`` that names the site (``where``) a rule decided on, so that the
    rule base can book the decision in the report (:meth:`ReportingRule.book`)."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where


def refusal(where: str, reason: str) -> MatchResult:
    """A failed match the report lists as a refusal of the rule at ``where``, for ``reason``."""
    return SiteResult(where).fail(reason)


def acceptance(where: str) -> MatchResult:
    """A successful match at ``where``; the rule's refusals booked there before are forgotten."""
    return SiteResult(where)


class ReportingRule(RewriteRuleClassBase):
    """``RewriteRuleClassBase`` with a report (None: nothing is recorded, the rule behaves the same)
    and fresh names; see the module docstring."""

    def __init__(self, name: str | None = None, report: FixReport | None = None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.report = report

    @classmethod
    def rule(cls, *args, **kwargs) -> RewriteRule:
        """The onnxscript ``RewriteRule`` of a new instance, as ``RewriteRuleClassBase.rule`` builds it but
        with :meth:`checked` as its condition: ``check()``'s decisions reach the report from there."""
        instance = cls(*args, **kwargs)
        return RewriteRule(
            instance.pattern,
            instance.rewrite,
            instance.checked,
            name=instance.name,
            remove_nodes=instance.remove_nodes,
            graph_pre_visitor=instance.setup,
            graph_post_visitor=instance.cleanup,
            as_function=instance.as_function,
        )

    def checked(self, context, **bindings):
        """The condition onnxscript calls: ``check()``, then :meth:`book` of what it returned. A site
        the report holds (:attr:`FixReport.held_sites`: the run-time guard undid the rule there) fails
        before ``check()``, and so does one whose root node an earlier fix() marked (:data:`GUARD_HELD_KEY`)."""
        site = _site(context)
        if self.report is not None and (self.name, site) in self.report.held_sites:
            return MatchResult().fail("held back at this site by the run-time guard")
        if self.name in guard_marks(getattr(context, "root", None)):
            held = refusal(site or self.name, "held back at this site by the run-time guard of the fix() that wrote this model")
            self.book(held)
            return held
        result = self.check(context, **bindings)
        self.book(result)
        if result:
            self._site = site  # the changes rewrite() records next are made there
        return result

    def book(self, result) -> None:
        """Write a :class:`SiteResult` into the report: a failure as a refusal at its site, a success by
        forgetting the rule's refusals there. Other results (plain ``MatchResult``, bool) are not booked."""
        if self.report is None or not isinstance(result, SiteResult):
            return
        if result:
            self.report.forget_refusals_at(self.name, result.where)
        else:
            self.report.refused(self.name, result.where, result.reason)

    def record(self, where: str, detail: str, exact: bool) -> None:
        """List one change made at ``where`` in the report (called by ``rewrite()``), and the site of
        the match it was made at."""
        if self.report is not None:
            self.report.changed(self.name, where, detail, exact=exact)
            self.report.sites.setdefault((self.name, where), self.__dict__.get("_site"))

    def setup(self) -> None:
        """Called by onnxscript before the rule visits a graph: no allocator survives from another application."""
        self._allocators: dict[int, qdq_params.NameAllocator] = {}

    def cleanup(self) -> None:
        """Called by onnxscript after the rule visited a graph."""
        self._allocators = {}

    def fresh_name(self, graph: ir.Graph | None, base: str) -> str:
        """``base`` or ``base_N``: a name no value, initializer or node of ``graph`` had when this rule first
        named something in it during this application, none handed out since, and no initializer has now
        (other rules of the set add initializers while this one runs; ``graph.initializers`` is a dict, so
        that check stays cheap)."""
        if graph is None:
            return base
        allocators = self.__dict__.setdefault("_allocators", {})
        if id(graph) not in allocators:
            allocators[id(graph)] = qdq_params.NameAllocator(graph)
        name = allocators[id(graph)].fresh(base)
        while name in graph.initializers:
            name = allocators[id(graph)].fresh(base)
        return name

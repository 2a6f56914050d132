"""The shape every kenosis pass shares: an onnx-ir in-place pass that records into a FixReport."""

from __future__ import annotations

import onnx_ir as ir

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph.rule_base import guard_marks


class ReportingPass(ir.passes.InPlacePass):
    """An ``InPlacePass`` with a rule name and an optional :class:`FixReport` to record into."""

    rule_name: str = ""

    def __init__(self, report: FixReport | None = None):
        super().__init__()
        self.report = report

    def changed(self, where: str, detail: str, *, exact: bool, site: str | None = None) -> None:
        """List one change in the report; ``site``: a name for where it was made that stays the same
        from one fix() to the next, so that the run-time guard can undo this one change alone
        (:attr:`FixReport.held_sites`, checked with :meth:`held`)."""
        if self.report is not None:
            self.report.changed(self.rule_name, where, detail, exact=exact)
            if site is not None:
                self.report.sites.setdefault((self.rule_name, where), site)

    def held(self, site: str, node: ir.Node | None = None) -> bool:
        """Whether the run-time guard undid this pass at ``site`` (then the pass leaves it alone): in this
        fix(), or in the fix() that wrote the model, which marked ``node`` (the site's node) so."""
        if self.report is not None and (self.rule_name, site) in self.report.held_sites:
            return True
        return self.rule_name in guard_marks(node)

    def refused(self, where: str, reason: str) -> None:
        if self.report is not None:
            self.report.refused(self.rule_name, where, reason)


def remove_unused_nodes(model: ir.Model, modified: bool = True) -> None:
    """Drop nodes and initializers a pass left without consumers."""
    if modified:
        from onnx_ir.passes.common import RemoveUnusedNodesPass  # noqa: PLC0415

        RemoveUnusedNodesPass()(model)

"""The rule contract, for every rule of placement/rules and canonicalization/rules: one base
(:class:`~kenosis_rewrite.graph.rule_base.ReportingRule`), and a ``check()`` that only returns a result:
what the report shows comes from the base, outside ``check()``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import onnx
import onnx_ir as ir
import pytest
from onnxscript.rewriter import RewriteRule, RewriteRuleSet

import kenosis_rewrite.canonicalization.rules as canonicalization_rules
import kenosis_rewrite.placement.rules as placement_rules
from kenosis_rewrite.canonicalization.rules.gemm_addend import GemmComputedAddendToAdd
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph.rule_base import ReportingRule, SiteResult
from kenosis_rewrite.placement.rules.gather_dequantize import GatherBeforeDequantize
from kenosis_rewrite.placement.rules.prelu import PReluToLeakyRelu
from kenosis_rewrite.placement.rules.successive_activations import CollapseSuccessiveActivations


def _rule_classes() -> list[type]:
    """Every class with a ``pattern`` defined in a module of the two rule packages."""
    found = []
    for package in (placement_rules, canonicalization_rules):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ == module.__name__ and callable(getattr(cls, "pattern", None)):
                    found.append(cls)
    return found


def test_every_rule_class_derives_from_the_one_base_and_keeps_its_bookkeeping():
    classes = _rule_classes()
    assert len(classes) > 30
    for cls in classes:
        assert issubclass(cls, ReportingRule), cls
        for method in ("rule", "checked", "book"):  # the bookkeeping lives in the base only
            assert method not in cls.__dict__, (cls, method)


PRELU_OF_AN_INPUT_SLOPE = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,3,4,4] x, float[3,1,1] slope) => (float[1,3,4,4] y) { y = PRelu(x, slope) }"""
RELU_THEN_CLIP = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3] x) => (float[2,3] y) <float lo = {0.5}, float hi = {6.0}> { t = Relu(x)
       y = Clip(t, lo, hi) }"""
GATHER_OF_A_DEQUANTIZED_TABLE = """
    <ir_version: 8, opset_import: ["" : 21]>
    g (int64[2] ids) => (float[2,3] y)
    <int8[4,3] table = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, float s = {0.5}, int8 z = {0}>
    { d = DequantizeLinear(table, s, z)
      y = Gather(d, ids) }"""
GEMM_WITH_A_COMPUTED_ADDEND = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3] a, float[3,4] b, float[2,4] c) => (float[2,4] y) { r = Relu(c)
       y = Gemm(a, b, r) }"""

# (rule class, its arguments before the report, model, a refusal booked at the site beforehand, the
# refusals after the rule ran)
CASES = {
    "refusal": (PReluToLeakyRelu, (), PRELU_OF_AN_INPUT_SLOPE, None,
                [("prelu-to-leakyrelu", "y", "slope 'slope' is not a constant")]),
    "acceptance": (CollapseSuccessiveActivations, ("Relu", "Clip"), RELU_THEN_CLIP,
                   ("collapse-successive-activations", "y", "an earlier refusal"), []),
    "acceptance of a gather": (GatherBeforeDequantize, (), GATHER_OF_A_DEQUANTIZED_TABLE,
                               ("gather-before-dequantize", "y", "an earlier refusal"), []),
    "canonicalization": (GemmComputedAddendToAdd, (), GEMM_WITH_A_COMPUTED_ADDEND, None, []),
}


def _report(earlier: tuple[str, str, str] | None) -> FixReport:
    report = FixReport()
    if earlier is not None:
        report.refused(*earlier)
    return report


def _contents(report: FixReport) -> tuple:
    return list(report.refusals), list(report.changes), list(report.notes)


def _model(text: str) -> ir.Model:
    return ir.serde.deserialize_model(onnx.parser.parse_model(text))


@pytest.mark.parametrize("case", list(CASES))
def test_check_leaves_the_report_as_it_was_and_the_rule_books_its_result(case):
    cls, args, text, earlier, refusals_after = CASES[case]
    report = _report(earlier)
    instance = cls(*args, report)
    results, unchanged = [], []

    def spy(context, **bindings):  # check() on each match site, the report compared around it
        before = _contents(report)
        results.append(instance.check(context, **bindings))
        unchanged.append(_contents(report) == before)
        return False  # rewrite nothing

    RewriteRuleSet([RewriteRule(instance.pattern, instance.rewrite, spy, name=instance.name)]).apply_to_model(_model(text))
    assert results and all(unchanged), case
    assert _contents(report) == _contents(_report(earlier))

    booked = _report(earlier)  # the same site, through the rule the base builds
    count = RewriteRuleSet([cls.rule(*args, booked)]).apply_to_model(_model(text))
    assert [(r.rule, r.where, r.reason) for r in booked.refusals] == refusals_after
    assert count == (0 if refusals_after else 1)
    refused = [(instance.name, r.where, r.reason) for r in results if isinstance(r, SiteResult) and not r]
    assert refused == refusals_after

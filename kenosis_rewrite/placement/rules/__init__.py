"""QDQ placement rules: onnxscript ``RewriteRuleClassBase`` rules (all of them
:class:`~kenosis_rewrite.graph.rule_base.ReportingRule`), one family per module, each usable on its own in any
onnxscript / onnx-ir pipeline (``kenosis_rewrite.rules(target)`` gives a target's set)."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

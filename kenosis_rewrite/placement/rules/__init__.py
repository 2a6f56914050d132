"""QDQ placement rules: onnxscript ``RewriteRuleClassBase`` rules, one family per module, each usable
on its own in any onnxscript / onnx-ir pipeline (``kenosis_rewrite.rules(target)`` gives a target's set)."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

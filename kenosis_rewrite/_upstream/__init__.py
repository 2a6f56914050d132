"""The one fenced place that uses other projects' private internals (onnxscript, onnx-ir, onnxruntime).

* :mod:`.onnxscript_patterns`: a rewrite rule's matcher and pattern (``onnxscript.rewriter._matcher``,
  ``_pattern_ir``), for :mod:`kenosis_rewrite.graph.rule_filter`.
* :mod:`.onnxscript_folding`: onnxscript's constant folding pass, its per-node shape inference and its
  default rewrite rules (``onnxscript.optimizer._constant_folding``, ``onnxscript.rewriter._DEFAULT_REWRITE_RULES``),
  for :mod:`kenosis_rewrite.canonicalization.folding`.
* :mod:`.lift_constants`: onnx_ir's constant lifting pass, its tensor conversion hook overridden.
* :mod:`.ort_quantizer`: onnxruntime's ``QDQQuantizer``/``ONNXModel`` private methods behind public hooks,
  and its quantizer modules' ``find_by_name`` pointed at an indexed lookup for a scope, for
  :mod:`kenosis_rewrite.calibration.ort_static`.

Each module names the internal it touches, since which release it has been seen and the public API that
would replace it; ``tests/unit/_upstream`` fails loudly when an internal moves, and ``pyproject.toml`` bounds
the releases checked. Nothing outside this package imports a private name of another project."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

"""The one fenced place that uses other projects' private internals (onnxscript, onnx-ir, onnxruntime).

Each module names the internal it touches and the public API that would replace it;
``tests/unit/_upstream`` fails loudly when an internal moves. Nothing outside this package imports a
private name of another project."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

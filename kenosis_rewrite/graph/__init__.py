"""QDQ graph primitives over onnx-ir: reading Q/DQ parameters, value ranges, removing quantizers,
and the bases every rewrite rule and pass of the package builds on."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

"""QDQ placement passes (onnx-ir ``InPlacePass``): rewrites that need more than one local pattern."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

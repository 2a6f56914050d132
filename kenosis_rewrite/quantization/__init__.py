"""``quantize()``: FP32 model to a fast, faithful QDQ model, as a sequence of named stages."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

"""Accuracy algorithms of ``quantize()``: bias correction, weight rounding, cross-layer equalization,
SNR sensitivity and output/metadata protection."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

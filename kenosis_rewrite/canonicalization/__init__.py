"""The FP32 canonical graph a quantizer should see (``kenosis_rewrite.prepare``): constant folding,
shape reads, per-channel affine folding, Transpose sinking, and their FP32 rewrite rules."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

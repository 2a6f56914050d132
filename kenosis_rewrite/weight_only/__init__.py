"""``quantize_weights()``: blockwise int4/int8 weight-only quantization (MatMulNBits / QDQ)."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

"""FP32 canonicalization rules (onnxscript rewrite rules) run by ``prepare()`` before quantization."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

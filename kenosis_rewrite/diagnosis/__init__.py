"""What ONNX Runtime really runs: ``explain()`` (integer vs float kernels, by MACs, with reasons) and
per-layer profiling."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

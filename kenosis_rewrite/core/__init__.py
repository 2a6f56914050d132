"""Infrastructure every layer uses: loading and validating models, ONNX Runtime sessions, timing,
fidelity metrics, the report, quantize_static with fixed configurations. Imports nothing of the package
but ``errors``."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

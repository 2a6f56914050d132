"""Benchmarks: interleaved latency and fidelity of quantize_static configurations, peers and
``fix()``/``quantize()`` variants on real models, and the pages generated from their results."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

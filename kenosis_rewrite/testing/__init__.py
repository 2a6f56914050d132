"""Testing tools users can run on their own rules: a generator of random QDQ graphs and quantizer
configurations, property checks (exactness, fidelity, validity), and small model builders."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

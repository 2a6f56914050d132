"""The ``kenosis-rewrite`` command line."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

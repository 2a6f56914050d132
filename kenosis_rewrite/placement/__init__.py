"""``fix()``: the QDQ placement rules and passes, the per-runtime targets that order them, and the
fidelity guard that undoes what does not hold."""

from kenosis_rewrite._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)

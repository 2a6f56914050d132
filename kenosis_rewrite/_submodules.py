"""Submodules reached as attributes: ``import kenosis_rewrite; kenosis_rewrite.placement.rules.prelu``.

Each subpackage's ``__init__`` sets ``__getattr__ = submodule_getattr(__name__)``, so a module is
imported on first attribute access (PEP 562) and ``import kenosis_rewrite`` stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType


def submodule_getattr(package: str) -> Callable[[str], ModuleType]:
    """A module ``__getattr__`` for ``package`` that imports ``package.<name>`` when it exists."""

    def __getattr__(name: str) -> ModuleType:
        if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__

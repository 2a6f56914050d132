"""The caller's objects out of the cyclic garbage collector's scans while a long call runs.

quantize() builds and drops many onnx_ir graphs: on a small model that is ~80,000 container
allocations, enough to trigger about one full (generation 2) collection a call. A full collection
walks every tracked object of the process, the caller's imports and data included, so its cost
grows with what the caller has loaded, not with what the call does: 0.06-0.15 s on PP-OCR cls
(a tenth of the call) with only this package and its dependencies imported.

:func:`objects_before_frozen` moves the objects that exist when the call starts to the permanent
generation (:func:`gc.freeze`) and back at its end (:func:`gc.unfreeze`). Garbage the call makes is
collected as usual; garbage among the frozen objects waits until the call returns. Where the caller
has frozen objects itself (a pre-fork server), or disabled the collector, nothing is touched: the
unfreeze would undo the caller's freeze. The one case it cannot see is another thread calling
:func:`gc.freeze` during the call: the call's unfreeze releases those objects too (they are then
scanned again, as they were before they were frozen; nothing is lost).
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import TypeVar

_Function = TypeVar("_Function", bound=Callable)


@contextlib.contextmanager
def objects_before_frozen() -> Iterator[None]:
    """Inside the block the objects alive at its start are not scanned by collections (see module)."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def caller_objects_frozen(function: _Function) -> _Function:
    """``function`` run inside :func:`objects_before_frozen`."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with objects_before_frozen():
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]

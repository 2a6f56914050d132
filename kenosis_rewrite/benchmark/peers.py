"""Peer quantizers (NNCF, Intel Neural Compressor, AMD Quark), each run from its own virtual environment.

Peers are never dependencies of this package: each pins libraries that conflict with ours or with
each other (INC 3.7: onnx 1.18 and numpy 1.26; Quark: torch and onnx 1.22). So a peer runs in its
own interpreter: :func:`quantize_with_peer` writes the FP32 model and the calibration feeds to a
temporary folder, runs the peer's driver (a short script, below) there with that interpreter, and
reads back the QDQ model and the time the peer's quantizer took.

Where a peer's interpreter is found, first match wins:

1. ``$KENOSIS_PEER_<NAME>_PYTHON`` (e.g. ``KENOSIS_PEER_NNCF_PYTHON=/opt/nncf/bin/python``);
2. the virtual environment :func:`install` makes: ``<cache>/peers/<name>/bin/python``, where
   ``<cache>`` is ``$KENOSIS_CACHE`` or ``~/.cache/kenosis_rewrite``
   (``kenosis-rewrite peers install nncf``);
3. this interpreter, when it can import the peer.

Each peer runs with its default configuration for ONNX Runtime CPU unless a preset is named
(Quark: ``XINT8``, ``INT8_CNN_DEFAULT``, ...; NNCF: ``MIXED``, ``PERFORMANCE``, ``TRANSFORMER`` or
``MIXED,TRANSFORMER``: its preset and model type); every peer gets all the feeds as its calibration set.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from kenosis_rewrite.errors import KenosisError, PeerFailedError, PeerNotInstalledError

__all__ = ["PEERS", "Peer", "PeerQuantization", "PeerNotInstalledError", "PeerFailedError",
           "find_python", "install", "quantize_with_peer", "save_feeds", "load_feeds"]




# Every driver: argv = fp32 model, feeds (.npz, "{index}::{input name}"), output model, preset or "".
# It prints one JSON line: {"wall_s": seconds spent in the peer's quantize call, "version": ...}.
_LOAD = '''
import json, sys, time
import numpy as np
import onnx
model_path, feeds_path, out_path, preset = sys.argv[1:5]
_data = np.load(feeds_path)
_names = sorted({key.split("::", 1)[1] for key in _data.files})
_count = len({key.split("::", 1)[0] for key in _data.files})
feeds = [{name: _data[f"{i}::{name}"] for name in _names} for i in range(_count)]
'''

_NNCF = _LOAD + '''
import nncf
options = {}
for part in filter(None, preset.split(",")):  # "MIXED", "PERFORMANCE", "TRANSFORMER"
    if part in ("MIXED", "PERFORMANCE"):
        options["preset"] = getattr(nncf.QuantizationPreset, part)
    elif part == "TRANSFORMER":
        options["model_type"] = nncf.ModelType.TRANSFORMER
    else:
        raise SystemExit(f"unknown NNCF preset {part!r}: MIXED, PERFORMANCE or TRANSFORMER")
model = onnx.load(model_path)
start = time.perf_counter()
quantized = nncf.quantize(model, nncf.Dataset(feeds), subset_size=len(feeds), **options)
wall = time.perf_counter() - start
onnx.save(quantized, out_path)
print(json.dumps({"wall_s": wall, "version": nncf.__version__}))
'''

_INC = _LOAD + '''
import neural_compressor
from neural_compressor import PostTrainingQuantConfig, quantization

class Loader:
    batch_size = 1
    def __iter__(self):
        for feed in feeds:
            yield (feed if len(feed) > 1 else next(iter(feed.values()))), 0

config = PostTrainingQuantConfig(quant_format="QDQ", calibration_sampling_size=[len(feeds)])
start = time.perf_counter()
quantized = quantization.fit(onnx.load(model_path), config, calib_dataloader=Loader())
wall = time.perf_counter() - start
if quantized is None:
    raise SystemExit("neural_compressor returned no model")
onnx.save(quantized.model, out_path)
print(json.dumps({"wall_s": wall, "version": neural_compressor.__version__}))
'''

_QUARK = _LOAD + '''
import quark
from quark.onnx import ModelQuantizer
from quark.onnx.quantization.config import Config, get_default_config

class Reader:
    def __init__(self):
        self._feeds = iter(feeds)
    def get_next(self):
        return next(self._feeds, None)
    def rewind(self):
        self._feeds = iter(feeds)

config = Config(global_quant_config=get_default_config(preset or "XINT8"))
start = time.perf_counter()
ModelQuantizer(config).quantize_model(model_path, out_path, Reader())
wall = time.perf_counter() - start
print(json.dumps({"wall_s": wall, "version": getattr(quark, "__version__", "?")}))
'''


@dataclasses.dataclass(frozen=True)
class Peer:
    """A peer quantizer: how to install it, how to run it."""

    name: str
    title: str
    module: str  # what its interpreter must import
    requirements: tuple[str, ...]  # pip requirements of its own virtual environment
    driver: str
    default_preset: str = ""


PEERS: Mapping[str, Peer] = types.MappingProxyType({
    "nncf": Peer("nncf", "NNCF", "nncf", ("nncf", "onnx", "onnxruntime"), _NNCF),
    "inc": Peer("inc", "Intel Neural Compressor", "neural_compressor",
                ("neural-compressor==3.7", "onnx==1.18.0", "six", "onnxruntime"), _INC),
    # torch 2.13.0: the CPU build; an unpinned torch pulls several GB of CUDA packages
    "quark": Peer("quark", "AMD Quark", "quark.onnx", ("torch==2.13.0", "amd-quark", "onnxruntime"), _QUARK,
                  default_preset="XINT8"),
})


@dataclasses.dataclass
class PeerQuantization:
    """A peer's QDQ model and what it cost."""

    peer: str
    preset: str
    model: onnx.ModelProto
    wall_s: float  # the peer's quantize call alone (no interpreter start-up, no I/O)
    version: str


def _peer(name: str) -> Peer:
    if name not in PEERS:
        raise KenosisError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    return PEERS[name]


def peers_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where :func:`install` makes the peers' virtual environments."""
    from kenosis_rewrite import zoo  # noqa: PLC0415 - the one definition of the cache folder

    return zoo.cache_root(cache_dir) / "peers"


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def find_python(name: str, cache_dir: str | os.PathLike | None = None) -> str | None:
    """The interpreter that runs peer ``name`` (see the module docstring), or None."""
    peer = _peer(name)
    override = os.environ.get(f"KENOSIS_PEER_{name.upper()}_PYTHON")
    if override:
        return override
    python = _venv_python(peers_dir(cache_dir) / name)
    if python.exists():
        return str(python)
    top = peer.module.split(".")[0]
    if importlib.util.find_spec(top) is not None:
        return sys.executable
    return None


def _install_hint(name: str, cache_dir) -> str:
    return (f"{PEERS[name].title} is not installed for kenosis_rewrite: run `kenosis-rewrite peers install {name}` "
            f"(its own virtual environment under {peers_dir(cache_dir)}), or set "
            f"KENOSIS_PEER_{name.upper()}_PYTHON to a Python that can import {PEERS[name].module}")


def install(name: str, cache_dir: str | os.PathLike | None = None,
            progress: Callable[[str], None] | None = None) -> str:
    """Make peer ``name``'s virtual environment (``pip install`` its requirements); returns its python."""
    peer = _peer(name)
    venv = peers_dir(cache_dir) / name
    say = progress or (lambda message: None)
    python = _venv_python(venv)
    steps = [] if python.exists() else [[sys.executable, "-m", "venv", str(venv)]]
    steps += [[str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
              [str(python), "-m", "pip", "install", "--quiet", *peer.requirements]]
    for command in steps:
        say(" ".join(command))
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise PeerFailedError(f"installing {peer.title} failed at `{' '.join(command)}`:\n{done.stderr[-2000:]}")
    return str(python)


def save_feeds(feeds: Sequence[Mapping[str, np.ndarray]], path: str | os.PathLike) -> None:
    """Feeds as the drivers read them: one ``.npz`` with ``"{index}::{input name}"`` arrays."""
    np.savez(path, **{f"{i}::{name}": np.asarray(array) for i, feed in enumerate(feeds) for name, array in feed.items()})


def load_feeds(path: str | os.PathLike) -> list[dict[str, np.ndarray]]:
    """The feeds :func:`save_feeds` wrote, in order."""
    data = np.load(path)
    names = sorted({key.split("::", 1)[1] for key in data.files})
    count = len({key.split("::", 1)[0] for key in data.files})
    return [{name: data[f"{i}::{name}"] for name in names} for i in range(count)]


def _cause(output: str, tail: list[str]) -> str:
    """The line that says why a peer failed, for the first line of the error (which reports and
    tables keep): the last line naming an error (a traceback's last line; INC logs its exception
    and then returns no model, so its own last line says nothing), else the last line."""
    for line in reversed(output.strip().splitlines()):
        if "Error" in line or "ERROR" in line or "Exception" in line:
            return line.strip()
    return tail[-1].strip() if tail else "no output"


def quantize_with_peer(
    name: str, model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]], *, preset: str | None = None,
    cache_dir: str | os.PathLike | None = None, timeout_s: float = 3600.0,
) -> PeerQuantization:
    """Quantize the FP32 ``model`` with peer ``name`` on ``feeds`` (its calibration set), in its own interpreter.

    Raises:
        PeerNotInstalledError: no interpreter can import the peer (the message says how to install it).
        PeerFailedError: the peer ran and failed, or wrote no model.
    """
    peer = _peer(name)
    if not feeds:
        raise KenosisError(f"{peer.title} needs calibration feeds")
    python = find_python(name, cache_dir)
    if python is None:
        raise PeerNotInstalledError(_install_hint(name, cache_dir))
    preset = preset if preset is not None else peer.default_preset
    with tempfile.TemporaryDirectory(prefix=f"kenosis-{name}-") as folder:
        fp32, feeds_path, out = (os.path.join(folder, f) for f in ("fp32.onnx", "feeds.npz", "quantized.onnx"))
        onnx.save(model, fp32)
        save_feeds(feeds, feeds_path)
        driver = os.path.join(folder, "driver.py")
        Path(driver).write_text(peer.driver, encoding="utf-8")
        start = time.perf_counter()
        try:
            done = subprocess.run([python, driver, fp32, feeds_path, out, preset], capture_output=True, text=True,
                                  timeout=timeout_s, check=False, cwd=folder)
        except subprocess.TimeoutExpired as error:
            raise PeerFailedError(f"{peer.title} did not finish in {timeout_s:g} s") from error
        except OSError as error:
            raise PeerNotInstalledError(f"{_install_hint(name, cache_dir)} ({python}: {error})") from error
        elapsed = time.perf_counter() - start
        if done.returncode != 0 or not os.path.exists(out):
            tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
            cause = _cause(f"{done.stdout}\n{done.stderr}", tail)
            raise PeerFailedError(f"{peer.title} failed (exit {done.returncode}): {cause}\n" + "\n".join(tail))
        summary = next((json.loads(line) for line in reversed(done.stdout.splitlines()) if line.startswith("{")), {})
        quantized = onnx.load(out)
    return PeerQuantization(name, preset, quantized, float(summary.get("wall_s", elapsed)), str(summary.get("version", "?")))

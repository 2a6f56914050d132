"""kenosis_rewrite.benchmark.peers and bench --peers: the driver protocol, with stand-in peer packages
(the real peers are never dependencies of CI; tests/test_peer_outputs.py covers their outputs)."""

from __future__ import annotations

import os
import sys
import textwrap

import numpy as np
import onnx
import pytest

from kenosis_rewrite.benchmark import bench, peers
from kenosis_rewrite.cli import main as cli
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.errors import KenosisError, one_line
from kenosis_rewrite.testing import toy_models

FAKE_NNCF = '''
__version__ = "0-stand-in"

class Dataset:
    def __init__(self, items):
        self.items = list(items)

class QuantizationPreset:
    MIXED, PERFORMANCE = "mixed", "performance"

class ModelType:
    TRANSFORMER = "transformer"

def quantize(model, dataset, subset_size, preset=None, model_type=None):
    if subset_size != len(dataset.items):
        raise ValueError("subset_size must cover every feed")
    if model.graph.input[0].name == "refuse_me":
        raise RuntimeError("the stand-in refuses this model")
    from kenosis_rewrite.core.ort_quantize import quantize_with_ort
    quantized = quantize_with_ort(model, dataset.items, "default")
    quantized.doc_string = f"preset={preset} model_type={model_type}"  # what the driver asked for
    return quantized
'''


@pytest.fixture
def stand_in_nncf(tmp_path, monkeypatch):
    """An ``nncf`` package that quantizes with quantize_static, run by this interpreter as the peer's."""
    package = tmp_path / "site" / "nncf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_NNCF))
    monkeypatch.setenv("KENOSIS_PEER_NNCF_PYTHON", sys.executable)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("KENOSIS_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def no_peers_installed(tmp_path, monkeypatch):
    for name in peers.PEERS:
        monkeypatch.delenv(f"KENOSIS_PEER_{name.upper()}_PYTHON", raising=False)
    monkeypatch.setenv("KENOSIS_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)


def test_a_peer_runs_in_its_interpreter_on_every_feed(stand_in_nncf):
    model = toy_models.build("resnetish")
    feeds = toy_models.random_feeds(model, 3)
    result = peers.quantize_with_peer("nncf", model, feeds)
    assert result.version == "0-stand-in" and result.wall_s > 0
    kinds = {n.op_type for n in result.model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= kinds
    assert fidelity.compare_to_float(model, {"peer": result.model}, feeds)["peer"]["cosine"] > 0.99


def test_nncf_presets_reach_its_quantize_call_and_an_unknown_one_is_refused(stand_in_nncf):
    model = toy_models.build("conv_relu")
    feeds = toy_models.random_feeds(model, 2)
    assert peers.quantize_with_peer("nncf", model, feeds).model.doc_string == "preset=None model_type=None"
    mixed = peers.quantize_with_peer("nncf", model, feeds, preset="MIXED,TRANSFORMER")
    assert mixed.model.doc_string == "preset=mixed model_type=transformer" and mixed.preset == "MIXED,TRANSFORMER"
    with pytest.raises(peers.PeerFailedError, match="unknown NNCF preset 'FAST'"):
        peers.quantize_with_peer("nncf", model, feeds, preset="FAST")


def test_a_missing_peer_says_how_to_install_it(no_peers_installed):
    assert peers.find_python("quark") is None
    model = toy_models.build("conv_relu")
    with pytest.raises(peers.PeerNotInstalledError, match="kenosis-rewrite peers install quark"):
        peers.quantize_with_peer("quark", model, toy_models.random_feeds(model, 1))


def test_a_failing_peer_reports_its_own_error(stand_in_nncf):
    model = toy_models.build("conv_relu")
    model.graph.input[0].name = "refuse_me"
    for node in model.graph.node:
        node.input[:] = ["refuse_me" if i == "x" else i for i in node.input]
    feeds = [{"refuse_me": f["x"]} for f in toy_models.random_feeds(toy_models.build("conv_relu"), 1)]
    with pytest.raises(peers.PeerFailedError, match="the stand-in refuses this model") as raised:
        peers.quantize_with_peer("nncf", model, feeds)
    # the cause on the first line too: reports and tables keep only that (errors.one_line)
    assert "the stand-in refuses this model" in one_line(raised.value)


def test_unknown_peer_and_empty_feeds_are_refused():
    model = toy_models.build("conv_relu")
    with pytest.raises(KenosisError, match="unknown peer 'openvino'"):
        peers.quantize_with_peer("openvino", model, [])
    with pytest.raises(KenosisError, match="needs calibration feeds"):
        peers.quantize_with_peer("nncf", model, [])


def test_feeds_round_trip_through_the_driver_format(tmp_path):
    feeds = [{"a": np.arange(3, dtype=np.float32), "b": np.ones((2, 2), np.int64)} for _ in range(2)]
    peers.save_feeds(feeds, tmp_path / "f.npz")
    data = np.load(tmp_path / "f.npz")
    assert sorted(data.files) == ["0::a", "0::b", "1::a", "1::b"]
    loaded = peers.load_feeds(tmp_path / "f.npz")
    assert len(loaded) == 2 and sorted(loaded[1]) == ["a", "b"]
    np.testing.assert_array_equal(loaded[1]["b"], feeds[1]["b"])


def test_bench_puts_peers_beside_quantize_static_at_two_thread_counts(stand_in_nncf, tmp_path):
    path = tmp_path / "toy.onnx"
    onnx.save(toy_models.build("conv_relu"), path)
    result = bench.run_bench(str(path), configs=("default",), peers=("nncf", "quark:XINT8"), runs=3, warmup=1,
                             calibration_samples=2, also_threads=(2,), retries=0)
    names = [v.name for v in result.variants]
    assert names == ["fp32", "nncf", "nncf+fix", "quark:XINT8", "default", "default+fix"]
    nncf, fixed = result.variant("nncf"), result.variant("nncf+fix")
    assert nncf.error is None and nncf.build_s > 0 and nncf.latency.runs >= 3
    assert fixed.config == "nncf" and fixed.speedup_vs_unfixed is not None
    assert set(nncf.speedup_by_threads) == {2}
    assert "kenosis-rewrite peers install quark" in result.variant("quark:XINT8").error
    text = result.to_markdown()
    assert "x FP32 (2 thr)" in text and "build s" in text and "| nncf+fix |" in text


def test_cli_lists_peers_and_how_to_install_them(no_peers_installed, capsys):
    assert cli.main(["peers", "list"]) == 0
    out = capsys.readouterr().out
    for name in peers.PEERS:
        assert f"kenosis-rewrite peers install {name}" in out


def test_the_first_line_of_a_peer_failure_names_the_error_not_the_last_line():
    """INC logs its exception and returns no model; its last line ("returned no model") said nothing
    of why (malvizv1: a ShapeInferenceError, four lines up)."""
    log = ("2026-11-27 [INFO] Start auto tuning.\n"
           "2026-11-27 [ERROR] Unexpected exception ShapeInferenceError('(op_type:Reshape): 512 vs 26') happened during tuning.\n"
           "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
           "2026-11-27 [INFO] Save tuning history\n"
           "neural_compressor returned no model")
    tail = log.splitlines()[-12:]
    assert "ShapeInferenceError('(op_type:Reshape): 512 vs 26')" in peers._cause(log, tail)
    assert peers._cause("just this line", ["just this line"]) == "just this line"
    assert peers._cause("", []) == "no output"

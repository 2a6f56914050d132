"""batch.run on the local engine: the single-model result per model, failures alone, resumable, silent unless asked."""

from __future__ import annotations

import os
import sys

import onnx
import pytest

import kenosis_rewrite
from kenosis_rewrite import batch
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.errors import KenosisError
from kenosis_rewrite.testing import toy_models


@pytest.fixture(scope="module")
def qdq_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    (folder / "sub").mkdir()
    for name, path in (("conv_bn", folder / "a.onnx"), ("resnetish", folder / "sub" / "b.onnx")):
        float_model = toy_models.build(name)
        onnx.save(ort_quantize.quantize_with_ort(float_model, toy_models.random_feeds(float_model, 4), "default"), path)
    (folder / "broken.onnx").write_bytes(b"not a model")
    return folder


def test_each_model_gets_what_fix_gives_it_alone_and_a_bad_model_fails_alone(qdq_folder, tmp_path, capsys):
    out = tmp_path / "out"
    outcomes = batch.run(qdq_folder, batch.ops.fix(target="ort-cpu"), out, jobs=2)
    assert [(o.name, o.status) for o in outcomes] == [("a.onnx", "ok"), ("broken.onnx", "failed"), ("sub/b.onnx", "ok")]
    assert "not a readable ONNX model" in outcomes[1].detail
    for name in ("a.onnx", "sub/b.onnx"):
        alone = tmp_path / "alone.onnx"
        kenosis_rewrite.save(kenosis_rewrite.fix(str(qdq_folder / name), target="ort-cpu"), alone)
        assert (out / name).read_bytes() == alone.read_bytes()
    assert not (out / "broken.onnx").exists() and not (out / batch.jobs.PARTIAL_DIR).exists()
    assert capsys.readouterr().err == ""  # the Python API is silent unless asked
    assert batch.exit_code(outcomes) == 1


def test_a_rerun_skips_what_is_done_and_force_redoes_it(qdq_folder, tmp_path, capsys):
    out = tmp_path / "out"
    models = [str(qdq_folder / "a.onnx")]
    batch.run(models, batch.ops.fix(), out)
    before = os.stat(out / "a.onnx").st_mtime_ns
    seen = []
    again = batch.run(models, batch.ops.fix(), out, progress="lines", on_outcome=seen.append)
    assert [(o.name, o.status) for o in again] == [("a.onnx", "skipped")] and seen == []
    assert os.stat(out / "a.onnx").st_mtime_ns == before
    assert "[1/1] skipped 1 model(s) already done" in capsys.readouterr().err
    forced = batch.run(models, batch.ops.fix(), out, force=True, progress="lines", on_outcome=seen.append)
    assert forced[0].status == "ok" and seen == forced
    assert capsys.readouterr().err.startswith("[1/1] ok a.onnx")


def test_a_progress_bar_when_asked(qdq_folder, tmp_path, capsys):
    pytest.importorskip("tqdm")
    batch.run([str(qdq_folder / "broken.onnx")], batch.ops.fix(), tmp_path / "out", progress=True)
    err = capsys.readouterr().err
    assert "models (local)" in err and "1/1" in err and "failed broken.onnx" in err


def test_the_ray_engine_without_ray_says_how_to_install_it(qdq_folder, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(KenosisError, match=r'pip install "kenosis-rewrite\[ray\]"'):
        batch.run([str(qdq_folder / "a.onnx")], batch.ops.fix(), tmp_path / "out", engine="ray")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown engine"):
        batch.run([], batch.ops.fix(), "out", engine="dask")
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        batch.run([], batch.ops.fix(), "out", jobs=0)


def test_nothing_to_do_is_an_empty_result(tmp_path):
    assert batch.run([], batch.ops.fix(), tmp_path / "out") == []

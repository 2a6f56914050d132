"""Progress on the command line: quantize()'s stages on a bar when asked, nothing when piped."""

from __future__ import annotations

import onnx
import pytest

from kenosis_rewrite.cli import main as cli
from kenosis_rewrite.testing import toy_models


@pytest.fixture
def fp32(tmp_path):
    path = tmp_path / "fp32.onnx"
    onnx.save(toy_models.build("conv_relu"), path)
    return path


def test_quantize_shows_its_stages_when_asked_and_nothing_when_piped(fp32, tmp_path, capsys):
    pytest.importorskip("tqdm")
    assert cli.main(["quantize", str(fp32), str(tmp_path / "a.onnx"), "--samples", "2", "--progress"]) == 0
    err = capsys.readouterr().err
    for stage in ("load", "calibrate", "quantize_static", "fidelity"):
        assert stage in err
    assert "quantize: " in err and "/11 [" in err
    assert cli.main(["quantize", str(fp32), str(tmp_path / "b.onnx"), "--samples", "2"]) == 0
    assert capsys.readouterr().err.strip() == f"wrote {tmp_path / 'b.onnx'}"  # piped: no bar
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()

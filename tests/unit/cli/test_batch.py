"""The batch command line: engines, the deprecated --shard, progress lines when piped, bad command lines."""

from __future__ import annotations

import onnx
import pytest

from kenosis_rewrite.batch.ops import CommandOp
from kenosis_rewrite.cli import batch as cli_batch
from kenosis_rewrite.cli import main as cli
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.testing import toy_models


@pytest.fixture(scope="module")
def listing(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    for name, seed in (("a", 0), ("b", 1), ("c", 2)):
        float_model = toy_models.build("conv_relu", seed=seed)
        onnx.save(ort_quantize.quantize_with_ort(float_model, toy_models.random_feeds(float_model, 2), "u8s8"),
                  folder / f"{name}.onnx")
    path = folder / "models.txt"
    path.write_text("a.onnx\nb.onnx\nc.onnx\n")
    return path


def test_shard_still_works_and_says_it_is_deprecated(listing, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["fix", str(listing), str(out), "--shard", "2/2"]) == 0
    captured = capsys.readouterr()
    assert "--shard is deprecated" in captured.err and "--engine ray" in captured.err
    assert sorted(p.name for p in out.iterdir()) == ["b.onnx"]
    assert "1 ok, 0 skipped, 0 failed" in captured.out


def test_piped_progress_is_one_line_per_model_and_the_table_goes_to_stdout(listing, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["fix", str(listing), str(out), "--jobs", "2"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 3 and all(line.startswith(f"[{i}/3] ok ") for i, line in enumerate(lines, 1))
    assert all(f"wrote {out}" in line for line in lines)  # the final path, not the staging folder
    assert captured.out.splitlines()[:2] == ["| model | status | seconds | detail |", "|---|---|---|---|"]
    assert cli.main(["fix", str(listing), str(out)]) == 0
    assert "[3/3] skipped 3 model(s) already done" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--engine", "dask"], "invalid choice: 'dask'"),
    (["--shard", "3/2"], "1 <= I <= N"),
])
def test_bad_command_lines_exit_2(listing, tmp_path, capsys, argv, message):
    assert cli.main(["fix", str(listing), str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_command_op_runs_the_single_model_command_and_names_bench_outputs():
    calls = []

    def single(argv):
        calls.append(argv)
        print("kenosis-rewrite: error: refused" if argv[1] == "bad.onnx" else f"wrote {argv[2]}",
              file=__import__("sys").stderr)
        return 1 if argv[1] == "bad.onnx" else 0

    op = CommandOp(single, "fix", ("--target", "ort-cpu"))
    assert op.outputs("sub/m.onnx") == ["sub/m.onnx"]
    assert op("m.onnx", "/tmp/x.onnx") == "wrote /tmp/x.onnx"
    assert calls[-1] == ["fix", "m.onnx", "/tmp/x.onnx", "--target", "ort-cpu"]
    with pytest.raises(Exception, match="kenosis-rewrite: error: refused"):
        op("bad.onnx", "/tmp/y.onnx")
    bench = CommandOp(single, "bench", ("--runs", "5"))
    assert bench.outputs("sub/m.onnx") == ["sub/m.md", "sub/m.json"]
    assert bench.argv("m.onnx", ["m.md", "m.json"]) == ["bench", "m.onnx", "--markdown", "m.md", "--json", "m.json",
                                                       "--runs", "5"]
    assert cli_batch.BATCH_COMMANDS == ("fix", "quantize", "quantize-weights", "bench")

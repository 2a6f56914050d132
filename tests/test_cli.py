"""The kenosis-rewrite command line: outputs, messages and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx

from kenosis_rewrite.cli import main as cli
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.testing import model_checks, toy_models


def _save_quantized(tmp_path, config="sym"):
    float_model = toy_models.build("conv_relu_maxpool")
    qdq = ort_quantize.quantize_with_ort(float_model, toy_models.random_feeds(float_model, 4), config)
    path = tmp_path / "model.qdq.onnx"
    onnx.save(qdq, path)
    onnx.save(float_model, tmp_path / "model.onnx")
    return path


def test_fix_writes_a_valid_faster_model_and_a_report(tmp_path, capsys):
    source = _save_quantized(tmp_path)
    target, report = tmp_path / "fixed.onnx", tmp_path / "report.json"
    code = cli.main(["fix", str(source), str(target), "--report", "--report-json", str(report),
                     "--float-model", str(tmp_path / "model.onnx")])
    assert code == cli.EXIT_OK
    fixed = onnx.load(target)
    onnx.checker.check_model(fixed, full_check=True)
    assert model_checks.ort_optimized_op_types(fixed)["Relu"] == 0
    printed = capsys.readouterr()
    assert "relu-island-on-codes: 1 change(s)" in printed.out and "fidelity vs FP32" in printed.out
    assert "wrote" in printed.err
    data = json.loads(report.read_text())
    assert data["change_counts"]["relu-island-on-codes"] == 1


def test_refused_input_exits_1_with_a_message(tmp_path, capsys):
    float_path = tmp_path / "float.onnx"
    onnx.save(toy_models.build("conv_relu"), float_path)
    assert cli.main(["fix", str(float_path), str(tmp_path / "out.onnx")]) == cli.EXIT_REFUSED
    assert "kenosis-rewrite: error: The model has no QuantizeLinear" in capsys.readouterr().err
    assert not (tmp_path / "out.onnx").exists()


def test_usage_errors_exit_2():
    assert cli.main(["fix"]) == cli.EXIT_USAGE
    assert cli.main(["frobnicate"]) == cli.EXIT_USAGE


def test_console_entry_point_runs_as_module(tmp_path):
    source = _save_quantized(tmp_path, "default")
    result = subprocess.run(
        [sys.executable, "-m", "kenosis_rewrite", "fix", str(source), str(tmp_path / "o.onnx")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "activation-int8-to-uint8" in result.stderr


def test_profile_prints_a_per_layer_table(tmp_path, capsys):
    source = _save_quantized(tmp_path, "u8s8")
    assert cli.main(["profile", str(source), "--runs", "3"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "| layer | op | kernel now |" in out and "QLinearConv" in out and "**all heavy ops**" in out


def test_fix_optimize_for_latency_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KENOSIS_CACHE", str(tmp_path / "cache"))
    source = _save_quantized(tmp_path, "default")
    target = tmp_path / "fast.onnx"
    assert cli.main(["fix", str(source), str(target), "--optimize-for", "latency", "--latency-budget", "2",
                     "--report"]) == cli.EXIT_OK
    onnx.checker.check_model(onnx.load(target), full_check=True)
    assert "latency placement:" in capsys.readouterr().out


def test_quantize_command_self_calibrates_and_reports(tmp_path, capsys):
    source = tmp_path / "fp32.onnx"
    onnx.save(toy_models.build("resnetish"), source)
    target = tmp_path / "int8.onnx"
    assert cli.main(["quantize", str(source), str(target), "--calibration", "synthetic", "--samples", "8",
                     "--fidelity", "0.9999", "--report"]) == cli.EXIT_OK
    model = onnx.load(target)
    onnx.checker.check_model(model, full_check=True)
    assert model_checks.ort_optimized_op_types(model)["QLinearConv"] >= 1
    out = capsys.readouterr().out
    assert "calibration: synthetic (8 samples)" in out and "sensitivity:" in out


def test_fix_input_shape_pins_dims_and_folds_the_padding(tmp_path, capsys):
    float_model = toy_models.build_export("tf_same_padding")
    feeds = [{"x": np.random.default_rng(i).standard_normal([1, toy_models.C, 24, 20]).astype(np.float32)} for i in range(4)]
    source, target = tmp_path / "q.onnx", tmp_path / "pinned.onnx"
    onnx.save(ort_quantize.quantize_with_ort(float_model, feeds), source)
    assert cli.main(["fix", str(source), str(target), "--input-shape", f"x=1,{toy_models.C},24,20", "--report"]) == cli.EXIT_OK
    pinned = onnx.load(target)
    assert [d.dim_value for d in pinned.graph.input[0].type.tensor_type.shape.dim] == [1, toy_models.C, 24, 20]
    assert model_checks.op_types(pinned)["Shape"] == 0
    assert "pin-input-shapes" in capsys.readouterr().out
    assert cli.main(["fix", str(source), str(target), "--input-shape", "x=1,a"]) == cli.EXIT_REFUSED
    assert "expected NAME=D,D" in capsys.readouterr().err

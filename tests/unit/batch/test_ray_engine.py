"""The Ray engine on a real local Ray cluster of 2 worker CPUs (skipped without the ``ray`` extra; CI installs it).

One Ray instance serves the module: ``batch.run`` and the command line find it initialised and use it.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import onnx
import pytest

ray = pytest.importorskip("ray")

from kenosis_rewrite import batch  # noqa: E402
from kenosis_rewrite.cli import main as cli  # noqa: E402
from kenosis_rewrite.testing import toy_models  # noqa: E402

# the ops below are defined here: Ray ships them to its workers by value, not by import
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@dataclasses.dataclass(frozen=True)
class DiesOnce:
    """Copies the model, but the first attempt on each model kills its worker process (a marker file remembers)."""

    markers: str

    def __call__(self, model: str, output: str) -> str:
        marker = os.path.join(self.markers, os.path.basename(model) + ".died")
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # the worker dies mid-job, as when killed or out of memory
        with open(model, "rb") as source, open(output, "wb") as target:
            target.write(source.read())
        return f"attempt {len(os.listdir(self.markers))}"


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp32")
    onnx.save(toy_models.build("conv_relu"), folder / "a.onnx")
    (folder / "sub").mkdir()
    onnx.save(toy_models.build("conv_add_relu", seed=1), folder / "sub" / "b.onnx")
    (folder / "broken.onnx").write_bytes(b"not a model")
    return folder


def test_quantize_on_ray_writes_the_bytes_the_local_engine_writes_and_a_bad_model_fails_alone(float_folder, tmp_path,
                                                                                              capsys):
    outputs = {}
    for engine in ("local", "ray"):
        out = tmp_path / engine
        assert cli.main(["quantize", str(float_folder), str(out), "--engine", engine, "--jobs", "2",
                         "--samples", "4", "--no-progress"]) == 1
        table = capsys.readouterr().out
        assert "| a.onnx | ok |" in table and "| sub/b.onnx | ok |" in table
        assert "| broken.onnx | failed |" in table and "not a readable ONNX model" in table
        outputs[engine] = {name: (out / name).read_bytes() for name in ("a.onnx", "sub/b.onnx")}
        assert not (out / "broken.onnx").exists()
    assert outputs["ray"] == outputs["local"]
    ops = [node.op_type for node in onnx.load_from_string(outputs["ray"]["a.onnx"]).graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops


def test_a_worker_killed_mid_job_is_retried(float_folder, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    models = [str(float_folder / "a.onnx"), str(float_folder / "sub" / "b.onnx")]
    outcomes = batch.run(models, DiesOnce(str(markers)), tmp_path / "out", engine="ray", max_retries=2)
    assert [(o.name, o.status) for o in outcomes] == [("a.onnx", "ok"), ("b.onnx", "ok")]
    assert sorted(os.listdir(markers)) == ["a.onnx.died", "b.onnx.died"]  # each died once, then ran again
    assert (tmp_path / "out" / "a.onnx").read_bytes() == (float_folder / "a.onnx").read_bytes()


def test_a_worker_that_dies_past_its_retries_fails_its_model_alone(float_folder, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    (markers / "b.onnx.died").touch()  # b already died once: only a dies now
    models = [str(float_folder / "a.onnx"), str(float_folder / "sub" / "b.onnx")]
    outcomes = batch.run(models, DiesOnce(str(markers)), tmp_path / "out", engine="ray", max_retries=0, jobs=1)
    assert [(o.name, o.status) for o in outcomes] == [("a.onnx", "failed"), ("b.onnx", "ok")]
    assert outcomes[0].detail.startswith("worker lost (0 retries)")
    assert not (tmp_path / "out" / "a.onnx").exists()


def test_another_process_runs_the_batch_on_this_cluster_by_its_address(float_folder, tmp_path):
    """``--ray-address``: a separate command line connects to a running cluster (here the module's)."""
    import subprocess

    from kenosis_rewrite.core.ort_quantize import quantize_with_ort

    qdq = tmp_path / "qdq"
    qdq.mkdir()
    model = onnx.load(float_folder / "a.onnx")
    onnx.save(quantize_with_ort(model, toy_models.random_feeds(model, 4)), qdq / "a.onnx")
    out = tmp_path / "by_address"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "CI": "true"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-m", "kenosis_rewrite", "fix", str(qdq), str(out), "--engine", "ray",
         "--ray-address", ray.get_runtime_context().gcs_address, "--no-guard", "--no-progress"],
        capture_output=True, text=True, timeout=240, env=env, stdin=subprocess.DEVNULL, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| a.onnx | ok |" in done.stdout
    local = tmp_path / "local"
    assert cli.main(["fix", str(qdq), str(local), "--engine", "local", "--no-guard", "--no-progress"]) == 0
    assert (out / "a.onnx").read_bytes() == (local / "a.onnx").read_bytes()

"""Models over 2 GB (external data) and many models at once, kept small by lowering the size limits.

``model_io.LARGE_MODEL_BYTES`` (beyond it no ModelProto can hold the model) and ``model_io.LAZY_LOAD_BYTES``
(beyond it a path is read lazily, memory-mapped) are lowered to a few KiB, so a 100 KiB model takes
the same code path as a 3 GB one. Gathering external data into a protobuf is made to fail, so a test
passes only if no step holds the whole model in one ModelProto.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kenosis_rewrite
from kenosis_rewrite.cli import batch
from kenosis_rewrite.cli import main as cli
from kenosis_rewrite.core import model_io
from kenosis_rewrite.errors import ModelTooLargeError
from kenosis_rewrite.weight_only import weights

HIDDEN, LAYERS = 64, 3


def _mlp(layers: int = LAYERS, hidden: int = HIDDEN, seed: int = 0) -> onnx.ModelProto:
    """``MatMul -> Add -> Relu`` blocks on ``x[1, 2, hidden]`` (opset 21), with metadata to keep."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits += [onnx.numpy_helper.from_array((rng.standard_normal((hidden, hidden)) / 8).astype(np.float32), f"w{i}"),
                  onnx.numpy_helper.from_array((rng.standard_normal(hidden) / 100).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"], name=f"layer{i}/MatMul"),
                  helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"add{i}"], name=f"layer{i}/Add"),
                  helper.make_node("Relu", [f"add{i}"], [f"y{i}"], name=f"layer{i}/Relu")]
        x = f"y{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 2, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], producer_name="scale-test")
    model.ir_version = 10
    helper.set_model_props(model, {"origin": "tests/test_scale.py"})
    return model


def _proto(model) -> onnx.ModelProto:
    return ir.serde.serialize_model(model) if isinstance(model, ir.Model) else model


def _save_external(model: onnx.ModelProto, path) -> str:
    onnx.save(copy.deepcopy(model), path, save_as_external_data=True, location=os.path.basename(path) + ".data",
              size_threshold=0)  # (onnx.save moves the data of the proto it is given out of it)
    return str(path)


@pytest.fixture
def large(monkeypatch):
    """Every model over 4 KiB counts as over 2 GB, and external data may not be gathered into a proto."""
    _lower_limits(monkeypatch)


def _lower_limits(monkeypatch) -> None:
    monkeypatch.setattr(model_io, "LARGE_MODEL_BYTES", 4096)
    monkeypatch.setattr(model_io, "LAZY_LOAD_BYTES", 4096)

    def refuse(*_args, **_kwargs):
        raise AssertionError("a large model's external data was read into one protobuf")

    monkeypatch.setattr(onnx, "load_external_data_for_model", refuse)


def _run(path_or_model, x: np.ndarray) -> np.ndarray:
    source = path_or_model if isinstance(path_or_model, str) else path_or_model.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _optimized_ops(path: str, tmp_path) -> list[str]:
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return [node.op_type for node in onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node]


X = np.random.default_rng(1).standard_normal((1, 2, HIDDEN)).astype(np.float32)


def test_quantize_weights_of_a_large_path_streams_and_matches_the_in_memory_result(tmp_path, large):
    float_model = _mlp()
    expected = _proto(weights.quantize_weights(float_model, bits=4, block_size=32))  # from memory
    path = _save_external(float_model, tmp_path / "big.onnx")
    quantized = weights.quantize_weights(path, bits=4, block_size=32)
    assert isinstance(quantized, ir.Model)  # over the (lowered) protobuf limit: an onnx_ir.Model, not a proto
    out = str(tmp_path / "out" / "q.onnx")
    os.makedirs(os.path.dirname(out))
    kenosis_rewrite.save(quantized, out)
    assert os.path.getsize(out + ".data") > 0
    onnx.checker.check_model(out, full_check=True)
    saved = onnx.load(out, load_external_data=False)
    assert [n.op_type for n in saved.graph.node] == [n.op_type for n in expected.graph.node]
    assert [n.op_type for n in saved.graph.node].count("DequantizeLinear") == LAYERS
    assert {p.key: p.value for p in saved.metadata_props} == {"origin": "tests/test_scale.py"}
    np.testing.assert_array_equal(_run(out, X), _run(expected, X))  # bit for bit the same weights
    assert _optimized_ops(out, tmp_path).count("MatMulNBits") == LAYERS
    assert not os.path.exists(tmp_path / "q.onnx")  # the input's folder is untouched


def test_fix_and_explain_of_a_large_qdq_path(tmp_path, large):
    qdq = _proto(weights.quantize_weights(_mlp(), bits=4, block_size=32))
    path = _save_external(qdq, tmp_path / "qdq.onnx")
    fixed, report = kenosis_rewrite.fix(path, return_report=True)
    assert isinstance(fixed, ir.Model)
    assert any("larger than 2 GB" in note for note in report.notes)
    out = str(tmp_path / "fixed.onnx")
    kenosis_rewrite.save(fixed, out)
    onnx.checker.check_model(out, full_check=True)
    saved = onnx.load(out, load_external_data=False)
    assert {p.key: p.value for p in saved.metadata_props} == {"origin": "tests/test_scale.py"}
    assert [(o.domain, o.version) for o in saved.opset_import] == [(o.domain, o.version) for o in qdq.opset_import]
    np.testing.assert_array_equal(_run(out, X), _run(qdq, X))
    explained = kenosis_rewrite.explain(path)
    assert len(explained.ops) == LAYERS


def test_a_large_model_in_memory_is_returned_as_onnx_ir_and_checked_without_data(monkeypatch):
    monkeypatch.setattr(model_io, "LARGE_MODEL_BYTES", 4096)
    model = weights.quantize_weights(_mlp(), bits=4, block_size=32)
    assert isinstance(model, ir.Model)  # a ModelProto in, but over the (lowered) limit: onnx_ir out
    fixed = kenosis_rewrite.fix(model)
    assert isinstance(fixed, ir.Model) and fixed is not model
    np.testing.assert_array_equal(_run(ir.serde.serialize_model(fixed), X), _run(ir.serde.serialize_model(model), X))


def test_quantize_refuses_a_large_model_with_a_typed_error(tmp_path, large):
    path = _save_external(_mlp(), tmp_path / "big.onnx")
    with pytest.raises(ModelTooLargeError, match="quantize_weights"):
        kenosis_rewrite.quantize(path)


def test_fix_leaves_a_matmul_nbits_model_unchanged_with_a_note():
    fused = weights.quantize_weights(_mlp(), bits=4, block_size=32, form="matmul_nbits")
    fixed, report = kenosis_rewrite.fix(fused, return_report=True)
    assert any("MatMulNBits" in note and "unchanged" in note for note in report.notes)
    assert fixed.graph == fused.graph
    assert not report.change_counts()


def test_save_refuses_to_overwrite_the_weights_it_reads(tmp_path, large):
    path = _save_external(_mlp(), tmp_path / "big.onnx")
    model = ir.load(path)
    with pytest.raises(kenosis_rewrite.KenosisError, match="overwrite"):
        kenosis_rewrite.save(model, path)


def _folder(tmp_path) -> str:
    folder = tmp_path / "models"
    (folder / "sub").mkdir(parents=True)
    onnx.save(_mlp(seed=1), folder / "a.onnx")
    onnx.save(_mlp(seed=2), folder / "sub" / "b.onnx")
    (folder / "broken.onnx").write_bytes(b"not a model")
    return str(folder)


def test_batch_reports_failures_without_stopping_and_resumes(tmp_path, capsys):
    models, out = _folder(tmp_path), str(tmp_path / "out")
    argv = ["quantize-weights", models, out, "--rtn", "--jobs", "2"]
    assert cli.main(argv) == 1  # one model failed
    table = capsys.readouterr().out
    assert "| a.onnx | ok |" in table and "| sub/b.onnx | ok |" in table
    assert "| broken.onnx | failed |" in table and "not a readable ONNX model" in table
    for name in ("a.onnx", "sub/b.onnx"):
        ops = [n.op_type for n in onnx.load(os.path.join(out, name)).graph.node]
        assert ops.count("DequantizeLinear") == LAYERS
    assert not os.path.exists(os.path.join(out, "broken.onnx"))
    assert not os.path.exists(os.path.join(out, batch._PARTIAL_DIR))
    before = os.path.getmtime(os.path.join(out, "a.onnx"))
    assert cli.main(argv) == 1  # resumed: the two done are skipped, the broken one fails again
    table = capsys.readouterr().out
    assert "| a.onnx | skipped |" in table and "| broken.onnx | failed |" in table
    assert os.path.getmtime(os.path.join(out, "a.onnx")) == before


def test_batch_shards_and_list_files(tmp_path, capsys):
    models = _folder(tmp_path)
    listing = tmp_path / "models.txt"
    listing.write_text("# two of them\nmodels/a.onnx\nmodels/sub/b.onnx\n")
    names = [name for _, name in batch.list_models(str(listing))]
    assert names == ["a.onnx", "b.onnx"]
    shards = [[name for _, name in batch._shard(batch.list_models(models), f"{i}/2")] for i in (1, 2)]
    assert sorted(shards[0] + shards[1]) == sorted(name for _, name in batch.list_models(models))
    assert not set(shards[0]) & set(shards[1])
    out = str(tmp_path / "out")
    assert cli.main(["quantize-weights", str(listing), out, "--rtn", "--shard", "2/2"]) == 0
    assert sorted(os.listdir(out)) == ["b.onnx"]
    assert "1 ok, 0 skipped, 0 failed" in capsys.readouterr().out
    assert cli.main(["quantize-weights", str(listing), out, "--shard", "3/2"]) == 2


def test_a_lazily_read_path_under_2_gb_still_gives_a_model_proto(tmp_path, monkeypatch):
    monkeypatch.setattr(model_io, "LAZY_LOAD_BYTES", 4096)  # read lazily, but small enough for one protobuf
    qdq = _proto(weights.quantize_weights(_mlp(), bits=4, block_size=32))
    path = _save_external(qdq, tmp_path / "qdq.onnx")
    fixed, report = kenosis_rewrite.fix(path, return_report=True)
    assert isinstance(fixed, onnx.ModelProto)
    assert not any("guard did not run" in note for note in report.notes)  # small: the guard ran
    np.testing.assert_array_equal(_run(fixed, X), _run(qdq, X))
    quantized = kenosis_rewrite.quantize_weights(_save_external(_mlp(), tmp_path / "f.onnx"), bits=4)
    assert isinstance(quantized, onnx.ModelProto)
    np.testing.assert_array_equal(_run(quantized, X), _run(qdq, X))


def test_fix_of_a_large_int8_cnn_path_rewrites_like_the_in_memory_fix(tmp_path, monkeypatch):
    from kenosis_rewrite.core import ort_quantize  # noqa: PLC0415
    from kenosis_rewrite.testing import toy_models

    float_model = toy_models.build("resnetish")
    feeds = toy_models.random_feeds(float_model, 4)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds, "default")
    expected, expected_report = kenosis_rewrite.fix(qdq, verify=False, return_report=True)
    assert expected_report.change_counts()  # the rules do change this model
    expected = _proto(expected)
    path = _save_external(qdq, tmp_path / "m.onnx")
    _lower_limits(monkeypatch)
    before = {name: os.path.getmtime(tmp_path / name) for name in os.listdir(tmp_path)}
    fixed, report = kenosis_rewrite.fix(path, return_report=True)
    assert report.change_counts() == expected_report.change_counts()
    assert isinstance(fixed, ir.Model)
    out = str(tmp_path / "out.onnx")
    kenosis_rewrite.save(fixed, out)
    onnx.checker.check_model(out, full_check=True)
    assert [n.op_type for n in onnx.load(out, load_external_data=False).graph.node] == \
        [n.op_type for n in expected.graph.node]
    session = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(expected.SerializeToString(), providers=["CPUExecutionProvider"])
    for feed in feeds:
        for got, want in zip(session.run(None, feed), reference.run(None, feed)):
            np.testing.assert_array_equal(got, want)
    assert {name: os.path.getmtime(tmp_path / name) for name in before} == before  # the input untouched


def test_bench_and_profile_refuse_a_large_path_with_a_typed_error(tmp_path, large, capsys):
    path = _save_external(_mlp(), tmp_path / "big.onnx")
    assert cli.main(["profile", path]) == 1
    assert cli.main(["bench", path, "--runs", "1"]) == 1
    assert capsys.readouterr().err.count("over 2 GB") == 2

"""Float16 models through quantize() and fix(), end to end.

quantize() of a float16 CNN: the caller's float16 interface kept, every weighted op an integer
kernel, outputs float16 and close to the float16 model's on held-out feeds (ORT), the checker's
full_check passed; float16 or float32 calibration feeds, any opset (the float16 graph at opset 13
failed onnx shape inference inside quantize_static before). fix() of quantize_static's own output
for a float16 model (float16 scales, opset 21): fused, float16 out, close to its input.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto

import kenosis_rewrite
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.ort_quantize import quantize_with_ort
from kenosis_rewrite.testing import toy_models
from kenosis_rewrite.testing.float16_models import float16_feeds, float16_model

HALF = TensorProto.FLOAT16
WEIGHTED = ("Conv", "Gemm")


@pytest.fixture(scope="module")
def cnn16() -> onnx.ModelProto:
    """Conv/Relu/MaxPool/residual Add/GlobalAveragePool/Gemm, every float tensor float16 (opset 17)."""
    return float16_model(toy_models.build("resnetish"))


def _feeds(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    return float16_feeds(toy_models.random_feeds(toy_models.build("resnetish"), n, seed=seed))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _check_quantized(given: onnx.ModelProto, quantized: onnx.ModelProto, min_cosine: float = 0.99) -> None:
    """The interface of ``given``, Q/DQ around every weighted op, all fused, close on held-out feeds."""
    onnx.checker.check_model(quantized, full_check=True)
    assert [(v.name, v.type) for v in quantized.graph.input] == [(v.name, v.type) for v in given.graph.input]
    assert [(v.name, v.type.tensor_type.elem_type) for v in quantized.graph.output] == [
        (v.name, HALF) for v in given.graph.output]
    producers = {o: n for n in quantized.graph.node for o in n.output}
    weighted = [n for n in quantized.graph.node if n.op_type in WEIGHTED]
    assert len(weighted) == sum(n.op_type in WEIGHTED for n in given.graph.node)
    for node in weighted:  # input and weight dequantized
        assert [producers[name].op_type for name in node.input[:2]] == ["DequantizeLinear"] * 2, node.name
    assert kenosis_rewrite.explain(quantized).integer_mac_fraction == 1.0
    theirs, ours = fidelity.session(given), fidelity.session(quantized)
    for feed in _feeds(8, seed=100):
        expected, got = theirs.run(None, feed)[0], ours.run(None, feed)[0]
        assert got.dtype == np.float16 and _cosine(got, expected) >= min_cosine


def test_quantize_float16_cnn_with_float16_feeds(cnn16):
    quantized, report = kenosis_rewrite.quantize(cnn16, calibration=_feeds(16, seed=1), return_report=True)
    _check_quantized(cnn16, quantized)
    assert any(note.startswith("float16 graph quantized in float32") for note in report.notes)
    assert report.fidelity["quantized"]["cosine"] >= 0.99


def test_quantize_float16_at_opset_13_self_calibrated_returns_the_kind_given(cnn16):
    """quantize_static writes float16 scales for a float16 graph, which opset 13 does not allow:
    onnx's InferenceError before; the float32 graph quantizes. An onnx_ir.Model comes back as one."""
    old = onnx.ModelProto()
    old.CopyFrom(cnn16)
    old.opset_import[0].version = 13
    quantized = kenosis_rewrite.quantize(ir.serde.deserialize_model(old))
    assert isinstance(quantized, ir.Model)
    _check_quantized(old, ir.serde.serialize_model(quantized), min_cosine=0.98)


def test_quantize_float16_accepts_float32_feeds_and_hands_the_metric_float16_models(cnn16):
    seen = []

    def metric(model: onnx.ModelProto) -> float:
        seen.append(model.graph.input[0].type.tensor_type.elem_type)
        fidelity.session(model).run(None, _feeds(1, seed=3)[0])  # the caller's float16 feeds run
        return 1.0

    feeds32 = toy_models.random_feeds(toy_models.build("resnetish"), 16, seed=2)
    quantized = kenosis_rewrite.quantize(cnn16, calibration=feeds32, validate=metric, max_drop=0.1)
    _check_quantized(cnn16, quantized)
    assert seen and set(seen) == {HALF}


def test_fix_of_quantize_static_on_a_float16_model(cnn16):
    """onnxruntime's quantize_static on the float16 graph (opset 21): float16 scales, nothing fused."""
    given = onnx.version_converter.convert_version(cnn16, 21)
    qdq = quantize_with_ort(given, _feeds(8, seed=4), per_channel=True)
    scales = [t for t in qdq.graph.initializer if t.name.endswith("_scale")]
    assert scales and all(t.data_type == HALF for t in scales)
    assert kenosis_rewrite.explain(qdq).integer_mac_fraction == 0.0
    fixed, report = kenosis_rewrite.fix(qdq, return_report=True)
    onnx.checker.check_model(fixed, full_check=True)
    assert kenosis_rewrite.explain(fixed).integer_mac_fraction == 1.0
    assert [v.type.tensor_type.elem_type for v in fixed.graph.output] == [HALF]
    before, after = fidelity.session(qdq), fidelity.session(fixed)
    for feed in _feeds(4, seed=9):
        expected, got = before.run(None, feed)[0], after.run(None, feed)[0]
        assert got.dtype == np.float16 and _cosine(got, expected) >= 0.999

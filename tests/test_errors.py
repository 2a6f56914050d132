"""Bad input gets a clear, typed KenosisError, never a deep traceback or a broken model."""

from __future__ import annotations

import onnx
import pytest
from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic

import kenosis_rewrite
from kenosis_rewrite import ort_quantize, toy_models


def test_missing_file(tmp_path):
    with pytest.raises(kenosis_rewrite.NotAnOnnxModelError, match="does not exist"):
        kenosis_rewrite.fix(tmp_path / "nope.onnx")


def test_not_an_onnx_file(tmp_path):
    path = tmp_path / "photo.onnx"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    with pytest.raises(kenosis_rewrite.NotAnOnnxModelError):
        kenosis_rewrite.fix(path)


def test_wrong_python_type():
    with pytest.raises(kenosis_rewrite.NotAnOnnxModelError, match="got int"):
        kenosis_rewrite.fix(42)


def test_float_model_has_nothing_to_fix():
    with pytest.raises(kenosis_rewrite.NoQDQError, match="not QDQ-quantized"):
        kenosis_rewrite.fix(toy_models.build("conv_relu"))


def test_qoperator_format_is_refused():
    float_model = toy_models.build("conv_relu")
    qop = ort_quantize.quantize_with_ort(
        float_model, toy_models.random_feeds(float_model, 2), "u8s8", quant_format=QuantFormat.QOperator
    )
    with pytest.raises(kenosis_rewrite.QOperatorFormatError, match="QLinearConv"):
        kenosis_rewrite.fix(qop)


@pytest.mark.parametrize("form", ["qdq", "qoperator", "dynamic-conv", "dynamic-matmul"])
def test_quantize_and_prepare_refuse_a_quantized_model(form, tmp_path):
    """quantize() of a dynamic model failed inside quantize_static (KeyError: 'relu_13_scale', as on
    ddddocr 1.6.1's common_old.onnx), of a QDQ one inside onnx_ir, and a QOperator one came back
    unchanged: each is refused up front, naming its quantized ops and what to pass instead."""
    float_model = toy_models.build("matmul_relu" if form == "dynamic-matmul" else "conv_relu")
    feeds = toy_models.random_feeds(float_model, 2)
    if form.startswith("dynamic"):
        onnx.save(float_model, tmp_path / "float.onnx")
        quantize_dynamic(tmp_path / "float.onnx", tmp_path / "dynamic.onnx", weight_type=QuantType.QUInt8)
        quantized = onnx.load(tmp_path / "dynamic.onnx")
        named = "ConvInteger" if form == "dynamic-conv" else "MatMulInteger"
    else:
        quantized = ort_quantize.quantize_with_ort(
            float_model, feeds, "u8s8", quant_format=QuantFormat.QDQ if form == "qdq" else QuantFormat.QOperator)
        named = "DequantizeLinear" if form == "qdq" else "QLinearConv"
    before = quantized.SerializeToString()
    for call, caller in ((lambda: kenosis_rewrite.quantize(quantized, calibration=feeds), "quantize()"),
                         (lambda: kenosis_rewrite.prepare(quantized, feeds), "prepare()")):
        with pytest.raises(kenosis_rewrite.AlreadyQuantizedError, match=rf"{caller[:-2]}\(\) takes an FP32 model.*\d+ {named}") as raised:
            call()
        assert ("kenosis_rewrite.fix()" in str(raised.value)) == (form == "qdq")
    assert quantized.SerializeToString() == before
    kenosis_rewrite.quantize(float_model, calibration=feeds)  # the FP32 model it came from is accepted


def test_old_opset_is_refused():
    model = onnx.parser.parse_model("""
    <ir_version: 4, opset_import: ["" : 9]>
    g (float[2] x) => (float[2] y) { y = Relu(x) }""")
    with pytest.raises(kenosis_rewrite.UnsupportedOpsetError, match="opset 9"):
        kenosis_rewrite.fix(model)


def test_invalid_graph_is_refused():
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2] x) => (float[2] y) { y = Relu(undefined_tensor) }""")
    with pytest.raises(kenosis_rewrite.InvalidModelError, match="fails the ONNX checker"):
        kenosis_rewrite.fix(model)


def test_every_error_is_a_kenosis_error():
    for name in ("NotAnOnnxModelError", "InvalidModelError", "AlreadyQuantizedError", "NoQDQError", "QOperatorFormatError",
                 "UnsupportedOpsetError", "ModelTooLargeError", "UnsupportedTargetError", "ZooError",
                 "RuntimeMeasurementError", "RewriteError"):
        assert issubclass(getattr(kenosis_rewrite, name), kenosis_rewrite.KenosisError)

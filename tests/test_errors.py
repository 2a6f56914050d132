"""Bad input gets a clear, typed KenosisError, never a deep traceback or a broken model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic

import kenosis_rewrite
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.testing import toy_models


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


def test_a_dynamic_conv_model_is_refused_as_dynamic_with_what_to_do(tmp_path):
    """quantize_dynamic (and Quark's UINT8_DYNAMIC_QUANT) write ConvInteger: not the QOperator format
    the message used to name, but a model whose Convs quantize their inputs at run time."""
    onnx.save(toy_models.build("conv_relu"), tmp_path / "float.onnx")
    quantize_dynamic(tmp_path / "float.onnx", tmp_path / "dynamic.onnx", weight_type=QuantType.QUInt8)
    with pytest.raises(kenosis_rewrite.QOperatorFormatError, match=r"dynamically quantized \(ConvInteger.*kenosis_rewrite.quantize"):
        kenosis_rewrite.fix(onnx.load(tmp_path / "dynamic.onnx"))


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
        # fix() has no placement to change in a dynamic model: not advised there
        assert ("at run time" in str(raised.value)) == form.startswith("dynamic")
    assert quantized.SerializeToString() == before
    kenosis_rewrite.quantize(float_model, calibration=feeds)  # the FP32 model it came from is accepted


def _conv_in_if_branches(conv_outside: bool) -> onnx.ModelProto:
    """y = If(flag, Conv(x) + 1, Conv(x) - 1), the Convs inside the branches; with ``conv_outside``,
    x goes through a Conv of the main graph first."""
    rng = np.random.default_rng(0)
    weights = onnx.numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    inner = onnx.numpy_helper.from_array(rng.standard_normal((4, 4 if conv_outside else 3, 3, 3)).astype(np.float32), "wi")
    one = onnx.numpy_helper.from_array(np.ones((1,), np.float32), "one")

    def branch(op: str) -> onnx.GraphProto:
        return onnx.helper.make_graph(
            [onnx.helper.make_node("Conv", ["h", "wi"], [f"c_{op}"], pads=[1, 1, 1, 1]),
             onnx.helper.make_node(op, [f"c_{op}", "one"], [f"y_{op}"])],
            f"branch_{op}", [], [onnx.helper.make_tensor_value_info(f"y_{op}", onnx.TensorProto.FLOAT, [1, 4, 8, 8])])

    nodes = [onnx.helper.make_node("Conv", ["x", "w"], ["h"], pads=[1, 1, 1, 1]) if conv_outside
             else onnx.helper.make_node("Identity", ["x"], ["h"]),
             onnx.helper.make_node("If", ["flag"], ["y"], name="branches", then_branch=branch("Add"), else_branch=branch("Sub"))]
    graph = onnx.helper.make_graph(
        nodes, "conv_in_if",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8]),
         onnx.helper.make_tensor_value_info("flag", onnx.TensorProto.BOOL, [])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 8, 8])],
        [weights, inner, one])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_quantize_refuses_a_model_whose_layers_are_all_inside_control_flow():
    """quantize_static quantizes the main graph only: a model whose Convs are all in If branches
    (Silero VAD 6.2.3) came back as the FP32 model, reported as "no changes" and cosine 1.0."""
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.uniform(0, 1, (1, 3, 8, 8)).astype(np.float32), "flag": np.array(i % 2 == 0)} for i in range(4)]
    with pytest.raises(kenosis_rewrite.ControlFlowError, match=r"2 Conv are inside the bodies of 'branches'.*Export"):
        kenosis_rewrite.quantize(_conv_in_if_branches(conv_outside=False), calibration=feeds)
    # a main-graph Conv is quantized; the report names the branch Convs left FP32
    model, report = kenosis_rewrite.quantize(_conv_in_if_branches(conv_outside=True), calibration=feeds,
                                             return_report=True)
    assert any(node.op_type == "QuantizeLinear" for node in model.graph.node)
    assert any("2 Conv inside the bodies of 'branches' stay FP32" in note for note in report.notes)
    assert report.fidelity["quantized"]["cosine"] > 0.99


def test_old_opset_is_refused():
    model = onnx.parser.parse_model("""
    <ir_version: 4, opset_import: ["" : 9]>
    g (float[2] x) => (float[2] y) { y = Relu(x) }""")
    with pytest.raises(kenosis_rewrite.UnsupportedOpsetError, match="opset 9"):
        kenosis_rewrite.fix(model)


def test_per_channel_qdq_below_opset_13_is_refused_with_what_to_do_then_upgraded_by_fix():
    """quantize_static(per_channel=True) on an opset-12 model writes DequantizeLinear(axis=...), which
    opset 12 does not have (ddddocr 1.6.1 common.onnx): the checker's refusal alone said nothing of why.
    Loading it still says why; fix() converts it to opset 13 and goes on (tests/unit/placement/test_opset_upgrade.py)."""
    from kenosis_rewrite.core import model_io  # noqa: PLC0415

    float_model = toy_models.build("conv_relu")
    qdq = ort_quantize.quantize_with_ort(float_model, toy_models.random_feeds(float_model, 2), "u8s8", per_channel=True)
    assert any(a.name == "axis" for n in qdq.graph.node if n.op_type == "DequantizeLinear" for a in n.attribute)
    for opset in qdq.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = 12
    with pytest.raises(kenosis_rewrite.InvalidModelError, match=r"need opset 13.*imports opset 12.*per_channel=False"):
        model_io.load(qdq)
    fixed, report = kenosis_rewrite.fix(qdq, return_report=True)
    assert [o.version for o in fixed.opset_import if o.domain == ""] == [13]
    assert any(note.startswith("opset 12 -> 13") for note in report.notes)


def test_invalid_graph_is_refused():
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2] x) => (float[2] y) { y = Relu(undefined_tensor) }""")
    with pytest.raises(kenosis_rewrite.InvalidModelError, match="fails the ONNX checker"):
        kenosis_rewrite.fix(model)


def test_every_error_is_a_kenosis_error():
    for name in ("NotAnOnnxModelError", "InvalidModelError", "AlreadyQuantizedError", "ControlFlowError", "NoQDQError",
                 "QOperatorFormatError", "UnsupportedOpsetError", "ModelTooLargeError", "UnsupportedTargetError", "ZooError",
                 "RuntimeMeasurementError", "RewriteError"):
        assert issubclass(getattr(kenosis_rewrite, name), kenosis_rewrite.KenosisError)


def test_fix_refuses_an_input_that_fails_full_check_and_onnxruntime_alike():
    """quantize_static of a float16 model (slovorez 0.1.0) writes float16 scales at an opset whose
    QuantizeLinear/DequantizeLinear take float32 only: the checker's full check and ONNX Runtime both
    refuse it. fix() returned a model failing the checker; it now raises InvalidModelError."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]), helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
             helper.make_node("Relu", ["d"], ["y"])]
    inits = [onnx.numpy_helper.from_array(np.array(0.1, np.float16), "s"), onnx.numpy_helper.from_array(np.array(128, np.uint8), "z")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 2, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 2, 4, 4])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(proto)  # the plain check passes
    with pytest.raises(kenosis_rewrite.InvalidModelError, match="full_check.*ONNX Runtime refuses to load it"):
        kenosis_rewrite.fix(proto)


def _zipmap_classifier(quantized: bool) -> onnx.ModelProto:
    """MatMul -> Softmax -> ZipMap, as skl2onnx writes a classifier's probabilities by default: an
    output of type seq(map(int64, tensor(float))), which ONNX Runtime runs and onnx_ir cannot hold."""
    from onnx import TensorProto, helper, numpy_helper  # noqa: PLC0415

    rng = np.random.default_rng(0)
    weights = rng.standard_normal((4, 3)).astype(np.float32)
    if quantized:
        initializers = [numpy_helper.from_array(np.clip(np.round(weights / 0.02), -127, 127).astype(np.int8), "Wq"),
                        numpy_helper.from_array(np.array(0.02, np.float32), "s"),
                        numpy_helper.from_array(np.array(0, np.int8), "z")]
        front = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
                 helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
                 helper.make_node("DequantizeLinear", ["Wq", "s", "z"], ["W"]),
                 helper.make_node("MatMul", ["xd", "W"], ["y"])]
    else:
        initializers = [numpy_helper.from_array(weights, "W")]
        front = [helper.make_node("MatMul", ["x", "W"], ["y"])]
    probabilities = helper.make_sequence_type_proto(
        helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, None)))
    graph = helper.make_graph(
        [*front, helper.make_node("Softmax", ["y"], ["p"], axis=1),
         helper.make_node("ZipMap", ["p"], ["probabilities"], domain="ai.onnx.ml", classlabels_int64s=[0, 1, 2])],
        "classifier", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 3]), helper.make_value_info("probabilities", probabilities)],
        initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("call", ["quantize", "prepare", "fix"])
def test_a_zipmap_output_is_a_typed_error_that_says_what_to_do(call):
    """luscinia 1.0.0's LightGBM classifier (onnxmltools), and every skl2onnx classifier by default:
    onnx_ir's SerdeError came out of quantize(), prepare() and fix()."""
    model = _zipmap_classifier(quantized=call == "fix")
    feeds = [{"x": np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32)} for i in range(4)]
    function = {"quantize": lambda: kenosis_rewrite.quantize(model, calibration=feeds),
                "prepare": lambda: kenosis_rewrite.prepare(model, feeds),
                "fix": lambda: kenosis_rewrite.fix(model)}[call]
    with pytest.raises(kenosis_rewrite.UnsupportedValueTypeError,
                       match=r"probabilities \(seq\(map\(int64, tensor\(float32\)\)\)\).*zipmap"):
        function()


@pytest.mark.parametrize("entry", ["fix", "explain", "quantize"])
def test_external_data_outside_the_model_folder_is_a_kenosis_error_naming_the_tensor(tmp_path, entry):
    float_model = toy_models.build("conv_relu")
    model = ort_quantize.quantize_with_ort(float_model, toy_models.random_feeds(float_model, 2), "u8s8")
    if entry == "quantize":
        model = float_model
    (tmp_path / "sub").mkdir()
    onnx.save(model, tmp_path / "sub" / "m.onnx", save_as_external_data=True, location="w.data", size_threshold=0)
    saved = onnx.load(tmp_path / "sub" / "m.onnx", load_external_data=False)
    for tensor in saved.graph.initializer:
        for entry_ in tensor.external_data:
            if entry_.key == "location":
                entry_.value = "../w.data"
    (tmp_path / "sub" / "w.data").rename(tmp_path / "w.data")
    onnx.save(saved, tmp_path / "sub" / "m.onnx")
    with pytest.raises(kenosis_rewrite.InvalidModelError, match=r"external data .* cannot be read: .*tensor name: .*points outside"):
        getattr(kenosis_rewrite, entry)(str(tmp_path / "sub" / "m.onnx"))

"""Every placement target: where Q/DQ end up (structure) and what the model computes (numerics)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnxscript.rewriter import RewriteRuleSet

import kenosis_rewrite
from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.placement import targets
from kenosis_rewrite.testing import model_checks, toy_models

NETS = ["resnetish", "conv_silu", "conv_leakyrelu", "concat", "conv_relu_maxpool", "conv_hardswish", "conv_bn"]


def _case(name, config="default"):
    float_model = toy_models.build(name)
    feeds = toy_models.random_feeds(float_model, 8)
    return float_model, feeds, ort_quantize.quantize_with_ort(float_model, feeds[:4], config)


def _activation_quantizers(model):
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    return [(n, inits.get(n.input[1]), inits.get(n.input[2]) if len(n.input) > 2 else None)
            for n in model.graph.node if n.op_type == "QuantizeLinear"]


def _reads_through_qdq(model, node):
    """True when ``node``'s first input comes through a DequantizeLinear."""
    producer = model_checks.producer_of(model, node.input[0])
    return producer is not None and producer.op_type == "DequantizeLinear"


@pytest.mark.parametrize("target", list(targets.TARGETS))
@pytest.mark.parametrize("name", NETS)
def test_every_target_gives_a_valid_model_close_to_fp32(name, target):
    float_model, feeds, qdq = _case(name)
    fixed = kenosis_rewrite.fix(qdq, target=target)
    onnx.checker.check_model(fixed, full_check=True)
    assert [o.name for o in fixed.graph.output] == [o.name for o in qdq.graph.output]
    scores = fidelity.compare_to_float(float_model, {"input": qdq, "fixed": fixed}, feeds[4:])
    tolerance = 0.5 if target.startswith("ort") else 6.0  # symmetric int8 halves one-sided resolution
    assert scores["fixed"]["sqnr_db"] >= scores["input"]["sqnr_db"] - tolerance, scores
    assert scores["fixed"]["cosine"] > 0.995


@pytest.mark.parametrize("name", NETS)
def test_tensorrt_placement(name):
    _, _, qdq = _case(name)
    fixed = kenosis_rewrite.fix(qdq, target="tensorrt")
    for _, _scale, zero_point in _activation_quantizers(fixed):
        assert zero_point is not None and zero_point.dtype == np.int8 and not zero_point.any()
    for node in fixed.graph.node:
        if node.op_type in ("Relu", "LeakyRelu", "HardSwish", "Sigmoid"):
            producer = model_checks.producer_of(fixed, node.input[0])
            assert producer is None or producer.op_type != "DequantizeLinear" or \
                model_checks.producer_of(fixed, producer.input[0]).op_type not in ("QuantizeLinear",) or \
                model_checks.producer_of(fixed, model_checks.producer_of(fixed, producer.input[0]).input[0]).op_type not in (
                    "Conv", "MatMul", "Gemm"), f"Q/DQ left between a weighted op and {node.name}"
        if node.op_type in ("Conv", "Gemm") and len(node.input) > 2:
            assert model_checks.producer_of(fixed, node.input[2]) is None, "TensorRT biases stay float"
        if node.op_type == "MaxPool":
            assert not _reads_through_qdq(fixed, node), "MaxPool should run on the int8 tensor"


@pytest.mark.parametrize("name", ["resnetish", "conv_leakyrelu", "conv_hardswish"])
def test_npu_placement_has_no_qdq_between_weighted_ops_and_activations(name):
    _, _, qdq = _case(name)
    fixed = kenosis_rewrite.fix(qdq, target="npu")
    for node in fixed.graph.node:
        if node.op_type in ("Relu", "LeakyRelu", "HardSwish"):
            producer = model_checks.producer_of(fixed, node.input[0])
            assert producer.op_type in ("Conv", "Add", "MatMul", "Gemm"), (node.name, producer.op_type)
    for _, _, zero_point in _activation_quantizers(fixed):
        assert zero_point.dtype == np.int8 and not zero_point.any()


def test_arm_target_keeps_int8_activations():
    _, _, qdq = _case("resnetish", "sym")
    fixed, report = kenosis_rewrite.fix(qdq, target="ort-cpu-arm", return_report=True)
    assert "activation-int8-to-uint8" not in report.change_counts()
    assert report.change_counts()["relu-island-on-codes"] == 7
    zero_points = [zp for _, _, zp in _activation_quantizers(fixed)]
    assert all(zp.dtype == np.int8 for zp in zero_points)
    # each Relu runs on the int8 codes of the Q before it: max(codes, zero point)
    maxes = [n for n in fixed.graph.node if n.op_type == "Max"]
    assert len(maxes) == 7 and "Relu" not in {n.op_type for n in fixed.graph.node}
    assert all(model_checks.producer_of(fixed, n.input[0]).op_type == "QuantizeLinear" for n in maxes)


def test_targets_are_data():
    for name, target in targets.TARGETS.items():
        assert target.name == name and target.facts.basis and target.facts.runtime
        assert isinstance(kenosis_rewrite.rules(name), RewriteRuleSet)
    with pytest.raises(kenosis_rewrite.UnsupportedTargetError):
        targets.get_target("tpu")


def _mlp_ending_in_a_reshape() -> onnx.ModelProto:
    """An sklearn MLP regressor as skl2onnx writes it (surfaces-onnx-files 0.0.1): MatMul/Add/Relu
    layers, the last Add reshaped into the output."""
    from onnx import TensorProto, helper, numpy_helper  # noqa: PLC0415

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)
             for name, shape in (("w1", (4, 16)), ("w2", (16, 1)))]
    inits += [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
              for name, shape in (("b1", (16,)), ("b2", (1,)))]
    inits.append(numpy_helper.from_array(np.array([-1, 1, 1], np.int64), "shape"))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Relu", ["a1"], ["r1"]), helper.make_node("MatMul", ["r1", "w2"], ["m2"]),
             helper.make_node("Add", ["m2", "b2"], ["a2"]), helper.make_node("Reshape", ["a2", "shape"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 1, 1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("target", ["ort-cpu-arm", "tensorrt", "npu"])
def test_quantize_for_an_int8_target_runs_where_the_output_is_a_reshape_of_a_quantized_tensor(target):
    """Output protection takes the output's Q/DQ away, leaving DQ(int8) -> Reshape -> output, which ORT
    requantizes itself with a stale output_dtype and refuses: quantize(target="npu"/"ort-cpu-arm")
    raised RuntimeMeasurementError on that MLP."""
    model = _mlp_ending_in_a_reshape()
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((16, 4)).astype(np.float32)} for _ in range(6)]
    quantized = kenosis_rewrite.quantize(model, calibration=feeds[:4], target=target)
    onnx.checker.check_model(quantized, full_check=True)
    assert [o.name for o in quantized.graph.output] == ["y"]
    for feed in feeds[4:]:
        expected = fidelity.run(model, [feed])[0][0]
        got = fidelity.run(quantized, [feed])[0][0]  # ORT_ENABLE_ALL: builds and runs
        assert got.shape == expected.shape
        assert fidelity.cosine(expected, got) > 0.99


def test_tensorrt_leaves_no_quantizer_between_a_residual_add_and_its_relu():
    """TensorRT fuses a residual Add and the Relu after it into the epilogue of the layer before:
    the Relu reads the Add directly (no Q/DQ between them), and the model stays close to FP32. (With
    QDQKeepRemovableActivations quantize_static keeps the Relu, and the pair between it and the Add.)"""
    float_model, feeds, qdq = _case("resnetish", "keep")
    adds_into_relu = [n for n in qdq.graph.node if n.op_type == "Relu"
                      and model_checks.producer_of(qdq, n.input[0]).op_type == "DequantizeLinear"
                      and model_checks.producer_of(qdq, model_checks.producer_of(
                          qdq, model_checks.producer_of(qdq, n.input[0]).input[0]).input[0]).op_type == "Add"]
    assert adds_into_relu  # quantize_static writes Add -> Q -> DQ -> Relu
    fixed, report = kenosis_rewrite.fix(qdq, target="tensorrt", return_report=True)
    relus_after_add = [n for n in fixed.graph.node if n.op_type == "Relu"
                       and model_checks.producer_of(fixed, n.input[0]).op_type == "Add"]
    assert len(relus_after_add) == len(adds_into_relu)
    scores = fidelity.compare_to_float(float_model, {"input": qdq, "fixed": fixed}, feeds[4:])
    assert scores["fixed"]["cosine"] > 0.995

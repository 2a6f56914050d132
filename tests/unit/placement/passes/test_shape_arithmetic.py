"""Tests of the pass that keeps shape arithmetic float (and of the origin analysis it shares with quantize())."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from kenosis_rewrite import fix
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.graph.value_origins import Origin, value_origins
from kenosis_rewrite.placement.passes.shape_arithmetic import RULE_NAME, FloatShapeArithmeticPass
from kenosis_rewrite.testing import model_checks, toy_models


def _feeds(width: int, n: int = 4, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(0, 1, (1, toy_models.C, 8, width)).astype(np.float32)} for _ in range(n)]


def _quantized_grid_detector() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    float_model = toy_models.build_export("grid_detector")
    return float_model, ort_quantize.quantize_with_ort(float_model, _feeds(40), "default")


def _shape_path_quantizers(proto: onnx.ModelProto) -> list[str]:
    graph = ir.serde.deserialize_model(proto).graph
    origins = value_origins(graph)
    return [n.inputs[0].name for n in graph if n.op_type == "QuantizeLinear" and origins[n.inputs[0]] is Origin.SHAPE]


def _with_outputs(proto: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """``proto`` with the float tensors ``names`` as extra graph outputs (to compare intermediates)."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    model.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    return model


def test_origins_tell_data_shape_arithmetic_and_weights_apart():
    _, qdq = _quantized_grid_detector()
    graph = ir.serde.deserialize_model(qdq).graph
    origins = value_origins(graph)
    kinds = {}
    for node in graph:
        kinds.setdefault(node.op_type, set()).add(origins[node.outputs[0]])
    assert kinds["Shape"] == kinds["Range"] == kinds["Ceil"] == kinds["Resize"] == {Origin.SHAPE}
    assert kinds["Conv"] == kinds["Add"] == {Origin.DATA}  # the boxes read data and the grid: data
    assert Origin.CONSTANT in kinds["DequantizeLinear"]  # the weights
    assert _shape_path_quantizers(qdq) == ["cast_16", "mul_19", "cast_29", "mul_32", "resize_36"]


def test_quantize_static_breaks_the_grid_at_other_sizes_and_the_pass_restores_it():
    float_model, qdq = _quantized_grid_detector()
    with pytest.raises(Exception, match="broadcast"):  # the count saturates at the calibrated width
        model_checks.outputs(qdq, _feeds(48, 1)[0])
    fixed, report = model_checks.apply_pass(qdq, FloatShapeArithmeticPass)
    assert report.change_counts()[RULE_NAME] == 5 and all(not c.exact for c in report.changes)
    assert _shape_path_quantizers(fixed) == []
    # data-path quantizers are untouched, node for node
    def data_q(m):
        return [(n.input, n.output) for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in ("x", "relu_5", "conv_9")]

    assert data_q(fixed) == data_q(qdq) and len(data_q(qdq)) == 3
    for width in (40, 30, 48, 64):
        feed = _feeds(width, 1, seed=width)[0]
        names = ["resize_36", "conv_9"]
        (out, grid, offsets), (_, grid_ref, _) = (
            model_checks.outputs(_with_outputs(m, names), feed, optimized=False) for m in (fixed, float_model))
        np.testing.assert_array_equal(grid, grid_ref)  # the grid is the float model's, bit for bit
        assert out.shape == (1, 2, 8, width)
        if width == 40:  # where the input runs: its data path is unchanged, bit for bit
            _, _, offsets_in = model_checks.outputs(_with_outputs(qdq, names), feed, optimized=False)
            np.testing.assert_array_equal(offsets, offsets_in)


def test_fix_runs_the_detector_at_every_size_the_float_model_runs():
    float_model, qdq = _quantized_grid_detector()
    fixed, report = fix(qdq, calibration=_feeds(40), return_report=True)
    onnx.checker.check_model(fixed, full_check=True)
    assert report.change_counts()[RULE_NAME] == 5
    for width in (30, 48, 64):
        feed = _feeds(width, 1, seed=width)[0]
        reference, = model_checks.outputs(float_model, feed)
        out, = model_checks.outputs(fixed, feed)
        assert out.shape == reference.shape
        if width <= 40:  # wider, the boxes leave the output quantizer's calibrated range
            assert model_checks.sqnr_db(reference, out) > 25


def test_a_graph_output_computed_from_shapes_is_refused_with_a_reason():
    _, qdq = _quantized_grid_detector()
    grid_dq = next(n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("resize_36"))
    qdq.graph.output.append(onnx.helper.make_tensor_value_info(grid_dq.output[0], onnx.TensorProto.FLOAT, ["W"]))
    fixed, report = model_checks.apply_pass(qdq, FloatShapeArithmeticPass)
    assert report.change_counts()[RULE_NAME] == 4
    assert [r.reason for r in report.refusals if r.rule == RULE_NAME] == [
        "the dequantized shape arithmetic is a graph output (its name is the interface)"]
    assert _shape_path_quantizers(fixed) == ["resize_36"]


def test_weights_behind_quantize_are_not_shape_arithmetic():
    """A float weight behind Q (NNCF on Paddle exports) is computed from constants only: it stays
    quantized (fold-constant-quantize turns it into an integer initializer)."""
    float_model = toy_models.build("resnetish")
    qdq = ort_quantize.quantize_with_ort(float_model, toy_models.random_feeds(float_model, 2), "default")
    fixed, report = model_checks.apply_pass(qdq, FloatShapeArithmeticPass)
    assert RULE_NAME not in report.change_counts()
    assert model_checks.op_types(fixed) == model_checks.op_types(qdq)


def test_a_weight_computed_from_its_own_shape_is_a_constant_not_shape_arithmetic():
    """``W + Expand(b, Shape(W))`` reads only constants: the shape of a constant is a constant. The
    MatMul keeps its quantized weight (ORT runs it integer) and fix() changes nothing there."""
    rng = np.random.default_rng(0)
    nodes = [
        onnx.helper.make_node("Shape", ["w"], ["w_shape"]),
        onnx.helper.make_node("Expand", ["b", "w_shape"], ["b_wide"]),
        onnx.helper.make_node("Add", ["w", "b_wide"], ["w_total"]),
        onnx.helper.make_node("MatMul", ["x", "w_total"], ["y"]),
    ]
    float_model = onnx.helper.make_model(onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 16])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8])],
        [onnx.numpy_helper.from_array(rng.normal(0, 0.3, (16, 8)).astype(np.float32), "w"),
         onnx.numpy_helper.from_array(rng.normal(0, 0.1, (8,)).astype(np.float32), "b")]),
        opset_imports=[onnx.helper.make_opsetid("", 17)])
    feeds = [{"x": rng.normal(0, 1, (2, 16)).astype(np.float32)} for _ in range(4)]
    qdq = ort_quantize.quantize_with_ort(float_model, feeds, "default")
    graph = ir.serde.deserialize_model(qdq).graph
    origins = value_origins(graph)
    assert {origins[n.outputs[0]] for n in graph if n.op_type in ("Shape", "Expand", "Add")} == {Origin.CONSTANT}
    assert _shape_path_quantizers(qdq) == []
    fixed, report = fix(qdq, calibration=feeds, return_report=True)
    assert RULE_NAME not in report.change_counts()
    matmul = next(n for n in ir.serde.deserialize_model(fixed).graph if n.op_type == "MatMul")
    assert all(v.producer() is not None and v.producer().op_type == "DequantizeLinear" for v in matmul.inputs)
    for feed in feeds:
        np.testing.assert_array_equal(model_checks.outputs(fixed, feed)[0], model_checks.outputs(qdq, feed)[0])


def test_shape_arithmetic_that_feeds_a_matmul_keeps_its_quantizer_and_the_matmul_stays_integer():
    """``W + ConstantOfShape(Shape(W))`` starts at an index generator, so it is shape arithmetic; but
    it is the MatMul's operand, and without its Q/DQ ORT ran the MatMul in float (fuzz 30000684)."""
    rng = np.random.default_rng(0)
    fill = onnx.helper.make_tensor("fill", onnx.TensorProto.FLOAT, [1], [0.25])
    nodes = [
        onnx.helper.make_node("Shape", ["w"], ["w_shape"]),
        onnx.helper.make_node("ConstantOfShape", ["w_shape"], ["filled"], value=fill),
        onnx.helper.make_node("Add", ["w", "filled"], ["w_total"]),
        onnx.helper.make_node("MatMul", ["x", "w_total"], ["y"]),
    ]
    float_model = onnx.helper.make_model(onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 16])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8])],
        [onnx.numpy_helper.from_array(rng.normal(0, 0.3, (16, 8)).astype(np.float32), "w")]),
        opset_imports=[onnx.helper.make_opsetid("", 17)])
    feeds = [{"x": rng.normal(0, 1, (2, 16)).astype(np.float32)} for _ in range(4)]
    qdq = ort_quantize.quantize_with_ort(float_model, feeds, "default")
    assert _shape_path_quantizers(qdq) == ["filled", "w_total"]
    fixed, report = model_checks.apply_pass(qdq, FloatShapeArithmeticPass)
    assert _shape_path_quantizers(fixed) == ["w_total"]  # the fill, read by the Add alone, is float now
    assert [r.reason for r in report.refusals if r.rule == RULE_NAME] == [
        "the shape arithmetic feeds a Conv/MatMul/Gemm, which runs in integers only on its quantized form"]
    assert "MatMul" not in model_checks.ort_optimized_op_types(fix(qdq, calibration=feeds))
    for feed in feeds:
        np.testing.assert_array_equal(model_checks.outputs(fixed, feed)[0], model_checks.outputs(qdq, feed)[0])

"""Tests of integer-matmul-bias: the integer MatMul's bias Add fused by ORT into MatMulIntegerToFloat."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes import common as common_passes

import kenosis_rewrite
from kenosis_rewrite.canonicalization.rules.residual_sum import residual_sum_rules
from kenosis_rewrite.placement.rules.integer_matmul_bias import RULE_NAME, integer_matmul_bias_rules
from kenosis_rewrite.testing import model_checks

K, N = 16, 12


def _model(*, activation: str = "uint8", per_column: bool = True, weight_zero: bool = True, bias_first: bool = False,
           rank: int = 3, bias_shape: tuple[int, ...] = (N,), weight_axis: int = 1, extra_reader: bool = False,
           seed: int = 0) -> onnx.ModelProto:
    """``y = Add(MatMul(DQ(Q(x)), DQ(w_q)), bias)`` as quantize_static/NNCF write it."""
    rng = np.random.default_rng(seed)
    x_type = np.uint8 if activation == "uint8" else np.int8
    x_zero = np.array(rng.integers(100, 150) if activation == "uint8" else rng.integers(-20, 20), x_type)
    weight = rng.integers(-127, 128, (K, N)).astype(np.int8)
    count = weight.shape[weight_axis] if per_column else 1
    w_scale = rng.uniform(0.002, 0.02, count).astype(np.float32)
    w_zero = (np.zeros(count) if weight_zero else rng.integers(-5, 5, count)).astype(np.int8)
    if not per_column:
        w_scale, w_zero = w_scale.reshape(()), w_zero.reshape(())
    bias = rng.normal(0, 0.5, bias_shape).astype(np.float32)
    attributes = {"axis": weight_axis} if per_column else {}
    add_inputs = ["bias", "product"] if bias_first else ["product", "bias"]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w"], **attributes),
        helper.make_node("MatMul", ["x_dq", "w"], ["product"]),
        helper.make_node("Add", add_inputs, ["y"]),
    ]
    shape = [2, 5, K][-rank:]
    out_shape = [*shape[:-1], N]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["product"], ["r"]))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, out_shape))
    graph = helper.make_graph(
        nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], outputs,
        [numpy_helper.from_array(np.array(0.03, np.float32), "x_scale"), numpy_helper.from_array(x_zero, "x_zero"),
         numpy_helper.from_array(weight, "w_q"), numpy_helper.from_array(w_scale, "w_scale"),
         numpy_helper.from_array(w_zero, "w_zero"), numpy_helper.from_array(bias, "bias")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model)  # fix() infers shapes first; matmul-bias-as-sum needs them


def _rewrite(model: onnx.ModelProto):
    """The rules applied, then what they left unread removed (as fix() does)."""
    rewritten, report, count = model_checks.apply_reporting_rules(model, integer_matmul_bias_rules)
    ir_model = ir.serde.deserialize_model(rewritten)
    common_passes.RemoveUnusedNodesPass()(ir_model)
    return ir.serde.serialize_model(ir_model), report, count


def _feeds(model: onnx.ModelProto, seeds=range(3)) -> list[dict]:
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return [{"x": np.random.default_rng(seed).normal(0, 2, shape).astype(np.float32)} for seed in seeds]


def _rounding_bound(model: onnx.ModelProto, feed: dict) -> np.ndarray:
    """(K + 3) * 2**-24 * sum_k |x_k w_k|, from the dequantized activation and weight of the input."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend([helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("x_dq", "w")])
    x, w = model_checks.outputs(probe, feed, optimized=False)
    return (K + 3) * 2.0**-24 * (np.abs(x) @ np.abs(w))


CASES = list(itertools.product(("uint8", "int8"), (True, False), (True, False), (False, True), (2, 3)))


@pytest.mark.parametrize(("activation", "per_column", "weight_zero", "bias_first", "rank"), CASES)
def test_rewritten_node_by_node_fused_by_ort_and_bit_exact(activation, per_column, weight_zero, bias_first, rank):
    model = _model(activation=activation, per_column=per_column, weight_zero=weight_zero, bias_first=bias_first, rank=rank)
    rewritten, report, count = _rewrite(model)
    assert count == 1 and [c.rule for c in report.changes] == [RULE_NAME] and not report.changes[0].exact
    assert [n.op_type for n in rewritten.graph.node] == [
        "QuantizeLinear", "MatMulInteger", "DequantizeLinear", "Mul", "Cast", "Mul", "Add"]
    matmul = next(n for n in rewritten.graph.node if n.op_type == "MatMulInteger")
    assert list(matmul.input[:2]) == ["x_q", "w_q"]
    add = rewritten.graph.node[-1]
    assert add.input[1] == "bias"  # where ORT's fusion looks for the bias
    unit_dq = next(n for n in rewritten.graph.node if n.op_type == "DequantizeLinear")
    assert model_checks.initializer(rewritten, unit_dq.input[0]) == 1 and unit_dq.input[1] == "x_scale"
    # what ORT runs: one MatMulIntegerToFloat with the bias, no Add (before: a separate Add, or a
    # float Gemm where MatMulAddFusion took the static 2-D MatMul)
    before = model_checks.ort_optimized_op_types(model)
    assert before["Add"] + before["Gemm"] == 1
    optimized = model_checks.ort_optimized_op_types(rewritten)
    assert optimized["MatMulIntegerToFloat"] == 1 and optimized["Add"] == 0 and optimized["MatMulInteger"] == 0
    # the input with its bias Add as Sum (matmul-bias-as-sum), so that ORT runs its MatMul integer
    # too (a static 2-D MatMul + Add would be a float Gemm)
    integer, _ = model_checks.apply_rules(model, residual_sum_rules())
    assert model_checks.ort_optimized_op_types(integer)["MatMulIntegerToFloat"] == 1
    for feed in _feeds(model):
        # exact on ORT: the same integer kernel and scales before and after
        for got, want in zip(model_checks.outputs(rewritten, feed), model_checks.outputs(integer, feed)):
            np.testing.assert_array_equal(got, want)
        # the graph as written: int32 accumulation vs float sums of dequantized products, within the
        # stated bound (K + 3) * u * sum_k |x_k w_k|
        got, want = model_checks.outputs(rewritten, feed, optimized=False)[0], model_checks.outputs(model, feed, optimized=False)[0]
        np.testing.assert_array_less(np.abs(got - want), _rounding_bound(model, feed) + 1e-30)


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"bias_shape": (5, N)}, f"the bias is not a vector of the weight's width ({N})"),
    ({"bias_shape": (1,)}, f"the bias is not a vector of the weight's width ({N})"),
    ({"weight_axis": 0}, "the weight is not quantized per tensor or per output column"),
])
def test_left_alone_with_reason(kwargs, reason):
    model = _model(**kwargs)
    rewritten, report, count = _rewrite(model)
    assert count == 0 and rewritten.graph.node[3].op_type == "MatMul"
    assert [(r.rule, r.reason) for r in report.refusals] == [(RULE_NAME, reason)]


def test_matmul_read_elsewhere_is_left_alone():
    rewritten, _, count = _rewrite(_model(extra_reader=True))
    assert count == 0 and "MatMulInteger" not in model_checks.op_types(rewritten)


def test_projections_of_one_tensor_share_the_unit_dequantize():
    model = _model(rank=2)
    graph = model.graph
    graph.node.extend([
        helper.make_node("MatMul", ["x_dq", "w"], ["product2"]),
        helper.make_node("Add", ["product2", "bias"], ["y2"]),
    ])
    graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [5, N]))
    rewritten, _, count = _rewrite(model)
    assert count == 2 and model_checks.op_types(rewritten)["DequantizeLinear"] == 1
    assert model_checks.ort_optimized_op_types(rewritten)["MatMulIntegerToFloat"] == 2
    integer, _ = model_checks.apply_rules(onnx.shape_inference.infer_shapes(model), residual_sum_rules())
    feed = _feeds(model)[0]
    for got, want in zip(model_checks.outputs(rewritten, feed), model_checks.outputs(integer, feed)):
        np.testing.assert_array_equal(got, want)


def test_fix_applies_it_once_and_a_second_fix_changes_nothing():
    model = _model()
    fixed, report = kenosis_rewrite.fix(model, return_report=True)
    assert [c.rule for c in report.changes if c.rule == RULE_NAME] == [RULE_NAME]
    again = kenosis_rewrite.fix(fixed)
    assert again.graph.SerializeToString() == fixed.graph.SerializeToString()
    assert model_checks.ort_optimized_op_types(again)["MatMulIntegerToFloat"] == 1

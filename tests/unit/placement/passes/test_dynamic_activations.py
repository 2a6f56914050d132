"""Tests of dynamic-activations: weight MatMul/Gemm inputs quantized with their own range on every run."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.placement.passes.dynamic_activations import RULE_NAME, DynamicActivationsPass
from kenosis_rewrite.testing import model_checks

K, N, ROWS = 16, 12, 6
X_SCALE, X_ZERO = 0.02, 128  # a calibrated range of [-2.56, 2.54]: the feeds below overshoot it


def _weights(rng, transposed: bool, per_column: bool):
    codes = rng.integers(-127, 128, (N, K) if transposed else (K, N)).astype(np.int8)
    scale = rng.uniform(0.002, 0.02, N if per_column else ()).astype(np.float32)
    zero = np.zeros(scale.shape, np.int8)
    return codes, scale, zero


def _model(op: str = "MatMul", *, per_column: bool = True, transposed: bool = True, bias_first: bool = False,
           alpha: float = 1.0, weight_axis: int | None = None, seed: int = 0) -> onnx.ModelProto:
    """Two layers reading one quantized ``x`` (q/k-like), as quantize_static's weighted plan writes them:
    ``Add(MatMul(DQ(Q(x)), DQ(w)), bias)`` or ``Gemm(DQ(Q(x)), DQ(w), DQ(int32 bias))``."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.array(X_SCALE, np.float32), "x_scale"),
             numpy_helper.from_array(np.array(X_ZERO, np.uint8), "x_zero")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"])]
    outputs = []
    for layer in ("a", "b"):
        gemm_transposed = op == "Gemm" and transposed
        codes, scale, zero = _weights(rng, gemm_transposed, per_column)
        axis = weight_axis if weight_axis is not None else (0 if gemm_transposed else 1)
        inits += [numpy_helper.from_array(codes, f"w_{layer}"), numpy_helper.from_array(scale, f"w_scale_{layer}"),
                  numpy_helper.from_array(zero, f"w_zero_{layer}")]
        nodes.append(helper.make_node("DequantizeLinear", [f"w_{layer}", f"w_scale_{layer}", f"w_zero_{layer}"],
                                      [f"w_dq_{layer}"], **({"axis": axis} if per_column else {})))
        bias = rng.normal(0, 0.5, N).astype(np.float32)
        if op == "MatMul":
            inits.append(numpy_helper.from_array(bias, f"bias_{layer}"))
            nodes.append(helper.make_node("MatMul", ["x_dq", f"w_dq_{layer}"], [f"p_{layer}"], name=f"mm_{layer}"))
            add_inputs = [f"bias_{layer}", f"p_{layer}"] if bias_first else [f"p_{layer}", f"bias_{layer}"]
            nodes.append(helper.make_node("Add", add_inputs, [f"y_{layer}"]))
        else:
            bias_scale = (X_SCALE * scale).astype(np.float32)
            inits += [numpy_helper.from_array(np.rint(bias / bias_scale).astype(np.int32), f"bias_q_{layer}"),
                      numpy_helper.from_array(bias_scale, f"bias_scale_{layer}")]
            nodes.append(helper.make_node("DequantizeLinear", [f"bias_q_{layer}", f"bias_scale_{layer}"], [f"bias_{layer}"],
                                          **({"axis": 0} if per_column else {})))
            nodes.append(helper.make_node("Gemm", ["x_dq", f"w_dq_{layer}", f"bias_{layer}"], [f"y_{layer}"],
                                          name=f"gemm_{layer}", transB=int(transposed), alpha=alpha))
        outputs.append(helper.make_tensor_value_info(f"y_{layer}", TensorProto.FLOAT, [ROWS, N]))
    graph = helper.make_graph(nodes, "layers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, K])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _float_with_quantized_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """The input with its activation Q/DQ removed: what the dynamic form approximates."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [n for n in out.graph.node if not (n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.input[0] in ("x", "x_q"))]
    for node in kept:
        node.input[:] = ["x" if name == "x_dq" else name for name in node.input]
    del out.graph.node[:]
    out.graph.node.extend(kept)
    return out


def _weight_matrix(model: onnx.ModelProto, layer: str) -> np.ndarray:
    """The dequantized weight of ``layer`` as [K, N]."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.append(helper.make_tensor_value_info(f"w_dq_{layer}", TensorProto.FLOAT, None))
    (weight,) = model_checks.outputs(probe, {"x": np.zeros((ROWS, K), np.float32)}, optimized=False)
    return weight if weight.shape == (K, N) else weight.T


def _feeds():
    rng = np.random.default_rng(7)
    # 3x past the calibrated range: the static form clips, the dynamic one must not
    return [{"x": rng.normal(0, 1, (ROWS, K)).astype(np.float32) * spread} for spread in (0.5, 1.0, 8.0)]


@pytest.mark.parametrize(("op", "per_column", "transposed", "bias_first"), [
    ("MatMul", True, False, False), ("MatMul", False, False, True), ("Gemm", True, True, False),
    ("Gemm", False, True, False), ("Gemm", True, False, False)])
def test_rewritten_node_by_node_fused_by_ort_and_within_the_dynamic_step(op, per_column, transposed, bias_first):
    model = _model(op, per_column=per_column, transposed=transposed, bias_first=bias_first)
    rewritten, report = model_checks.apply_pass(model, DynamicActivationsPass)
    assert [c.rule for c in report.changes] == [RULE_NAME] * 2 and not any(c.exact for c in report.changes)
    types = model_checks.op_types(rewritten)
    # one DynamicQuantizeLinear for the tensor both layers read; no Q/DQ of x left
    assert types["DynamicQuantizeLinear"] == 1 and types["MatMulInteger"] == 2 and types["QuantizeLinear"] == 0
    assert types[op] == 0 and types["Add"] == 2 and types["Cast"] == 2 and types["Mul"] == 4
    for add in (n for n in rewritten.graph.node if n.op_type == "Add"):
        assert model_checks.producer_of(rewritten, add.input[0]).op_type == "Mul"  # the bias second, where ORT looks
    optimized = model_checks.ort_optimized_op_types(rewritten)
    assert optimized["MatMulIntegerToFloat"] + optimized["DynamicQuantizeMatMul"] == 2
    assert optimized["Add"] == 0 and optimized["MatMulInteger"] == 0
    # bound: each run's own uint8 step, half of it per element of x, times sum_k |w_k|
    reference = _float_with_quantized_weights(model)
    weight_l1 = {layer: np.abs(_weight_matrix(model, layer)).sum(axis=0) for layer in ("a", "b")}
    static_error = 0.0
    for feed in _feeds():
        x = feed["x"]
        step = (max(x.max(), 0) - min(x.min(), 0)) / 255
        want = model_checks.outputs(reference, feed, optimized=False)
        for optimized_run in (False, True):
            got = model_checks.outputs(rewritten, feed, optimized_run)
            for layer, g, w in zip(("a", "b"), got, want):
                assert np.all(np.abs(g - w) <= 0.5 * step * weight_l1[layer] * 1.001 + 1e-4)
        static_error = max(static_error, max(float(np.abs(s - w).max()) for s, w in zip(model_checks.outputs(model, feed), want)))
    assert static_error > 1.0  # the calibrated range clips the wide feed: what the pass is for


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"op": "Gemm", "alpha": 0.5}, "a Gemm with transA, alpha or beta"),
    ({"op": "MatMul", "weight_axis": 0, "per_column": True}, "the weight is not quantized per tensor or per output column"),
])
def test_left_alone_with_reason(kwargs, reason):
    if "weight_axis" in kwargs:  # per-row scales need as many entries as rows
        model = _model("MatMul", per_column=False)
        for init in model.graph.initializer:
            if init.name.startswith("w_scale_"):
                init.CopyFrom(numpy_helper.from_array(np.full(K, 0.01, np.float32), init.name))
            if init.name.startswith("w_zero_"):
                init.CopyFrom(numpy_helper.from_array(np.zeros(K, np.int8), init.name))
        for node in model.graph.node:
            if node.output[0].startswith("w_dq_"):
                node.attribute.append(helper.make_attribute("axis", 0))
    else:
        model = _model(**kwargs)
    rewritten, report = model_checks.apply_pass(model, DynamicActivationsPass)
    assert not report.changes and model_checks.op_types(rewritten)["DynamicQuantizeLinear"] == 0
    assert {(r.rule, r.reason) for r in report.refusals} == {(RULE_NAME, reason)}


def test_graph_output_keeps_its_name():
    model = _model("Gemm")
    rewritten, _ = model_checks.apply_pass(model, DynamicActivationsPass)
    assert [o.name for o in rewritten.graph.output] == ["y_a", "y_b"]
    assert {model_checks.producer_of(rewritten, name).op_type for name in ("y_a", "y_b")} == {"Add"}

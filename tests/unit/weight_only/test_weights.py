"""Tests of quantize_weights(), and of fix() on models with non-8-bit and blocked Q/DQ types."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import kenosis_rewrite
from kenosis_rewrite.errors import KenosisError
from kenosis_rewrite.placement.rules.matmul_nbits import matmul_nbits_rules
from kenosis_rewrite.testing import model_checks
from kenosis_rewrite.weight_only import weights

ELIGIBLE = 12  # 2 layers x (q, k, v, o, up, down); QK^T and PV multiply activations


@functools.cache
def _toy(float16: bool = False) -> onnx.ModelProto:
    return weights.toy_transformer(hidden=256, layers=2, seq=8, float16=float16)


def _feed(float16: bool = False, seed: int = 1) -> dict:
    x = np.random.default_rng(seed).standard_normal((1, 8, 256)).astype(np.float32)
    return {"x": x.astype(np.float16) if float16 else x}


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _cosine_vs_fp32(model, float16: bool) -> float:
    worst = 1.0
    for seed in range(3):
        reference = model_checks.outputs(_toy(False), _feed(False, seed))[0]
        worst = min(worst, _cosine(reference, model_checks.outputs(model, _feed(float16, seed))[0]))
    return worst


@pytest.mark.parametrize("float16", [False, True])
def test_transformer_quantized_runs_every_eligible_matmul_as_matmulnbits(float16):
    base = _toy(float16)
    quantized = weights.quantize_weights(base)
    weighted = [n for n in quantized.graph.node if n.op_type == "MatMul" and n.input[1].endswith("_output")]
    assert len(weighted) == ELIGIBLE
    inits = {t.name: t for t in quantized.graph.initializer}
    for node in quantized.graph.node:
        if node.op_type != "DequantizeLinear":
            continue
        assert {a.name: a.i for a in node.attribute} == {"axis": 0, "block_size": 32}
        data, scale = inits[node.input[0]], inits[node.input[1]]
        assert data.data_type == T.INT4 and len(node.input) == 2
        assert scale.data_type == (T.FLOAT16 if float16 else T.FLOAT)
        assert list(scale.dims) == [data.dims[0] // 32, data.dims[1]]
    assert not any(t.name.endswith(".weight") for t in quantized.graph.initializer)  # float weights gone
    report = kenosis_rewrite.explain(quantized)
    assert report.optimized_op_counts["com.microsoft.MatMulNBits"] == ELIGIBLE
    assert report.optimized_op_counts["DequantizeLinear"] == 0
    assert _cosine_vs_fp32(quantized, float16) >= 0.99


def test_explain_counts_matmulnbits_as_integer_per_op():
    report = kenosis_rewrite.explain(weights.quantize_weights(_toy()))
    assert sum(op.kernel == "integer" for op in report.ops) == ELIGIBLE


def test_matmul_nbits_form_matches_the_dequantize_form():
    """Same numbers as DequantizeLinear + float MatMul (ORT's own fusion uses accuracy_level 4: int8 A)."""
    qdq = weights.quantize_weights(_toy(), form="qdq")
    nbits = weights.quantize_weights(_toy(), form="matmul_nbits")
    assert model_checks.op_types(nbits)["MatMulNBits"] == ELIGIBLE and "DequantizeLinear" not in model_checks.op_types(nbits)
    assert {(o.domain, o.version) for o in nbits.opset_import} >= {("com.microsoft", 1)}
    node = next(n for n in nbits.graph.node if n.op_type == "MatMulNBits")
    assert {a.name: a.i for a in node.attribute} == {"K": 256, "N": 256, "bits": 4, "block_size": 32}
    for seed in range(2):
        expected = model_checks.outputs(qdq, _feed(seed=seed), optimized=False)[0]
        np.testing.assert_allclose(model_checks.outputs(nbits, _feed(seed=seed))[0], expected, rtol=0, atol=1e-4)
    level4 = weights.quantize_weights(_toy(), form="matmul_nbits", accuracy_level=4)
    assert next(a.i for a in level4.graph.node[1].attribute if a.name == "accuracy_level") == 4
    assert _cosine(model_checks.outputs(level4, _feed())[0], model_checks.outputs(qdq, _feed())[0]) > 0.999


@pytest.mark.parametrize(("bits", "symmetric", "dtype"), [(4, False, T.UINT4), (8, True, T.INT8), (8, False, T.UINT8)])
def test_other_bit_widths_fuse_and_keep_accuracy(bits, symmetric, dtype):
    quantized = weights.quantize_weights(_toy(), bits=bits, symmetric=symmetric, block_size=64)
    data_types = {t.data_type for t in quantized.graph.initializer if len(t.dims) == 2}
    assert dtype in data_types
    assert model_checks.ort_optimized_op_types(quantized)["MatMulNBits"] == ELIGIBLE
    assert _cosine_vs_fp32(quantized, False) >= (0.99 if bits == 4 else 0.9999)
    if bits == 4:  # the MatMulNBits packing of zero points agrees with the DQ form
        nbits = weights.quantize_weights(_toy(), bits=4, symmetric=False, block_size=64, form="matmul_nbits")
        expected = model_checks.outputs(quantized, _feed(), optimized=False)[0]
        np.testing.assert_allclose(model_checks.outputs(nbits, _feed())[0], expected, rtol=0, atol=1e-4)


def test_round_half_to_even_and_block_layout():
    column = np.array([7, 0.5, 1.5, 2.5, -2.5, -0.5, 3.49, -7] + [0] * 8, np.float32)
    quantized = weights.quantize_blockwise(column[:, None], block_size=16, scale_search=False)
    assert quantized.scale.tolist() == [[1.0]]
    assert quantized.data[:, 0].tolist() == [7, 0, 2, 2, -2, 0, 3, -7] + [0] * 8
    w = np.random.default_rng(0).standard_normal((40, 3)).astype(np.float16)  # K not a multiple of the block
    quantized = weights.quantize_blockwise(w, block_size=16)
    assert quantized.scale.shape == (3, 3) and quantized.scale.dtype == np.float16
    assert np.abs(weights.dequantize_blockwise(quantized) - w).max() <= quantized.scale.max() * 0.6


def test_input_is_not_modified_and_ir_model_in_ir_model_out():
    base = _toy()
    before = base.SerializeToString()
    weights.quantize_weights(base)
    assert base.SerializeToString() == before
    model = ir.serde.deserialize_model(base)
    out = weights.quantize_weights(model)
    assert isinstance(out, ir.Model) and out is not model
    assert sum(n.op_type == "DequantizeLinear" for n in model.graph) == 0


def _gemm_model(opset: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 128)).astype(np.float32) / 8, "w"),
             numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "c"),
             numpy_helper.from_array(rng.standard_normal((128, 32)).astype(np.float32) / 8, "shared")]
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["g"], transB=1, alpha=0.5, beta=2.0, name="gemm"),
             helper.make_node("Relu", ["g"], ["r"]),
             helper.make_node("Gemm", ["x", "shared"], ["y1"], name="gemm_a"),
             helper.make_node("MatMul", ["x", "shared"], ["y2"], name="mm_b")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [4, 128])],
                              [helper.make_tensor_value_info(n, T.FLOAT, [4, d]) for n, d in (("r", 64), ("y1", 32), ("y2", 32))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def test_gemm_and_shared_weights():
    model = _gemm_model(21)
    quantized = weights.quantize_weights(model)
    types = model_checks.op_types(quantized)
    assert types["Gemm"] == 0 and types["MatMul"] == 3 and types["Add"] == 1 and types["DequantizeLinear"] == 3
    assert len({n.input[0] for n in quantized.graph.node if n.op_type == "DequantizeLinear"}) == 3
    assert model_checks.ort_optimized_op_types(quantized)["MatMulNBits"] == 3
    feed = {"x": np.random.default_rng(2).standard_normal((4, 128)).astype(np.float32)}
    for expected, got in zip(model_checks.outputs(model, feed), model_checks.outputs(quantized, feed)):
        assert _cosine(expected, got) > 0.995


def test_old_opset_auto_uses_matmul_nbits_and_qdq_converts_to_21():
    model = _gemm_model(17)
    auto = weights.quantize_weights(model)
    assert {o.domain: o.version for o in auto.opset_import} == {"": 17, "com.microsoft": 1}
    assert model_checks.op_types(auto)["MatMulNBits"] == 3
    qdq = weights.quantize_weights(model, form="qdq")
    assert {o.domain: o.version for o in qdq.opset_import} == {"": 21} and qdq.ir_version >= 10
    feed = {"x": np.random.default_rng(2).standard_normal((4, 128)).astype(np.float32)}
    for a, b in zip(model_checks.outputs(auto, feed), model_checks.outputs(qdq, feed)):
        np.testing.assert_allclose(a, b, atol=2e-2)


def test_bad_arguments_raise():
    for kwargs in ({"bits": 3}, {"block_size": 48}, {"block_size": 8}, {"block_size": 512}, {"form": "gguf"}):
        with pytest.raises(KenosisError):
            weights.quantize_weights(_toy(), **kwargs)


# ----------------------------------------------------------------------------------------------
# onnxruntime's own MatMulNBitsQuantizer (QDQ format) through fix() and the MatMulNBits rules
# ----------------------------------------------------------------------------------------------


def _ort_qdq(model: onnx.ModelProto, block_size=32, symmetric=True) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.ModelProto.FromString(model.SerializeToString()), block_size=block_size,
                                     is_symmetric=symmetric, quant_format=QuantFormat.QDQ)
    quantizer.process()
    return quantizer.model.model


def _with_nbits_rules(model: onnx.ModelProto) -> onnx.ModelProto:
    ir_model = ir.serde.deserialize_model(model)
    for _ in range(4):
        if not matmul_nbits_rules().apply_to_model(ir_model):
            break
    return ir.serde.serialize_model(ir_model)


def _relu_mlp(layers=4, k=256) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((k, k)) / 16).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", T.FLOAT, [1, k])],
                              [helper.make_tensor_value_info(x, T.FLOAT, [1, k])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def test_ort_quantizer_models_keep_or_gain_their_fusion_after_fix():
    for float_model, symmetric in ((_toy(), True), (_toy(), False), (_relu_mlp(), True)):
        quantized = _ort_qdq(float_model, symmetric=symmetric)
        before = model_checks.ort_optimized_op_types(quantized)["MatMulNBits"]
        fixed = kenosis_rewrite.fix(quantized)
        assert model_checks.ort_optimized_op_types(fixed)["MatMulNBits"] >= before
        # every weight DQ kept bit for bit (with or without the MatMulNBits rules in fix())
        assert {t.name: t for t in quantized.graph.initializer if t.data_type in (T.INT4, T.UINT4)}.items() <= \
            {t.name: t for t in fixed.graph.initializer}.items()
        feed = {"x": np.random.default_rng(0).standard_normal(
            [d.dim_value for d in float_model.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)}
        np.testing.assert_array_equal(model_checks.outputs(fixed, feed, optimized=False)[0],
                                      model_checks.outputs(quantized, feed, optimized=False)[0])
        gained = _with_nbits_rules(fixed)
        eligible = sum(n.op_type == "DequantizeLinear" for n in quantized.graph.node)
        assert model_checks.ort_optimized_op_types(gained)["MatMulNBits"] == eligible
        if float_model is not _toy():
            assert before == 1  # measured: only the MatMul whose Relu is a graph output fused


def test_ort_channelwise_transposed_form_gains_the_fusion():
    """MatMulNBitsQuantizer's Intel-NPU form: DQ(axis=1, block=K) -> Transpose -> MatMul."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(_toy(), block_size=32, is_symmetric=True, quant_format=QuantFormat.QDQ,
                                     channel_wised_quantize=True)
    quantizer.process()
    quantized = quantizer.model.model
    assert model_checks.op_types(quantized)["Transpose"] == 8 + ELIGIBLE
    fixed = _with_nbits_rules(kenosis_rewrite.fix(quantized))
    assert model_checks.op_types(fixed)["Transpose"] == 8
    assert model_checks.ort_optimized_op_types(fixed)["MatMulNBits"] == ELIGIBLE
    np.testing.assert_array_equal(model_checks.outputs(fixed, _feed(), optimized=False)[0],
                                  model_checks.outputs(quantized, _feed(), optimized=False)[0])


# ----------------------------------------------------------------------------------------------
# fix() on int16/uint16, int4/uint4, float8 and blocked Q/DQ: preserved bit for bit (or refused)
# ----------------------------------------------------------------------------------------------

_SPECIAL = (T.INT4, T.UINT4, T.FLOAT8E4M3FN, T.FLOAT8E5M2)
_NUMPY = {T.INT16: np.int16, T.UINT16: np.uint16, T.UINT8: np.uint8, T.INT8: np.int8}


def _tensor(name: str, array, elem: int) -> onnx.TensorProto:
    array = np.asarray(array)
    if elem in _SPECIAL:
        return helper.make_tensor(name, elem, list(array.shape), array.reshape(-1).tolist())
    return numpy_helper.from_array(array.astype(_NUMPY.get(elem, array.dtype)), name)


def _qdq_pair(name: str, source: str, elem: int, zero_point: int = 0):
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), f"{name}_s"), _tensor(f"{name}_zp", zero_point, elem)]
    nodes = [helper.make_node("QuantizeLinear", [source, f"{name}_s", f"{name}_zp"], [f"{name}_q"]),
             helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_zp"], [f"{name}_d"])]
    return nodes, inits, f"{name}_d"


def _conv_relu_pool(act: int, weight: int, blocked: bool, zero_point: int = 0) -> onnx.ModelProto:
    """QDQ Conv -> Relu island -> MaxPool with activations of type ``act`` and weights of type ``weight``."""
    rng = np.random.default_rng(0)
    n0, i0, x = _qdq_pair("in", "x", act, zero_point)
    inits = [_tensor("w_q", rng.integers(-7, 8, (8, 4, 3, 3)), weight)]
    if blocked:
        inits.append(numpy_helper.from_array(rng.uniform(0.01, 0.02, (8, 1, 3, 3)).astype(np.float32), "w_s"))
        w_dq = helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["w"], axis=1, block_size=4)
    else:
        inits.append(numpy_helper.from_array(rng.uniform(0.01, 0.02, 8).astype(np.float32), "w_s"))
        w_dq = helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["w"], axis=0)
    n1, i1, c = _qdq_pair("mid", "c", act, zero_point)
    n2, i2, r = _qdq_pair("out", "r", act, zero_point)
    n3, i3, p = _qdq_pair("pool", "p", act, zero_point)
    nodes = [*n0, w_dq, helper.make_node("Conv", [x, "w"], ["c"], pads=[1, 1, 1, 1]), *n1,
             helper.make_node("Relu", [c], ["r"]), *n2,
             helper.make_node("MaxPool", [r], ["p"], kernel_shape=[2, 2], strides=[2, 2]), *n3,
             helper.make_node("Identity", [p], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [1, 8, 4, 4])], [*i0, *inits, *i1, *i2, *i3])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def _assert_preserved(model: onnx.ModelProto, fixed: onnx.ModelProto) -> None:
    """Every input initializer kept bit for bit, every Q/DQ keeps its type, same ORT outputs bit for bit."""
    kept = {t.name: t for t in fixed.graph.initializer}
    for tensor in model.graph.initializer:
        assert tensor.name not in kept or kept[tensor.name] == tensor, tensor.name
    x = np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(model_checks.outputs(fixed, {"x": x}, optimized=False)[0],
                                  model_checks.outputs(model, {"x": x}, optimized=False)[0])


@pytest.mark.parametrize("act", [T.INT16, T.UINT16, T.INT4, T.FLOAT8E4M3FN, T.FLOAT8E5M2])
def test_fix_refuses_and_preserves_non_8bit_activations(act):
    model = _conv_relu_pool(act, T.INT8, blocked=False, zero_point=300 if act == T.UINT16 else 0)
    fixed, report = kenosis_rewrite.fix(model, return_report=True)
    assert not report.changes
    assert [n.op_type for n in fixed.graph.node] == [n.op_type for n in model.graph.node]
    assert {r.rule for r in report.refusals} == {"relu-island-on-codes", "relu-on-codes", "fold-relu-island",
                                                 "relu-zero-point-to-qmin"}
    assert all("only per-tensor 8-bit activations" in r.reason for r in report.refusals)
    _assert_preserved(model, fixed)


@pytest.mark.parametrize("weight", [T.INT4, T.UINT4])
@pytest.mark.parametrize("blocked", [False, True])
def test_fix_keeps_int4_per_axis_and_blocked_weights_bit_for_bit(weight, blocked):
    model = _conv_relu_pool(T.UINT8, weight, blocked=blocked)
    fixed, report = kenosis_rewrite.fix(model, return_report=True)
    assert [(c.rule, c.exact) for c in report.changes] == [("fold-relu-island", True)]
    def weight_dq(m):
        node = next(n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "w_q")
        return list(node.input), list(node.output), list(node.attribute)
    assert weight_dq(fixed) == weight_dq(model)
    _assert_preserved(model, fixed)


@pytest.mark.parametrize("elem", [T.INT4, T.UINT4, T.INT16, T.FLOAT8E4M3FN, T.FLOAT8E5M2, T.INT8])
@pytest.mark.parametrize("blocked", [False, True])
def test_fix_on_quantized_constants_of_every_type(elem, blocked):
    """Q(constant weight) -> DQ -> MatMul with per-axis or blocked parameters of each type."""
    rng = np.random.default_rng(0)
    scale = np.full((2, 16) if blocked else (16,), 0.3, np.float32)
    attributes = {"axis": 0, "block_size": 16} if blocked else {"axis": 1}
    inits = [numpy_helper.from_array(rng.standard_normal((32, 16)).astype(np.float32), "w"),
             numpy_helper.from_array(scale, "ws"), _tensor("wz", np.zeros(scale.shape, np.int64), elem)]
    nodes = [helper.make_node("QuantizeLinear", ["w", "ws", "wz"], ["wq"], **attributes),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], **attributes),
             helper.make_node("MatMul", ["x", "wd"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [1, 32])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [1, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    fixed, report = kenosis_rewrite.fix(model, return_report=True)
    assert all(change.exact for change in report.changes)
    folded = {c.rule for c in report.changes}
    # 8/16-bit per-axis constants are quantized offline (exact); a blocked Q(constant) is a weight:
    # left alone (never retyped to uint8 as if it were an activation).
    expected = {(T.INT16, False): {"fold-constant-quantize"}, (T.INT8, False): {"fold-constant-quantize"}}.get(
        (elem, blocked), set())
    assert folded == expected
    x = rng.standard_normal((1, 32)).astype(np.float32)
    np.testing.assert_array_equal(model_checks.outputs(fixed, {"x": x}, optimized=False)[0],
                                  model_checks.outputs(model, {"x": x}, optimized=False)[0])

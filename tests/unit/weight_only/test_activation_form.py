"""quantize_weights() output fuses into MatMulNBits on every MLP shape, and the Relu/Clip -> Max/Min helpers.

Generated MLPs over {2-D, 3-D activations} x {no bias, Add bias, bias Add first, Gemm} x {Relu, Clip,
com.microsoft Gelu, Gelu as Erf, Sigmoid, nothing, a graph output} x block sizes: node by node in
ORT's optimized graph every weight MatMul is a MatMulNBits, the fused outputs match the same model
run with dequantized weights (DequantizeLinear + float MatMul, ORT's optimizations off) to float
rounding, and stay close to FP32 (cosine >= 0.99; 0.985 at block 64).
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.testing import model_checks
from kenosis_rewrite.weight_only import activation_form, weights

DIMS = (128, 64, 128)  # x[..., 128] -> W0[128, 64] -> W1[64, 128]
BIASES = ("none", "add", "add_first", "gemm")
FOLLOWERS = ("Relu", "Clip", "GeluMS", "GeluErf", "Sigmoid", "none", "graph_output")
BLOCKS = (16, 32, 64)
FLOAT_OPS = {"MatMul", "Gemm", "FusedGemm", "FusedMatMul", "DequantizeLinear"}


def _const(inits, name, array):
    inits.append(numpy_helper.from_array(np.asarray(array, inits.dtype), name))
    return name


class _Initializers(list):
    """Initializers of one float type."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype


def _follower(nodes, inits, kind: str, x: str, i: int) -> str:
    if kind in ("none", "graph_output"):
        return x
    out = f"act{i}"
    if kind == "Clip":
        nodes.append(helper.make_node("Clip", [x, _const(inits, f"lo{i}", 0.0), _const(inits, f"hi{i}", 6.0)], [out]))
    elif kind == "GeluMS":
        nodes.append(helper.make_node("Gelu", [x], [out], domain="com.microsoft"))
    elif kind == "GeluErf":
        nodes += [helper.make_node("Div", [x, _const(inits, f"sqrt2_{i}", np.sqrt(2))], [f"div{i}"]),
                  helper.make_node("Erf", [f"div{i}"], [f"erf{i}"]),
                  helper.make_node("Add", [f"erf{i}", _const(inits, f"one{i}", 1.0)], [f"erf1_{i}"]),
                  helper.make_node("Mul", [x, f"erf1_{i}"], [f"mul{i}"]),
                  helper.make_node("Mul", [f"mul{i}", _const(inits, f"half{i}", 0.5)], [out])]
    else:
        nodes.append(helper.make_node(kind, [x], [out]))
    return out


def mlp(rank: int, bias: str, follower: str, seed: int = 0, dtype=np.float32) -> onnx.ModelProto:
    """Two layers ``(MatMul | Gemm) (+ bias) -> follower`` on ``x[4, 128]`` (rank 2) or ``x[1, 4, 128]``."""
    rng = np.random.default_rng(seed)
    nodes, inits, x, matmul_outputs = [], _Initializers(dtype), "x", []
    for i, (k, n) in enumerate(zip(DIMS, DIMS[1:])):
        weight = rng.standard_normal((k, n)) / np.sqrt(k)
        if bias == "gemm":
            inputs = [x, _const(inits, f"w{i}", weight.T), _const(inits, f"b{i}", 0.1 * rng.standard_normal(n))]
            nodes.append(helper.make_node("Gemm", inputs, [f"mm{i}"], transB=1, name=f"gemm{i}"))
        else:
            nodes.append(helper.make_node("MatMul", [x, _const(inits, f"w{i}", weight)], [f"mm{i}"], name=f"matmul{i}"))
        x = f"mm{i}"
        if bias in ("add", "add_first"):
            b = _const(inits, f"b{i}", 0.1 * rng.standard_normal(n))
            nodes.append(helper.make_node("Add", [x, b] if bias == "add" else [b, x], [f"biased{i}"]))
            x = f"biased{i}"
        matmul_outputs.append(x)
        x = _follower(nodes, inits, follower, x, i)
    shape = [4] if rank == 2 else [1, 4]
    outputs = zip(matmul_outputs, DIMS[1:]) if follower == "graph_output" else [(x, DIMS[-1])]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", elem, [*shape, DIMS[0]])],
                              [helper.make_tensor_value_info(o, elem, [*shape, n]) for o, n in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


CASES = [(rank, bias, follower) for rank, bias, follower in itertools.product((2, 3), BIASES, FOLLOWERS)
         if not (rank == 3 and bias == "gemm")]  # Gemm takes 2-D inputs only


def _outputs(model: onnx.ModelProto, feed: dict, optimized: bool) -> list[np.ndarray]:
    """Outputs with ORT's optimizations on or off; MatMulNBits at accuracy level 0 (float A), the
    arithmetic of DequantizeLinear + float MatMul up to summation order."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimized
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize(("rank", "bias", "follower"), CASES)
def test_every_weight_matmul_of_every_mlp_shape_runs_as_matmulnbits(rank, bias, follower):
    block = BLOCKS[CASES.index((rank, bias, follower)) % len(BLOCKS)]
    model = mlp(rank, bias, follower)
    quantized = weights.quantize_weights(model, block_size=block)
    # our output, node by node: each weight MatMul reads an int4 blocked DQ; no Relu/Clip left after one
    types = model_checks.op_types(quantized)
    assert types["MatMul"] == 2 and types["DequantizeLinear"] == 2 and types["Gemm"] == 0
    for node in quantized.graph.node:
        if node.op_type == "DequantizeLinear":
            assert {a.name: a.i for a in node.attribute} == {"axis": 0, "block_size": block}
        assert node.op_type not in ("Relu", "Clip")
    if follower in ("Relu", "Clip"):
        assert types["Max"] == 2 and types["Min"] == (2 if follower == "Clip" else 0)
    # ORT's optimized graph, node by node: both MatMuls are MatMulNBits, nothing float is left of them
    optimized = model_checks.ort_optimized(quantized)
    ops = [node.op_type for node in optimized.graph.node]
    assert ops.count("MatMulNBits") == 2, ops
    assert not FLOAT_OPS & set(ops), ops
    for node in optimized.graph.node:
        if node.op_type == "MatMulNBits":
            attributes = {a.name: a.i for a in node.attribute}
            assert attributes["bits"] == 4 and attributes["block_size"] == block
    # numerics: fused == dequantized-weight float model to float rounding; close to FP32
    for seed in range(2):
        x = np.random.default_rng(seed + 10).standard_normal((4, DIMS[0]) if rank == 2 else (1, 4, DIMS[0]))
        feed = {"x": x.astype(np.float32)}
        fused, dequantized = _outputs(quantized, feed, True), _outputs(quantized, feed, False)
        for got, expected in zip(fused, dequantized):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
        for got, expected in zip(fused, _outputs(model, feed, False)):  # int4: ~21 dB a layer at block 32
            assert _cosine(got, expected) >= (0.99 if block <= 32 else 0.985)


@pytest.mark.parametrize("follower", ["Relu", "Clip", "Sigmoid"])
@pytest.mark.parametrize(("rank", "bias"), [(2, "none"), (2, "add"), (3, "add_first")])
def test_float16_mlps_fuse_too(rank, bias, follower):
    model = mlp(rank, bias, follower, dtype=np.float16)
    quantized = weights.quantize_weights(model)
    ops = [node.op_type for node in model_checks.ort_optimized(quantized).graph.node]
    assert ops.count("MatMulNBits") == 2 and not FLOAT_OPS & set(ops), ops
    x = np.random.default_rng(3).standard_normal((4, DIMS[0]) if rank == 2 else (1, 4, DIMS[0])).astype(np.float16)
    for got, expected in zip(_outputs(quantized, {"x": x}, True), _outputs(model, {"x": x}, False)):
        assert _cosine(got, expected) >= 0.99


def test_max_min_form_is_bit_identical_to_relu_and_clip_without_fusion():
    """Max/Min compute what Relu/Clip did: the same model run op by op, with the Relu/Clip put back."""
    for follower in ("Relu", "Clip"):
        quantized = weights.quantize_weights(mlp(2, "add", follower), form="qdq")
        before = ir.serde.deserialize_model(weights.quantize_weights(mlp(2, "add", follower)))
        # rebuild the Relu/Clip form from the quantized graph: Max(x, 0) -> Relu, Min(Max(x, lo), hi) -> Clip
        proto = onnx.ModelProto.FromString(quantized.SerializeToString())
        nodes = []
        for node in proto.graph.node:
            if node.op_type == "Max" and follower == "Relu":
                nodes.append(helper.make_node("Relu", [node.input[0]], list(node.output)))
            elif node.op_type == "Max":
                bound_max = next(n for n in proto.graph.node if n.op_type == "Min" and n.input[0] == node.output[0])
                nodes.append(helper.make_node("Clip", [node.input[0], node.input[1], bound_max.input[1]],
                                              list(bound_max.output)))
            elif node.op_type != "Min":
                nodes.append(node)
        del proto.graph.node[:]
        proto.graph.node.extend(nodes)
        feed = {"x": np.random.default_rng(0).standard_normal((4, DIMS[0])).astype(np.float32)}
        for a, b in zip(_outputs(proto, feed, False), _outputs(quantized, feed, False)):
            np.testing.assert_array_equal(a, b)
        assert sum(n.op_type == "Max" for n in before.graph) == 2


def _graph(nodes_text: str) -> ir.Graph:
    model = onnx.parser.parse_model(f"""<ir_version: 10, opset_import: ["" : 21]>
        g (float[4, 8] x) => (float[4, 8] y) <float[8, 8] w = {{{', '.join(['0.5'] * 64)}}}, float[8] b = {{{', '.join(['0.1'] * 8)}}},
        float lo = {{-1.0}}, float hi = {{2.0}}> {{ {nodes_text} }}""")
    return ir.serde.deserialize_model(model).graph


def _node(graph: ir.Graph, op_type: str) -> ir.Node:
    return next(node for node in graph if node.op_type == op_type)


def test_blocked_matmul_finds_the_matmul_directly_or_through_one_add_only_when_sole_reader():
    def always(_):
        return True
    direct = _graph("m = MatMul(x, w)\n y = Relu(m)")
    assert activation_form.blocked_matmul(_node(direct, "Relu"), always) is _node(direct, "MatMul")
    assert activation_form.blocked_matmul(_node(direct, "Relu"), lambda node: False) is None
    through_add = _graph("m = MatMul(x, w)\n a = Add(b, m)\n y = Clip(a, lo, hi)")
    assert activation_form.blocked_matmul(_node(through_add, "Clip"), always) is _node(through_add, "MatMul")
    shared = _graph("m = MatMul(x, w)\n r = Relu(m)\n y = Add(r, m)")
    assert activation_form.blocked_matmul(_node(shared, "Relu"), always) is None  # ORT fuses that one
    two_adds = _graph("m = MatMul(x, w)\n a = Add(m, b)\n c = Add(a, x)\n y = Relu(c)")
    assert activation_form.blocked_matmul(_node(two_adds, "Relu"), always) is None
    assert activation_form.blocked_matmul(_node(two_adds, "MatMul"), always) is None


def test_min_max_steps_and_rewrite_keep_the_output_name():
    graph = _graph("m = MatMul(x, w)\n y = Clip(m, lo, hi)")
    assert activation_form.min_max_steps(_node(graph, "Clip")) == [("Max", -1.0), ("Min", 2.0)]
    assert activation_form.min_max_steps(_node(_graph("y = Relu(x)"), "Relu")) == [("Max", 0.0)]
    assert activation_form.min_max_steps(_node(_graph("y = Clip(x, lo)"), "Clip")) == [("Max", -1.0)]
    assert activation_form.min_max_steps(_node(_graph("y = Clip(x, x, hi)"), "Clip")) == "Clip bound 'x' is not a constant"
    assert activation_form.min_max_steps(_node(_graph("y = Clip(x)"), "Clip")) == []
    assert activation_form.rewrite_as_min_max(_node(graph, "Clip"), np.float32, qdq_params.NameAllocator(graph))
    assert [node.op_type for node in graph] == ["MatMul", "Max", "Min"]
    assert graph.outputs[0].name == "y" and graph.outputs[0].producer().op_type == "Min"
    unbounded = _graph("y = Clip(x)")
    assert not activation_form.rewrite_as_min_max(_node(unbounded, "Clip"), np.float32, qdq_params.NameAllocator(unbounded))

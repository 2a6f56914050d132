"""Tests of the residual Add -> Sum rule (no SkipLayerNormalization fusion on ORT CPU)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from kenosis_rewrite.canonicalization.rules.residual_sum import MATMUL_BIAS_RULE_NAME, RULE_NAME, ResidualAddAsSum, residual_sum_rules
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.testing import model_checks

# bias Add then residual Add then LayerNormalization: what ORT fuses into SkipLayerNormalization
BLOCK = """
<ir_version: 8, opset_import: ["" : {opset}]>
g (float[1,6,8] x, float[1,6,8] r) => (float[1,6,8] y)
<float[8] bias = {{0.1, -0.2, 0.3, 0.0, 0.5, -0.6, 0.7, 0.05}}, float[8] gamma = {{1, 2, 1, 0.5, 1, 1, 3, 1}},
 float[8] beta = {{0, 0.1, 0, 0, -0.1, 0, 0, 0.2}}>
{{
  xb = Add(x, bias)
  s = Add(xb, r)
  y = LayerNormalization(s, gamma, beta)
}}
"""

# the decomposed form an exporter writes (ORT's LayerNormFusion makes it one op at session time)
DECOMPOSED = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[1,6,8] x, float[1,6,8] r) => (float[1,6,8] y, float[1,6,8] s)
<float eps = {0.00001}, float two = {2.0}, float[8] gamma = {1, 2, 1, 0.5, 1, 1, 3, 1}, int64[1] axes = {-1}>
{
  s = Add(x, r)
  mean = ReduceMean(s, axes)
  d = Sub(s, mean)
  d2 = Pow(d, two)
  var = ReduceMean(d2, axes)
  ve = Add(var, eps)
  sd = Sqrt(ve)
  n = Div(d, sd)
  y = Mul(n, gamma)
}
"""


def _apply(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, FixReport, int]:
    return model_checks.apply_reporting_rules(proto, residual_sum_rules)


def _assert_bit_identical(a: onnx.ModelProto, b: onnx.ModelProto, n: int = 4) -> None:
    """The graphs compute the same function bit for bit (each op as ONNX defines it: no session
    fusions); with ORT's fusions on, the original runs as SkipLayerNormalization, which rounds its
    own way, so there the outputs agree to float rounding only."""
    for seed in range(n):
        rng = np.random.default_rng(seed)
        feed = {name: rng.standard_normal((1, 6, 8)).astype(np.float32) * 3 for name in ("x", "r")}
        for got, want in zip(model_checks.outputs(b, feed, optimized=False), model_checks.outputs(a, feed, optimized=False)):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(model_checks.outputs(b, feed), model_checks.outputs(a, feed)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_residual_add_before_layernorm_becomes_sum_and_ort_no_longer_fuses_skip_layernorm():
    proto = onnx.parser.parse_model(BLOCK.format(opset=17))
    assert model_checks.ort_optimized_op_types(proto)["SkipLayerNormalization"] == 1  # the slow kernel
    fixed, report, count = _apply(proto)
    assert count == 1
    assert [n.op_type for n in fixed.graph.node] == ["Add", "Sum", "LayerNormalization"]
    assert list(fixed.graph.node[1].input) == ["xb", "r"]  # the bias Add stays an Add
    assert [c.rule for c in report.changes] == [RULE_NAME] and report.changes[0].exact
    optimized = model_checks.ort_optimized_op_types(fixed)
    assert "SkipLayerNormalization" not in optimized and optimized["LayerNormalization"] == 1
    _assert_bit_identical(proto, fixed)


def test_decomposed_layernorm_reading_the_sum_is_recognised():
    proto = onnx.parser.parse_model(DECOMPOSED)
    fixed, _, count = _apply(proto)
    assert count == 1
    assert model_checks.op_types(fixed)["Sum"] == 1 and model_checks.op_types(fixed)["Add"] == 1  # Add(var, eps) stays
    assert "SkipLayerNormalization" not in model_checks.ort_optimized_op_types(fixed)
    _assert_bit_identical(proto, fixed)


@pytest.mark.parametrize(
    "source, reason",
    [
        # a constant input: a bias Add, which ORT fuses into the MatMul or GELU before it
        (BLOCK.format(opset=17).replace("s = Add(xb, r)", "s = Add(xb, bias)"), "constant"),
        # nothing reads the sum as a layer norm
        (BLOCK.format(opset=17).replace("y = LayerNormalization(s, gamma, beta)", "y = Relu(s)"), "no layer norm"),
    ],
)
def test_left_alone_with_reason(source, reason):
    proto = onnx.parser.parse_model(source)
    model = ir.serde.deserialize_model(proto)
    residual = next(node for node in model.graph if node.op_type == "Add" and node.outputs[0].name == "s")
    result = ResidualAddAsSum().check(None, *residual.inputs, added=residual.outputs[0])
    assert not result and reason in result.reason
    fixed, report, count = _apply(proto)
    assert count == 0 and not report.changes and model_checks.op_types(fixed)["Sum"] == 0


def test_integer_add_is_left_alone():
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (int32[4] x, int32[4] r) => (int32[4] y) { y = Add(x, r) }""")
    _, _, count = _apply(proto)
    assert count == 0


# DQ -> MatMul (no Q after it) -> bias Add, static shapes: ORT's MatMulAddFusion would make it a float Gemm
_INTEGER_MATMUL_WEIGHTS = ", ".join(str(v) for v in np.random.default_rng(0).integers(-127, 128, 32 * 8))
INTEGER_MATMUL = f"""
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,16,32] x) => (float[1,16,8] y)
<float sx = {{0.05}}, uint8 zx = {{128}}, int8[32,8] w = {{{_INTEGER_MATMUL_WEIGHTS}}},
 float[8] sw = {{0.01, 0.02, 0.01, 0.03, 0.01, 0.02, 0.02, 0.01}},
 int8[8] zw = {{0, 0, 0, 0, 0, 0, 0, 0}}, float[8] bias = {{0.1, -0.2, 0.3, 0.0, 0.5, -0.6, 0.7, 0.05}}>
{{
  qx = QuantizeLinear(x, sx, zx)
  dx = DequantizeLinear(qx, sx, zx)
  dw = DequantizeLinear(w, sw, zw)
  m = MatMul(dx, dw)
  y = Add(m, bias)
}}
"""


def test_integer_matmul_bias_becomes_sum_and_the_matmul_stays_integer():
    proto = onnx.shape_inference.infer_shapes(onnx.parser.parse_model(INTEGER_MATMUL))
    before = model_checks.ort_optimized_op_types(proto)
    assert before["Gemm"] == 1 and "MatMulIntegerToFloat" not in before  # the float GEMM it replaces
    fixed, report, count = _apply(proto)
    assert count == 1 and [c.rule for c in report.changes] == [MATMUL_BIAS_RULE_NAME]
    assert model_checks.op_types(fixed)["Sum"] == 1 and "Add" not in model_checks.op_types(fixed)
    after = model_checks.ort_optimized_op_types(fixed)
    assert after["MatMulIntegerToFloat"] == 1 and "Gemm" not in after
    for seed in range(3):
        feed = {"x": np.random.default_rng(seed).standard_normal((1, 16, 32)).astype(np.float32)}
        np.testing.assert_array_equal(model_checks.outputs(fixed, feed, optimized=False)[0],
                                      model_checks.outputs(proto, feed, optimized=False)[0])


# weight-only int4 MatMul -> bias -> Relu on 2-D activations: ORT would make a float FusedGemm, not MatMulNBits
def _weight_only_model() -> onnx.ModelProto:
    """Two int4 weight-only layers MatMul -> bias Add -> Relu on [1, 64]: ORT fuses the second
    into a float FusedGemm, not MatMulNBits."""
    rng = np.random.default_rng(1)
    make = onnx.helper.make_node
    nodes, inits, x = [], [], "x"
    for i in range(2):
        inits += [onnx.helper.make_tensor(f"w{i}", onnx.TensorProto.INT4, [64, 64], rng.integers(-8, 8, 64 * 64).tolist()),
                  onnx.numpy_helper.from_array(rng.uniform(0.01, 0.05, (4, 64)).astype(np.float32), f"s{i}"),
                  onnx.numpy_helper.from_array((0.1 * rng.standard_normal(64)).astype(np.float32), f"b{i}")]
        nodes += [make("DequantizeLinear", [f"w{i}", f"s{i}"], [f"d{i}"], axis=0, block_size=16),
                  make("MatMul", [x, f"d{i}"], [f"m{i}"]), make("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  make("Relu", [f"a{i}"], [f"r{i}"])]
        x = f"r{i}"
    vi = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(nodes, "g", [vi("x", onnx.TensorProto.FLOAT, [1, 64])],
                                   [vi(x, onnx.TensorProto.FLOAT, [1, 64])], inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)


def test_weight_only_blocked_matmul_bias_becomes_sum_and_fuses_to_matmul_nbits():
    proto = _weight_only_model()
    before = model_checks.ort_optimized_op_types(proto)
    assert before["FusedGemm"] == 1  # ORT's Gemm fusion came first on one of the two
    fixed, report, count = _apply(proto)
    assert count == 2 and {c.rule for c in report.changes} == {MATMUL_BIAS_RULE_NAME}
    after = model_checks.ort_optimized_op_types(fixed)
    assert after["MatMulNBits"] == 2 and not (after["Gemm"] or after["FusedGemm"])
    for seed in range(3):
        feed = {"x": np.random.default_rng(seed).standard_normal((1, 64)).astype(np.float32)}
        np.testing.assert_array_equal(model_checks.outputs(fixed, feed, optimized=False)[0],
                                      model_checks.outputs(proto, feed, optimized=False)[0])
        # under ORT, MatMulNBits computes at its QDQ fusion's default accuracy level 4 (int8
        # activations per block), where the input ran a float FusedGemm: close, not equal
        assert fidelity.cosine(model_checks.outputs(fixed, feed)[0], model_checks.outputs(proto, feed)[0]) > 0.999


@pytest.mark.parametrize("source", [
    INTEGER_MATMUL.replace("m = MatMul(dx, dw)", "m = MatMul(x, dw)"),  # a float MatMul, per-channel weight
    # symbolic shapes: MatMulAddFusion does not fire, and the Add (faster than Sum on 2 threads) stays
    INTEGER_MATMUL.replace("float[1,16,32] x) => (float[1,16,8] y)", 'float[1,"S",32] x) => (float[1,"S",8] y)'),
])
def test_bias_add_left_alone_where_orts_fusion_would_not_fire(source):
    proto = onnx.shape_inference.infer_shapes(onnx.parser.parse_model(source))
    _, _, count = _apply(proto)
    assert count == 0
    assert "MatMulIntegerToFloat" in model_checks.ort_optimized_op_types(proto) or "MatMul(x, dw)" in source


@pytest.mark.parametrize("seed", range(6))
def test_property_generated_transformers_fp32_and_qdq_rewritten_bit_exactly(seed):
    """Generated pre-LayerNorm encoders (random width, heads, length, depth), as FP32 and as
    quantize_static QDQ with MatMul outputs left float (the weighted plan's placement, static
    shapes): every residual Add and every integer MatMul's bias Add becomes a Sum, op by op the
    outputs are bit-identical, and ORT then runs no SkipLayerNormalization, and in the QDQ model
    every weight MatMul integer (no float Gemm; in FP32 its MatMul+Add -> Gemm is right)."""
    from kenosis_rewrite.core import ort_quantize  # noqa: PLC0415
    from kenosis_rewrite.weight_only import weights

    rng = np.random.default_rng(seed)
    heads = int(rng.choice([1, 2, 4]))
    hidden, seq, layers = heads * int(rng.choice([8, 16])), int(rng.integers(3, 12)), int(rng.integers(1, 3))
    fp32 = weights.toy_transformer(hidden=hidden, layers=layers, heads=heads, seq=seq, seed=seed)
    feeds = [{"x": rng.standard_normal((1, seq, hidden)).astype(np.float32)} for _ in range(4)]
    qdq = ort_quantize.quantize_with_ort(
        fp32, feeds, "default", activation_type=ort_quantize.QuantType.QUInt8, op_types_to_quantize=["MatMul"],
        nodes_to_exclude=[f"layer{i}.attn/{p}" for i in range(layers) for p in ("QK", "PV")],
        extra_options={"OpTypesToExcludeOutputQuantization": ["MatMul"]})
    for proto, expected in ((fp32, 2 * layers), (qdq, 2 * layers + 6 * layers)):
        fixed, report, count = _apply(onnx.shape_inference.infer_shapes(proto))
        assert count == expected and all(change.exact for change in report.changes)
        assert "SkipLayerNormalization" not in model_checks.ort_optimized_op_types(fixed)
        for feed in feeds:
            for got, want in zip(model_checks.outputs(fixed, feed, optimized=False), model_checks.outputs(proto, feed, optimized=False)):
                np.testing.assert_array_equal(got, want)
    runs = model_checks.ort_optimized_op_types(fixed)  # the QDQ model
    assert runs["MatMulIntegerToFloat"] == 6 * layers and "Gemm" not in runs

"""explain(): ORT CPU integer-kernel coverage, MAC weighting and float reasons, checked against ORT itself."""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.diagnosis.explain import (
    R_ACTIVATION,
    R_BIAS_TYPE,
    R_FANOUT,
    R_GRAPH_OUTPUT,
    R_INT8_NO_Q,
    R_MISSING,
    R_NO_KERNEL,
    R_PER_AXIS_ACTIVATION,
    R_STALE_BIAS,
    R_UNSUPPORTED_TYPE,
    R_WEIGHT_ONLY,
    R_ZP_NOT_QMIN,
    FusionReport,
    base_name,
    explain,
)
from kenosis_rewrite.errors import KenosisError, NotAnOnnxModelError, RuntimeMeasurementError
from kenosis_rewrite.testing import toy_models


@functools.cache
def _quantized_bytes(name: str, config: str) -> bytes:
    model = toy_models.build(name)
    if config != "fp32":
        model = ort_quantize.quantize_with_ort(model, toy_models.random_feeds(model, 4), config)
    return model.SerializeToString()


def quantized(name: str, config: str) -> onnx.ModelProto:
    """A fresh copy of toy model ``name`` quantized with ``config`` (cached across tests)."""
    return onnx.load_from_string(_quantized_bytes(name, config))


@functools.cache
def _report(name: str, config: str) -> FusionReport:
    return explain(quantized(name, config))


def _ints(count: int, lo: int, hi: int) -> str:
    values = np.random.default_rng(0).integers(lo, hi, count)
    return ", ".join(str(int(v)) for v in values)


def conv_qdq(
    *, xt="uint8", xz=128, yt=None, yz=None, act="", ys=0.05, xs=0.02, bias_scale=None, bias="dq",
    out_q=True, x_int_input=False, fanout=False, w_axis="", wz="0", w_scale="0.01", bias_type="int32",
) -> onnx.ModelProto:
    """``x -> Q -> DQ -> Conv3x3(DQ w, DQ b) [-> act] -> Q -> DQ -> y`` on [1,4,8,8], written in ONNX text."""
    yt, yz = yt or xt, xz if yz is None else yz
    bs = xs * 0.01 if bias_scale is None else bias_scale
    lines = ["xd = DequantizeLinear(x, xs, xz)"] if x_int_input else [
        "xq = QuantizeLinear(x, xs, xz)", "xd = DequantizeLinear(xq, xs, xz)"]
    lines.append(f"wd = DequantizeLinear{w_axis}(w, ws, wz)")
    lines.append("bd = DequantizeLinear(b, bs)" if bias == "dq" else "bd = Identity(bf)")
    lines.append("c = Conv <pads = [1, 1, 1, 1]> (xd, wd, bd)")
    head = "c"
    if act:
        lines.append(f"a = {act}")
        head = "a"
    if out_q is True:
        lines += [f"yq = QuantizeLinear({head}, ys, yz)", "y = DequantizeLinear(yq, ys, yz)"]
    elif out_q == "graph":  # a float activation producing the graph output
        lines.append(f"y = Relu({head})")
    else:  # float ops all the way, no QuantizeLinear anywhere after the Conv
        lines += [f"r = Relu({head})", "y = Add(r, r)"]
    outputs = "float[1,4,8,8] y" + (", float[1,4,8,8] z" if fanout else "")
    if fanout:
        lines.append("z = Relu(xd)")
    x_decl = f"{xt}[1,4,8,8] x" if x_int_input else "float[1,4,8,8] x"
    w_decl = "[4]" if w_axis else ""
    text = f"""<ir_version: 9, opset_import: ["" : 21]>
conv ({x_decl}) => ({outputs})
<float xs = {{{xs}}}, {xt} xz = {{{xz}}}, int8[4,4,3,3] w = {{{_ints(144, -60, 60)}}},
 float{w_decl} ws = {{{w_scale}}}, int8{w_decl} wz = {{{wz}}}, {bias_type}[4] b = {{{_ints(4, -100, 100)}}},
 float bs = {{{bs}}}, float[4] bf = {{0.1, 0.2, 0.3, 0.4}}, float ys = {{{ys}}}, {yt} yz = {{{yz}}},
 float lo = {{0.0}}, float hi = {{6.0}}>
{{
{chr(10).join(lines)}
}}
"""
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model)
    return model


def single_op(model: onnx.ModelProto):
    report = explain(model)
    assert len(report.ops) == 1
    return report.ops[0]


# ---------------------------------------------------------------------------------------------
# quantize_static models
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["conv_relu", "resnetish", "matmul_relu", "gemm_relu", "gap_head", "conv_leakyrelu"])
def test_u8s8_models_run_fully_integer(name):
    report = _report(name, "u8s8")
    assert report.integer_mac_fraction == 1.0
    assert report.float_ops == []
    assert all(op.reason is None and op.fixing_rule is None for op in report.ops)
    assert all(op.optimized_op_type in ("com.microsoft.QLinearConv", "QLinearMatMul", "com.microsoft.QGemm")
               for op in report.ops)


def test_default_resnetish_names_the_int8_fanout_convs():
    report = _report("resnetish", "default")
    floats = {op.name: op for op in report.float_ops}
    # The Convs reading the residual (MaxPool / Add outputs read by a Conv and the next Add).
    assert set(floats) == {"Conv_12", "Conv_26", "Conv_40"}
    for op in floats.values():
        assert op.reason == R_FANOUT
        assert op.fixing_rule == "activation-int8-to-uint8"
        assert op.optimized_op_type == "Conv"
    assert 0.5 < report.integer_mac_fraction < 0.6  # 4 of 7 equal Convs + the tiny Gemm
    kernels = {op.name: op.optimized_op_type for op in report.ops if op.kernel == "integer"}
    assert kernels["Gemm_58"] == "com.microsoft.QGemm"
    assert kernels["Conv_4"] == "com.microsoft.QLinearConv"
    # The residual Adds stay float too; the islands say why.
    adds = [i for i in report.float_islands if i.op_types == ("Add",)]
    assert len(adds) == 3 and all(i.fixing_rule == "activation-int8-to-uint8" for i in adds)


def test_default_conv_add_relu_fanout_on_the_shared_input():
    report = _report("conv_add_relu", "default")
    assert [op.name for op in report.float_ops] == ["Conv_4"]
    op = report.float_ops[0]
    assert (op.reason, op.fixing_rule) == (R_FANOUT, "activation-int8-to-uint8")
    assert "read by 2 ops" in op.detail


def test_u8s8_of_the_same_models_fixes_what_default_breaks():
    assert _report("conv_add_relu", "u8s8").integer_mac_fraction == 1.0
    assert _report("resnetish", "default").integer_mac_fraction < _report("resnetish", "u8s8").integer_mac_fraction


def test_stale_bias_edited_by_hand():
    model = quantized("conv_relu", "u8s8")
    bias_scale = next(t for t in model.graph.initializer if t.name == "b_8_quantized_scale")
    bias_scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(bias_scale) * 1.5, bias_scale.name))
    report = explain(model)
    ops = {op.name: op for op in report.ops}
    assert ops["Conv_4"].kernel == "integer"
    assert ops["Conv_10"].kernel == "float"
    assert (ops["Conv_10"].reason, ops["Conv_10"].fixing_rule) == (R_STALE_BIAS, "requantize-stale-bias")


def test_fp32_model_is_zero_percent_with_missing_qdq():
    report = _report("resnetish", "fp32")
    assert report.integer_mac_fraction == 0.0
    assert len(report.float_ops) == len(report.ops) == 8
    assert {op.reason for op in report.ops} == {R_MISSING}
    assert all(op.fixing_rule is None for op in report.ops)


def test_float_islands_of_quantize_static_configs():
    relu = _report("conv_relu", "u8s8_sym").float_islands
    assert [(i.op_types, i.fixing_rule) for i in relu] == [(("Relu",), "fold-relu-island")]
    requantize = _report("conv_relu", "u8s8_convmm").float_islands
    assert [(i.kind, i.fixing_rule) for i in requantize] == [("requantize", "fold-relu-island")]
    prelu = _report("conv_prelu", "u8s8").float_islands
    assert [i.op_types for i in prelu] == [("PRelu",)] and prelu[0].fixing_rule.startswith("prelu-to")
    hardswish = _report("conv_hardswish", "u8s8").float_islands
    assert hardswish[0].fixing_rule is None and "no integer kernel" in hardswish[0].reason
    assert _report("conv_relu", "u8s8").float_islands == []


# ---------------------------------------------------------------------------------------------
# Hand-built graphs, one reason each (each verified against what ORT 1.31 does)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"act": "Relu(c)", "yz": 0},
        {"act": "Clip(c, lo, hi)", "yz": 0, "ys": 0.02},  # Q range [0, 5.1] inside [0, 6]
        {"xt": "int8", "xz": 0},  # single-consumer int8 pair: ORT converts it to uint8
        {"bias": "float"},  # ORT quantizes a float bias itself
        {"w_axis": " <axis = 0> ", "wz": "0, 1, 0, 2", "w_scale": "0.01, 0.01, 0.01, 0.01"},
    ],
    ids=["plain", "relu-zp-qmin", "clip-redundant", "int8-single-consumer", "float-bias", "per-channel-zps"],
)
def test_hand_built_conv_fuses(kwargs):
    op = single_op(conv_qdq(**kwargs))
    assert (op.kernel, op.optimized_op_type, op.reason) == ("integer", "com.microsoft.QLinearConv", None)


@pytest.mark.parametrize(
    ("kwargs", "reason", "rule", "fragment"),
    [
        ({"act": "Relu(c)", "yz": 128}, R_ZP_NOT_QMIN, "relu-on-codes", "zero point 128"),
        ({"act": "Clip(c, lo, hi)", "yz": 0, "ys": 0.05}, R_ZP_NOT_QMIN, "clip-on-codes", "not redundant"),
        ({"bias_scale": 0.0003}, R_STALE_BIAS, "requantize-stale-bias", "0.0003"),
        # Quark's XINT8 preset: an int8 bias with its own scale (even at input x weight scale)
        ({"bias_type": "int8"}, R_BIAS_TYPE, "requantize-stale-bias", "the bias is int8"),
        ({"xt": "int8", "xz": 0, "fanout": True}, R_FANOUT, "activation-int8-to-uint8", "read by 2 ops"),
        ({"xt": "int8", "xz": 0, "x_int_input": True}, R_INT8_NO_Q, "activation-int8-to-uint8", "'x'"),
        ({"xt": "int16", "xz": 0}, R_UNSUPPORTED_TYPE, None, "int16"),
        ({"out_q": False}, R_MISSING, None, "no QuantizeLinear"),
        ({"out_q": "graph"}, R_GRAPH_OUTPUT, None, "graph output"),
        ({"act": "LeakyRelu(c)"}, R_ACTIVATION, None, "LeakyRelu"),
        ({"act": "Sigmoid(c)"}, R_ACTIVATION, None, "Sigmoid"),
    ],
    ids=["relu-zp-mid", "clip-too-wide", "stale-bias", "int8-bias", "int8-fanout", "int8-graph-input", "int16",
         "no-output-q", "relu-graph-output", "leakyrelu-before-q", "sigmoid-before-q"],
)
def test_hand_built_conv_float_reason(kwargs, reason, rule, fragment):
    op = single_op(conv_qdq(**kwargs))
    assert op.kernel == "float"
    assert op.optimized_op_type in ("Conv", "com.microsoft.FusedConv")
    assert (op.reason, op.fixing_rule) == (reason, rule)
    assert fragment in op.detail


def test_per_axis_activation_is_float():
    model = conv_qdq()
    graph = model.graph
    graph.initializer.extend([
        numpy_helper.from_array(np.full(4, 0.02, np.float32), "xs4"),
        numpy_helper.from_array(np.full(4, 128, np.uint8), "xz4"),
    ])
    for node in graph.node:
        if node.input[0] in ("x", "xq"):
            node.input[1:] = ["xs4", "xz4"]
            node.attribute.append(helper.make_attribute("axis", 1))
    op = single_op(model)
    assert (op.kernel, op.reason) == ("float", R_PER_AXIS_ACTIVATION)


def test_conv_producing_a_graph_output():
    text = """<ir_version: 9, opset_import: ["" : 21]>
g (float[1,4,8,8] x) => (float[1,4,8,8] y)
<float xs = {0.02}, uint8 xz = {128}, int8[4,4,1,1] w = {1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16}, float ws = {0.01}>
{
 xq = QuantizeLinear(x, xs, xz)
 xd = DequantizeLinear(xq, xs, xz)
 wd = DequantizeLinear(w, ws)
 y = Conv(xd, wd)
}"""
    op = single_op(onnx.parser.parse_model(text))
    assert (op.kernel, op.reason, op.optimized_op_type) == ("float", R_GRAPH_OUTPUT, "Conv")


MATMUL_TEXT = """<ir_version: 9, opset_import: ["" : 21]>
g (float[2,16] x) => (float[2,8] y)
<float xs = {{0.02}}, uint8 xz = {{128}}, int8[16,8] w = {{{w}}}, float ws = {{0.01}}, int8 wz = {{0}},
 float ys = {{0.05}}, uint8 yz = {{128}}, int32[8] b = {{{b}}}, float bs = {{{bs}}}>
{{
 xq = QuantizeLinear(x, xs, xz)
 xd = DequantizeLinear(xq, xs, xz)
 wd = DequantizeLinear(w, ws, wz)
 {body}
}}"""


def matmul_model(body: str, bs: float = 0.0002) -> onnx.ModelProto:
    return onnx.parser.parse_model(MATMUL_TEXT.format(w=_ints(128, -60, 60), b=_ints(8, -50, 50), bs=bs, body=body))


def test_matmul_without_output_q_is_matmul_integer_to_float():
    op = single_op(matmul_model("y = MatMul(xd, wd)"))
    assert (op.kernel, op.optimized_op_type) == ("integer", "com.microsoft.MatMulIntegerToFloat")


def test_gemm_with_stale_bias_fuses_but_warns():
    body = "bd = DequantizeLinear(b, bs)\n m = Gemm(xd, wd, bd)\n yq = QuantizeLinear(m, ys, yz)\n y = DequantizeLinear(yq, ys, yz)"
    good = single_op(matmul_model(body))
    assert (good.kernel, good.optimized_op_type, good.warning) == ("integer", "com.microsoft.QGemm", None)
    stale = single_op(matmul_model(body, bs=0.0003))
    assert stale.kernel == "integer"
    assert R_STALE_BIAS in stale.warning and "requantize-stale-bias" in stale.warning


def test_conv_transpose_has_no_qdq_fusion():
    text = f"""<ir_version: 9, opset_import: ["" : 21]>
g (float[1,4,8,8] x) => (float[1,4,16,16] y)
<float xs = {{0.02}}, uint8 xz = {{128}}, int8[4,4,2,2] w = {{{_ints(64, -60, 60)}}}, float ws = {{0.01}},
 float ys = {{0.05}}, uint8 yz = {{128}}>
{{
 xq = QuantizeLinear(x, xs, xz)
 xd = DequantizeLinear(xq, xs, xz)
 wd = DequantizeLinear(w, ws)
 c = ConvTranspose <strides = [2, 2]> (xd, wd)
 yq = QuantizeLinear(c, ys, yz)
 y = DequantizeLinear(yq, ys, yz)
}}"""
    op = single_op(onnx.parser.parse_model(text))
    assert (op.kernel, op.reason, op.optimized_op_type) == ("float", R_NO_KERNEL, "ConvTranspose")
    assert op.macs == 1 * 8 * 8 * 4 * 4 * 2 * 2  # every input pixel scatters a Cout x 2 x 2 kernel


def test_int4_weight_only_matmuls():
    nodes, inits, x = [], [], "x"
    rng = np.random.default_rng(0)
    for i in range(2):
        inits.append(helper.make_tensor(f"w{i}", TensorProto.INT4, [64, 64], rng.integers(-8, 8, 64 * 64).tolist()))
        inits.append(helper.make_tensor(f"s{i}", TensorProto.FLOAT, [2, 64], [0.01] * 128))
        nodes.append(helper.make_node("DequantizeLinear", [f"w{i}", f"s{i}"], [f"wd{i}"], axis=0, block_size=32))
        nodes.append(helper.make_node("MatMul", [x, f"wd{i}"], [f"m{i}"], name=f"MatMul{i}"))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"]))
        x = f"r{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 64])], inits)
    report = explain(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10))
    ops = {op.name: op for op in report.ops}
    # ORT 1.31 fuses only the MatMul whose output leads to the graph output (see the research notes).
    assert ops["MatMul1"].optimized_op_type == "com.microsoft.MatMulNBits" and ops["MatMul1"].kernel == "integer"
    assert (ops["MatMul0"].kernel, ops["MatMul0"].reason) == ("float", R_WEIGHT_ONLY)
    assert report.integer_mac_fraction == 0.5


# ---------------------------------------------------------------------------------------------
# MACs
# ---------------------------------------------------------------------------------------------


def test_macs_of_toy_models_match_hand_computation():
    conv = {op.name: op.macs for op in _report("conv_relu", "u8s8").ops}
    assert conv == {"Conv_4": 16 * 16 * 16 * 16 * 9, "Conv_10": 16 * 16 * 16 * 16}
    matmul = [op.macs for op in _report("matmul_relu", "u8s8").ops]
    assert matmul == [32 * 64 * 64, 32 * 64 * 64]
    gemm = [op.macs for op in _report("gemm_relu", "u8s8").ops]
    assert gemm == [8 * 64 * 64, 8 * 64 * 10]
    report = _report("conv_relu", "u8s8")
    assert report.total_macs == sum(conv.values())


def test_macs_of_strided_grouped_conv_and_batched_matmul():
    text = """<ir_version: 9, opset_import: ["" : 17]>
g (float[2,8,9,9] x, float[3,1,5,6] a, float[4,6,7] b) => (float[2,4,5,5] y, float[3,4,5,7] m)
<float[4,4,3,3] w = {""" + ", ".join(["0.1"] * 144) + """}>
{
 y = Conv <strides = [2, 2], pads = [1, 1, 1, 1], group = 2> (x, w)
 m = MatMul(a, b)
}"""
    report = explain(onnx.parser.parse_model(text))
    macs = [op.macs for op in report.ops]
    assert macs == [2 * 4 * 5 * 5 * (8 // 2) * 3 * 3, 3 * 4 * 5 * 6 * 7]


def test_unknown_dims_count_as_one():
    text = """<ir_version: 9, opset_import: ["" : 17]>
g (float[N,16] x) => (float[N,8] y)
<float[16,8] w = {""" + ", ".join(["0.5"] * 128) + """}>
{
 y = MatMul(x, w)
}"""
    assert [op.macs for op in explain(onnx.parser.parse_model(text)).ops] == [16 * 8]


# ---------------------------------------------------------------------------------------------
# Report API, inputs, errors
# ---------------------------------------------------------------------------------------------


def test_report_serialisation_and_summary():
    report = _report("conv_add_relu", "default")
    data = json.loads(report.to_json())
    assert data["integer_mac_fraction"] == pytest.approx(report.integer_mac_fraction)
    assert data["total_macs"] == report.total_macs
    assert [op["name"] for op in data["ops"]] == [op.name for op in report.ops]
    assert data["optimized_op_counts"]["com.microsoft.QLinearConv"] == 2
    assert report.optimized_op_counts["Conv"] == 1
    lines = report.summary().splitlines()
    assert lines[0].startswith(f"Integer kernels: {100 * report.integer_mac_fraction:.1f}% of MACs (2/3 heavy ops")
    assert any("Conv_4" in line and R_FANOUT in line and "activation-int8-to-uint8" in line for line in lines)


def test_accepts_ir_model_and_path(tmp_path):
    proto = quantized("conv_relu", "u8s8")
    path = tmp_path / "model.onnx"
    onnx.save(proto, path)
    from_path = explain(path)
    from_ir = explain(ir.serde.deserialize_model(proto))
    assert from_path.to_dict() == from_ir.to_dict() == _report("conv_relu", "u8s8").to_dict()


def test_not_an_onnx_model(tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(NotAnOnnxModelError):
        explain(junk)
    with pytest.raises(NotAnOnnxModelError):
        explain(tmp_path / "missing.onnx")
    with pytest.raises(KenosisError):
        explain(42)


def test_ort_session_failure_is_a_runtime_measurement_error():
    node = helper.make_node("Mystery", ["x"], ["y"], domain="com.example")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    with pytest.raises(RuntimeMeasurementError, match="ONNX Runtime"):
        explain(model)


def test_base_name_strips_ort_suffixes():
    assert base_name("Conv_4_token_24") == "Conv_4"
    assert base_name("relu_5_nchwc") == "relu_5"
    assert base_name("x_DequantizeLinear/duplicated") == "x_DequantizeLinear"
    assert base_name("Conv_40") == "Conv_40"


def test_attention_products_are_explained_as_float_by_design():
    from kenosis_rewrite import quantize
    from kenosis_rewrite.diagnosis.explain import R_ACTIVATION_PRODUCT
    from kenosis_rewrite.weight_only import weights

    transformer = weights.toy_transformer(hidden=64, layers=1, heads=4, seq=16)
    rng = np.random.default_rng(0)
    quantized = quantize(transformer, [{"x": rng.standard_normal((1, 16, 64)).astype(np.float32)} for _ in range(8)],
                         calibration_samples=8)
    report = explain(quantized)
    floats = {op.name: op for op in report.ops if op.kernel != "integer"}
    assert sorted(floats) == ["layer0.attn/PV", "layer0.attn/QK"]
    assert all(op.reason == R_ACTIVATION_PRODUCT and op.fixing_rule is None for op in floats.values())
    assert len(report.ops) - len(floats) == 6  # the weight MatMuls/Gemms run integer


def _same_padded_convs(runtime_pads: bool, size: int = 224) -> onnx.ModelProto:
    """Three Pad -> Conv -> Relu blocks with TF-style SAME padding; ``runtime_pads``: pads computed from the
    input's shape at run time (Shape -> arithmetic -> Concat, input dims symbolic), else constant pads."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    x, channels = "x", 3
    for i, (cout, k, s) in enumerate([(8, 3, 2), (16, 3, 2), (16, 3, 1)]):
        w = const(f"w{i}", rng.standard_normal((cout, channels, k, k)).astype(np.float32) * 0.3)
        b = const(f"b{i}", rng.standard_normal(cout).astype(np.float32) * 0.1)
        if runtime_pads:
            c = {n: const(f"{n}{i}", np.array([v, v], np.int64)) for n, v in (("s", s), ("k", k), ("one", 1),
                                                                                 ("zero", 0), ("two", 2))}
            steps = [("Shape", [x], "hw"), ("Add", ["hw", c["s"]], "a"), ("Sub", ["a", c["one"]], "a1"),
                     ("Div", ["a1", c["s"]], "ceil"), ("Sub", ["ceil", c["one"]], "c1"), ("Mul", ["c1", c["s"]], "m"),
                     ("Add", ["m", c["k"]], "mk"), ("Sub", ["mk", "hw"], "t0"), ("Max", ["t0", c["zero"]], "tot"),
                     ("Div", ["tot", c["two"]], "beg"), ("Sub", ["tot", "beg"], "end"),
                     ("Concat", [c["zero"], "beg", c["zero"], "end"], "pads")]
            local = {out for _, _, out in steps}
            for op, inputs, out in steps:
                attrs = {"Shape": {"start": 2, "end": 4}, "Concat": {"axis": 0}}.get(op, {})
                names = [f"{n}{i}" if n in local else n for n in inputs]
                nodes.append(helper.make_node(op, names, [f"{out}{i}"], **attrs))
        else:
            total = max((-(-size // s) - 1) * s + k - size, 0)
            const(f"pads{i}", np.array([0, 0, total // 2, total // 2, 0, 0, total - total // 2, total - total // 2]))
            size = -(-size // s)
        nodes += [helper.make_node("Pad", [x, f"pads{i}"], [f"p{i}"]),
                  helper.make_node("Conv", [f"p{i}", w, b], [f"c{i}"], strides=[s, s]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        x, channels = f"r{i}", cout
    shape = ["N", 3, "H", "W"] if runtime_pads else [1, 3, 224, 224]
    graph = helper.make_graph(nodes, "same_pads", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = [{"x": np.random.default_rng(i).standard_normal((1, 3, 224, 224)).astype(np.float32)} for i in range(2)]
    return ort_quantize.quantize_with_ort(model, feeds, "u8s8")


def test_runtime_shapes_count_macs_as_static_and_name_float_pad_islands():
    static, runtime = explain(_same_padded_convs(False)), explain(_same_padded_convs(True))
    assert static.total_macs > 10_000_000
    assert abs(runtime.total_macs - static.total_macs) <= 0.1 * static.total_macs
    assert any("measured on one ONNX Runtime run" in note for note in runtime.notes)
    pads = [island for island in runtime.float_islands if "Pad" in island.op_types]
    assert len(pads) == 3 and all("pads are computed at run time" in island.reason for island in pads)
    assert "Note: shapes of" in runtime.summary()


def test_macs_of_a_model_that_runs_only_at_some_sizes_are_measured_at_one():
    """A recognizer whose height must pool to one row (``[1, 3, "?", "?"]``, MaxPool 32 high, Squeeze)
    refuses the made-up 224 x 224: its MACs are measured at another size, not undercounted."""
    model = toy_models.build_export("text_line_recognizer")
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 3, 32, 96)).astype(np.float32)} for _ in range(2)]
    report = explain(ort_quantize.quantize_with_ort(model, feeds, "u8s8"))
    assert not any("undercounted" in note for note in report.notes), report.notes
    assert any("measured on one ONNX Runtime run" in note for note in report.notes)
    # at the size measured (32 x 32): the Conv's 32 * 32 * 8 * 27 MACs and the MatMul's 32 * 8 * 5
    assert report.total_macs == 32 * 32 * 8 * 27 + 32 * 8 * 5


def test_explain_does_not_modify_its_input():
    model = quantized("conv_relu", "u8s8")
    before = model.SerializeToString()
    explain(model)
    assert model.SerializeToString() == before
    as_ir = ir.serde.deserialize_model(model)
    before_ir = ir.serde.serialize_model(as_ir).SerializeToString()
    explain(as_ir)
    assert ir.serde.serialize_model(as_ir).SerializeToString() == before_ir

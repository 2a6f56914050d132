"""Tests of placing a residual Add, its activation and its quantizer as TensorRT fuses them."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper
from onnxscript.rewriter import RewriteRuleSet

import kenosis_rewrite
from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.placement.rules.residual_activation import RULE_NAME, residual_activation_rules
from kenosis_rewrite.testing import model_checks, toy_models


def _apply(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, FixReport, int]:
    model = ir.serde.deserialize_model(proto)
    report = FixReport()
    count = RewriteRuleSet(residual_activation_rules(report)).apply_to_model(model)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    return out, report, count


def _reader(model: onnx.ModelProto, tensor: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if tensor in n.input]


def test_symmetric_quantize_static_block_becomes_conv_add_relu_then_one_quantizer():
    # quantize_static with symmetric activations keeps the Relu, with a Q/DQ pair before and after it
    float_model = toy_models.build("conv_add_relu")
    feeds = toy_models.random_feeds(float_model, 8)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds[:4], "sym")
    add = next(n for n in qdq.graph.node if n.op_type == "Add")
    assert _reader(qdq, add.output[0])[0].op_type == "QuantizeLinear"
    out, report, count = _apply(qdq)
    assert count == 2 and {c.rule for c in report.changes} == {RULE_NAME}
    add = next(n for n in out.graph.node if n.op_type == "Add")
    # the Add reads the Conv through the removed quantizer's clamp (it may stand for a deleted Clip)
    clamp = next(model_checks.producer_of(out, i) for i in add.input if model_checks.producer_of(out, i).op_type == "Clip")
    assert {model_checks.producer_of(out, i).op_type for i in add.input} == {"Clip", "DequantizeLinear"}
    assert model_checks.producer_of(out, clamp.input[0]).op_type == "Conv"
    (relu,) = _reader(out, add.output[0])
    assert relu.op_type == "Relu"
    (quantize,) = _reader(out, relu.output[0])
    assert quantize.op_type == "QuantizeLinear" and quantize.input[1] == "relu_13_scale"  # the activation's own
    assert model_checks.op_types(out)["QuantizeLinear"] == model_checks.op_types(qdq)["QuantizeLinear"] - 2
    scores = fidelity.compare_to_float(float_model, {"input": qdq, "fixed": out}, feeds[4:], optimized=False)
    assert scores["fixed"]["cosine"] >= scores["input"]["cosine"] - 1e-4


def test_fix_tensorrt_target_places_the_block():
    float_model = toy_models.build("resnetish")
    feeds = toy_models.random_feeds(float_model, 8)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds[:4], "sym")
    fixed, report = kenosis_rewrite.fix(qdq, target="tensorrt", calibration=feeds[:4], return_report=True)
    adds = [n for n in fixed.graph.node if n.op_type == "Add"]
    assert len(adds) == 3 and report.change_counts()[RULE_NAME] == 6
    for add in adds:
        assert [n.op_type for n in _reader(fixed, add.output[0])] == ["Relu"]
        sources = [model_checks.producer_of(fixed, i) for i in add.input]
        sources = [model_checks.producer_of(fixed, n.input[0]) if n.op_type == "Clip" else n for n in sources]
        assert "Conv" in {n.op_type for n in sources}
    scores = fidelity.compare_to_float(float_model, {"input": qdq, "fixed": fixed}, feeds[4:])
    assert scores["fixed"]["cosine"] >= scores["input"]["cosine"] - 1e-3


def _block(act: str, s0: float | None, s1: float, s2: float | None, rng, channels: int = 4, size: int = 6,
           reader: str = "") -> onnx.ModelProto:
    """x -> Conv [-> Q0/DQ0] -> Add(., DQx) -> Q1/DQ1 -> act [-> Q2/DQ2] [-> reader] -> y, int8 zero point 0."""
    make = helper.make_node
    weight = (rng.standard_normal((channels, channels, 3, 3)) / 6).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.array(0, np.int8), "zp")]
    for name, value in (("sx", 0.02), ("s0", s0 or 1.0), ("s1", s1), ("s2", s2 or 1.0), ("lo", 0.0), ("hi", 1.5)):
        inits.append(numpy_helper.from_array(np.array(value, np.float32), name))
    nodes = [make("QuantizeLinear", ["x", "sx", "zp"], ["xq"]), make("DequantizeLinear", ["xq", "sx", "zp"], ["xd"]),
             make("Conv", ["xd", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             make("QuantizeLinear", ["c", "s0", "zp"], ["cq"]), make("DequantizeLinear", ["cq", "s0", "zp"], ["cd"]),
             make("Add", ["cd" if s0 else "c", "xd"], ["sum"], name="add"),
             make("QuantizeLinear", ["sum", "s1", "zp"], ["sq"]), make("DequantizeLinear", ["sq", "s1", "zp"], ["sd"])]
    extra = {"LeakyRelu": {"alpha": 0.1}}.get(act, {})
    nodes.append(make(act, ["sd", "lo", "hi"] if act == "Clip" else ["sd"], ["a"], name="act", **extra))
    last = "a"
    if s2 is not None:
        nodes += [make("QuantizeLinear", ["a", "s2", "zp"], ["aq"]), make("DequantizeLinear", ["aq", "s2", "zp"], ["ad"])]
        last = "ad"
    if reader:
        nodes.append(make(reader, [last], ["r"]))
        last = "r"
    nodes.append(make("Identity", [last], ["y"]))
    shape = [1, channels, size, size]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", 1, shape)],
                              [helper.make_tensor_value_info("y", 1, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_relu_read_by_a_float_op_moves_in_front_of_the_quantizer_bit_exact():
    rng = np.random.default_rng(0)
    qdq = _block("Relu", None, 0.02, None, rng, reader="Sin")
    out, report, count = _apply(qdq)
    assert count == 1
    relu = next(n for n in out.graph.node if n.op_type == "Relu")
    assert model_checks.producer_of(out, relu.input[0]).op_type == "Add"
    assert [n.op_type for n in _reader(out, relu.output[0])] == ["QuantizeLinear"]
    assert [(c.rule, c.exact) for c in report.changes] == [(RULE_NAME, True)]
    for seed in range(4):
        x = {"x": 3 * np.random.default_rng(seed).standard_normal((1, 4, 6, 6)).astype(np.float32)}
        assert np.array_equal(model_checks.outputs(out, x, optimized=False)[0],
                              model_checks.outputs(qdq, x, optimized=False)[0])


def test_clip_bound_of_the_removed_quantizer_stays():
    rng = np.random.default_rng(1)
    # Q1 reaches 127 * 0.005 = 0.635, Q2 127 * 0.02 = 2.54: the Relu gets Q1's top as a Clip bound
    qdq = _block("Relu", 0.01, 0.005, 0.02, rng)
    out, _, _ = _apply(qdq)
    assert "Relu" not in model_checks.op_types(out)
    add = next(n for n in out.graph.node if n.op_type == "Add")
    (clip,) = _reader(out, add.output[0])
    assert clip.op_type == "Clip"
    assert float(model_checks.initializer(out, clip.input[2])) == pytest.approx(127 * 0.005)
    x = {"x": 4 * rng.standard_normal((1, 4, 6, 6)).astype(np.float32)}
    assert model_checks.outputs(out, x, optimized=False)[0].max() <= 127 * 0.005 + 0.02 / 2


def test_add_of_two_quantized_conv_outputs_is_refused_with_a_reason():
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,4,4] x) => (float[1,2,4,4] y)
    <float[2,2,1,1] w = {1, 0, 0, 1}, float s = {0.05}, int8 z = {0}>
    { a = Conv(x, w)  b = Conv(x, w)
      aq = QuantizeLinear(a, s, z)  ad = DequantizeLinear(aq, s, z)
      bq = QuantizeLinear(b, s, z)  bd = DequantizeLinear(bq, s, z)
      y = Add(ad, bd) }""")
    out, report, count = _apply(proto)
    assert count == 0 and model_checks.op_types(out)["QuantizeLinear"] == 2
    assert any("which one TensorRT fuses" in r.reason for r in report.refusals)


@pytest.mark.parametrize("seed", range(12))
def test_property_generated_residual_blocks_stay_within_the_stated_bound(seed):
    """Random scales, sizes and activations: the output moves by at most s0/2 + s1/2 + s2 per element
    (each removed rounding, then one step of Q2)."""
    rng = np.random.default_rng(seed)
    act = ["Relu", "Clip", "LeakyRelu"][seed % 3]
    channels, size = int(rng.integers(2, 6)), int(rng.integers(3, 8))
    x = [{"x": rng.standard_normal((1, channels, size, size)).astype(np.float32)} for _ in range(4)]
    probe = _block(act, 1.0, 1.0, 1.0, np.random.default_rng(seed), channels, size)
    # scales from the values each quantizer sees (ranges that cover the data, times 1-1.5)
    conv = np.concatenate([model_checks.outputs(_tap(probe, "c"), f, optimized=False)[0].ravel() for f in x])
    total = np.concatenate([model_checks.outputs(_tap(probe, "sum"), f, optimized=False)[0].ravel() for f in x])
    s0 = float(np.abs(conv).max() * rng.uniform(1, 1.5) / 127)
    s1 = float(np.abs(total).max() * rng.uniform(1, 1.5) / 127)
    s2 = float(np.abs(total).max() * rng.uniform(1, 1.5) / 127)
    qdq = _block(act, s0, s1, s2, np.random.default_rng(seed), channels, size)
    out, report, count = _apply(qdq)
    assert count == 2 and all(not c.exact for c in report.changes)
    if act == "LeakyRelu" and 0.1 * 128 * s1 < 128 * s2:
        # Q1 clamped the negative side tighter than Q2 reaches: (2) is refused, (3) moves the LeakyRelu
        (leaky,) = [n for n in out.graph.node if n.op_type == "LeakyRelu"]
        assert model_checks.producer_of(out, leaky.input[0]).op_type == "Add"
        assert [n.input[1] for n in _reader(out, leaky.output[0])] == ["s1"]
        assert model_checks.op_types(out)["QuantizeLinear"] == 3
        bound = s0 / 2 + 2 * s1 + s2 + 1e-5  # (3)'s (1 + alpha) s1 / 2, and a step of Q1 and of Q2
    else:
        assert model_checks.op_types(out)["QuantizeLinear"] == 2  # the input's and Q2
        bound = s0 / 2 + s1 / 2 + s2 + 1e-5
    for feed in x:
        got, given = (model_checks.outputs(m, feed, optimized=False)[0] for m in (out, qdq))
        assert np.abs(got - given).max() <= bound


def _tap(model: onnx.ModelProto, tensor: str) -> onnx.ModelProto:
    """``model`` with ``tensor`` as its only output."""
    tapped = onnx.ModelProto()
    tapped.CopyFrom(model)
    del tapped.graph.output[:]
    tapped.graph.output.append(helper.make_tensor_value_info(tensor, 1, None))
    return tapped

"""Tests of giving the ops ONNX Runtime runs in float their weights as float constants."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import kenosis_rewrite
from kenosis_rewrite.core import model_io
from kenosis_rewrite.diagnosis.explain import float_kernels
from kenosis_rewrite.placement import guard as guard_module
from kenosis_rewrite.placement.passes.float_kernel_weights import RULE_NAME, FloatKernelWeightsPass
from kenosis_rewrite.testing import model_checks

# Conv "float_conv" has a HardSwish between it and its quantizer (no ORT fusion: it runs in float);
# Conv "int_conv" reads the HardSwish's Q/DQ and has its own (ORT runs it as QLinearConv). With
# ``shared`` a third Conv, "int_twin", reads float_conv's own weight DequantizeLinear and runs integer.
HARDSWISH_THEN_CONV = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,8,8] x) => (float[1,6,8,8] y{twin_output})
<float sx = {{0.03125}}, uint8 zx = {{128}}, int8[6,4,3,3] w = {{{w}}}, float sw = {{0.0078125}}, int8 zw = {{0}},
 float[6] b = {{{b}}}, float sa = {{0.0625}}, uint8 za = {{128}}, int8[6,6,1,1] w2 = {{{w2}}}>
{{
  qx = QuantizeLinear(x, sx, zx)
  dx = DequantizeLinear(qx, sx, zx)
  dw = DequantizeLinear(w, sw, zw)
  c = Conv <pads = [1, 1, 1, 1]> (dx, dw, b)
  h = HardSwish(c)
  qh = QuantizeLinear(h, sa, za)
  dh = DequantizeLinear(qh, sa, za)
  dw2 = DequantizeLinear(w2, sw, zw)
  c2 = Conv(dh, dw2)
  q2 = QuantizeLinear(c2, sa, za)
  y = DequantizeLinear(q2, sa, za)
  {twin}
}}
"""
TWIN = """t = Conv <pads = [1, 1, 1, 1]> (dx, dw, b)
  qt = QuantizeLinear(t, sa, za)
  twin = DequantizeLinear(qt, sa, za)"""
NAMES = {"c": "float_conv", "c2": "int_conv", "t": "int_twin"}


def _model(seed: int = 0, shared: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    ints = lambda n: ", ".join(map(str, rng.integers(-127, 128, n)))  # noqa: E731
    text = HARDSWISH_THEN_CONV.format(
        w=ints(216), w2=ints(36), b=", ".join(f"{v:.4f}" for v in rng.normal(0, 0.3, 6)),
        twin_output=", float[1,6,8,8] twin" if shared else "", twin=TWIN if shared else "",
    )
    proto = onnx.parser.parse_model(text)
    for index, node in enumerate(proto.graph.node):
        node.name = NAMES.get(node.output[0], f"{node.op_type}_{index}")
    return proto


def _feeds(count: int = 3, scale: float = 2.0) -> list[dict[str, np.ndarray]]:
    return [{"x": (np.random.default_rng(seed).standard_normal((1, 4, 8, 8)) * scale).astype(np.float32)}
            for seed in range(count)]


def _with_pass(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, kenosis_rewrite.FixReport, frozenset[str]]:
    model = ir.serde.deserialize_model(proto)
    found = float_kernels(model)
    report = kenosis_rewrite.FixReport()
    FloatKernelWeightsPass(found, report)(model)
    return ir.serde.serialize_model(model), report, found


def test_ort_is_asked_which_convs_run_in_float_and_only_their_weights_become_float():
    proto = _model()
    out, report, found = _with_pass(proto)
    assert found == {"float_conv"}  # the HardSwish keeps it float; int_conv is a QLinearConv
    onnx.checker.check_model(out, full_check=True)
    conv = model_checks.node_by_name(out, "float_conv")
    weight = model_checks.initializer(out, conv.input[1])
    assert weight.dtype == np.float32
    w_codes = model_checks.initializer(proto, "w").astype(np.float32)
    np.testing.assert_array_equal(weight, w_codes * np.float32(0.0078125))  # the DQ's own product
    assert model_checks.producer_of(out, model_checks.node_by_name(out, "int_conv").input[1]).op_type == "DequantizeLinear"
    assert [c.rule for c in report.changes] == [RULE_NAME] and not report.changes[0].exact
    optimized = model_checks.ort_optimized_op_types(out)
    assert optimized["QLinearConv"] == 1  # int_conv still fused
    assert optimized["DequantizeLinear"] < model_checks.ort_optimized_op_types(proto)["DequantizeLinear"]


@pytest.mark.parametrize("seed", range(6))
def test_property_outputs_move_by_float_rounding_at_most_one_output_step(seed):
    """The stated bound: the float Conv reads the same values; only ORT's summation order changes, so
    its output moves by float rounding (relative 1e-5 of its largest value here), and a quantizer after
    it can turn that into one step at a tie, never more."""
    proto = _model(seed)
    out, _, _ = _with_pass(proto)
    exposed = [onnx.helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [1, 6, 8, 8])]
    for feed in _feeds(3, scale=float(np.random.default_rng(seed).uniform(0.5, 4.0))):
        for optimized in (False, True):
            before, after = (model_checks.outputs(_exposed(m, exposed), feed, optimized) for m in (proto, out))
            step = 0.0625
            assert np.abs(before[0] - after[0]).max() <= step * (1 + 1e-6)
            assert np.abs(before[1] - after[1]).max() <= 1e-5 * max(1.0, float(np.abs(before[1]).max()))


def _exposed(proto: onnx.ModelProto, outputs) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    copy.graph.output.extend(outputs)
    return copy


def test_a_weight_dequantizer_shared_with_an_integer_conv_stays_for_it():
    proto = _model(shared=True)
    out, report, found = _with_pass(proto)
    assert found == {"float_conv"}
    twin = model_checks.node_by_name(out, "int_twin")
    assert model_checks.producer_of(out, twin.input[1]).op_type == "DequantizeLinear"
    assert model_checks.ort_optimized_op_types(out)["QLinearConv"] == 2  # int_conv and int_twin
    onnx.checker.check_model(out, full_check=True)


def _head_model() -> onnx.ModelProto:
    """A detector head as NNCF leaves it: the last Conv's output is the answer, with no quantizer
    (fix() without data gives it none: it stays float)."""
    proto = _model()
    keep = [n for n in proto.graph.node if n.output[0] in ("qx", "dx", "dw", "c")]
    del proto.graph.node[:]
    proto.graph.node.extend(keep)
    proto.graph.output[0].name = "c"
    return proto


def test_fix_gives_a_float_head_float_weights_and_a_second_fix_finds_nothing_to_do():
    proto = _head_model()
    fixed, report = kenosis_rewrite.fix(proto, return_report=True)
    assert RULE_NAME in report.change_counts()
    conv = next(n for n in fixed.graph.node if n.op_type == "Conv")
    assert model_checks.producer_of(fixed, conv.input[1]) is None  # an initializer now
    # the head's input quantizer served only it: gone too (float-kernels-read-float), so the head is the
    # input's Conv on the unrounded input, with float weights: only the summation order differs
    assert "float-kernels-read-float" in report.change_counts()
    assert conv.input[0] == "x"
    unrounded = _head_model()
    next(n for n in unrounded.graph.node if n.op_type == "Conv").input[0] = "x"
    del unrounded.graph.node[:2]  # qx, dx
    cosine = model_checks.graph_cosine(unrounded, fixed, _feeds())
    assert cosine > 0.9999
    again, second = kenosis_rewrite.fix(fixed, return_report=True)
    assert not second.changes and model_io.ALL_FLOAT_NOTE in second.notes  # nothing quantized left to fix
    assert [n.op_type for n in again.graph.node] == [n.op_type for n in fixed.graph.node]
    head = next(op for op in kenosis_rewrite.explain(fixed).ops if op.name == conv.name)
    assert head.kernel == "float" and head.reason == "float weights", head  # not "unquantized"


def test_where_the_guard_rejects_it_fix_returns_the_accepted_model_and_says_so(monkeypatch):
    original = guard_module.Guard.violation

    def rejecting(self, model, report, selecting=False):
        if any(change.rule == RULE_NAME for change in report.changes):
            return "a made-up rejection"
        return original(self, model, report, selecting)

    monkeypatch.setattr(guard_module.Guard, "violation", rejecting)
    fixed, report = kenosis_rewrite.fix(_head_model(), return_report=True)
    assert RULE_NAME not in report.change_counts()
    assert any(RULE_NAME in note and "a made-up rejection" in note for note in report.notes)
    conv = next(n for n in fixed.graph.node if n.op_type == "Conv")
    assert model_checks.producer_of(fixed, conv.input[1]).op_type == "DequantizeLinear"


def test_float_kernels_reads_an_unnamed_op_as_unknown():
    proto = _model()
    for node in proto.graph.node:
        node.name = ""
    assert float_kernels(model_io.load(proto, lazy=True).model) == frozenset()


def test_weight_only_quantization_keeps_its_quantized_weights():
    """A MatMul reading a float activation and 8-bit weights (weight-only quantization) runs in float
    too, but its weights were quantized for size: left as they are, with the reason."""
    rng = np.random.default_rng(0)
    codes = ", ".join(map(str, rng.integers(-127, 128, 32)))
    proto = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,8] x) => (float[1,4] y)
    <int8[8,4] w = {{{codes}}}, float sw = {{0.01}}, int8 zw = {{0}}>
    {{
      dw = DequantizeLinear(w, sw, zw)
      y = MatMul(x, dw)
    }}
    """)
    proto.graph.node[1].name = "weight_only"
    model = ir.serde.deserialize_model(proto)
    report = kenosis_rewrite.FixReport()
    FloatKernelWeightsPass({"weight_only"}, report)(model)  # as though ORT ran it in float
    out = ir.serde.serialize_model(model)
    assert not report.changes
    assert any("weight-only" in r.reason for r in report.refusals)
    assert [n.op_type for n in out.graph.node] == ["DequantizeLinear", "MatMul"]


def test_a_conv_reading_its_quantized_activation_through_a_pool_or_transpose_gets_float_weights():
    """NHWC exports transpose the dequantized input, pooled activations reach the next Conv through a
    MaxPool: still a quantized activation, not weight-only quantization."""
    proto = _head_model()
    conv = next(n for n in proto.graph.node if n.op_type == "Conv")
    conv.input[0] = "pooled"
    pool = onnx.helper.make_node("MaxPool", ["dx"], ["pooled"], kernel_shape=[1, 1], name="pool")
    proto.graph.node.insert(list(proto.graph.node).index(conv), pool)
    onnx.checker.check_model(proto, full_check=True)
    model = ir.serde.deserialize_model(proto)
    report = kenosis_rewrite.FixReport()
    FloatKernelWeightsPass({"float_conv"}, report)(model)
    out = ir.serde.serialize_model(model)
    assert [c.rule for c in report.changes] == [RULE_NAME]
    assert model_checks.producer_of(out, model_checks.node_by_name(out, "float_conv").input[1]) is None
    for feed in _feeds():
        np.testing.assert_allclose(model_checks.outputs(out, feed, False)[0], model_checks.outputs(proto, feed, False)[0],
                                   rtol=1e-5, atol=1e-5)

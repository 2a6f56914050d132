"""Tests of letting the ops ONNX Runtime runs in float read the float tensor instead of its Q/DQ copy."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import kenosis_rewrite
from kenosis_rewrite.diagnosis.explain import float_kernels
from kenosis_rewrite.placement.passes.float_kernel_inputs import RULE_NAME, FloatKernelInputsPass
from kenosis_rewrite.placement.passes.float_kernel_weights import FloatKernelWeightsPass
from kenosis_rewrite.testing import model_checks

# "float_conv" has a HardSwish between it and its quantizer (ORT runs it in float); "int_conv" reads
# the HardSwish's Q/DQ and has its own output quantizer (ORT runs it as QLinearConv). {pool} is how the
# input reaches float_conv: through a MaxPool on the round trip, on the codes, or between two pairs.
MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,8,8] x) => (float[1,6,4,4] y{side_output})
<float sx = {{{sx}}}, uint8 zx = {{{zx}}}, int8[6,4,3,3] w = {{{w}}}, float sw = {{0.0078125}}, int8 zw = {{0}},
 float[6] b = {{{b}}}, float sa = {{0.0625}}, uint8 za = {{128}}, int8[6,6,1,1] w2 = {{{w2}}}>
{{
  {pool}
  dw = DequantizeLinear(w, sw, zw)
  c = Conv <pads = [1, 1, 1, 1]> (px, dw, b)
  h = {activation}(c)
  qh = QuantizeLinear(h, sa, za)
  dh = DequantizeLinear(qh, sa, za)
  dw2 = DequantizeLinear(w2, sw, zw)
  c2 = Conv(dh, dw2)
  q2 = QuantizeLinear(c2, sa, za)
  y = DequantizeLinear(q2, sa, za)
  {side}
}}
"""
POOLS = {
    "round trip, then pool": """qx = QuantizeLinear(x, sx, zx)
  dx = DequantizeLinear(qx, sx, zx)
  px = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (dx)""",
    "pool on the codes": """qx = QuantizeLinear(x, sx, zx)
  pq = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (qx)
  px = DequantizeLinear(pq, sx, zx)""",
    "a pair on each side of the pool": """qx = QuantizeLinear(x, sx, zx)
  dx = DequantizeLinear(qx, sx, zx)
  pool = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (dx)
  qp = QuantizeLinear(pool, sx, zx)
  px = DequantizeLinear(qp, sx, zx)""",
}
# The same model with the activation quantizers in front of float_conv deleted: what the rewrite must equal.
DELETED = "px = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (x)"
# An integer Conv also reading the round trip of the input (then it serves an integer kernel).
SIDE = """side_conv = Conv <pads = [1, 1, 1, 1]> (dx, dw, b)
  qs = QuantizeLinear(side_conv, sa, za)
  side = DequantizeLinear(qs, sa, za)"""
NAMES = {"c": "float_conv", "c2": "int_conv", "side_conv": "side_conv"}


def _model(pool: str, seed: int = 0, side: bool = False, sx: float = 0.03125, zx: int = 128,
           activation: str = "HardSwish") -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    ints = lambda n: ", ".join(map(str, rng.integers(-127, 128, n)))  # noqa: E731
    text = MODEL.format(
        w=ints(216), w2=ints(36), b=", ".join(f"{v:.4f}" for v in rng.normal(0, 0.3, 6)), sx=repr(sx), zx=zx,
        activation=activation, pool=POOLS.get(pool, pool), side=SIDE if side else "", side_output=", float[1,6,8,8] side" if side else "",
    )
    proto = onnx.parser.parse_model(text)
    for index, node in enumerate(proto.graph.node):
        node.name = NAMES.get(node.output[0], f"{node.op_type}_{index}")
    return proto


def _feeds(count: int = 3, scale: float = 2.0) -> list[dict[str, np.ndarray]]:
    return [{"x": (np.random.default_rng(seed).standard_normal((1, 4, 8, 8)) * scale).astype(np.float32)}
            for seed in range(count)]


def _with_pass(proto: onnx.ModelProto, float_weights: bool = True) -> tuple[onnx.ModelProto, kenosis_rewrite.FixReport, frozenset[str]]:
    """The pass as fix() runs it: after the float kernels' weights became float constants."""
    model = ir.serde.deserialize_model(proto)
    found = float_kernels(model)
    if float_weights:
        FloatKernelWeightsPass(found)(model)
    report = kenosis_rewrite.FixReport()
    FloatKernelInputsPass(found, report)(model)
    return ir.serde.serialize_model(model), report, found


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_a_float_conv_and_its_pool_read_the_float_input_and_equal_the_model_without_that_quantizer(pool):
    proto = _model(pool)
    out, report, found = _with_pass(proto)
    assert found == {"float_conv"}
    onnx.checker.check_model(out, full_check=True)
    assert {c.rule for c in report.changes} == {RULE_NAME}
    float_conv = model_checks.node_by_name(out, "float_conv")
    pool_node = model_checks.producer_of(out, float_conv.input[0])
    assert pool_node.op_type == "MaxPool" and pool_node.input[0] == "x"
    assert not [n for n in out.graph.node if "x" in n.input and n.op_type == "QuantizeLinear"]
    # int_conv's round trip serves an integer kernel: untouched
    assert model_checks.producer_of(out, model_checks.node_by_name(out, "int_conv").input[0]).op_type == "DequantizeLinear"
    assert model_checks.op_types(out)["QuantizeLinear"] == 2
    reference = _model(DELETED)
    for feed in _feeds():
        for optimized in (False, True):
            np.testing.assert_array_equal(model_checks.outputs(out, feed, optimized)[0],
                                          model_checks.outputs(reference, feed, optimized)[0])


@pytest.mark.parametrize("seed", range(10))
def test_property_the_rewrite_equals_the_input_with_the_quantizers_deleted_over_grids_and_pools(seed):
    """Bit for bit over generated weights, input grids, zero points and the three placements; and the
    rounding it removes is at most what deleting that quantizer changes (a mutation that kept the
    rounding, or pooled the wrong tensor, would fail the equality)."""
    rng = np.random.default_rng(seed)
    pool = sorted(POOLS)[seed % len(POOLS)]
    sx, zx = float(2.0 ** rng.integers(-7, -2)), int(rng.integers(1, 256))  # zero point 0: a Relu's (below)
    proto = _model(pool, seed=seed, sx=sx, zx=zx)
    out, report, _ = _with_pass(proto)
    assert [c.rule for c in report.changes][:1] == [RULE_NAME]
    reference = _model(DELETED, seed=seed, sx=sx, zx=zx)
    for feed in _feeds(2, scale=float(rng.uniform(0.5, 4.0))):
        got = model_checks.outputs(out, feed, False)[0]
        np.testing.assert_array_equal(got, model_checks.outputs(reference, feed, False)[0])
        # the output is on int_conv's grid: the input model differs from it only by the deleted rounding
        assert np.max(np.abs(got - model_checks.outputs(proto, feed, False)[0])) <= 255 * 0.0625


def test_a_round_trip_an_integer_kernel_also_reads_is_left_alone():
    proto = _model("round trip, then pool", side=True)
    out, report, found = _with_pass(proto)
    assert "side_conv" not in found
    assert not report.changes
    assert model_checks.op_types(out) == model_checks.op_types(proto)


def test_a_quantizer_whose_input_an_integer_kernel_computes_is_refused():
    """int_conv -> Q -> DQ -> float reader: deleting that Q would turn the QLinearConv into a float Conv."""
    pool = """qx = QuantizeLinear(x, sx, zx)
  dx = DequantizeLinear(qx, sx, zx)
  px = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (dx)"""
    proto = _model(pool)
    text_model = onnx.helper.make_model(proto.graph, opset_imports=proto.opset_import, ir_version=proto.ir_version)
    graph = text_model.graph
    # a float Conv reading int_conv's output round trip, with a HardSwish after it (ORT runs it in float)
    consumer = onnx.helper.make_node("Conv", ["y", "dw2"], ["z_conv"], name="reader_conv")
    swish = onnx.helper.make_node("HardSwish", ["z_conv"], ["z"], name="reader_swish")
    graph.node.extend([consumer, swish])
    del graph.output[:]
    graph.output.append(onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [1, 6, 4, 4]))
    onnx.checker.check_model(text_model, full_check=True)
    out, report, found = _with_pass(text_model)
    assert "reader_conv" in found and "int_conv" not in found
    assert any(r.rule == RULE_NAME and "integer kernel" in r.reason for r in report.refusals)
    assert model_checks.producer_of(out, "y").op_type == "DequantizeLinear"


def test_fix_applies_it_under_its_guard_and_keeps_fidelity():
    """A Softplus, which ORT cannot fuse and fix() cannot bound without data (with calibration, fix()
    gives float_conv an output quantizer: an integer kernel)."""
    proto = _model("pool on the codes", activation="Softplus")
    out, report = kenosis_rewrite.fix(proto, return_report=True)
    onnx.checker.check_model(out, full_check=True)
    assert RULE_NAME in {c.rule for c in report.changes}
    assert not any(c.exact for c in report.changes if c.rule == RULE_NAME)
    float_model = _model(DELETED, activation="Softplus")
    feeds = _feeds(4)
    before = model_checks.graph_cosine(float_model, proto, feeds)
    after = model_checks.graph_cosine(float_model, out, feeds)
    assert after >= before - 1e-6
    # explain() says why a Conv of a QDQ model reads a float tensor with float weights
    conv = next(op for op in kenosis_rewrite.explain(out).ops if op.name == "float_conv")
    assert conv.kernel == "float" and conv.reason == "float weights" and RULE_NAME in conv.detail


def test_a_quantizer_that_stands_for_a_deleted_relu_leaves_its_clamp():
    """quantize_static deletes a Relu before a Q and lets the Q's zero point at 0 clamp for it: the float
    readers then read the clamped tensor, ``Clip(0, top)``, not the raw one (fuzz seed 9400530: a deleted
    ``Clip(-1, 1)`` before a Transpose, dropped with the pair, cost 0.013 cosine against FP32)."""
    proto = _model("round trip, then pool", zx=0)
    out, report, _ = _with_pass(proto)
    assert [c.rule for c in report.changes] == [RULE_NAME]
    pool_node = model_checks.producer_of(out, model_checks.node_by_name(out, "float_conv").input[0])
    clamp = model_checks.producer_of(out, pool_node.input[0])
    assert clamp.op_type == "Clip" and clamp.input[0] == "x"
    top = 255 * 0.03125
    reference = _model("""clamped = Clip(x, zero, top)
  px = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (clamped)""", zx=0)
    reference.graph.initializer.extend([onnx.numpy_helper.from_array(np.float32(0), "zero"),
                                        onnx.numpy_helper.from_array(np.float32(top), "top")])
    for feed in _feeds():
        np.testing.assert_array_equal(model_checks.outputs(out, feed, False)[0], model_checks.outputs(reference, feed, False)[0])


def test_a_float_kernel_that_keeps_quantized_weights_keeps_its_quantized_input():
    """4-bit or blocked weights, which float-weights-for-float-kernels leaves quantized (for size),
    keep the activation quantizer they were made with."""
    proto = _model("round trip, then pool")
    out, report, found = _with_pass(proto, float_weights=False)
    assert "float_conv" in found and not report.changes
    assert model_checks.op_types(out) == model_checks.op_types(proto)

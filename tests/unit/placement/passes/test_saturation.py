"""Saturation bounds: outside [a, b] every value gives the downstream quantizer the code the bound gives.

Property test over activations and downstream quantizers (uint8/int8 grids of many steps and zero
points), with the activations computed in float32 as ONNX Runtime computes them; then fix() end to
end on an NNCF-style ``DQ -> Conv -> SiLU -> Q`` graph without calibration data.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kenosis_rewrite
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.placement.passes.saturation import SMOOTH_ACTIVATIONS, activation_bounds

_erf = np.vectorize(math.erf)


def _f32(kind: str, x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    one = np.float32(1)
    with np.errstate(over="ignore"):
        sigmoid = one / (one + np.exp(-x))
        return {
            "SiLU": x * sigmoid,
            "Sigmoid": sigmoid,
            "Tanh": np.tanh(x),
            "Gelu": (np.float32(0.5) * x * (one + _erf(x.astype(np.float64) / math.sqrt(2)).astype(np.float32))),
            "Mish": x * np.tanh(np.log1p(np.exp(x))).astype(np.float32),
            "HardSwish": x * np.clip(x / np.float32(6) + np.float32(0.5), 0, 1),
            "HardSigmoid": np.clip(np.float32(0.2) * x + np.float32(0.5), 0, 1),
            "LeakyRelu": np.where(x < 0, np.float32(0.1) * x, x),
        }[kind].astype(np.float32)


def _codes(values: np.ndarray, scale: float, zero_point: int, qmin: int, qmax: int) -> np.ndarray:
    return np.clip(np.rint(values / np.float32(scale)) + zero_point, qmin, qmax)


def _grids(seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(12):
        signed = bool(rng.integers(2))
        qmin, qmax = (-128, 127) if signed else (0, 255)
        scale = float(np.exp(rng.uniform(np.log(1e-3), np.log(0.2))))
        zero_point = int(rng.choice([qmin, 0 if signed else 128, int(rng.integers(qmin, qmax + 1))]))
        yield scale, zero_point, qmin, qmax


@pytest.mark.parametrize("kind", [*SMOOTH_ACTIVATIONS, "HardSwish", "HardSigmoid", "LeakyRelu"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outside_the_bounds_the_downstream_code_is_the_bounds_code(kind, seed):
    alpha, beta = {"HardSigmoid": (0.2, 0.5), "HardSwish": (1 / 6, 0.5), "LeakyRelu": (0.1, 0.0)}.get(kind, (1.0, 0.0))
    for scale, zero_point, qmin, qmax in _grids(seed):
        lo, hi = (qmin - zero_point) * scale, (qmax - zero_point) * scale
        if not lo <= 0 <= hi:
            continue
        a, b = activation_bounds(kind, alpha, beta, lo, hi, scale)
        assert a < b
        above = np.concatenate([b + np.geomspace(1e-4, 1e4, 400), [b]])
        below = np.concatenate([a - np.geomspace(1e-4, 1e4, 400), [a]])
        for outside, bound in ((above, b), (below, a)):
            codes = _codes(_f32(kind, outside), scale, zero_point, qmin, qmax)
            bound_code = _codes(_f32(kind, np.array([bound])), scale, zero_point, qmin, qmax)[0]
            assert np.all(codes == bound_code), (kind, scale, zero_point, bound, outside[codes != bound_code][:3])


def test_the_bounds_are_tight_enough_to_spend_the_grid():
    """Not a clamp at +-inf: a SiLU before a quantizer over [0, 6] stops near 6, and at 0 below."""
    a, b = activation_bounds("SiLU", 1.0, 0.0, 0.0, 6.0, 6.0 / 255)
    assert a == 0.0 and 6.0 < b < 6.02
    a, b = activation_bounds("SiLU", 1.0, 0.0, -0.3, 6.0, 0.025)
    assert -7 < a < -6 and 6.0 < b < 6.02  # on the left branch, where SiLU is back within half a step of 0


def _nncf_silu_block() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """FP32 ``Conv -> SiLU -> Conv -> SiLU`` and NNCF's placement of it: Q/DQ on the input, the
    weights and each SiLU output, none on the Conv outputs."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((8, 3, 3, 3)) * 0.4).astype(np.float32)
    w2 = (rng.standard_normal((8, 8, 3, 3)) * 0.2).astype(np.float32)

    def silu(x, name):
        return [helper.make_node("Sigmoid", [x], [f"{name}_s"]), helper.make_node("Mul", [x, f"{name}_s"], [name])]

    def qdq(x, name, scale, zp, dtype=TensorProto.UINT8):
        inits.extend([helper.make_tensor(f"{name}_sc", TensorProto.FLOAT, [], [scale]),
                      helper.make_tensor(f"{name}_zp", dtype, [], [zp])])
        return [helper.make_node("QuantizeLinear", [x, f"{name}_sc", f"{name}_zp"], [f"{name}_q"]),
                helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_sc", f"{name}_zp"], [f"{name}_dq"])]

    def weight(w, name):
        scales = np.abs(w).reshape(w.shape[0], -1).max(1) / 127
        codes = np.clip(np.rint(w / scales[:, None, None, None]), -127, 127).astype(np.int8)
        inits.extend([numpy_helper.from_array(codes, f"{name}_w"), numpy_helper.from_array(scales.astype(np.float32), f"{name}_ws"),
                      numpy_helper.from_array(np.zeros(w.shape[0], np.int8), f"{name}_wz")])
        return [helper.make_node("DequantizeLinear", [f"{name}_w", f"{name}_ws", f"{name}_wz"], [f"{name}_wdq"], axis=0)]

    inits: list = []
    float_nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), *silu("c1", "a1"),
                   helper.make_node("Conv", ["a1", "w2"], ["c2"], pads=[1, 1, 1, 1]), *silu("c2", "y")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 12, 12])]
    float_model = helper.make_model(helper.make_graph(float_nodes, "f", inputs, outputs, [
        numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")]), opset_imports=[helper.make_opsetid("", 17)])
    nodes = [*qdq("x", "xin", 4.0 / 255, 128), *weight(w1, "l1"),
             helper.make_node("Conv", ["xin_dq", "l1_wdq"], ["c1"], pads=[1, 1, 1, 1]), *silu("c1", "a1"),
             *qdq("a1", "a1o", 3.0 / 255, 12), *weight(w2, "l2"),
             helper.make_node("Conv", ["a1o_dq", "l2_wdq"], ["c2"], pads=[1, 1, 1, 1]), *silu("c2", "y")]
    qdq_model = helper.make_model(helper.make_graph(nodes, "q", inputs, outputs, inits), opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(qdq_model, full_check=True)
    return float_model, qdq_model


def test_fix_without_data_quantizes_a_conv_before_silu_from_the_bounds_and_keeps_fidelity():
    float_model, qdq = _nncf_silu_block()
    assert kenosis_rewrite.explain(qdq).integer_mac_fraction == 0.0
    fixed, report = kenosis_rewrite.fix(qdq, return_report=True)
    changes = [c for c in report.changes if c.rule == "quantize-weighted-outputs"]
    assert len(changes) == 1 and "SiLU then a quantizer over" in changes[0].detail
    first_conv_share = kenosis_rewrite.explain(fixed).integer_mac_fraction
    assert first_conv_share > 0.2  # the first Conv now runs as an integer kernel
    added = [n for n in fixed.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "c1"]
    assert len(added) == 1
    feeds = [{"x": np.random.default_rng(i).uniform(-2, 2, (1, 3, 12, 12)).astype(np.float32)} for i in range(6)]
    reference = fidelity.run(float_model, feeds)
    before = fidelity.scores(reference, fidelity.run(qdq, feeds))["cosine"]
    after = fidelity.scores(reference, fidelity.run(fixed, feeds))["cosine"]
    assert after >= before - 0.002


@pytest.mark.parametrize("zero_point", [0, 100])
def test_a_prelu_bound_holds_for_every_channel_slope_of_either_sign(zero_point):
    """PRelu's per-channel slopes, some negative (MTCNN's): below the bound every channel's code is
    the code it has at the bound (qmin for a positive slope, qmax for a negative one)."""
    slopes = np.array([0.05, 0.2, 0.5, -0.4, -1.3, 0.0], np.float32)
    scale, qmin, qmax = 0.02, 0, 255
    lo, hi = (qmin - zero_point) * scale, (qmax - zero_point) * scale
    positive, negative = slopes[slopes > 0], slopes[slopes < 0]
    a, b = activation_bounds("LeakyRelu", float(positive.min()), float(negative.max()), lo, hi, scale)
    below = (a - np.geomspace(1e-4, 1e4, 200)).astype(np.float32)
    for slope in slopes:
        at_bound = _codes(np.float32(slope) * np.float32(a), scale, zero_point, qmin, qmax)
        assert np.all(_codes(np.float32(slope) * below, scale, zero_point, qmin, qmax) == at_bound)
    assert np.all(_codes(np.float32(b) + np.geomspace(1e-4, 1e4, 200).astype(np.float32), scale, zero_point, qmin, qmax) == qmax)


def _conv_hardswish_per_channel(scales: np.ndarray, zero_points: np.ndarray) -> onnx.ModelProto:
    """``DQ -> Conv -> HardSwish -> Q/DQ (per channel, NNCF at a depthwise input) -> depthwise Conv``."""
    channels = len(scales)
    rng = np.random.default_rng(1)
    inits = [
        helper.make_tensor("sx", TensorProto.FLOAT, [], [0.02]), helper.make_tensor("zx", TensorProto.UINT8, [], [128]),
        numpy_helper.from_array(rng.integers(-127, 128, (channels, 2, 3, 3)).astype(np.int8), "w"),
        numpy_helper.from_array(np.full(channels, 0.02, np.float32), "ws"),
        numpy_helper.from_array(np.zeros(channels, np.int8), "wz"),
        numpy_helper.from_array(scales.astype(np.float32), "sa"), numpy_helper.from_array(zero_points.astype(np.uint8), "za"),
        numpy_helper.from_array(rng.integers(-127, 128, (channels, 1, 3, 3)).astype(np.int8), "dw"),
        numpy_helper.from_array(np.full(channels, 0.01, np.float32), "dws"),
        numpy_helper.from_array(np.zeros(channels, np.int8), "dwz"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]), helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("Conv", ["xd", "wd"], ["c"], pads=[1] * 4, name="conv"), helper.make_node("HardSwish", ["c"], ["h"]),
        helper.make_node("QuantizeLinear", ["h", "sa", "za"], ["hq"], axis=1),
        helper.make_node("DequantizeLinear", ["hq", "sa", "za"], ["hd"], axis=1),
        helper.make_node("DequantizeLinear", ["dw", "dws", "dwz"], ["dwd"], axis=0),
        helper.make_node("Conv", ["hd", "dwd"], ["y"], pads=[1] * 4, group=channels),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, 6, 6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("seed", range(4))
def test_per_channel_quantizers_after_a_hardswish_bound_a_measured_range_by_their_widest_channel(seed):
    """Beyond the span of every channel's range each channel's code saturates: the measured range
    is clipped there (exact); without data that span alone is no grid (too coarse for narrow channels)."""
    import onnx_ir as ir

    from kenosis_rewrite.placement.passes import output_quantizers

    rng = np.random.default_rng(seed)
    channels = int(rng.integers(2, 6))
    scales = np.exp(rng.uniform(np.log(0.005), np.log(0.1), channels))
    zero_points = rng.integers(0, 60, channels)
    model = ir.serde.deserialize_model(_conv_hardswish_per_channel(scales, zero_points))
    [site] = output_quantizers.sites(model.graph)
    top = float(np.max((255 - zero_points) * scales.astype(np.float32)))
    lo, hi, why = output_quantizers.site_range(site, (-40.0, 45.0))
    assert (lo, hi) == (-3.0, pytest.approx(top, rel=1e-6)) and "per-channel quantizers" in why
    assert output_quantizers.site_range(site, None) is None
    # soundness, channel by channel: every value above hi gives each channel the code of hi
    above = np.concatenate([hi + np.geomspace(1e-4, 1e3, 200), [hi]])
    for scale, zero_point in zip(scales, zero_points):
        codes = _codes(_f32("HardSwish", above), scale, int(zero_point), 0, 255)
        assert np.all(codes == codes[-1])

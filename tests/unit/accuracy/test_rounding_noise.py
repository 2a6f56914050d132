"""The input's rounding noise: activation scales jittered by 1e-5, and how far that moves each output."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kenosis_rewrite.accuracy import rounding_noise
from kenosis_rewrite.core import fidelity

STEP = 1.0 / 64


def _model(gain: float, offset: float) -> onnx.ModelProto:
    """x -> Q/DQ (step 1/64, uint8 zp 128) -> Conv (int8 weight, its own DQ) -> Sub offset -> Mul gain -> Tanh.
    With a large gain the Tanh is a step at the offset: a rounding that flips there flips the output's sign."""
    inits = [
        numpy_helper.from_array(np.array(STEP, np.float32), "s"), numpy_helper.from_array(np.array(128, np.uint8), "z"),
        numpy_helper.from_array(np.ones((1, 1, 1, 1), np.int8), "w_q"),
        numpy_helper.from_array(np.array(1.0, np.float32), "w_s"), numpy_helper.from_array(np.array(0, np.int8), "w_z"),
        numpy_helper.from_array(np.array(offset, np.float32), "half"), numpy_helper.from_array(np.array(gain, np.float32), "gain"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"]),
        helper.make_node("Conv", ["xd", "w"], ["c"]),
        helper.make_node("Sub", ["c", "half"], ["centred"]),
        helper.make_node("Mul", ["centred", "gain"], ["sharp"]),
        helper.make_node("Tanh", ["sharp"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1, 8, 8])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 1, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _feeds() -> list[dict[str, np.ndarray]]:
    """Values just below rounding ties near 0.5 (code 32 +- a few, half a step minus 1e-6 of a step):
    a scale 1e-5 larger or smaller rounds some of them the other way."""
    rng = np.random.default_rng(3)
    feeds = []
    for _ in range(3):
        codes = rng.integers(28, 37, size=(1, 1, 8, 8))
        side = rng.choice([-1.0, 1.0], size=codes.shape)
        feeds.append({"x": ((codes + side * (0.5 - 1e-6)) * STEP).astype(np.float32)})
    return feeds


def _noise(model: onnx.ModelProto, reference_model: onnx.ModelProto) -> list[float]:
    feeds = _feeds()
    reference = fidelity.run(reference_model, feeds)
    return rounding_noise.rounding_noise(model, reference, fidelity.run(model, feeds), lambda m: fidelity.run(m, feeds))


def _float_of(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without its activation Q/DQ: its FP32 here."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    nodes = [n for n in copy.graph.node if n.output[0] not in ("xq", "xd")]
    nodes[1].input[0] = "x"  # the Conv reads x
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    return copy


def test_jittered_scales_move_activation_scales_only_and_keep_the_model_valid():
    model = _model(gain=1.0, offset=0.5)
    jittered = rounding_noise.jittered_scales(model, 1e-5)
    onnx.checker.check_model(jittered, full_check=True)
    values = {t.name: numpy_helper.to_array(t) for t in jittered.graph.initializer}
    nodes = {n.output[0]: n for n in jittered.graph.node}
    for name in ("xq", "xd"):  # the activation pair: a scale 1e-5 larger, the same zero point
        scale = values[nodes[name].input[1]]
        assert scale == np.float32(STEP * (1 + 1e-5)) and values[nodes[name].input[2]] == 128
    assert nodes["w"].input[1] == "w_s" and values["w_s"] == 1.0  # the weight's scale untouched
    assert [n.op_type for n in jittered.graph.node] == [n.op_type for n in model.graph.node]
    assert numpy_helper.to_array(model.graph.initializer[0]) == np.float32(STEP)  # the input is not touched


def test_a_model_that_turns_one_rounding_into_a_sign_has_a_large_rounding_noise_a_smooth_one_none():
    sharp, smooth = _model(gain=1e4, offset=0.5), _model(gain=1.0, offset=0.0)
    [sharp_noise] = _noise(sharp, _float_of(sharp))
    [smooth_noise] = _noise(smooth, _float_of(smooth))
    # flipped roundings at 0.5 +- half a step flip Tanh(1e4 (c - 0.5)) between -1 and 1 there
    assert sharp_noise > 0.05
    # the same flips move a smooth output by one step at a few of 64 values
    assert 0.0 < smooth_noise < 1e-3

"""Image inputs of self-calibration: the input's own quantizer names the range a quantized model was fed."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.calibration import inputs
from kenosis_rewrite.placement import guard


def _quantized_input_model(low: float, high: float, layout: str = "NCHW") -> onnx.ModelProto:
    """``x -> [Transpose] -> Q(s, z) -> DQ -> Conv``, the quantizer spanning ``[low, high]`` (uint8)."""
    scale = (high - low) / 255.0
    zero_point = int(round(-low / scale))
    shape = [1, 3, 32, 32] if layout == "NCHW" else [1, 32, 32, 3]
    nodes, source = [], "x"
    if layout == "NHWC":
        nodes.append(helper.make_node("Transpose", ["x"], ["x_nchw"], perm=[0, 3, 1, 2]))
        source = "x_nchw"
    nodes += [
        helper.make_node("QuantizeLinear", [source, "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("Conv", ["xd", "w"], ["y"], pads=[1, 1, 1, 1]),
    ]
    weight = np.random.default_rng(0).normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.float32(scale), "s"), numpy_helper.from_array(np.uint8(zero_point), "z"),
         numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("low, high, expected", [
    (0.0, 1.0, "unit"), (-1.0, 1.0, "symmetric"), (0.0, 255.0, "pixels"), (-2.12, 2.64, "imagenet"),
])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_the_inputs_own_quantizer_picks_the_preprocessing(low, high, expected, layout):
    model = _quantized_input_model(low, high, layout)
    (spec,) = inputs.infer_inputs(model)
    assert spec.kind == "image" and spec.layout == layout
    assert "the input's QuantizeLinear measured" in spec.reason and f"{expected} preprocessing" in spec.reason
    feeds = inputs.synthetic_feeds(model, 3)
    values = np.stack([feed["x"] for feed in feeds])
    span = high - low
    # the feeds fill the measured range: neither far beyond it nor a small part of it
    assert values.min() >= low - 0.15 * span and values.max() <= high + 0.15 * span
    assert values.max() - values.min() >= 0.5 * span


def test_the_guard_makes_up_feeds_in_the_range_the_inputs_quantizer_measured():
    model = _quantized_input_model(0.0, 1.0, "NHWC")
    check = guard.Guard(model, [])
    values = np.stack([feed["x"] for feed in check.feeds])
    assert 0.0 <= values.min() and values.max() <= 1.0 + 1e-6 and values.std() > 0.05
    # not white noise: neighbouring pixels are correlated as in photos (N(0, 1) noise: ~0)
    horizontal = np.corrcoef(values[..., :-1, :].ravel(), values[..., 1:, :].ravel())[0, 1]
    assert horizontal > 0.5

"""Tests of per-layer ORT profiling."""

from __future__ import annotations

import kenosis_rewrite
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.diagnosis import profiler
from kenosis_rewrite.testing import toy_models


def test_profile_attributes_kernels_and_overhead_to_heavy_ops():
    float_model = toy_models.build("conv_hardswish")
    feeds = toy_models.random_feeds(float_model, 2)
    fixed = kenosis_rewrite.fix(ort_quantize.quantize_with_ort(float_model, feeds, "u8s8"))
    result = profiler.profile(fixed, feeds[0], runs=5, warmup=1)
    convs = [n.name for n in fixed.graph.node if n.op_type == "Conv"]
    assert set(result.layers) == set(convs)
    assert all(result.layers[c].kernel == "QLinearConv" and result.layers[c].kernel_us > 0 for c in convs)
    # the HardSwish island (DQ -> HardSigmoid -> Mul -> Q) is overhead of the first Conv
    assert result.layers[convs[0]].overhead_us > 0
    assert "HardSigmoid" in result.by_op_type()
    assert convs[0] in result.summary()


def test_profile_of_float_model_reports_float_kernels():
    float_model = toy_models.build("conv_relu")
    result = profiler.profile(float_model, toy_models.random_feeds(float_model, 1)[0], runs=3, warmup=1)
    kernels = {layer.kernel for layer in result.layers.values()}
    assert kernels and not kernels & profiler.INTEGER_KERNELS

"""Tests of per-axis activation quantizers re-quantized per tensor (NNCF's depthwise-input form)."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.placement.passes.per_tensor_activations import (
    MIN_ESTIMATED_SQNR_DB,
    RULE_NAME,
    PerTensorActivationsPass,
    per_tensor_params,
)
from kenosis_rewrite.testing import model_checks

FIXTURES = pathlib.Path(__file__).resolve().parents[3] / "fixtures"

PER_AXIS = """
<ir_version: 8, opset_import: ["" : 13]>
g (float[1, 3, 4, 4] x) => (float[1, 3, 4, 4] y)
<float[3] s = {{{scales}}}, uint8[3] z = {{0, 0, 0}}, float[3, 1, 1, 1] w = {{1.0, -0.5, 2.0}}>
{{
  q = QuantizeLinear <axis: int = 1> (x, s, z)
  d = DequantizeLinear <axis: int = 1> (q, s, z)
  y = Conv <group: int = 3> (d, w)
}}
"""


def _apply(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, FixReport]:
    return model_checks.apply_pass(proto, PerTensorActivationsPass)


def test_close_channel_ranges_become_one_grid_covering_them_all():
    proto = onnx.parser.parse_model(PER_AXIS.format(scales="0.01, 0.02, 0.015"))
    fixed, report = _apply(proto)
    assert report.change_counts() == {RULE_NAME: 1}
    q = next(n for n in fixed.graph.node if n.op_type == "QuantizeLinear")
    assert model_checks.initializer(fixed, q.input[1]).size == 1
    assert float(model_checks.initializer(fixed, q.input[1])) == pytest.approx(0.02)
    assert int(model_checks.initializer(fixed, q.input[2])) == 0  # the clamp at 0 stays at 0
    # inside each channel's calibrated range, each element moves by at most half the old step plus
    # half the new one (the stated bound), times the depthwise weight
    old_steps = np.array([0.01, 0.02, 0.015]).reshape(1, 3, 1, 1)
    rng = np.random.default_rng(0)
    feed = {"x": (rng.uniform(-1, 1, (1, 3, 4, 4)) * old_steps * 255).astype(np.float32)}
    before, after = model_checks.outputs(proto, feed, optimized=False)[0], model_checks.outputs(fixed, feed, optimized=False)[0]
    weights = np.abs(np.array([1.0, -0.5, 2.0])).reshape(1, 3, 1, 1)
    assert np.all(np.abs(after - before) <= weights * (old_steps / 2 + 0.02 / 2) + 1e-6)
    assert np.all(after[:, [0, 2]] >= 0) and np.all(after[:, 1] <= 0)  # the clamp at 0 kept


def test_channel_ranges_far_apart_keep_their_quantizer_with_the_estimate_as_reason():
    proto = onnx.parser.parse_model(PER_AXIS.format(scales="0.001, 0.02, 0.5"))
    quantizer = next(n for n in ir.serde.deserialize_model(proto).graph if n.op_type == "QuantizeLinear")
    assert per_tensor_params(qdq_params.quant_params(quantizer))[2] < MIN_ESTIMATED_SQNR_DB
    fixed, report = _apply(proto)
    assert not report.changes
    assert "estimated SQNR" in report.refusals[0].reason


def test_on_nncf_output_each_quantizer_is_converted_or_refused_by_its_estimate():
    """NNCF 3.4 output (tests/fixtures). In fix() the exact fold (activation_scale_folding) takes
    these first; on its own this pass decides per quantizer by the estimate alone."""
    qdq = onnx.load(FIXTURES / "mbv2ish_nncf3.4.onnx")
    model = ir.serde.deserialize_model(qdq)
    estimates = {n.name: per_tensor_params(qdq_params.quant_params(n))[2] for n in model.graph
                 if n.op_type == "QuantizeLinear" and qdq_params.quant_params(n).scale.size > 1}
    assert len(estimates) == 2
    fixed, report = _apply(qdq)
    converted = {change.where for change in report.changes}
    assert converted == {name for name, estimate in estimates.items() if estimate >= MIN_ESTIMATED_SQNR_DB}
    assert {refusal.where for refusal in report.refusals} == set(estimates) - converted
    feed = {"x": np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    assert fidelity.cosine(model_checks.outputs(qdq, feed)[0], model_checks.outputs(fixed, feed)[0]) > 0.99

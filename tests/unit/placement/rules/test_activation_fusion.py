"""Tests of removing the Q/DQ pair between a weighted op and its activation (TensorRT/NPU form)."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest
from onnxscript.rewriter import RewriteRuleSet

from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.placement.rules.activation_fusion import RULE_NAME, TENSORRT_FUSIBLE, activation_fusion_rules
from kenosis_rewrite.testing import model_checks, toy_models


def _apply(proto, activations=TENSORRT_FUSIBLE):
    model = ir.serde.deserialize_model(proto)
    report = FixReport()
    count = RewriteRuleSet(activation_fusion_rules(activations, report)).apply_to_model(model)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    return out, report, count


@pytest.mark.parametrize("name, activation", [("conv_leakyrelu", "LeakyRelu"), ("conv_hardswish", "HardSwish"),
                                              ("conv_silu", "Sigmoid"), ("conv_sigmoid", "Sigmoid")])
def test_activation_reads_the_weighted_op_directly(name, activation):
    float_model = toy_models.build(name)
    feeds = toy_models.random_feeds(float_model, 8)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds[:4], "u8s8")
    out, report, count = _apply(qdq)
    assert count == 1 and [c.rule for c in report.changes] == [RULE_NAME]
    act = next(n for n in out.graph.node if n.op_type == activation)
    assert model_checks.producer_of(out, act.input[0]).op_type == "Conv"
    scores = fidelity.compare_to_float(float_model, {"input": qdq, "fused": out}, feeds[4:])
    assert scores["fused"]["sqnr_db"] >= scores["input"]["sqnr_db"] - 0.5


def test_npu_set_leaves_sigmoid_alone():
    float_model = toy_models.build("conv_sigmoid")
    qdq = ort_quantize.quantize_with_ort(float_model, toy_models.random_feeds(float_model, 4), "u8s8")
    _, _, count = _apply(qdq, ("Relu", "LeakyRelu", "Clip", "HardSwish"))
    assert count == 0


def test_pair_shared_with_another_consumer_is_left_alone():
    # onnxscript's matcher itself refuses matches whose intermediate values have other uses.
    proto = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,3,3] x) => (float[1,2,3,3] y, float[1,2,3,3] z)
    <float[2,2,1,1] w = {0.5, -0.3, 0.2, 0.9}, float s = {0.02}, int8 zp = {0}>
    { c = Conv(x, w)  q = QuantizeLinear(c, s, zp)  d = DequantizeLinear(q, s, zp)
      y = LeakyRelu(d)  z = Identity(d) }""")
    out, _, count = _apply(proto)
    assert count == 0
    assert model_checks.producer_of(out, model_checks.producer_of(out, "y").input[0]).op_type == "DequantizeLinear"

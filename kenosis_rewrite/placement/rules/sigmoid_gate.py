"""Quantize the gate of a quantized SiLU/GLU-style product so ORT runs it in integer kernels.

Transformation (per-tensor; ``DQ(a)`` any dequantized tensor, often the Sigmoid's own input)::

    DQ(x) -> Sigmoid -> g;   Mul(DQ(a), g) -> Q(s, z)
    ==>
    DQ(x) -> Sigmoid -> Q(1/255, 0) -> DQ(1/255, 0) -> g';   Mul(DQ(a), g') -> Q(s, z)

Why: quantizers that place Q/DQ only in front of weighted ops (NNCF, OpenVINO's placement) leave a
SiLU ``x * sigmoid(x)`` with no quantizer after the Sigmoid. ORT CPU then runs ``Sigmoid -> Mul`` in
float between two integer Convs (measured on NNCF's YOLOv8n: 57 such islands, 1.36x FP32 where
quantize_static's placement, which has the pair, reaches 1.73x). With the pair, ``DQ -> Sigmoid -> Q``
becomes QLinearSigmoid and ``DQ, DQ -> Mul -> Q`` QLinearMul. The Sigmoid's range is known, (0, 1),
so the new quantizer needs no calibration: uint8, scale 1/255, zero point 0.

Exactness: approximate. One rounding is added, of the gate onto a grid of 1/255: the gate moves by
at most 1/510 and the product by at most ``|a| / 510`` before the output quantizer's own rounding.
No clamp is added (the grid covers the Sigmoid's whole range).

Refused with a reason: a Sigmoid whose input is not dequantized, a product whose other input is not
dequantized (ORT would not fuse the Mul), per-axis parameters, a gate read by more than the Mul.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_base import ReportingRule, refusal

__all__ = ["QuantizeSigmoidGate", "sigmoid_gate_rules", "RULE_NAME"]

RULE_NAME = "quantize-sigmoid-gate"
_TOP = 255


def _gate_index(a: ir.Value, b: ir.Value) -> int | None:
    """Which Mul input (0 or 1) is a Sigmoid's output; None when neither is."""
    for index, value in enumerate((a, b)):
        producer = value.producer()
        if producer is not None and producer.op_type == "Sigmoid" and producer.domain in ("", "ai.onnx"):
            return index
    return None


def _per_tensor_dequantized(value: ir.Value) -> bool:
    producer = value.producer()
    if not qdq_params.is_dequantize(producer):
        return False
    params = qdq_params.quant_params(producer)
    return params is not None and params.is_per_tensor and params.dtype in qdq_params.EIGHT_BIT


class QuantizeSigmoidGate(ReportingRule):
    """``Mul(DQ(a), Sigmoid(DQ(x))) -> Q`` ==> the gate quantized on (0, 1); see the module docstring."""

    def __init__(self, report: FixReport | None = None):
        super().__init__(RULE_NAME, report)

    def pattern(self, op, a, b):
        product = op.Mul(a, b, _outputs=["product"])
        return op.QuantizeLinear(product, _allow_other_inputs=True, _outputs=["q"])

    def check(self, context, a, b, product, q, **_) -> MatchResult:
        del context
        index = _gate_index(a, b)
        if index is None:
            return MatchResult().fail("neither factor is a Sigmoid")
        gate, other = (a, b) if index == 0 else (b, a)
        sigmoid = gate.producer()
        where = sigmoid.name or str(gate.name)
        if not _per_tensor_dequantized(sigmoid.inputs[0]):
            return refusal(where, "the Sigmoid's input is not a per-tensor 8-bit DequantizeLinear")
        if not _per_tensor_dequantized(other):
            return refusal(where, "the other factor is not a per-tensor 8-bit DequantizeLinear (ORT would not fuse the Mul)")
        params = qdq_params.quant_params(q.producer())
        if params is None or not params.is_per_tensor:
            return refusal(where, "the product's quantizer is not per-tensor")
        if len(gate.uses()) != 1 or gate.is_graph_output():
            return refusal(where, "the Sigmoid's output is read by more than the Mul")
        return MatchResult()

    def rewrite(self, op, a, b, product, q, **_):
        index = _gate_index(a, b)
        gate = (a, b)[index]
        q_node = q.producer()
        base = gate.name or "sigmoid"
        constant = qdq_params.constant_maker(op, lambda name: self.fresh_name(q_node.graph, name), base)
        # the scale in the product's own float type: QuantizeLinear's input and scale share one type
        float_type = qdq_params.quant_params(q_node).scale.dtype
        scale, zero = constant(1.0 / _TOP, float_type, "gate_scale"), constant(0, np.uint8, "gate_zero_point")
        quantized_gate = op.DequantizeLinear(op.QuantizeLinear(gate, scale, zero), scale, zero)
        factors = [a, b]
        factors[index] = quantized_gate
        self.record(gate.producer().name or base, "gate quantized on (0, 1): QLinearSigmoid + QLinearMul", exact=False)
        return op.QuantizeLinear(op.Mul(*factors), *q_node.inputs[1:], **dict(q_node.attributes))


def sigmoid_gate_rules(report: FixReport | None = None) -> RewriteRuleSet:
    return RewriteRuleSet([QuantizeSigmoidGate.rule(report)])

"""Remove the Q/DQ pair between a weighted op and the activation its runtime fuses into it.

Transformation (``Act`` in the target's fusible set; SiLU is ``x * Sigmoid(x)``)::

    W(...) -> Q -> DQ -> Act -> ...        ==>   W(...) -> Act -> ...
    W(...) -> Q -> DQ -> {Sigmoid, Mul}    ==>   W(...) -> Mul(., Sigmoid(.))

Why: TensorRT and NPU compilers fuse Conv/MatMul/Gemm with their activation into one kernel and
quantize the activation's output; a Q/DQ between them either blocks the fusion or forces an
extra requantization (TensorRT's explicit-quantization guide: do not quantize the outputs of
weighted ops; Quark's DPU form ``Conv -> Relu -> Q -> DQ``). ORT CPU is the opposite case, which
is why this rule is not in the ``ort-cpu`` target: there, the pair is what makes QLinearConv.

Exactness: approximate, towards FP32: the activation reads the weighted op's exact output instead
of its rounded, clamped copy. For positively homogeneous activations (Relu, LeakyRelu, Clip(0, M))
and zero point 0, ``Act(s * q) = s * Act(q)``, so the quantization the pair performed commutes
with the activation and the post-activation quantizer loses nothing by coming later.

Refused with a reason: the weighted op's output or the pair read by other nodes, or a pair
whose DQ feeds anything but the activation (and, for SiLU, its Mul).
"""

from __future__ import annotations

from onnxscript.rewriter import MatchResult

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph.rule_base import ReportingRule, refusal

__all__ = ["FuseActivationIntoProducer", "FuseSiLUIntoProducer", "activation_fusion_rules"]

RULE_NAME = "fuse-activation-into-producer"
TENSORRT_FUSIBLE = ("Relu", "LeakyRelu", "Clip", "HardSwish", "HardSigmoid", "Sigmoid", "Tanh", "Gelu", "Elu")
NPU_FUSIBLE = ("Relu", "LeakyRelu", "Clip", "HardSwish")


def _check_producer(x) -> str | None:
    producer = x.producer()
    if producer is None or producer.op_type not in op_tables.WEIGHTED_OPS:
        return "the quantized tensor does not come from a Conv/ConvTranspose/MatMul/Gemm"
    if len(x.uses()) != 1:
        return f"{x.name!r} is read by other nodes"
    return None


class FuseActivationIntoProducer(ReportingRule):
    """``W -> Q -> DQ -> Act`` ==> ``W -> Act``; see the module docstring."""

    def __init__(self, activation: str, report: FixReport | None = None):
        super().__init__(RULE_NAME, report)
        self.activation = activation

    def pattern(self, op, x):
        quantized = op.QuantizeLinear(x, _allow_other_inputs=True, _outputs=["q"])
        dequantized = op.DequantizeLinear(quantized, _allow_other_inputs=True, _outputs=["dq"])
        return getattr(op, self.activation)(dequantized, _allow_other_inputs=True, _outputs=["act"])

    def check(self, context, x, q, dq, act, **_) -> MatchResult:
        del context
        reason = _check_producer(x)
        if reason is None and (len(q.uses()) != 1 or len(dq.uses()) != 1):
            reason = "the Q/DQ pair is read by other nodes"
        if reason is not None:
            if x.producer() is not None and x.producer().op_type in op_tables.WEIGHTED_OPS:
                return refusal(act.producer().name or str(act.name), reason)
            return MatchResult().fail(reason)
        return MatchResult()

    def rewrite(self, op, x, act, **_):
        node = act.producer()
        self.record(node.name or str(act.name), f"{self.activation} reads the {x.producer().op_type} directly", exact=False)
        return op.op(self.activation, x, *node.inputs[1:], _name=node.name, **dict(node.attributes))


class FuseSiLUIntoProducer(ReportingRule):
    """``W -> Q -> DQ -> {Sigmoid, Mul}`` ==> ``W -> x * Sigmoid(x)``; see the module docstring."""

    def __init__(self, report: FixReport | None = None):
        super().__init__(RULE_NAME, report)

    def pattern(self, op, x):
        quantized = op.QuantizeLinear(x, _allow_other_inputs=True, _outputs=["q"])
        dequantized = op.DequantizeLinear(quantized, _allow_other_inputs=True, _outputs=["dq"])
        return op.Mul(dequantized, op.Sigmoid(dequantized, _outputs=["sig"]), _outputs=["out"])

    def check(self, context, x, q, dq, out, **_) -> MatchResult:
        del context
        reason = _check_producer(x)
        if reason is None and (len(q.uses()) != 1 or len(dq.uses()) != 2):
            reason = "the Q/DQ pair is read by other nodes"
        return MatchResult().fail(reason) if reason else MatchResult()

    def rewrite(self, op, x, out, sig, **_):
        self.record(out.producer().name or str(out.name), "SiLU reads the producer directly", exact=False)
        return op.Mul(x, op.Sigmoid(x, _name=sig.producer().name), _name=out.producer().name)


class FuseQuantizedSiLUIntoProducer(FuseSiLUIntoProducer):
    """quantize_static's SiLU: ``W -> Q -> DQ -> {Sigmoid -> Q -> DQ, Mul}`` ==> ``x * Sigmoid(x)``."""

    def pattern(self, op, x):
        quantized = op.QuantizeLinear(x, _allow_other_inputs=True, _outputs=["q"])
        dequantized = op.DequantizeLinear(quantized, _allow_other_inputs=True, _outputs=["dq"])
        gate = op.DequantizeLinear(
            op.QuantizeLinear(op.Sigmoid(dequantized, _outputs=["sig"]), _allow_other_inputs=True),
            _allow_other_inputs=True,
        )
        return op.Mul(dequantized, gate, _outputs=["out"])


def activation_fusion_rules(activations, report: FixReport | None = None) -> list:
    rules = [FuseActivationIntoProducer.rule(a, report) for a in activations]
    if "Sigmoid" in activations:
        silu = [FuseQuantizedSiLUIntoProducer.rule(report), FuseSiLUIntoProducer.rule(report)]
        rules[:0] = [variant for rule in silu for variant in rule.commute()]  # Mul(a, b) or Mul(b, a)
    return rules

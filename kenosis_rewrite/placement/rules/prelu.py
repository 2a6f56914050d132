"""Replace PRelu, which ORT CPU only has a slow float kernel for, with exact equivalents.

Transformations (``slope`` a constant):

* every slope equal to ``a``:   ``PRelu(x, slope)  ==>  LeakyRelu(x, alpha=a)``
  ORT then fuses ``DQ -> LeakyRelu -> Q`` into QLinearLeakyRelu.
* per-channel slope:            ``PRelu(x, slope)  ==>  Relu(x) + Min(x, 0) * slope``
  three cheap element-wise float kernels instead of PRelu's broadcasting one.

Exactness: exact, bit for bit. For ``x >= 0`` both sides are ``x`` (``x + 0 * slope``); for
``x < 0`` both are ``slope * x`` (``0 + x * slope``). The LeakyRelu form computes
``alpha * x`` with the same float multiplication. Measured on ORT 1.31 x86 (shared research,
ort-cpu-facts.md §3.4): PRelu with a [C,1,1] slope on a 64x56x56 tensor takes 0.98 ms, LeakyRelu
0.06 ms, Relu + Min*slope + Add 0.15 ms.

Refused with a reason: a slope that is not a constant, or one with NaN/inf values.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_base import ReportingRule, refusal

__all__ = ["PReluToLeakyRelu", "PReluToReluMin", "prelu_rules"]


def _slope_or_reason(slope: ir.Value) -> np.ndarray | str:
    array = qdq_params.const_array(slope)
    if array is None:
        return f"slope {slope.name!r} is not a constant"
    if not np.all(np.isfinite(array)):
        return "slope has NaN or infinite values"
    return array


class _PReluRule(ReportingRule):
    rule_name = ""
    wants_uniform = True

    def __init__(self, report: FixReport | None = None):
        super().__init__(self.rule_name, report)

    def pattern(self, op, x, slope):
        return op.PRelu(x, slope, _outputs=["out"])

    def check(self, context, x, slope, out, **_) -> MatchResult:
        del context
        where = out.producer().name or str(out.name)
        array = _slope_or_reason(slope)
        if isinstance(array, str):
            return refusal(where, array)
        uniform = array.size == 1 or bool(np.all(array == array.reshape(-1)[0]))
        if uniform != self.wants_uniform:
            return MatchResult().fail("slope is per-channel" if self.wants_uniform else "slope is uniform")
        if x.dtype is not None and array.dtype != x.dtype.numpy():
            return refusal(where, "slope and input have different types")
        return MatchResult()

    def _record(self, out: ir.Value, detail: str) -> None:
        self.record(out.producer().name or str(out.name), detail, exact=True)


class PReluToLeakyRelu(_PReluRule):
    """``PRelu(x, a)`` with one slope value ``a`` ==> ``LeakyRelu(x, alpha=a)``. Exact."""

    rule_name = "prelu-to-leakyrelu"
    wants_uniform = True

    def rewrite(self, op, x, slope, out, **_):
        alpha = float(qdq_params.const_array(slope).reshape(-1)[0])
        self._record(out, f"uniform slope {alpha:.6g} -> LeakyRelu")
        return op.LeakyRelu(x, alpha=alpha)


class PReluToReluMin(_PReluRule):
    """``PRelu(x, slope)`` with a per-channel slope ==> ``Relu(x) + Min(x, 0) * slope``. Exact."""

    rule_name = "prelu-to-relu-min"
    wants_uniform = False

    def rewrite(self, op, x, slope, out, **_):
        array = qdq_params.const_array(slope)
        graph = out.producer().graph
        zero_name = self.fresh_name(graph, f"{out.name or 'prelu'}_zero")
        zero = op.initializer(ir.tensor(np.zeros((), dtype=array.dtype), name=zero_name), name=zero_name)
        self._record(out, f"{array.size}-channel slope -> Relu + Min*slope")
        return op.Add(op.Relu(x), op.Mul(op.Min(x, zero), slope))


def prelu_rules(report: FixReport | None = None) -> RewriteRuleSet:
    return RewriteRuleSet([PReluToLeakyRelu.rule(report), PReluToReluMin.rule(report)])

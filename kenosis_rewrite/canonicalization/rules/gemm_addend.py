"""A Gemm whose addend ``C`` is a computed tensor, split into the Gemm and an Add (FP32 graphs).

Transformation (``C`` not a constant, ``beta = 1``)::

    Gemm(A, B, C; alpha, transA, transB)      ==>     Add(Gemm(A, B; alpha, transA, transB), C)

Why: onnxruntime's level-1 ``MatMulAddFusion`` (run by :func:`kenosis_rewrite.prepare` to cancel
NHWC Transposes) turns ``MatMul -> Add`` into a Gemm whatever the Add's other input is, so a
residual connection on 2-D activations (an MLP block, an unrolled recurrent cell) becomes the Gemm's
``C``. quantize_static quantizes a Gemm's ``C`` only when it is a constant (an int32 bias), and no
QDQ selector of ORT accepts a float ``C``: the Gemm then runs in float on dequantized weights.
Measured on a 256-wide MLP block with a residual (8 rows, quantize(), one thread, interleaved
medians, onnxruntime 1.32.0): 143 us with the fused float Gemm against 21 us split (QGemm,
QLinearAdd), ``python benchmarks/gemm_addend_speed.py``.

Exactness: exact in real arithmetic; float32 results may differ by the rounding of where ``C`` is
added (ORT's Gemm accumulates onto ``C``), which ``prepare()``'s verification measures. Gemm's
``C`` broadcasts unidirectionally to ``(M, N)``, so the Add's multidirectional broadcast gives the
same shape.

Left alone: constant ``C`` (a bias, which quantize_static makes int32), ``beta != 1``, non-float types.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_base import ReportingRule

__all__ = ["GemmComputedAddendToAdd", "gemm_addend_rules", "RULE_NAME"]

RULE_NAME = "split-gemm-computed-addend"
_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


class GemmComputedAddendToAdd(ReportingRule):
    """``Gemm(A, B, C)`` with a computed ``C`` ==> ``Add(Gemm(A, B), C)``; see the module docstring."""

    def __init__(self, report: FixReport | None = None):
        super().__init__(RULE_NAME, report)

    def pattern(self, op, a, b, c):
        return op.Gemm(a, b, c, _outputs=["product"])

    def check(self, context, a, b, c, product, **_) -> MatchResult:
        del context, a, b
        gemm = product.producer()
        if c is None or qdq_params.const_array(c) is not None:
            return MatchResult().fail("C is a constant: quantize_static makes it the int32 bias")
        beta = gemm.attributes.get_float("beta", 1.0)
        if beta != 1.0:
            return MatchResult().fail(f"beta is {beta}, not 1")
        dtype = product.dtype or c.dtype
        if dtype not in _FLOAT_TYPES:
            return MatchResult().fail(f"Add of {dtype or 'an unknown type'}")
        return MatchResult()

    def rewrite(self, op, a, b, c, product, **_):
        gemm = product.producer()
        self.record(gemm.name or str(product.name), "computed addend C moved out of the Gemm into an Add (quantizable)",
                    exact=True)
        attributes = {name: gemm.attributes[name].value for name in ("alpha", "transA", "transB") if name in gemm.attributes}
        return op.Add(op.Gemm(a, b, **attributes), c)


def gemm_addend_rules(report: FixReport | None = None) -> RewriteRuleSet:
    return RewriteRuleSet([GemmComputedAddendToAdd.rule(report)])

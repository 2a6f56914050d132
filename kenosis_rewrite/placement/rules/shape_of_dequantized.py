"""Read a quantized tensor's shape from its codes, not from a dequantized copy.

Transformation (``shape-of-codes``)::

    Shape(DQ(x_q; s, z); start, end)   ==>   Shape(x_q; start, end)
    Size(DQ(x_q; s, z))                ==>   Size(x_q)

Why: exports with a dynamic batch compute shapes at run time (``x.view(x.size(0), -1)``,
``interpolate(size=y.shape[2:])``), and a quantizer that wraps ``x`` in Q/DQ leaves the Shape
reading the DequantizeLinear's output. ONNX Runtime gives each consumer of a DequantizeLinear its
own copy before it fuses the others into integer kernels, so the Shape's copy stays: a whole
tensor dequantized on every run for its dims (the fuzz's dynamic-batch graphs: one float
DequantizeLinear per Shape in ORT's optimized graph).

Exactness: exact, bit for bit: DequantizeLinear's output has its input's shape (per-tensor,
per-axis and blocked parameters alike), so both read the same dims. The DequantizeLinear stays for
its other readers and goes where the Shape was its only one.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_base import ReportingRule

__all__ = ["ShapeOfCodes", "SizeOfCodes", "shape_of_codes_rules", "RULE_NAME"]

RULE_NAME = "shape-of-codes"


class _ReadCodes(ReportingRule):
    """``op(DQ(x_q))`` ==> ``op(x_q)`` for an op that reads only its input's shape. Exact."""

    op_type = ""

    def __init__(self, report: FixReport | None = None):
        super().__init__(RULE_NAME, report)

    def pattern(self, op, dequantized):
        return getattr(op, self.op_type)(dequantized, _outputs=["read"])

    def check(self, context, dequantized: ir.Value, read: ir.Value, **_) -> MatchResult:
        producer = dequantized.producer()
        if producer is None or producer.op_type != "DequantizeLinear" or producer.domain not in qdq_params.DEFAULT_DOMAINS:
            return MatchResult().fail("the input is not a DequantizeLinear's output")
        return MatchResult()

    def rewrite(self, op, dequantized: ir.Value, read: ir.Value, **_):
        node = read.producer()
        self.record(node.name or read.name, f"{self.op_type} reads {dequantized.producer().inputs[0].name}, not its "
                    "DequantizeLinear", exact=True)
        return getattr(op, self.op_type)(dequantized.producer().inputs[0], **{
            name: attribute.value for name, attribute in node.attributes.items()})


class ShapeOfCodes(_ReadCodes):
    """``Shape(DQ(x_q))`` ==> ``Shape(x_q)`` (start and end kept). Exact."""

    op_type = "Shape"


class SizeOfCodes(_ReadCodes):
    """``Size(DQ(x_q))`` ==> ``Size(x_q)``. Exact."""

    op_type = "Size"


def shape_of_codes_rules(report: FixReport | None = None) -> RewriteRuleSet:
    return RewriteRuleSet([ShapeOfCodes.rule(report), SizeOfCodes.rule(report)])

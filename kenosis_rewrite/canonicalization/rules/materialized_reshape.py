"""A Reshape to a computed shape whose result's shape is known reads that shape as a constant, in any opset.

FP32 canonicalization rule (run by :func:`kenosis_rewrite.prepare`, in place of onnxscript's
``MaterializeReshapeShape``).

Transformation::

    Reshape(x, computed)  ==>  Reshape(x, Constant(dims))
    where the output's shape is known but for at most one symbolic dim, written -1

Why: onnxscript's own rule writes ``allowzero=1``, an attribute Reshape has only from opset 14: on
an opset-13 export (``x.view(x.shape[0], 4, 4, 10)`` once inference knows the view's dims) its
Reshape is invalid, ONNX Runtime refuses the model, and prepare() gave up every fold it had made.
Before opset 14 the constant is written without the attribute where none of its dims is 0 (0 means
"copy the input's dim" there; ``allowzero=1`` is what makes a 0 in the materialized dims a 0).

Exactness: exact (the constant holds the dims the Reshape produces; at most one -1, which Reshape
infers from the element count as the computed shape did).

Refused with a reason: a shape input already constant, an unknown output shape, two or more
symbolic dims, a materialized 0 dim before opset 14.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_base import ReportingRule

__all__ = ["MATERIALIZE_RESHAPE_RULE_NAME", "materialized_reshape_rules"]

MATERIALIZE_RESHAPE_RULE_NAME = "MaterializeReshapeShape"  # the onnxscript rule this one stands in for
_ALLOWZERO_OPSET = 14


def _opset(value: ir.Value) -> int:
    graph = value.producer().graph if value.producer() is not None else None
    return qdq_params.default_opset(graph) if graph is not None else _ALLOWZERO_OPSET


class MaterializeReshapeShapeAnyOpset(ReportingRule):
    def pattern(self, op, data, shape):
        return op.Reshape(data, shape, _outputs=["reshaped"])

    def _dims(self, shape: ir.Value, reshaped: ir.Value) -> list[int] | str:
        """The constant target shape, or why there is none."""
        if shape.const_value is not None:
            return "the shape input is already a constant"
        if reshaped.shape is None:
            return "the output's shape is not known"
        dims = [dim if isinstance(dim, int) else -1 for dim in reshaped.shape]
        if dims.count(-1) > 1:
            return f"the output's shape has {dims.count(-1)} symbolic dims"
        if 0 in dims and _opset(reshaped) < _ALLOWZERO_OPSET:
            return "a 0 dim, which Reshape reads as 'copy the input's dim' before opset 14"
        return dims

    def check(self, context, data, shape, reshaped) -> MatchResult:
        found = self._dims(shape, reshaped)
        return MatchResult().fail(found) if isinstance(found, str) else MatchResult()

    def rewrite(self, op, data, shape, reshaped):
        dims = op.Constant(value=ir.tensor(np.array(self._dims(shape, reshaped), np.int64)))
        allowzero = {"allowzero": 1} if _opset(reshaped) >= _ALLOWZERO_OPSET else {}
        return op.Reshape(data, dims, **allowzero)


def materialized_reshape_rules() -> RewriteRuleSet:
    return RewriteRuleSet([MaterializeReshapeShapeAnyOpset.rule()])

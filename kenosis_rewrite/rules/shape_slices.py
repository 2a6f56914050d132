"""Write ``Slice(Shape(x))`` as ``Shape(x, start, end)`` so the dims it reads fold when they are static.

FP32 canonicalization rule (run by :func:`kenosis_rewrite.prepare`).

Transformation (opset >= 15, where Shape has ``start``/``end``)::

    Slice(Shape(x), [s], [e])            ==>  Shape(x, start=s, end=e)
    Slice(Shape(x), [s], [e], [0], [1])  ==>  Shape(x, start=s, end=e)

Why: TF "same" padding and detector heads read ``Shape(x)[2:4]``. onnxscript's constant folder
folds a Shape whose dims are all static and a Gather of a partly static shape, but not a Slice of
one, so with a symbolic batch the spatial dims never become constants and the Pads never reach
the Convs. As one Shape with bounds, the read covers only the (static) spatial dims and folds.

Exactness: exact (Shape's start/end are defined as this slice).

Refused with a reason: non-constant or multi-element starts/ends, axes other than 0, steps
other than 1, opsets before 15, a Shape that already has bounds.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

__all__ = ["shape_slice_rules"]

_SHAPE_BOUNDS_OPSET = 15


def _single_int(value: ir.Value | None) -> int | None:
    if value is None or value.const_value is None or value.const_value.size != 1:
        return None
    return int(value.const_value.numpy().reshape(-1)[0])


class SliceOfShape(RewriteRuleClassBase):
    def pattern(self, op, x, starts, ends):
        return op.Slice(op.Shape(x, _outputs=["dims"]), starts, ends, _allow_other_inputs=True, _outputs=["sliced"])

    def check(self, context, x, starts, ends, dims, sliced) -> MatchResult:
        result = MatchResult()
        shape_node, slice_node = dims.producer(), sliced.producer()
        graph = slice_node.graph
        opset = graph.opset_imports.get("", 0) if graph is not None else 0
        if opset < _SHAPE_BOUNDS_OPSET:
            return result.fail(f"opset {opset} < 15: Shape has no start/end")
        if "start" in shape_node.attributes or "end" in shape_node.attributes:
            return result.fail("the Shape already has bounds")
        if _single_int(starts) is None or _single_int(ends) is None:
            return result.fail("starts/ends are not single constants")
        axes, steps = (slice_node.inputs[3:4] or [None])[0], (slice_node.inputs[4:5] or [None])[0]
        if axes is not None and _single_int(axes) not in (0, -1):
            return result.fail("the Slice reads another axis")
        if steps is not None and _single_int(steps) != 1:
            return result.fail("the Slice has a step other than 1")
        return result

    def rewrite(self, op, x, starts, ends, dims, sliced):
        start, end = _single_int(starts), _single_int(ends)
        end = min(end, 2**62)  # INT64_MAX ("to the end") as a Python int stays valid
        return op.Shape(x, start=start, end=end)


def shape_slice_rules() -> RewriteRuleSet:
    return RewriteRuleSet([SliceOfShape.rule()])

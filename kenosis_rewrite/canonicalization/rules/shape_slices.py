"""Read the static dims of a partly static shape as what they are, so the arithmetic on them folds.

FP32 canonicalization rules (run by :func:`kenosis_rewrite.prepare`).

Transformations::

    Slice(Shape(x), [s], [e])            ==>  Shape(x, start=s, end=e)      (opset >= 15)
    Slice(Shape(x), [s], [e], [0], [1])  ==>  Shape(x, start=s, end=e)
    Gather(Shape(x), i)                  ==>  Constant(x.shape[i])          (x.shape[i] static)
    Slice(Shape(x), [s], [e], ...)       ==>  Constant(x.shape[s:e])        (those dims static, any opset)

Why: TF "same" padding and detector heads read ``Shape(x)[2:4]``, ViT exports ``x.shape[2] //
patch``. onnxscript's constant folder folds a Shape whose dims are all static, but neither a Slice
nor a Gather of a partly static one, so with a symbolic batch the spatial dims never become
constants: the Pads never reach the Convs, and a ViT's position embeddings are resized to its patch
grid on every run (pinning the batch was the only way to fold them: vit_s_focus). As one Shape with
bounds, the read covers only the (static) spatial dims and folds; a Gather of static dims is those dims.

Exactness: exact (Shape's start/end are defined as this slice; a static dim is the value Shape
returns for it).

Refused with a reason: non-constant or multi-element starts/ends, axes other than 0, steps
other than 1, opsets before 15, a Shape that already has bounds; for Gather, indices that are not
constants, a dim that is not static, an index out of range.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.graph.rule_base import ReportingRule

__all__ = ["shape_slice_rules", "static_dim_rules"]

_SHAPE_BOUNDS_OPSET = 15


def _single_int(value: ir.Value | None) -> int | None:
    if value is None or value.const_value is None or value.const_value.size != 1:
        return None
    return int(value.const_value.numpy().reshape(-1)[0])


class SliceOfShape(ReportingRule):
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


def _shape_read(x: ir.Value, shape_node: ir.Node) -> list:
    """The dims of ``x`` (ints where static) that ``shape_node`` (``Shape``, maybe bounded) returns."""
    rank = x.shape.rank()
    start, end = (v + rank if v < 0 else v for v in (shape_node.attributes.get_int("start", 0),
                                                      shape_node.attributes.get_int("end", rank)))
    return list(x.shape)[max(0, start):min(rank, end)]


class GatherOfShape(ReportingRule):
    def __init__(self):
        # the Shape stays for its other readers (the height and the width Gathered from one Shape)
        super().__init__(remove_nodes=False)

    def pattern(self, op, x, indices):
        return op.Gather(op.Shape(x, _outputs=["dims"]), indices, _outputs=["gathered"])

    def _dims(self, x: ir.Value, indices: ir.Value, dims: ir.Value, gathered: ir.Value) -> np.ndarray | str:
        """The gathered dims, or why they are not known."""
        if x.shape is None:
            return "the tensor's rank is unknown"
        if indices.const_value is None:
            return "the indices are not constants"
        if gathered.producer().attributes.get_int("axis", 0) not in (0, -1):
            return "the Gather reads another axis"
        read = _shape_read(x, dims.producer())
        index = indices.const_value.numpy().astype(np.int64)
        if index.size and (index.min() < -len(read) or index.max() >= len(read)):
            return "an index is out of range"
        picked = [read[int(i)] for i in index.reshape(-1)]
        if not all(isinstance(dim, int) for dim in picked):
            return "a gathered dim is not static"
        return np.array(picked, np.int64).reshape(index.shape)

    def check(self, context, x, indices, dims, gathered) -> MatchResult:
        found = self._dims(x, indices, dims, gathered)
        return MatchResult().fail(found) if isinstance(found, str) else MatchResult()

    def rewrite(self, op, x, indices, dims, gathered):
        return op.Constant(value=ir.tensor(self._dims(x, indices, dims, gathered)))


class SliceOfStaticDims(ReportingRule):
    """``Slice(Shape(x), s, e)`` of static dims as their values, in every opset (Shape has no bounds
    before 15, so :class:`SliceOfShape` cannot help there)."""

    def __init__(self):
        super().__init__(remove_nodes=False)  # the Shape stays for its other readers

    def pattern(self, op, x, starts, ends):
        return op.Slice(op.Shape(x, _outputs=["dims"]), starts, ends, _allow_other_inputs=True, _outputs=["sliced"])

    def _dims(self, x: ir.Value, starts: ir.Value, ends: ir.Value, dims: ir.Value, sliced: ir.Value) -> list[int] | str:
        slice_node = sliced.producer()
        if x.shape is None:
            return "the tensor's rank is unknown"
        axes, steps = (slice_node.inputs[3:4] or [None])[0], (slice_node.inputs[4:5] or [None])[0]
        start, end = _single_int(starts), _single_int(ends)
        step = 1 if steps is None else _single_int(steps)
        if start is None or end is None or step in (None, 0):
            return "starts/ends/steps are not single constants"
        if axes is not None and _single_int(axes) not in (0, -1):
            return "the Slice reads another axis"
        # Python's slice clamps and counts from the end as ONNX's Slice does
        read = _shape_read(x, dims.producer())[slice(start, min(end, 2**62), step)]
        if not all(isinstance(dim, int) for dim in read):
            return "a sliced dim is not static"
        return read

    def check(self, context, x, starts, ends, dims, sliced) -> MatchResult:
        found = self._dims(x, starts, ends, dims, sliced)
        return MatchResult().fail(found) if isinstance(found, str) else MatchResult()

    def rewrite(self, op, x, starts, ends, dims, sliced):
        return op.Constant(value=ir.tensor(np.array(self._dims(x, starts, ends, dims, sliced), np.int64)))


def shape_slice_rules() -> RewriteRuleSet:
    return RewriteRuleSet([SliceOfShape.rule()])


def static_dim_rules() -> RewriteRuleSet:
    """``Gather(Shape(x), i)`` and ``Slice(Shape(x), s, e)`` of static dims as constants. :func:`kenosis_rewrite.prepare` applies
    it only where a Pad's or Resize's parameters are computed (instead of pinning input dims): folded
    everywhere it changed what ORT's transpose optimizer does with the captcha CRNN's sequence, which
    then ran one slower int8 Transpose (300 against 34 us; 6-10% slower)."""
    return RewriteRuleSet([GatherOfShape.rule(), SliceOfStaticDims.rule()])

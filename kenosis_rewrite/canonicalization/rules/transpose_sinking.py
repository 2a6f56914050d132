"""Move a Transpose after the elementwise ops that read it, so Transpose pairs meet and cancel.

FP32 canonicalization rules (run by :func:`kenosis_rewrite.prepare` before quantization).

Transformations (``p`` the permutation, ``c`` a constant, ``c'`` = ``c`` broadcast to the rank and
transposed by the inverse of ``p``)::

    Transpose(x, p) -> Relu/Clip/LeakyRelu/Sigmoid/...   ==>  Relu/... (x) -> Transpose(., p)
    Transpose(x, p) -> Add/Sub/Mul/Div(., c)            ==>  Add/...(x, c') -> Transpose(., p)

Why: NHWC exports (tf2onnx, keras2onnx, some PyTorch exports) put ``Transpose`` on both sides of
every Conv, with the bias, BatchNorm arithmetic and activation in NHWC between them:
``Conv -> Transpose -> Add -> Relu -> Transpose -> Conv``. The Transpose separates the Conv from
its affine and activation, so no fold or fusion sees them together, and a quantizer wraps each
piece in Q/DQ. Sunk past the elementwise ops, the two Transposes become adjacent and onnxscript's
``transpose_transpose``/``no_op_transpose`` rules remove them; the per-channel constants are then
in NCHW order, next to the Conv, for :mod:`kenosis_rewrite.canonicalization.rules.channel_affine`.

Exactness: exact (bit for bit): elementwise ops commute with any permutation of the axes.

Refused with a reason: a constant operand that would broadcast the output to a larger shape (its
rank exceeds the Transpose's), non-constant second operands. The Transpose's output must have no
other reader (the pattern matcher guarantees it), so no Transpose is duplicated.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.graph.rule_base import ReportingRule

__all__ = ["transpose_sinking_rules", "UNARY_ELEMENTWISE"]

# Elementwise ops of one data input; Clip's bounds must be scalars (checked).
UNARY_ELEMENTWISE = (
    "Relu", "LeakyRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu",
    "Softplus", "Neg", "Abs", "Exp", "Sqrt", "Erf", "Mish", "Gelu",
)
BINARY_WITH_CONSTANT = ("Add", "Sub", "Mul", "Div")


def _permutation(node: ir.Node) -> list[int] | None:
    """The Transpose's permutation (its length is the rank); None when it is implicit and the rank unknown."""
    perm = node.attributes.get_ints("perm", None)
    if perm is not None:
        return list(perm)
    data = node.inputs[0]
    rank = data.shape.rank() if data is not None and data.shape is not None else None
    return list(reversed(range(rank))) if rank is not None else None


class _SinkPastUnary(ReportingRule):
    def __init__(self, op_type: str):
        self.op_type = op_type
        super().__init__(f"sink-transpose-past-{op_type.lower()}")

    def pattern(self, op, x):
        transposed = op.Transpose(x, _outputs=["transposed"])
        return getattr(op, self.op_type)(transposed, _allow_other_inputs=True, _outputs=["result"])

    def check(self, context, x, transposed, result) -> MatchResult:
        check = MatchResult()
        node = result.producer()
        for extra in node.inputs[1:]:
            if extra is not None and (extra.const_value is None or extra.const_value.size != 1):
                return check.fail(f"{self.op_type} has a non-scalar or non-constant operand")
        if _permutation(transposed.producer()) is None:
            return check.fail("the Transpose's rank is unknown")
        return check

    def rewrite(self, op, x, transposed, result):
        node = result.producer()
        moved = getattr(op, self.op_type)(x, *node.inputs[1:], **node.attributes)
        return op.Transpose(moved, **transposed.producer().attributes)


class _SinkPastBinary(ReportingRule):
    def __init__(self, op_type: str, constant_first: bool):
        self.op_type, self.constant_first = op_type, constant_first
        super().__init__(f"sink-transpose-past-{op_type.lower()}{'-reversed' if constant_first else ''}")

    def pattern(self, op, x, constant):
        transposed = op.Transpose(x, _outputs=["transposed"])
        operands = (constant, transposed) if self.constant_first else (transposed, constant)
        return getattr(op, self.op_type)(*operands)

    def check(self, context, x, constant, transposed) -> MatchResult:
        check = MatchResult()
        if constant.const_value is None:
            return check.fail(f"the {self.op_type} operand is not a constant")
        perm = _permutation(transposed.producer())
        if perm is None:
            return check.fail("the Transpose's rank is unknown")
        if constant.const_value.shape.rank() > len(perm):
            return check.fail(f"the {self.op_type} constant has a higher rank than the tensor")
        return check

    def rewrite(self, op, x, constant, transposed):
        perm = _permutation(transposed.producer())
        rank = len(perm)
        values = constant.const_value.numpy()
        values = values.reshape((1,) * (rank - values.ndim) + values.shape)
        # one copy per site: onnxscript replaces an initializer of the same name, which would leave
        # an earlier site reading a value no longer in the graph
        name = self.fresh_name(transposed.producer().graph, f"{constant.name}_untransposed")
        moved_constant = op.initializer(ir.tensor(np.ascontiguousarray(np.transpose(values, np.argsort(perm)))), name=name)
        operands = (moved_constant, x) if self.constant_first else (x, moved_constant)
        return op.Transpose(getattr(op, self.op_type)(*operands), perm=perm)


def transpose_sinking_rules() -> RewriteRuleSet:
    """Every sink of this module (binary ops with the constant on either side)."""
    rules = [_SinkPastUnary.rule(op_type) for op_type in UNARY_ELEMENTWISE]
    rules += [_SinkPastBinary.rule(op_type, first) for op_type in BINARY_WITH_CONSTANT for first in (False, True)]
    return RewriteRuleSet(rules)

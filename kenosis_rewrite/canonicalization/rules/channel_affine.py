"""Fold per-channel affine arithmetic (decomposed BatchNorm, input scaling) into Conv/Gemm weights.

FP32 canonicalization rules (run by :func:`kenosis_rewrite.prepare` before quantization).

Transformations (``s``, ``c`` constants that vary at most along the channel axis)::

    Conv(x, W, B) -> Mul(., s)   ==>  Conv(x, W * s[o], B * s)        (Div: W / s[o], B / s)
    Conv(x, W, B) -> Add(., c)   ==>  Conv(x, W, B + c)               (Sub: B - c)
    Gemm(a, W, C) -> Mul/Div/Add/Sub(., per-column constant)  ==>  Gemm with W, C scaled/shifted
    Mul(x, s) -> Conv(., W, B)   ==>  Conv(x, W * s[i], B)            (Div: W / s[i])
    Add(x, c) -> Conv(., W, B)   ==>  Conv(x, W, B + sum_i,k W[o, i, k] * c[i])   (Sub: - c)

``o`` is the output channel, ``i`` the input channel (per group). Exporters write BatchNorm as
``Sub(mean) -> Mul(gamma / std) -> Add(beta)`` (PyTorch exports of frozen BN, Paddle) and input
normalisation as ``Div(std)`` before the first Conv; onnxruntime's optimizer folds none of them
(no fusion folds a Sub), so a quantizer wraps each in its own Q/DQ and the Conv cannot fuse with
its activation. Folded, the Conv's output is the affine's output.

Exactness: equal in real arithmetic; float32 rounding differs by a few ulps (products are formed
once in float64 and rounded once). An ``Add``/``Sub`` before a Conv folds only when the Conv pads
nothing: a padded border reads zeros, not ``c``, so the shift is not uniform there.

Refused with a reason: non-constant operands, weights or bias shared with other nodes, constants
that vary along a non-channel axis or would broadcast the output to a larger shape, a Div by a
constant with a zero, an Add/Sub before a padding Conv, non-float weights, a Gemm bias that varies
along rows.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core.op_tables import AFFINE_OPS
from kenosis_rewrite.graph.rule_base import ReportingRule

__all__ = ["channel_affine_rules", "channel_vector"]

_FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16)


def _constant(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def _owned_constant(value: ir.Value, owner: ir.Node) -> str | None:
    """Why ``value`` cannot be rewritten in place for ``owner``, or None when it can."""
    if value.const_value is None:
        return f"{value.name} is not a constant"
    if value.is_graph_input():
        return f"{value.name} is a graph input"
    if any(user is not owner for user, _ in value.uses()):
        return f"{value.name} is shared with other nodes"
    return None


def channel_vector(constant: np.ndarray, rank: int, axis: int, channels: int) -> np.ndarray | None:
    """The constant as a vector along ``axis`` of a rank-``rank`` tensor, or None if it varies elsewhere."""
    if constant.ndim > rank:
        return None
    shape = (1,) * (rank - constant.ndim) + constant.shape
    if any(size != 1 for dim, size in enumerate(shape) if dim != axis):
        return None
    if shape[axis] not in (1, channels):
        return None
    return np.broadcast_to(constant.reshape(-1).astype(np.float64), (channels,))


def _is_float(value: ir.Value) -> bool:
    return value.dtype in _FLOAT_TYPES if value.dtype is not None else False


def _tensor_like(values: np.ndarray, like: ir.Value, name: str) -> ir.Tensor:
    return ir.Tensor(values.astype(like.const_value.numpy().dtype), name=name)


class _AffineAfter(ReportingRule):
    """``Producer(x, W[, B]) -> Op(., constant)``: the affine moves into W and B."""

    def __init__(self, producer: str, affine: str):
        self.producer, self.affine = producer, affine
        super().__init__(f"fold-{affine.lower()}-after-{producer.lower()}")

    def pattern(self, op, x, constant):
        out = getattr(op, self.producer)(x, _allow_other_inputs=True, _outputs=["produced"])
        return getattr(op, self.affine)(out, constant)

    def _layout(self, node: ir.Node) -> tuple[int, int, int] | str:
        """(rank of the output, channel axis, channel count) or a reason."""
        weights = _constant(node.inputs[1])
        if weights is None:
            return "weights are not constant"
        if self.producer == "Conv":
            return weights.ndim, 1, weights.shape[0]
        trans_b = node.attributes.get_int("transB", 0)
        return 2, 1, weights.shape[0] if trans_b else weights.shape[1]

    def check(self, context, x, constant, produced) -> MatchResult:
        result = MatchResult()
        node = produced.producer()
        if not _is_float(node.inputs[1]):
            return result.fail("the weights are not a float tensor")
        values = _constant(constant)
        if values is None:
            return result.fail(f"the {self.affine} operand is not a constant")
        for owned in node.inputs[1:3]:
            if owned is not None and (reason := _owned_constant(owned, node)):
                return result.fail(reason)
        layout = self._layout(node)
        if isinstance(layout, str):
            return result.fail(layout)
        vector = channel_vector(values, *layout)
        if vector is None:
            return result.fail(f"the {self.affine} constant varies along a non-channel axis or broadcasts the output")
        if self.affine == "Div" and not np.all(vector != 0):
            return result.fail("division by a constant with a zero")
        if self.producer == "Gemm" and node.inputs[2:3] and node.inputs[2] is not None:
            bias = _constant(node.inputs[2])
            if bias is not None and channel_vector(bias, 2, 1, layout[2]) is None:
                return result.fail("the Gemm bias varies along rows")
        return result

    def rewrite(self, op, x, constant, produced):
        node = produced.producer()
        rank, axis, channels = self._layout(node)
        vector = channel_vector(_constant(constant), rank, axis, channels)
        weights = node.inputs[1].const_value.numpy().astype(np.float64)
        bias_value = node.inputs[2] if len(node.inputs) > 2 else None
        bias = np.zeros(channels) if bias_value is None else channel_vector(_constant(bias_value), 1, 0, channels)
        attributes = dict(node.attributes)
        if self.producer == "Gemm":
            bias = bias * attributes.pop("beta", ir.AttrFloat32("beta", 1.0)).as_float()
        if self.affine in ("Mul", "Div"):
            factor = vector if self.affine == "Mul" else 1.0 / vector
            weight_axis = 0 if self.producer == "Conv" or node.attributes.get_int("transB", 0) else 1
            shape = [1] * weights.ndim
            shape[weight_axis] = channels
            weights = weights * factor.reshape(shape)
            bias = bias * factor
        else:
            bias = bias + vector if self.affine == "Add" else bias - vector
        name = node.inputs[1].name
        new_weights = op.initializer(_tensor_like(weights, node.inputs[1], name), name=name)
        bias_name = bias_value.name if bias_value is not None else self.fresh_name(node.graph, f"{name}_bias")
        new_bias = op.initializer(_tensor_like(bias, node.inputs[1], bias_name), name=bias_name)
        return getattr(op, self.producer)(x, new_weights, new_bias, **attributes)


class _AffineBeforeConv(ReportingRule):
    """``Op(x, constant) -> Conv(., W[, B])``: the per-input-channel affine moves into W or B."""

    def __init__(self, affine: str):
        self.affine = affine
        super().__init__(f"fold-{affine.lower()}-before-conv")

    def pattern(self, op, x, constant):
        affined = getattr(op, self.affine)(x, constant, _outputs=["affined"])
        return op.Conv(affined, _allow_other_inputs=True, _outputs=["convolved"])

    def check(self, context, x, constant, affined, convolved) -> MatchResult:
        result = MatchResult()
        conv = convolved.producer()
        if not _is_float(conv.inputs[1]):
            return result.fail("the weights are not a float tensor")
        if _constant(constant) is None:
            return result.fail(f"the {self.affine} operand is not a constant")
        for owned in conv.inputs[1:3]:
            if owned is not None and (reason := _owned_constant(owned, conv)):
                return result.fail(reason)
        weights = _constant(conv.inputs[1])
        channels = weights.shape[1] * conv.attributes.get_int("group", 1)
        vector = channel_vector(_constant(constant), weights.ndim, 1, channels)
        if vector is None:
            return result.fail(f"the {self.affine} constant varies along a non-channel axis or broadcasts the input")
        # the constant must not be what gives the Conv's input its rank or channels (broadcasting)
        if x.shape is None:
            if _constant(constant).ndim >= weights.ndim:
                return result.fail("the Conv input's rank is unknown")
        elif len(x.shape) != weights.ndim or (isinstance(x.shape[1], int) and x.shape[1] != channels):
            return result.fail(f"the {self.affine} broadcasts its input to the Conv's shape")
        if self.affine == "Div" and not np.all(vector != 0):
            return result.fail("division by a constant with a zero")
        if self.affine in ("Add", "Sub"):
            pads = conv.attributes.get_ints("pads", [0])
            auto_pad = conv.attributes.get_string("auto_pad", "NOTSET")
            if any(pads) or auto_pad not in ("NOTSET", "VALID"):
                return result.fail(f"the Conv pads its input: a border reads zeros, not the {self.affine} constant")
        return result

    def rewrite(self, op, x, constant, affined, convolved):
        conv = convolved.producer()
        weights = conv.inputs[1].const_value.numpy().astype(np.float64)
        group = conv.attributes.get_int("group", 1)
        per_group_in, out_channels = weights.shape[1], weights.shape[0]
        vector = channel_vector(_constant(constant), weights.ndim, 1, per_group_in * group)
        # input channel g * per_group_in + i feeds output channels of group g through W[o, i]
        per_weight = vector.reshape(group, 1, per_group_in)
        per_weight = np.broadcast_to(per_weight, (group, out_channels // group, per_group_in)).reshape(out_channels, per_group_in)
        per_weight = per_weight.reshape(per_weight.shape + (1,) * (weights.ndim - 2))
        bias_value = conv.inputs[2] if len(conv.inputs) > 2 else None
        bias = np.zeros(out_channels) if bias_value is None else _constant(bias_value).astype(np.float64).reshape(-1)
        if self.affine == "Mul":
            weights = weights * per_weight
        elif self.affine == "Div":
            weights = weights / per_weight
        else:
            sign = 1.0 if self.affine == "Add" else -1.0
            bias = bias + sign * (weights * per_weight).reshape(out_channels, -1).sum(axis=1)
        name = conv.inputs[1].name
        new_weights = op.initializer(_tensor_like(weights, conv.inputs[1], name), name=name)
        bias_name = bias_value.name if bias_value is not None else self.fresh_name(conv.graph, f"{name}_bias")
        new_bias = op.initializer(_tensor_like(bias, conv.inputs[1], bias_name), name=bias_name)
        return op.Conv(x, new_weights, new_bias, **conv.attributes)


def channel_affine_rules() -> RewriteRuleSet:
    """Every fold of this module; Mul/Add also match with the constant first."""
    after = [_AffineAfter.rule(producer, affine) for producer in ("Conv", "Gemm") for affine in AFFINE_OPS]
    before = [_AffineBeforeConv.rule(affine) for affine in AFFINE_OPS]
    return RewriteRuleSet(after + before, commute=True)

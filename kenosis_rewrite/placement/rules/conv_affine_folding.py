"""Fold a constant Mul/Div/Add/Sub that follows a quantized Conv into its weight scales and bias.

Transformation, per output channel ``o`` (``t`` a constant that varies at most along the channels;
Mul: ``a = t, c = 0``; Div: ``a = 1 / t``; Add: ``a = 1, c = t``; Sub: ``c = -t``)::

    DQ(w_q; s_w, 0) -> Conv(x, ., B) [-> Q -> DQ] -> Mul/Div/Add/Sub(., t)
    ==>
    DQ(sign(a) * w_q; s_w * |a|, 0, axis=0) -> Conv(x, ., DQ(rint((B * a + c) / (s_x * s_w * |a|))))

the fold of ``fold-batchnorm-into-conv`` (:mod:`kenosis_rewrite.placement.rules.batchnorm_folding`, which
states the details: integer weights kept, ``|a|`` into the scales, the bias re-rounded onto the
int32 grid, one scale re-rounded before opset 13) for affine arithmetic instead of a
BatchNormalization, also through the Q/DQ between them (which disappears; the op's output must be
quantized, or the Conv would lose its output quantizer). Applied again, it folds a chain:
``Conv -> Add -> Mul -> Add`` becomes one Conv.

Why: Paddle exports of PP-LCNetV3 (the PP-OCRv4/v5 recognizers' backbone) write every layer as
``Conv -> Add(Reshape(bias)) -> Mul(scale) -> Add(shift) -> HardSwish -> Mul -> Add`` (the bias,
then a learnable affine block). NNCF quantizes each Conv's inputs and leaves that chain float, so
ORT runs every Conv in float (``explain()``: 87% of the MACs of PP-OCRv5's recognizer): with the
chain folded, the Conv's output reaches the activation directly, and ``quantize-weighted-outputs``
gives it the quantizer ORT needs for QLinearConv. quantize_static quantizes every op of the chain
on its own instead: ORT runs three QLinearAdd/QLinearMul per layer after the QLinearConv (PP-OCRv5's
recognizer: 112 QLinearAdd and 72 QLinearMul), each a requantization.

Exactness: approximate, as the BatchNormalization fold: equal in real arithmetic up to the float32
rounding of the new scales and the re-rounding of the bias onto the int32 grid (at most half a
step; a float bias takes the new value as it is). The constant may be written behind a
Reshape/Unsqueeze/Squeeze/Identity of constants, or a DequantizeLinear of constants (read as the
input model computes it).

Refused with a reason: a constant that varies along another axis than the output channels or would
broadcast the output to a larger shape, a Conv output that is the subtrahend or divisor, a Div by a
constant with a zero, and what the BatchNormalization fold refuses (outputs read by other nodes,
non-constant or blocked weights, a per-axis weight scale off the output channels, a fold before
opset 13 whose one weight scale would coarsen a channel's grid).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RewriteRuleSet

from kenosis_rewrite.canonicalization.rules.channel_affine import channel_vector
from kenosis_rewrite.core.op_tables import AFFINE_OPS  # re-exported: it was defined here
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.placement.rules.batchnorm_folding import ConvAffineFold

__all__ = ["AFFINE_OPS", "FoldAffineIntoConv", "FoldAffineIntoConvThroughQDQ", "conv_affine_rules", "conv_affine"]

RULE_NAME = "fold-affine-into-conv"


def conv_affine(node: ir.Node, conv_output: ir.Value, channels: int, rank: int) -> tuple[np.ndarray, np.ndarray] | str:
    """``(a, c)`` with ``node(conv_output) = a * conv_output + c`` per output channel (vectors of
    ``channels``; ``rank``: the Conv output's, its weights'), or why ``node`` is not such an affine
    of ``conv_output``."""
    if node.op_type not in AFFINE_OPS or node.domain not in qdq_params.DEFAULT_DOMAINS or len(node.inputs) != 2:
        return f"{node.op_type} is not an elementwise Mul/Div/Add/Sub"
    if node.inputs[0] is conv_output:
        other = node.inputs[1]
    elif node.op_type in ("Mul", "Add"):
        other = node.inputs[0]
    else:
        return f"the Conv output is the second operand of the {node.op_type}"
    if other is conv_output:
        return f"the {node.op_type} reads the Conv output twice"
    constant = qdq_params.reshaped_constant(other)
    if constant is None or not np.issubdtype(constant.dtype, np.floating):
        return f"the {node.op_type}'s other operand is not a float constant"
    vector = channel_vector(constant, rank, 1, channels)
    if vector is None:
        return (f"the constant of shape {list(constant.shape)} varies along another axis than the output channels, "
                "or broadcasts the Conv output to a larger shape")
    if node.op_type == "Mul":
        return vector, np.zeros(channels)
    if node.op_type == "Div":
        if np.any(vector == 0):
            return "a Div by a constant with a zero"
        return 1.0 / vector, np.zeros(channels)
    return np.ones(channels), (vector if node.op_type == "Add" else -vector)


class FoldAffineIntoConv(ConvAffineFold):
    """``Conv -> Mul/Div/Add/Sub(., constant)`` ==> ``Conv`` with folded scales and bias; see the module docstring."""

    folded_suffix = "affine_folded"

    def __init__(self, op_type: str, report: FixReport | None = None):
        self.op_type = op_type
        super().__init__(report, name=RULE_NAME)

    def _affine(self, node: ir.Node, data: ir.Value, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray] | str:
        return conv_affine(node, data, weights.shape[0], weights.ndim)

    def pattern(self, op, x, w, constant):
        conv_out = op.Conv(x, w, _allow_other_inputs=True, _outputs=["conv_out"])
        return getattr(op, self.op_type)(conv_out, constant, _outputs=["bn_out"])


class FoldAffineIntoConvThroughQDQ(FoldAffineIntoConv):
    """``Conv -> Q -> DQ -> Mul/Div/Add/Sub(., constant)`` ==> ``Conv``; the Q/DQ in between disappears
    (quantize_static's placement: every Add/Mul of the chain quantized on its own)."""

    def pattern(self, op, x, w, constant):
        conv_out = op.Conv(x, w, _allow_other_inputs=True, _outputs=["conv_out"])
        quantized = op.QuantizeLinear(conv_out, _allow_other_inputs=True, _outputs=["q"])
        dequantized = op.DequantizeLinear(quantized, _allow_other_inputs=True, _outputs=["dq"])
        return getattr(op, self.op_type)(dequantized, constant, _outputs=["bn_out"])


def conv_affine_rules(report: FixReport | None = None) -> RewriteRuleSet:
    """Every fold of this module; Mul/Add also match with the constant first."""
    return RewriteRuleSet([rule.rule(op_type, report) for rule in (FoldAffineIntoConvThroughQDQ, FoldAffineIntoConv)
                           for op_type in AFFINE_OPS], commute=True)

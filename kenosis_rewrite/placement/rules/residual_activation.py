"""Place a residual block's Add, its activation and its quantizer as TensorRT fuses them.

Transformations (TensorRT target; ``W`` a Conv/ConvTranspose/MatMul/Gemm, ``r`` the residual operand,
``Act`` one of Relu, Clip, LeakyRelu, zero points 0 as the target's symmetric conversion leaves them)::

    W -> Q0 -> DQ0 -> Add(., r)                 ==>  W -> Clip(Q0's range) -> Add(., r)   (1)
    Add(a, b) -> Q1 -> DQ1 -> Act -> Q2 -> DQ2   ==>  Add(a, b) -> Act' -> Q2 -> DQ2       (2)
    Add(a, b) -> Q1 -> DQ1 -> Act               ==>  Add(a, b) -> Act -> Q1 -> DQ1        (3)

Why: TensorRT fuses a Conv, the element-wise sum that follows it and the activation after the sum
into one kernel whose epilogue quantizes the result (NVIDIA TensorRT "Layer Fusion Catalog":
convolution + element-wise sum, convolution + activation, point-wise fusion; its "Explicit
Quantization" guide, Q/DQ layer-placement recommendations: an extra Q/DQ pair between the
convolution and the element-wise addition "forces the separation" of the two; NVIDIA ModelOpt's
ONNX placement puts the Conv, its residual Add, BatchNormalization and Relu in one fusible partition
with Q/DQ only at its inputs, ``modelopt/onnx/quantization/partitioning.py``). A Q/DQ pair between
the Add and its activation (what quantize_static writes with symmetric activations, which cannot fold
the Relu into a zero point, and what the other quantizers write for ``Add -> Relu``) splits that
kernel in two and adds an int8 round trip. Cited, not measured (no TensorRT here).

Exactness:

* (3) with Relu is exact bit for bit: with zero point 0 and ``s > 0``,
  ``Relu(s rint(x / s)) = s rint(Relu(x) / s)`` (``rint`` and the clamp to [-128, 127] are
  non-decreasing and fix 0), so the quantizer commutes with the Relu. With Clip(lo, hi) or
  LeakyRelu(alpha) it is approximate: the two orders differ by at most ``s1 / 2`` (Clip, where a
  bound is not on the grid) or ``(1 + alpha) s1 / 2`` (LeakyRelu's negative side), per element.
* (1) and (2) remove a rounding: approximate, towards FP32. (1) keeps the removed quantizer's clamp
  ``[-128 s, 127 s]`` as a Clip: it may stand for an activation quantize_static deleted (a
  ``Clip(-1, 1)`` leaves a Q of step 1/127.5 and nothing else; the graph cannot tell it from a
  calibrated range), and TensorRT fuses a Clip into the Conv as well. (2): the activation reads the exact sum
  instead of its rounded copy, and each activation is 1-Lipschitz (alpha <= 1), so the value
  ``Q2`` rounds moves by at most ``s1 / 2`` and the output by at most ``s1 / 2 + s2`` per element.
  Where the sum goes beyond ``Q1``'s range (a calibrated bound), the input clamped it there: a
  Relu/Clip is given ``Q1``'s top as its upper bound (``Act'``, a Clip) where that is below what
  ``Q2`` reaches, so that bound stays; a LeakyRelu is refused where ``Q1``'s range is narrower than
  ``Q2``'s on either side. (1): the Add reads the weighted op's exact output (the same bound as
  the activation fusion of :mod:`.activation_fusion`).

Refused, with a reason: a Q/DQ with a nonzero zero point or per-axis parameters (exactness above
needs zero point 0), values read by other nodes, an Add that is not residual (two non-constant
operands, one of them a weighted op's output, directly or through one Q/DQ pair), and in (1) an Add
whose both operands are quantized weighted-op outputs: which of the two TensorRT fuses the sum into
is its choice, so both stay quantized.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_base import ReportingRule, acceptance, refusal

__all__ = ["ACTIVATIONS", "AddIntoProducer", "ActivationAfterResidualAdd", "residual_activation_rules"]

RULE_NAME = "residual-add-activation"
ACTIVATIONS = ("Relu", "Clip", "LeakyRelu")
_QMAX, _QMIN = 127, -128


def _zero_point_free(node: ir.Node) -> qdq_params.QuantParams | None:
    """The per-tensor 8-bit parameters of a Q/DQ with zero point 0, else None."""
    params = qdq_params.quant_params(node)
    if params is None or not params.is_per_tensor or params.dtype not in qdq_params.EIGHT_BIT:
        return None
    return params if params.scalar_zero_point == 0 and params.scalar_scale > 0 else None


def _weighted_source(value: ir.Value | None) -> ir.Node | None:
    """The Conv/MatMul/Gemm ``value`` comes from, directly, through one ``Q -> DQ`` pair, or through
    the clamp (1) leaves in a removed pair's place."""
    producer = value.producer() if value is not None else None
    if producer is not None and producer.op_type == "Clip" and producer.inputs[0] is not None:
        producer = producer.inputs[0].producer()
    if qdq_params.is_dequantize(producer) and qdq_params.is_quantize(producer.inputs[0].producer()):
        producer = producer.inputs[0].producer().inputs[0].producer()
    return producer if producer is not None and producer.op_type in op_tables.WEIGHTED_OPS else None


def _is_sum_of_tensors(add: ir.Node | None) -> bool:
    """An Add of two non-constant tensors (not a bias Add): what a residual sum looks like."""
    return add is not None and add.op_type == "Add" and len(add.inputs) == 2 and all(
        v is not None and v.const_value is None and qdq_params.const_array(v) is None for v in add.inputs)


def _residual_reason(add: ir.Node) -> str | None:
    """Why a sum of two tensors is not one TensorRT fuses into the layer before it (None: it is)."""
    if not any(_weighted_source(v) is not None for v in add.inputs):
        return "no operand of the Add comes from a Conv/MatMul/Gemm: no layer to fuse the sum into"
    return None


def _clip_bounds(node: ir.Node) -> tuple[float, float] | None:
    """A Clip's constant (lo, hi) (missing bounds as -inf/inf), or None when a bound is not constant
    or is an attribute (opset < 11: no input to give a new bound)."""
    if "min" in node.attributes or "max" in node.attributes:
        return None
    bounds = []
    for index, default in ((1, -np.inf), (2, np.inf)):
        value = node.inputs[index] if len(node.inputs) > index else None
        array = qdq_params.const_array(value) if value is not None else None
        if value is not None and array is None:
            return None
        bounds.append(default if array is None else float(array.reshape(-1)[0]))
    return bounds[0], bounds[1]


class AddIntoProducer(ReportingRule):
    """(1) ``W -> Q0 -> DQ0 -> Add(., r)`` ==> ``W -> Add(., r)``; see the module docstring."""

    def __init__(self, report: FixReport | None = None):
        super().__init__(RULE_NAME, report)

    def pattern(self, op, x, other):
        quantized = op.QuantizeLinear(x, _allow_other_inputs=True, _outputs=["q"])
        dequantized = op.DequantizeLinear(quantized, _allow_other_inputs=True, _outputs=["dq"])
        return op.Add(dequantized, other, _outputs=["total"])

    def check(self, context, x, other, q, dq, total, **_) -> MatchResult:
        del context
        producer, add = x.producer(), total.producer()
        if producer is None or producer.op_type not in op_tables.WEIGHTED_OPS or not _is_sum_of_tensors(add):
            return MatchResult().fail("not a quantized Conv/MatMul/Gemm output read by a sum of two tensors")
        where = add.name or str(total.name)
        reason = _residual_reason(add)
        if reason is None and (len(x.uses()) != 1 or len(q.uses()) != 1 or len(dq.uses()) != 1):
            reason = "the weighted op's output or its Q/DQ pair is read by other nodes"
        if reason is None and (_zero_point_free(q.producer()) is None or _zero_point_free(dq.producer()) is None):
            reason = "the Q/DQ pair is not per-tensor 8-bit with zero point 0"
        if reason is None and other.producer() is not None and other.producer().op_type in op_tables.WEIGHTED_OPS:
            reason = "the Add already reads the other operand's Conv/MatMul/Gemm directly"
        if reason is None and qdq_params.is_dequantize(other.producer()) and _weighted_source(other) is not None:
            reason = "both operands are quantized Conv/MatMul/Gemm outputs: which one TensorRT fuses the sum into is its choice"
        return refusal(where, reason) if reason else acceptance(where)

    def rewrite(self, op, x, other, q, total, **_):
        add = total.producer()
        params = qdq_params.quant_params(q.producer())
        lo, hi = params.scalar_scale * (params.qmin - 0), params.scalar_scale * (params.qmax - 0)
        base = self.fresh_name(add.graph, f"{x.name or 'weighted'}_clamp")
        bounds = [op.initializer(ir.tensor(np.asarray(bound, dtype=params.scale.dtype), name=f"{base}_{side}"),
                                 name=f"{base}_{side}") for bound, side in ((lo, "min"), (hi, "max"))]
        self.record(add.name or str(total.name), f"the Add reads the {x.producer().op_type} through the quantizer's "
                    f"clamp [{lo:.6g}, {hi:.6g}], unrounded", exact=False)
        return op.Add(op.Clip(x, *bounds), other, _name=add.name)


class ActivationAfterResidualAdd(ReportingRule):
    """(2) ``Add -> Q1 -> DQ1 -> Act -> Q2`` ==> ``Add -> Act' -> Q2`` (``requantized``), or
    (3) ``Add -> Q1 -> DQ1 -> Act`` ==> ``Add -> Act -> Q1 -> DQ1``; see the module docstring."""

    def __init__(self, activation: str, requantized: bool, report: FixReport | None = None):
        super().__init__(RULE_NAME, report)
        self.activation = activation
        self.requantized = requantized

    def pattern(self, op, x):
        quantized = op.QuantizeLinear(x, _allow_other_inputs=True, _outputs=["q1"])
        dequantized = op.DequantizeLinear(quantized, _allow_other_inputs=True, _outputs=["dq1"])
        act = getattr(op, self.activation)(dequantized, _allow_other_inputs=True, _outputs=["act"])
        if not self.requantized:
            return act
        return op.QuantizeLinear(act, _allow_other_inputs=True, _outputs=["q2"])

    def check(self, context, x, q1, dq1, act, q2=None, **_) -> MatchResult:
        del context
        add = x.producer()
        if not _is_sum_of_tensors(add):
            return MatchResult().fail("the quantized tensor is not a sum of two tensors")
        where = act.producer().name or str(act.name)
        reason = _residual_reason(add)
        if reason is None and (len(x.uses()) != 1 or len(q1.uses()) != 1 or len(dq1.uses()) != 1):
            reason = "the sum or its Q/DQ pair is read by other nodes"
        if reason is None and self.requantized and len(act.uses()) != 1:
            reason = "the activation is read by other nodes"
        first = _zero_point_free(q1.producer()) if reason is None else None
        if reason is None and (first is None or _zero_point_free(dq1.producer()) is None
                               or not first.same_as(_zero_point_free(dq1.producer()))):
            reason = "the Q/DQ pair is not per-tensor 8-bit with zero point 0 (and one grid)"
        if reason is None and self.activation == "Clip" and _clip_bounds(act.producer()) is None:
            reason = "the Clip's bounds are not constant inputs"
        if reason is None and self.requantized:
            reason = self._second_quantizer_reason(act.producer(), first, q2.producer())
        if reason is None and not self.requantized and self._second_rule_applies(act, first):
            return MatchResult().fail("the activation is quantized: (2) removes the sum's pair instead")
        return refusal(where, reason) if reason else acceptance(where)

    def _second_rule_applies(self, act: ir.Value, first: qdq_params.QuantParams) -> bool:
        """Whether (2) takes this match: the activation's one reader is a Q that (2) accepts."""
        uses = act.uses()
        if len(uses) != 1 or not qdq_params.is_quantize(uses[0][0]) or uses[0][1] != 0:
            return False
        return self._second_quantizer_reason(act.producer(), first, uses[0][0]) is None

    def _second_quantizer_reason(self, act: ir.Node, first: qdq_params.QuantParams, q2: ir.Node) -> str | None:
        second = qdq_params.quant_params(q2)
        if second is None or not second.is_per_tensor:
            return "the activation's quantizer is not per-tensor"
        if self.activation == "LeakyRelu":
            alpha = act.attributes["alpha"].as_float() if "alpha" in act.attributes else 0.01
            low, high = alpha * _QMIN * first.scalar_scale, _QMAX * first.scalar_scale
            reach_low = (second.qmin - second.scalar_zero_point) * second.scalar_scale
            reach_high = (second.qmax - second.scalar_zero_point) * second.scalar_scale
            if not (0 <= alpha <= 1) or low > reach_low or high < reach_high:
                return "the LeakyRelu's first quantizer clamps tighter than its second: that bound would be lost"
        return None

    def rewrite(self, op, x, q1, dq1, act, q2=None, **_):
        node = act.producer()
        where = node.name or str(act.name)
        if not self.requantized:
            exact = self.activation == "Relu"
            moved = op.op(self.activation, x, *node.inputs[1:], _name=node.name, **dict(node.attributes))
            quantize, dequantize = q1.producer(), dq1.producer()
            quantized = op.QuantizeLinear(moved, *quantize.inputs[1:], _name=quantize.name, **dict(quantize.attributes))
            self.record(where, f"{self.activation} moved in front of the sum's quantizer", exact=exact)
            return op.DequantizeLinear(quantized, *dequantize.inputs[1:], _name=dequantize.name, **dict(dequantize.attributes))
        activated = self._bounded_activation(op, x, node, q1.producer(), q2.producer())
        quantize = q2.producer()
        self.record(where, f"the sum's Q/DQ removed: {self.activation} reads the Add directly", exact=False)
        return op.QuantizeLinear(activated, *quantize.inputs[1:], _name=quantize.name, **dict(quantize.attributes))

    def _bounded_activation(self, op, x, node: ir.Node, q1: ir.Node, q2: ir.Node) -> ir.Value:
        """The activation on the exact sum, with ``Q1``'s top as its upper bound where ``Q2`` reaches
        beyond it (Relu/Clip): the clamp the removed quantizer applied."""
        first, second = qdq_params.quant_params(q1), qdq_params.quant_params(q2)
        top = first.qmax * first.scalar_scale
        reach = (second.qmax - second.scalar_zero_point) * second.scalar_scale
        if self.activation == "LeakyRelu" or top >= reach - second.scalar_scale / 2:
            return op.op(self.activation, x, *node.inputs[1:], _name=node.name, **dict(node.attributes))
        lo, hi = (0.0, np.inf) if self.activation == "Relu" else _clip_bounds(node)
        dtype = np.float32 if x.dtype is None else x.dtype.numpy()
        constant = qdq_params.constant_maker(op, lambda name: self.fresh_name(node.graph, name), node.name or "residual")
        return op.Clip(x, constant(lo, dtype, "lo"), constant(min(hi, top), dtype, "hi"), _name=node.name)


def residual_activation_rules(report: FixReport | None = None, activations=ACTIVATIONS) -> list:
    """(1), then (2) before (3) for each activation: a quantized activation loses the first pair."""
    rules = list(AddIntoProducer.rule(report).commute())  # the weighted op's pair on either side of the Add
    for activation in activations:
        rules += [ActivationAfterResidualAdd.rule(activation, True, report),
                  ActivationAfterResidualAdd.rule(activation, False, report)]
    return rules

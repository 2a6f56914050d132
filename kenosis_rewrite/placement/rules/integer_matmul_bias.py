"""An integer MatMul with float output and a bias, written so ORT fuses the bias into the kernel.

Transformation (``integer-matmul-bias``; ``x_q`` per-tensor 8-bit, ``w_q`` a constant 2-D 8-bit
weight, per-tensor or per output column, ``bias`` a constant 1-D float vector of the weight's width)::

    Add(MatMul(DQ(x_q; sx, zx), DQ(w_q; sw, zw)), bias)
        ==>
    Add(Mul(Cast(MatMulInteger(x_q, w_q, zx, zw), float), Mul(DQ(1; sx), sw)), bias)

Why: ORT runs ``DQ -> MatMul`` with no Q after it as ``com.microsoft.MatMulIntegerToFloat`` without
its bias input (the QDQ selector has none), so the bias Add of every weight MatMul of a transformer
quantized by the weighted plan (or by NNCF) stays a separate pass over the output. The written-out
form is what ORT's level-2 ``MatMulIntegerToFloatFusion`` matches, and that fusion takes the bias
Add with it: one kernel, as ``quantize_dynamic``'s ``DynamicQuantizeMatMul`` has. The scale product
``Mul(sx, sw)`` must be computed by a node (the fusion reads ``sx`` and ``sw`` from its inputs),
but ORT's constant folding would fold a Mul of two initializers first; ``DQ(1; sx)`` is ``sx``
exactly (``1 * sx``) and ORT does not constant-fold DequantizeLinear, so the Mul survives.

Exactness: not bit for bit as a graph; bounded by float32 rounding. The written-out form
accumulates in int32, exactly, where ``MatMul`` on dequantized floats rounds its partial sums; with
``u = 2**-24`` and ``K`` the inner dimension, each output differs by at most
``(K + 3) * u * sum_k |x_k * w_k|`` (the float dot-product bound, the int32 -> float cast and the
scale product's rounding; tests check it). On ORT CPU, where ``DQ -> MatMul`` already runs as
``MatMulIntegerToFloat``, the two forms give the same bits (tests check that too).

Left alone: per-row or blocked activation parameters, weights that are not 2-D constants or are
quantized along another axis, non-float32 tensors (ORT's CPU kernel is float32 only), biases that
broadcast to more than the weight's width, a MatMul whose output anything else reads.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_base import ReportingRule, acceptance, refusal

__all__ = ["IntegerMatMulBias", "integer_matmul_bias_rules", "RULE_NAME"]

RULE_NAME = "integer-matmul-bias"
_MATMUL_INTEGER_OPSET = 10
_ONE_SUFFIX = "unit_code"  # names the int32 1 of ``DQ(1; sx)``


def _float32(value: ir.Value) -> bool:
    return value.dtype in (None, ir.DataType.FLOAT)  # exports often leave intermediate types out


def _refusal(x_dq: ir.Node | None, w_dq: ir.Node | None, bias: ir.Value, product: ir.Value) -> str | None:
    """Why ``Add(MatMul(x, w), bias)`` cannot be written as the fused integer form, or None."""
    if not qdq_params.is_dequantize(x_dq) or not qdq_params.is_dequantize(w_dq):
        return "the MatMul's inputs are not both dequantized"
    x_params, w_params = qdq_params.quant_params(x_dq), qdq_params.quant_params(w_dq)
    if x_params is None or w_params is None:
        return "a scale or zero point is not a constant"
    if x_params.dtype not in qdq_params.EIGHT_BIT or w_params.dtype not in qdq_params.EIGHT_BIT:
        return "not 8-bit quantization"
    if not x_params.is_per_tensor:
        return "the activation is not quantized per tensor"
    weight = qdq_params.const_array(w_dq.inputs[0])
    if weight is None or weight.ndim != 2:
        return "the weight is not a constant 2-D matrix"
    columns = weight.shape[1]
    if not qdq_params.per_output_column(w_params, weight.shape, 1):
        return "the weight is not quantized per tensor or per output column"
    bias_array = qdq_params.const_array(bias)
    if bias_array is None or bias_array.dtype != np.float32:
        return "the other input of the Add is not a float32 constant"
    if bias_array.ndim != 1 or bias_array.shape[0] != columns or columns < 2:
        # ORT's fusion takes [1, ..., N] biases with N > 1; 1-D keeps the output shape the same
        return f"the bias is not a vector of the weight's width ({columns})"
    if not (_float32(product) and x_params.scale.dtype == np.float32 and w_params.scale.dtype == np.float32):
        return "not float32: ORT's MatMulIntegerToFloat is float32 only on CPU"
    if x_dq.attributes.get_int("output_dtype", 0) or w_dq.attributes.get_int("output_dtype", 0):
        return "a DequantizeLinear with an output_dtype attribute"
    graph = product.producer().graph
    if graph is None or qdq_params.default_opset(graph) < _MATMUL_INTEGER_OPSET:
        return f"MatMulInteger needs opset {_MATMUL_INTEGER_OPSET}"
    return None


def _unfolded_scale(scale: ir.Value) -> ir.Value | None:
    """The output of an earlier rewrite's ``DQ(1; scale)``, if one exists."""
    for user, index in scale.uses():
        if (index == 1 and qdq_params.is_dequantize(user) and len(user.inputs) == 2 and user.inputs[0] is not None
                and (user.inputs[0].name or "").endswith(_ONE_SUFFIX)):
            one = qdq_params.const_array(user.inputs[0])
            if one is not None and one.dtype == np.int32 and one.shape == () and int(one) == 1:
                return user.outputs[0]
    return None


class IntegerMatMulBias(ReportingRule):
    """``Add(MatMul(DQ(x), DQ(w)), bias)`` ==> ``Add(Mul(Cast(MatMulInteger(x, w)), scales), bias)``. Within
    float rounding; bit for bit on ORT CPU."""

    def __init__(self, report: FixReport | None = None):
        super().__init__(RULE_NAME, report)

    def pattern(self, op, x, w, bias):
        return op.Add(op.MatMul(x, w, _outputs=["product"]), bias, _outputs=["added"])

    def check(self, context, x, w, bias, product, added, **_) -> MatchResult:
        del context
        matmul = product.producer()
        if matmul.domain not in qdq_params.DEFAULT_DOMAINS or added.producer().domain not in qdq_params.DEFAULT_DOMAINS:
            return MatchResult().fail("not default-domain MatMul and Add")
        if not qdq_params.is_dequantize(x.producer()) or not qdq_params.is_dequantize(w.producer()):
            return MatchResult().fail("the MatMul's inputs are not both dequantized")  # common: not reported
        reason = _refusal(x.producer(), w.producer(), bias, product)
        where = matmul.name or str(product.name)
        return refusal(where, reason) if reason else acceptance(where)

    def rewrite(self, op, x, w, bias, product, added, **_):
        x_dq, w_dq, matmul = x.producer(), w.producer(), product.producer()
        x_params, w_params = qdq_params.quant_params(x_dq), qdq_params.quant_params(w_dq)
        graph = matmul.graph
        base = matmul.name or "matmul"

        constant = qdq_params.constant_maker(op, lambda name: self.fresh_name(graph, name), base)
        x_zero = constant(x_params.zero_point.reshape(()), x_params.dtype.numpy(), "x_zero_point")
        w_zero = constant(qdq_params.column_params(w_params.zero_point, w_params), w_params.dtype.numpy(), "w_zero_point")
        accumulated = op.MatMulInteger(x_dq.inputs[0], w_dq.inputs[0], x_zero, w_zero)
        # DQ(1; sx) == sx exactly, and keeps ORT's constant folding off the scale product (see
        # docstring); one per activation scale: the projections reading one tensor share it
        x_scale = _unfolded_scale(x_dq.inputs[1])
        if x_scale is None:
            x_scale = op.DequantizeLinear(constant(1, np.int32, _ONE_SUFFIX), x_dq.inputs[1])
        scales = op.Mul(x_scale, w_dq.inputs[1])
        self.record(where=matmul.name or str(product.name),
                    detail="integer MatMul written out so ORT fuses its bias into MatMulIntegerToFloat "
                           "(int32 accumulation: within float32 rounding of the dequantized MatMul)", exact=False)
        return op.Add(op.Mul(op.Cast(accumulated, to=ir.DataType.FLOAT), scales), bias)


def integer_matmul_bias_rules(report: FixReport | None = None) -> RewriteRuleSet:
    return RewriteRuleSet([IntegerMatMulBias.rule(report)], commute=True)  # Add(bias, product) too

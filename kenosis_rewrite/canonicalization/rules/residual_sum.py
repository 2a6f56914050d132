"""Adds written as the two-input Sum where an ONNX Runtime CPU fusion of ``Add`` makes the graph slower.

ORT's session-time fusions match ``Add`` only; a two-input ``Sum`` is the same IEEE addition with
the same broadcasting (from opset 8), so writing it keeps ORT's hands off. Two places pay:

**1. Residual Adds read by a layer norm** (``residual-add-as-sum``). Transformation (``a`` and ``b`` both
computed, not constants; the Add's output read by a layer norm,
as ``LayerNormalization`` or as the decomposed ``ReduceMean -> Sub`` that ORT's LayerNormFusion
turns into one)::

    Add(a, b) -> LayerNormalization       ==>     Sum(a, b) -> LayerNormalization

Why: at session time ORT's level-2 ``SkipLayerNormFusion`` folds ``Add -> LayerNormalization`` (and
the bias Add before it) into ``com.microsoft.SkipLayerNormalization``, whose x86 CPU kernel is
3-8x slower on one thread than the Sum and the LayerNormalization it replaces, 1.3-5x on two
(onnxruntime 1.32.0, AMD EPYC with AVX512-VNNI: 235 vs 31 us at [1,128,384], 2026 vs 272 us at
[1,512,768]; ``python benchmarks/skip_layernorm.py`` measures it). The fusion matches ``Add`` only, so
the same addition written as the two-input ``Sum`` keeps the fast kernels. Transformers lose most
(MiniLM-L3 quantized dynamically, ORT's profiler: 3 SkipLayerNormalizations took 0.7 of its 5.6 ms).

Left alone: Adds with a constant input (biases: see 2.), Adds read by no layer norm.

**2. The bias Add of an integer MatMul with float output** (``matmul-bias-as-sum``)::

    DQ(x) -> MatMul(., DQ(w)) -> Add(., bias)      ==>     DQ(x) -> MatMul(., DQ(w)) -> Sum(., bias)

Why: ORT runs ``DQ -> MatMul`` with no Q after it as ``MatMulIntegerToFloat`` (the weighted
quantization plan of transformers, NNCF-style placements), but its level-1 ``MatMulAddFusion``
runs first and, where the shapes are static, turns ``MatMul -> Add(bias)`` into a Gemm with a
float bias, which no QDQ selector accepts: the GEMM runs in float on dequantized tensors (MiniLM-L3
with 128 pinned tokens: 12 of 18 weight MatMuls). With the Sum, the MatMul stays integer. The same
holds for weight-only MatMuls with blocked weights (``x -> MatMul(., DQ(w; block_size)) -> Add``),
which ORT otherwise fuses into a float ``FusedGemm`` instead of ``MatMulNBits`` where the
activations are 2-D (an MLP on ``x[1, h]``: 2 of 3 layers ran float). Only
where the MatMul's output shape is static (the fusion needs it): elsewhere the Add stays, since
ORT's Sum kernel is the slower one on two threads.

Exactness: exact, bit for bit, both rules: a two-input Sum is the same IEEE addition as Add, with
the same multidirectional broadcasting (Sum broadcasts from opset 8; the rules require it).
Left alone by both: non-float Adds (Sum is defined for float types only), opsets below 8.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_base import ReportingRule

__all__ = ["ResidualAddAsSum", "MatMulBiasAsSum", "residual_sum_rules", "RULE_NAME", "MATMUL_BIAS_RULE_NAME"]

RULE_NAME = "residual-add-as-sum"
MATMUL_BIAS_RULE_NAME = "matmul-bias-as-sum"
_SUM_BROADCASTS_OPSET = 8
_SUM_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


def _starts_layer_norm(value: ir.Value, user: ir.Node, index: int) -> bool:
    """``user`` reads ``value`` as the input of a layer norm: LayerNormalization's X, or the
    ``ReduceMean(x) -> Sub(x, mean)`` head of the decomposed form."""
    if user.domain not in qdq_params.DEFAULT_DOMAINS or index != 0:
        return False
    if user.op_type == "LayerNormalization":
        return True
    if user.op_type != "ReduceMean":
        return False
    return any(
        reader.op_type == "Sub" and list(reader.inputs) == [value, user.outputs[0]]
        for reader, _ in user.outputs[0].uses()
    )


def _sum_refusal(a: ir.Value, b: ir.Value, added: ir.Value) -> str | None:
    """Why a two-input Sum cannot stand for ``Add(a, b)``, or None."""
    dtype = added.dtype or a.dtype or b.dtype  # exports often leave intermediate types out
    if dtype not in _SUM_TYPES:
        return f"Sum is not defined for {dtype or 'an unknown type'}"
    graph = added.producer().graph
    if graph is None or qdq_params.default_opset(graph) < _SUM_BROADCASTS_OPSET:
        return f"Sum broadcasts only from opset {_SUM_BROADCASTS_OPSET}"
    return None


class _AddAsSum(ReportingRule):
    """``Add(a, b)`` ==> ``Sum(a, b)`` where :meth:`_refusal` finds nothing against it. Exact."""

    rule_name = ""
    detail = ""

    def __init__(self, report: FixReport | None = None):
        super().__init__(self.rule_name, report)

    def pattern(self, op, a, b):
        return op.Add(a, b, _outputs=["added"])

    def _refusal(self, a: ir.Value, b: ir.Value, added: ir.Value) -> str | None:
        raise NotImplementedError

    def check(self, context, a, b, added, **_) -> MatchResult:
        del context
        refusal = self._refusal(a, b, added) or _sum_refusal(a, b, added)
        return MatchResult().fail(refusal) if refusal else MatchResult()

    def rewrite(self, op, a, b, added, **_):
        self.record(added.producer().name or str(added.name), self.detail, exact=True)
        return op.Sum(a, b)


class ResidualAddAsSum(_AddAsSum):
    """``Add(a, b)`` of two computed tensors read by a layer norm ==> ``Sum(a, b)``. Exact."""

    rule_name = RULE_NAME
    detail = "residual Add read by a layer norm written as Sum (no SkipLayerNormalization)"

    def _refusal(self, a, b, added):
        if not any(_starts_layer_norm(added, user, index) for user, index in added.uses()):
            return "no layer norm reads the sum"
        if qdq_params.const_array(a) is not None or qdq_params.const_array(b) is not None:
            return "one input is a constant (a bias): ORT fuses it elsewhere"
        return None


def _integer_float_output_matmul(value: ir.Value) -> ir.Node | None:
    """The MatMul writing ``value`` when its weight is a dequantized constant, its data input
    dequantized too (what ORT runs as MatMulIntegerToFloat) or its weight blocked (weight-only: what
    ORT runs as MatMulNBits), and ``value`` has no other reader."""
    node = value.producer()
    if node is None or node.op_type != "MatMul" or node.domain not in qdq_params.DEFAULT_DOMAINS or len(value.uses()) != 1:
        return None
    x, w = (v.producer() if v is not None else None for v in node.inputs[:2])
    if not qdq_params.is_dequantize(w) or qdq_params.const_array(w.inputs[0]) is None:
        return None
    if qdq_params.is_dequantize(x):
        return node
    # weight-only with blocked weights: what ORT fuses into MatMulNBits (float activations)
    params = qdq_params.quant_params(w)
    return node if params is not None and params.block_size else None


class MatMulBiasAsSum(_AddAsSum):
    """``DQ -> MatMul -> Add(., constant bias)`` ==> ``... -> Sum(., bias)``. Exact."""

    rule_name = MATMUL_BIAS_RULE_NAME
    detail = "bias Add of an integer MatMul written as Sum (no float Gemm from MatMulAddFusion)"

    def _refusal(self, a, b, added):
        product, bias = a, b
        if qdq_params.const_array(bias) is None:
            return "the other input is not a constant bias"
        matmul = _integer_float_output_matmul(product)
        if matmul is None:
            return "not the float output of a MatMul with dequantized inputs and weight"
        if not qdq_params.is_dequantize(matmul.inputs[0].producer()):
            # weight-only: ORT's MatMulAddFusion takes 2-D products only; elsewhere ORT fuses the
            # bias into MatMulNBits itself, and a Sum would keep it out
            if product.shape is None or product.shape.rank() != 2:
                return "not a known 2-D product: ORT's MatMulAddFusion does not fire"
            return None
        if product.shape is None or not all(isinstance(dim, int) for dim in product.shape):
            # MatMulAddFusion needs static shapes; where they are symbolic the Add stays (ORT's
            # Sum kernel is slower than Add on two threads: 54 vs 39 us at [1,512,768])
            return "shapes are not static: ORT's MatMulAddFusion does not fire"
        return None


def residual_sum_rules(report: FixReport | None = None) -> RewriteRuleSet:
    return RewriteRuleSet([ResidualAddAsSum.rule(report), MatMulBiasAsSum.rule(report)], commute=True)  # Add(bias, product) too

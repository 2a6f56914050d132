"""Make weight-only quantized MatMuls fuse into ORT CPU's ``com.microsoft.MatMulNBits``.

A weight-only MatMul is ``MatMul(A, DequantizeLinear(Wq, scale, zp))`` with a float ``A``. ORT's
``DQMatMulToMatMulNBits`` selector (Level 2) turns it into one MatMulNBits kernel that never
materialises the float weight. Measured on onnxruntime 1.31.1 (x86 CPU EP, this module's tests),
it fuses only when **all** of these hold, otherwise the model silently runs DequantizeLinear plus
a float MatMul (several times slower, the float weight in memory):

* the DQ's data is int4, uint4, int8 or uint8 (int16 and float8 never fuse);
* the DQ is blocked along axis 0 of a 2-D constant ``[K, N]`` weight with a power-of-two
  ``block_size`` from 16 to 256 (512 and 1024 measured not to fuse; a 4-bit per-column DQ, axis 1,
  also fuses);
* its scales have the MatMul's float type and nothing (no Cast, Transpose, Reshape) sits between
  the DQ and the MatMul's input B;
* the DQ feeds only this MatMul, and its constants are read by no other node (even two DQs
  sharing one quantized initializer stop both fusions);
* the MatMul is a MatMul: ``Gemm(transB=1)`` over a DQ does not fuse;
* the MatMul's only consumer is not a Relu/Clip, nor an Add read by a Relu/Clip: ORT then leaves a
  float MatMul or FusedGemm (only a MatMul whose Relu is a graph output fuses).

Transformations (each refuses with a reason when its condition fails):

* ``cast-weight-dequantize``: ``DQ(s) -> Cast(T) -> MatMul`` ==> ``DQ(s as T) -> MatMul``. Exact when
  the dequantized weights are equal bit for bit (checked on the constants; e.g. float32 scales
  that float16 represents exactly); otherwise the difference is at most half a float16 ulp of the
  scale per weight and the change is reported as inexact.
* ``unshare-weight-dequantize``: a DQ (or its constants) shared by several MatMuls ==> one DQ with
  private copies of the constants per MatMul. Exact. The model file grows by the copies; ORT
  prepacks every MatMulNBits weight separately anyway.
* ``fold-weight-layout``: ``DQ -> Transpose([1, 0]) -> MatMul`` and ``DQ -> Reshape -> MatMul`` (a
  reshape that only adds or removes unit dims) ==> the DQ of the transposed/reshaped constants,
  with axis and block layout moved along. Exact (a relabelling of the same numbers).
* ``reblock-weight-dequantize``: a block size that is not a power of two in [16, 256] (e.g.
  ``block_size = K`` from channel-wise quantization) ==> its largest power-of-two divisor in
  [16, 256], each scale repeated. Exact. Refused when no such divisor exists.
* ``gemm-weight-to-matmul``: ``Gemm(A, DQ(W[N, K]), C, transB=1)`` ==> ``MatMul(A, DQ(W^T)) + beta*C``.
  Same arithmetic up to float summation order (reported inexact). Refused for transA, alpha != 1,
  or beta != 1 with a non-constant C.
* ``relu-to-max-after-nbits`` / ``clip-to-min-max-after-nbits``: ``MatMul (-> Add) -> Relu`` ==>
  ``MatMul (-> Add) -> Max(x, 0)``, ``Clip(lo, hi)`` ==> ``Min(Max(x, lo), hi)``. Exact for every non-NaN
  input (both are the same comparisons); only applied after a weight-only MatMul whose output has
  no other consumer, read by the activation directly or through one Add (a bias: on 2-D
  activations ORT otherwise makes a float FusedGemm of the three). The matching and the bounds are
  :mod:`kenosis_rewrite.weight_only.activation_form`'s, which ``quantize_weights()`` applies to
  its own output.

Only weight-only MatMuls are touched: a MatMul whose input A comes from a DequantizeLinear is an
activation-quantized (QLinearMatMul / MatMulIntegerToFloat) candidate and is left to the other rules.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_base import ReportingRule, acceptance, refusal
from kenosis_rewrite.placement.rules.nbits_weight import (  # re-exported: they were defined here
    NBITS_TYPES,
    WeightDQ,
    constant_of,
    dequantize_constant,
    float_dtype,
    fusible_block,
    nbits_type_reason,
    weight_dq,
)
from kenosis_rewrite.weight_only import activation_form

__all__ = [
    "CastWeightDequantize", "UnshareWeightDequantize", "FoldWeightTranspose", "FoldWeightReshape",
    "ReblockWeightDequantize", "GemmWeightToMatMul", "ReluToMaxAfterNBits", "ClipToMinMaxAfterNBits",
    "matmul_nbits_rules", "NBITS_TYPES", "dequantize_constant",
]

def _reads_dequantize(value: ir.Value | None) -> bool:
    return value is not None and qdq_params.is_dequantize(value.producer())


def _where(node: ir.Node | None, fallback: str) -> str:
    if node is None:
        return fallback
    return node.name or (node.outputs[0].name if node.outputs else None) or fallback


def _tensor(array: np.ndarray, dtype: ir.DataType, name: str) -> ir.Tensor:
    if dtype in qdq_params.INTEGER_RANGES:
        return qdq_params.integer_tensor(np.asarray(array).astype(np.int32), dtype, name)
    return ir.tensor(np.ascontiguousarray(array), name=name)


def _dq_attributes(axis: int, block_size: int) -> dict:
    attributes = {"axis": axis}
    if block_size:
        attributes["block_size"] = block_size
    return attributes


# --------------------------------------------------------------------------------------------
# Rule base
# --------------------------------------------------------------------------------------------


class _NBitsRule(ReportingRule):
    """Shared check prologue and DQ construction of the MatMulNBits rules."""

    rule_name = ""

    def __init__(self, report: FixReport | None = None, **kwargs):
        super().__init__(self.rule_name, report, **kwargs)

    def _weight(self, a: ir.Value, weight: ir.Value, refuse_at: str | None = None) -> WeightDQ | MatchResult:
        """The check prologue every weight rule shares: the readable weight DQ of a weight-only op, or
        the failure that ends the match (a DQ that cannot be read is refused at ``refuse_at`` when given)."""
        if _reads_dequantize(a):
            return MatchResult().fail("activation-quantized MatMul")
        dq = weight_dq(weight)
        if isinstance(dq, str):
            return refusal(refuse_at, dq) if refuse_at is not None else MatchResult().fail(dq)
        return dq

    def _initializer(self, op, graph: ir.Graph, array: np.ndarray, dtype: ir.DataType, base: str):
        name = self.fresh_name(graph, base)
        return op.initializer(_tensor(array, dtype, name), name=name)

    def _new_dq(self, op, dq: WeightDQ, data, scale, zero_point, axis: int, block_size: int, tag: str):
        """A DequantizeLinear of fresh initializers (arrays), named after the old one."""
        graph = dq.node.graph
        base = dq.node.inputs[0].name or "weight"
        inputs = [
            self._initializer(op, graph, data, dq.dtype, f"{base}_{tag}"),
            self._initializer(op, graph, scale, float_dtype(scale), f"{dq.node.inputs[1].name or 'scale'}_{tag}"),
        ]
        if zero_point is not None:
            zp_name = (dq.node.inputs[2].name or "zero_point") + f"_{tag}"
            inputs.append(self._initializer(op, graph, zero_point, dq.dtype, zp_name))
        name = f"{dq.node.name}_{tag}" if dq.node.name else None
        return op.DequantizeLinear(*inputs, _name=name, **_dq_attributes(axis, block_size))


def _weight_only_matmul(matmul: ir.Node | None) -> bool:
    return qdq_params.is_op(matmul, "MatMul") and not _reads_dequantize(matmul.inputs[0])


# --------------------------------------------------------------------------------------------
# DQ -> Cast -> MatMul
# --------------------------------------------------------------------------------------------


class CastWeightDequantize(_NBitsRule):
    """``DQ(scale) -> Cast(T) -> MatMul`` ==> ``DQ(scale as T) -> MatMul``; see the module docstring."""

    rule_name = "cast-weight-dequantize"

    def pattern(self, op, a, data):
        weight = op.DequantizeLinear(data, _allow_other_inputs=True, _outputs=["weight"])
        cast = op.Cast(weight, _outputs=["cast"])
        return op.MatMul(a, cast, _outputs=["out"])

    def check(self, context, a, weight, cast, out, **_) -> MatchResult:
        del context
        where = _where(out.producer(), "MatMul")
        dq = self._weight(a, weight, refuse_at=where)
        if isinstance(dq, MatchResult):
            return dq
        reason = nbits_type_reason(dq)
        if reason is not None:
            return refusal(where, reason)
        target = cast.producer().attributes.get_int("to", 0)
        if target not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            return refusal(where, f"Cast to {ir.DataType(target).name.lower()}: not a float MatMul")
        if target == dq.scale_type:
            return MatchResult().fail("the Cast does not change the type")
        if target == ir.DataType.FLOAT16 and np.abs(dq.scale.astype(np.float32)).max() > 65504:
            return refusal(where, "scales overflow float16")
        return acceptance(where)

    def rewrite(self, op, a, weight, cast, out, **_):
        dq = weight_dq(weight)
        target = ir.DataType(cast.producer().attributes.get_int("to", 0))
        scale = dq.scale.astype(target.numpy())
        before = dequantize_constant(dq).astype(target.numpy())
        exact = bool(np.array_equal(before.view(np.uint8), dequantize_constant(dq, scale).view(np.uint8)))
        new_dq = self._new_dq(op, dq, dq.data, scale, dq.zero_point, dq.axis, dq.block_size, target.name.lower())
        detail = f"{dq.describe()}: scales {dq.scale_type.name.lower()} -> {target.name.lower()}, Cast removed"
        self.record(_where(out.producer(), "MatMul"), detail, exact)
        return op.MatMul(a, new_dq, _name=out.producer().name)


# --------------------------------------------------------------------------------------------
# Shared DQ -> one DQ with private constants per MatMul
# --------------------------------------------------------------------------------------------


def _shared(dq: WeightDQ, weight: ir.Value) -> bool:
    if len(weight.uses()) > 1:
        return True
    return any(value is not None and len(value.uses()) > 1 for value in dq.node.inputs)


class UnshareWeightDequantize(_NBitsRule):
    """A weight DQ (or its constants) read by several nodes ==> private copies per MatMul. Exact."""

    rule_name = "unshare-weight-dequantize"

    def __init__(self, report: FixReport | None = None):
        super().__init__(report, remove_nodes=False)

    def pattern(self, op, a, data):
        weight = op.DequantizeLinear(data, _allow_other_inputs=True, _outputs=["weight"])
        return op.MatMul(a, weight, _outputs=["out"])

    def check(self, context, a, weight, out, **_) -> MatchResult:
        del context
        dq = self._weight(a, weight)
        if isinstance(dq, MatchResult):
            return dq
        if not _shared(dq, weight):
            return MatchResult().fail("not a shared weight DequantizeLinear")
        where = _where(out.producer(), "MatMul")
        reason = nbits_type_reason(dq)
        if reason is not None:
            return refusal(where, reason)
        return acceptance(where)

    def rewrite(self, op, a, weight, out, **_):
        dq = weight_dq(weight)
        zero_point = None if dq.zero_point is None else dq.zero_point.copy()
        new_dq = self._new_dq(op, dq, dq.data.copy(), dq.scale.copy(), zero_point, dq.axis, dq.block_size, "copy")
        self.record(_where(out.producer(), "MatMul"), f"{dq.describe()}: private copy of a shared weight", True)
        return op.MatMul(a, new_dq, _name=out.producer().name)


# --------------------------------------------------------------------------------------------
# Layout: Transpose / Reshape between the DQ and the MatMul
# --------------------------------------------------------------------------------------------


def _transposed(dq: WeightDQ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """The DQ constants of the transposed 2-D weight and the new axis."""
    axis = 1 - dq.axis
    def flip(array):
        return None if array is None else (array.T.copy() if array.ndim == 2 else array.copy())
    return dq.data.T.copy(), flip(dq.scale), flip(dq.zero_point), axis


def _unit_free_positions(shape: tuple[int, ...]) -> list[int]:
    return [index for index, size in enumerate(shape) if size != 1]


class FoldWeightTranspose(_NBitsRule):
    """``DQ -> Transpose([1, 0]) -> MatMul`` ==> DQ of the transposed constants. Exact."""

    rule_name = "fold-weight-transpose"

    def pattern(self, op, a, data):
        weight = op.DequantizeLinear(data, _allow_other_inputs=True, _outputs=["weight"])
        moved = op.Transpose(weight, _outputs=["moved"])
        return op.MatMul(a, moved, _outputs=["out"])

    def check(self, context, a, weight, moved, out, **_) -> MatchResult:
        del context
        where = _where(out.producer(), "MatMul")
        dq = self._weight(a, weight)
        if isinstance(dq, MatchResult):
            return dq
        reason = nbits_type_reason(dq)
        if reason is not None:
            return refusal(where, reason)
        perm = moved.producer().attributes.get_ints("perm", None)
        if len(dq.shape) != 2 or (perm is not None and list(perm) != [1, 0]):
            return refusal(where, "only the transpose of a 2-D weight is folded")
        return acceptance(where)

    def rewrite(self, op, a, weight, moved, out, **_):
        dq = weight_dq(weight)
        data, scale, zero_point, axis = _transposed(dq)
        new_dq = self._new_dq(op, dq, data, scale, zero_point, axis, dq.block_size, "T")
        self.record(_where(out.producer(), "MatMul"), f"{dq.describe()}: Transpose folded into the constants", True)
        return op.MatMul(a, new_dq, _name=out.producer().name)


class FoldWeightReshape(_NBitsRule):
    """``DQ -> Reshape -> MatMul`` (unit dims only) ==> DQ of the reshaped constants. Exact."""

    rule_name = "fold-weight-reshape"

    def pattern(self, op, a, data, shape):
        weight = op.DequantizeLinear(data, _allow_other_inputs=True, _outputs=["weight"])
        moved = op.Reshape(weight, shape, _allow_other_attributes=True, _outputs=["moved"])
        return op.MatMul(a, moved, _outputs=["out"])

    def _target(self, dq: WeightDQ, shape: ir.Value) -> tuple[int, int] | str:
        target = constant_of(shape)
        if target is None:
            return "the Reshape's shape is not a constant"
        source = dq.shape
        try:
            result = np.empty(source, np.int8).reshape([int(v) if v != 0 else source[i] for i, v in enumerate(target)])
        except (ValueError, IndexError):
            return "the Reshape's shape does not fit the weight"
        kept = _unit_free_positions(source)
        if result.ndim != 2 or len(kept) != 2 or [source[i] for i in kept] != list(result.shape):
            return "only a reshape that adds or removes unit dims of a 2-D weight is folded"
        if (dq.block_size or dq.scale.size > 1) and dq.axis not in kept:
            return "the quantization axis is a unit dim"
        return kept[0], kept[1]

    def check(self, context, a, weight, shape, out, **_) -> MatchResult:
        del context
        where = _where(out.producer(), "MatMul")
        dq = self._weight(a, weight)
        if isinstance(dq, MatchResult):
            return dq
        reason = nbits_type_reason(dq)
        if reason is None:
            target = self._target(dq, shape)
            reason = target if isinstance(target, str) else None
        return refusal(where, reason) if reason is not None else acceptance(where)

    def rewrite(self, op, a, weight, shape, out, **_):
        dq = weight_dq(weight)
        kept = self._target(dq, shape)
        def squeeze(array):
            if array is None or array.ndim != len(dq.shape):
                return None if array is None else array.copy()
            return array.reshape([array.shape[i] for i in kept])
        axis = kept.index(dq.axis) if dq.axis in kept else 1
        new_dq = self._new_dq(op, dq, squeeze(dq.data), squeeze(dq.scale), squeeze(dq.zero_point), axis,
                              dq.block_size, "2d")
        self.record(_where(out.producer(), "MatMul"), f"{dq.describe()}: Reshape folded into the constants", True)
        return op.MatMul(a, new_dq, _name=out.producer().name)


# --------------------------------------------------------------------------------------------
# Block size that is not a power of two
# --------------------------------------------------------------------------------------------


def fusible_divisor(block_size: int) -> int | None:
    """The largest power of two in [16, 256] dividing ``block_size``, or None."""
    for candidate in (256, 128, 64, 32, 16):
        if block_size % candidate == 0:
            return candidate
    return None


class ReblockWeightDequantize(_NBitsRule):
    """A blocked weight DQ with a non-power-of-two block ==> a power-of-two divisor block. Exact."""

    rule_name = "reblock-weight-dequantize"

    def pattern(self, op, a, data):
        weight = op.DequantizeLinear(data, _allow_other_inputs=True, _outputs=["weight"])
        return op.MatMul(a, weight, _outputs=["out"])

    def check(self, context, a, weight, out, **_) -> MatchResult:
        del context
        dq = self._weight(a, weight)
        if isinstance(dq, MatchResult):
            return dq
        if not dq.block_size or fusible_block(dq):
            return MatchResult().fail("not a blocked DQ with an unfusible block size")
        where = _where(out.producer(), "MatMul")
        reason = nbits_type_reason(dq)
        if reason is None and (len(dq.shape) != 2 or dq.axis != 0):
            reason = f"blocks along axis {dq.axis} of the weight, not along K (axis 0): MatMulNBits cannot take them"
        if reason is None and fusible_divisor(dq.block_size) is None:
            reason = f"block_size {dq.block_size} has no power-of-two divisor >= 16: exact re-blocking is impossible"
        return refusal(where, reason) if reason is not None else acceptance(where)

    def rewrite(self, op, a, weight, out, **_):
        dq = weight_dq(weight)
        block = fusible_divisor(dq.block_size)
        k = dq.shape[0]
        n_blocks = -(-k // block)
        def repeat(array):
            if array is None:
                return None
            return np.repeat(array, dq.block_size // block, axis=0)[:n_blocks]
        new_dq = self._new_dq(op, dq, dq.data.copy(), repeat(dq.scale), repeat(dq.zero_point), 0, block, f"b{block}")
        self.record(_where(out.producer(), "MatMul"), f"{dq.describe()}: block size {dq.block_size} -> {block}", True)
        return op.MatMul(a, new_dq, _name=out.producer().name)


# --------------------------------------------------------------------------------------------
# Gemm(transB=1) over a weight DQ
# --------------------------------------------------------------------------------------------


class GemmWeightToMatMul(_NBitsRule):
    """``Gemm(A, DQ(W[N, K]), C, transB=1)`` ==> ``MatMul(A, DQ(W^T)) + beta * C``; see the module docstring."""

    rule_name = "gemm-weight-to-matmul"

    def pattern(self, op, a, data):
        weight = op.DequantizeLinear(data, _allow_other_inputs=True, _outputs=["weight"])
        return op.Gemm(a, weight, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["out"])

    def check(self, context, a, weight, out, **_) -> MatchResult:
        del context
        gemm = out.producer()
        if _reads_dequantize(a):
            return MatchResult().fail("activation-quantized Gemm")
        if not gemm.attributes.get_int("transB", 0):
            return MatchResult().fail("ORT already fuses a Gemm without transB")
        where = _where(gemm, "Gemm")
        dq = weight_dq(weight)
        if isinstance(dq, str):
            return MatchResult().fail(dq)
        reason = nbits_type_reason(dq)
        if reason is None and gemm.attributes.get_int("transA", 0):
            reason = "transA=1"
        if reason is None and gemm.attributes.get_float("alpha", 1.0) != 1.0:
            reason = "alpha != 1 (folding it into the scales would change them)"
        bias = gemm.inputs[2] if len(gemm.inputs) > 2 else None
        if reason is None and bias is not None and gemm.attributes.get_float("beta", 1.0) != 1.0 and constant_of(bias) is None:
            reason = "beta != 1 with a non-constant C"
        if reason is None and len(dq.shape) != 2:
            reason = "the weight is not 2-D"
        return refusal(where, reason) if reason is not None else acceptance(where)

    def rewrite(self, op, a, weight, out, **_):
        gemm = out.producer()
        dq = weight_dq(weight)
        data, scale, zero_point, axis = _transposed(dq)
        new_dq = self._new_dq(op, dq, data, scale, zero_point, axis, dq.block_size, "T")
        product = op.MatMul(a, new_dq, _name=gemm.name)
        self.record(_where(gemm, "Gemm"), f"{dq.describe()}: Gemm(transB=1) -> MatMul + Add", False)
        bias = gemm.inputs[2] if len(gemm.inputs) > 2 else None
        beta = gemm.attributes.get_float("beta", 1.0)
        if bias is None or beta == 0.0:
            return product
        if beta != 1.0:
            constant = constant_of(bias)
            name = self.fresh_name(gemm.graph, f"{bias.name or 'bias'}_beta")
            scaled = (constant.astype(np.float32) * beta).astype(constant.dtype)
            bias = op.initializer(ir.tensor(scaled, name=name), name=name)
        return op.Add(product, bias)


# --------------------------------------------------------------------------------------------
# Relu / Clip right after a weight-only MatMul
# --------------------------------------------------------------------------------------------


def _nbits_candidate_reason(matmul: ir.Node | None) -> str | None:
    """None when ``matmul`` is a weight-only MatMul over a MatMulNBits-type DQ."""
    if not _weight_only_matmul(matmul):
        return "not a weight-only MatMul"
    dq = weight_dq(matmul.inputs[1])
    if isinstance(dq, str):
        return dq
    return nbits_type_reason(dq)


def _float_type(matmul: ir.Node) -> ir.DataType:
    dq = weight_dq(matmul.inputs[1])
    return dq.scale_type


def _weight_only_nbits(matmul: ir.Node) -> bool:
    return _nbits_candidate_reason(matmul) is None


class _ActivationAfterNBits(_NBitsRule):
    activation = ""

    def pattern(self, op, x):
        return getattr(op, self.activation)(x, _allow_other_inputs=True, _allow_other_attributes=True,
                                            _outputs=["out"])

    def check(self, context, x, out, **_) -> MatchResult:
        del context
        node = out.producer()
        if activation_form.blocked_matmul(node, _weight_only_nbits) is None:
            return MatchResult().fail("not after a weight-only MatMulNBits candidate that is its only reader")
        steps = activation_form.min_max_steps(node)
        if isinstance(steps, str):
            return refusal(_where(node, self.activation), steps)
        return acceptance(_where(node, self.activation))

    def rewrite(self, op, x, out, **_):
        node = out.producer()
        dtype = _float_type(activation_form.blocked_matmul(node, _weight_only_nbits)).numpy()
        graph, result = node.graph, x
        for op_type, bound in activation_form.min_max_steps(node):
            name = self.fresh_name(graph, f"{x.name or 'matmul'}_{op_type.lower()}_bound")
            constant = op.initializer(ir.tensor(np.asarray(bound, dtype=dtype), name=name), name=name)
            result = op.op(op_type, result, constant)
        self.record(_where(node, self.activation), f"{self.activation} -> Max/Min so ORT fuses the MatMul", True)
        return result


class ReluToMaxAfterNBits(_ActivationAfterNBits):
    """``weight-only MatMul -> Relu`` ==> ``Max(x, 0)``. Exact for non-NaN inputs."""

    rule_name = "relu-to-max-after-nbits"
    activation = "Relu"


class ClipToMinMaxAfterNBits(_ActivationAfterNBits):
    """``weight-only MatMul -> Clip(lo, hi)`` ==> ``Min(Max(x, lo), hi)``. Exact for non-NaN inputs."""

    rule_name = "clip-to-min-max-after-nbits"
    activation = "Clip"


def matmul_nbits_rules(report: FixReport | None = None) -> RewriteRuleSet:
    """Every rule of this module, recording into ``report`` when given."""
    return RewriteRuleSet([
        CastWeightDequantize.rule(report), FoldWeightTranspose.rule(report), FoldWeightReshape.rule(report),
        GemmWeightToMatMul.rule(report), ReblockWeightDequantize.rule(report), UnshareWeightDequantize.rule(report),
        ReluToMaxAfterNBits.rule(report), ClipToMinMaxAfterNBits.rule(report),
    ])

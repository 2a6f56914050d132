"""Give the output quantizer of a pass-through op the parameters of its input.

Transformation, for a pass-through op P (MaxPool, Reshape, Transpose, Flatten, Slice, ...)::

    DQ(s_in, z_in) -> P -> Q(s_out, z_out) -> DQ(s_out, z_out)
    ==>
    DQ(s_in, z_in) -> P -> Q(s_in, z_in) -> DQ(s_in, z_in)

Exactness: P only selects, reorders or reshapes values, so every value it outputs is a
dequantized input value, a point of the grid ``s_in * (q - z_in)``. ``Q(s_in, z_in)`` represents
each of them without rounding or clamping, so ``DQ(Q(P(DQ(x))))`` equals ``P(DQ(x))`` bit for bit.
Against the model before the pass, the change is exact when the old output quantizer also
reproduced every input grid value (checked exhaustively over the input type, and so reported);
otherwise it removes a rounding onto the old, coarser output grid: each element moves by at most
half an old output step, towards P's input. A Q that *clamps* values its input can take is never
aligned: quantize_static deletes a Relu/Clip after a Reshape, Flatten, ... and leaves its clamp in
that Q (zero point at qmin), and the input's parameters would drop it
(:func:`kenosis_rewrite.graph.value_range.quantizer_clamp`).

It matters for speed because ORT CPU removes the Q/DQ around a pass-through op (running it on the
integer tensor) only when both sides have identical parameters; the activation rules change
parameters upstream, and this pass keeps the chain aligned.

Refused with a reason: an output Q that clamps reachable values, an output that feeds a Concat
whose inputs all share the output Q's parameters (NNCF's unified Concat scales: aligning one input
would leave the Concat, and the Conv after it, float), a Q read by anything but
DequantizeLinear, a Q that is a graph output, a different quantized type on the two sides,
per-axis or blocked parameters.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.graph.pass_base import ReportingPass

RULE_NAME = "align-pass-through-qparams"


def _round_trip_is_identity(p_in: qdq_params.QuantParams, p_out: qdq_params.QuantParams) -> bool:
    """True when ``DQ_out(Q_out(v)) == v`` for every value ``v`` of the input grid (checked exhaustively)."""
    lo, hi = qdq_params.INTEGER_RANGES[p_in.dtype]
    grid = qdq_params.dequantize_array(np.arange(lo, hi + 1, dtype=np.int64), p_in)
    return bool(np.array_equal(qdq_params.dequantize_array(qdq_params.quantize_array(grid, p_out), p_out), grid))


def _feeds_unified_concat(dequantizers: list[ir.Node], params: qdq_params.QuantParams) -> bool:
    """True when one of ``dequantizers`` feeds a Concat all of whose inputs are DQs with ``params``."""
    for dq in dequantizers:
        for user, _ in dq.outputs[0].uses():
            if user.op_type != "Concat" or user.domain not in qdq_params.DEFAULT_DOMAINS or len(user.inputs) < 2:
                continue
            shared = qdq_params.shared_dequantize_params(user.inputs)
            if shared is not None and shared.same_as(params):
                return True
    return False


class PassThroughQParamsPass(ReportingPass):
    """Align Q parameters after pass-through ops with their input's DQ parameters; see the module docstring."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(model.graph):  # graph order is topological: chains align front to back
            if qdq_params.is_quantize(node):
                modified |= self._align(node)
        return ir.passes.PassResult(model, modified=modified)

    def _align(self, quantize: ir.Node) -> bool:
        op = quantize.inputs[0].producer() if quantize.inputs[0] is not None else None
        if not value_range.is_pass_through(op):
            return False
        source = op.inputs[0].producer()
        if not qdq_params.is_dequantize(source):
            return False
        p_in, p_out = qdq_params.quant_params(source), qdq_params.quant_params(quantize)
        if p_in is None or p_out is None or p_in.same_as(p_out):
            return False
        where = op.name or op.op_type
        if not (p_in.is_per_tensor and p_out.is_per_tensor):
            self.refused(where, "per-axis or blocked parameters are not aligned")
            return False
        if p_in.dtype != p_out.dtype:
            self.refused(where, f"input is {p_in.dtype.name}, output quantizer is {p_out.dtype.name}")
            return False
        if len(source.inputs) < 3 or source.inputs[2] is None:
            self.refused(where, "the input DequantizeLinear has no explicit zero point")
            return False
        output = quantize.outputs[0]
        consumers = qdq_params.requantizable(output, "quantized output")
        if isinstance(consumers, str):
            self.refused(where, consumers)
            return False
        if _feeds_unified_concat(consumers, p_out):
            self.refused(
                where, "its output feeds a Concat whose inputs all share the output quantizer's parameters "
                "(unified scales, which ORT runs on the integer tensors); aligning would break them",
            )
            return False
        clamp = value_range.quantizer_clamp(quantize)
        if clamp is not None:
            lo, hi = clamp
            self.refused(
                where, f"the output quantizer clamps the input's values (at {lo} / {hi}): it stands for an "
                "activation quantize_static removed, which the input's parameters would drop",
            )
            return False
        exact = _round_trip_is_identity(p_in, p_out)
        for node in (quantize, *consumers):
            node.replace_input_with(1, source.inputs[1])
            if len(node.inputs) < 3:
                node.resize_inputs(3)
            node.replace_input_with(2, source.inputs[2])
        self.changed(where, f"{p_out.describe()} -> {p_in.describe()} (input's parameters)", exact=exact)
        return True

"""Give the output quantizer of a pass-through op the parameters of its input.

Transformation, for a pass-through op P (MaxPool, Reshape, Transpose, Flatten, Slice, ...)::

    DQ(s_in, z_in) -> P -> Q(s_out, z_out) -> DQ(s_out, z_out)
    ==>
    DQ(s_in, z_in) -> P -> Q(s_in, z_in) -> DQ(s_in, z_in)

Exactness: exact with respect to P's input. P only selects, reorders or reshapes values, so
every value it outputs is a dequantized input value: a point of the grid ``s_in * (q - z_in)``
inside the input's range. ``Q(s_in, z_in)`` represents each of them without rounding or
clamping, so ``DQ(Q(P(DQ(x))))`` equals ``P(DQ(x))`` bit for bit; the old parameters could only
round or clamp them. It matters for speed because ORT CPU removes the Q/DQ around a pass-through
op (running it on the integer tensor) only when both sides have identical parameters; the
activation rules change parameters upstream, and this pass keeps the chain aligned.

Refused with a reason: a Q read by anything but DequantizeLinear, a Q that is a graph output, a
different quantized type on the two sides, per-axis or blocked parameters.
"""

from __future__ import annotations

import onnx_ir as ir

from kenosis_rewrite import _qdq
from kenosis_rewrite.passes._base import ReportingPass

RULE_NAME = "align-pass-through-qparams"

# Ops whose every output value is one of the values of their first input.
PASS_THROUGH_OPS = frozenset(
    {
        "MaxPool", "GlobalMaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze",
        "Slice", "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Identity",
        "DepthToSpace", "SpaceToDepth", "ReduceMax", "ReduceMin", "Split",
    }
)


def _is_pass_through(node: ir.Node | None) -> bool:
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in PASS_THROUGH_OPS:
        return False
    if node.op_type == "MaxPool" and len(node.outputs) > 1 and node.outputs[1].uses():
        return False  # the Indices output is not a value of the input
    return True


class PassThroughQParamsPass(ReportingPass):
    """Align Q parameters after pass-through ops with their input's DQ parameters. Exact."""

    rule_name = RULE_NAME


    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(model.graph):  # graph order is topological: chains align front to back
            if _qdq.is_quantize(node):
                modified |= self._align(node)
        return ir.passes.PassResult(model, modified=modified)

    def _align(self, quantize: ir.Node) -> bool:
        op = quantize.inputs[0].producer() if quantize.inputs[0] is not None else None
        if not _is_pass_through(op) or op.inputs[0] is None:
            return False
        source = op.inputs[0].producer()
        if not _qdq.is_dequantize(source):
            return False
        p_in, p_out = _qdq.quant_params(source), _qdq.quant_params(quantize)
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
        if output.is_graph_output():
            self.refused(where, f"quantized output {output.name!r} is a graph output")
            return False
        consumers = _qdq.dequantize_consumers(output)
        if consumers is None:
            self.refused(where, f"quantized output {output.name!r} is read by a non-DequantizeLinear node")
            return False
        for node in (quantize, *consumers):
            node.replace_input_with(1, source.inputs[1])
            if len(node.inputs) < 3:
                node.resize_inputs(3)
            node.replace_input_with(2, source.inputs[2])
        self.changed(where, f"{p_out.describe()} -> {p_in.describe()} (input's parameters)", exact=True)
        return True

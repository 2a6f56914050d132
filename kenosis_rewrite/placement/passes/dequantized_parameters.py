"""Read a dequantized constant in an operator's parameter slot as the float constant it is.

Transformation, for a DequantizeLinear of constants read as a PRelu's slope or a Clip's bound::

    PRelu(x, DQ(q_a; s, z))          ==>   PRelu(x, a)            a = (q_a - z) * s
    Clip(x, DQ(q_lo), DQ(q_hi))      ==>   Clip(x, lo, hi)

with the float32 constant computed as DequantizeLinear computes it. Other readers of the DQ keep it.

Why: Quark quantizes every constant, a PRelu's slopes and a Clip's bounds among them. ONNX Runtime
does not constant-fold a DequantizeLinear in a QDQ model, so the PRelu rules, the Clip rules and
ORT's own ClipQuantFusion, which all want a constant there, saw none: MediaPipe's iris, face mesh and
palm models by Quark kept ORT's slow PRelu kernel (0.98 ms against 0.15 ms for the form
``prelu-to-relu-min`` writes, shared research ort-cpu-facts.md §3.4), and PP-OCR's Clips by Quark
kept the Conv in front of them float. A slope or a bound is a parameter of the op, not a tensor ORT
fuses into an integer kernel, so nothing is lost by reading it as a constant.

Exactness: exact, bit for bit. For 8- and 16-bit codes, ``q - z`` is an integer that float32 holds
exactly, and one float32 product by ``s`` is what DequantizeLinear computes too; the op reads the same
values.

Left alone: a float16 or bfloat16 DequantizeLinear (the op's other inputs are of that type), 32-bit
or 4-bit codes, blocked parameters, and a DequantizeLinear whose output is a graph output.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass, remove_unused_nodes

RULE_NAME = "fold-dequantized-parameters"
# (op type, input index): slots that hold a parameter of the op, never an activation ORT fuses
PARAMETER_SLOTS = frozenset({("PRelu", 1), ("Clip", 1), ("Clip", 2)})
_EXACT_CODE_TYPES = (*qdq_params.EIGHT_BIT, ir.DataType.INT16, ir.DataType.UINT16)


def _parameter_uses(value: ir.Value) -> list[tuple[ir.Node, int]]:
    return [(user, index) for user, index in value.uses()
            if user.domain in qdq_params.DEFAULT_DOMAINS and (user.op_type, index) in PARAMETER_SLOTS]


def dequantized_constant(node: ir.Node) -> np.ndarray | None:
    """The float32 values a DequantizeLinear of constant 8- or 16-bit codes computes, or None."""
    if not qdq_params.is_dequantize(node) or node.outputs[0].is_graph_output():
        return None
    params = qdq_params.quant_params(node)
    if params is None or params.block_size or params.dtype not in _EXACT_CODE_TYPES or params.scale.dtype != np.float32:
        return None
    codes = qdq_params.const_array(node.inputs[0])
    return None if codes is None else qdq_params.dequantize_array(codes, params)


class FoldDequantizedParametersPass(ReportingPass):
    """DQ(constant) in a PRelu slope or Clip bound slot -> float constant; see the module docstring."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, modified = model.graph, False
        names = qdq_params.NameAllocator(graph)
        for node in list(graph):
            uses = _parameter_uses(node.outputs[0]) if qdq_params.is_dequantize(node) else []
            values = dequantized_constant(node) if uses else None
            if values is None:
                continue
            name = names.fresh(f"{node.outputs[0].name or 'parameter'}_value")
            constant = qdq_params.add_initializer(graph, ir.tensor(values, name=name), name)
            for user, index in uses:
                user.replace_input_with(index, constant)
                self.changed(user.name or user.op_type, f"{user.op_type} input {index} read as the constant its "
                             f"DequantizeLinear {node.name!r} computes", exact=True)
            modified = True
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)

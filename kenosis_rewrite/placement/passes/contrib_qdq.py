"""Move com.microsoft QuantizeLinear/DequantizeLinear to the default ONNX domain.

Transformation::

    com.microsoft.QuantizeLinear(x, s, z; axis)   ==>   QuantizeLinear(x, s, z; axis)
    com.microsoft.DequantizeLinear(q, s, z; axis) ==>   DequantizeLinear(q, s, z; axis)

quantize_static writes them with ``UseQDQContribOps=True`` (and Quark's older presets do), mainly
for 16-bit and 4-bit types before opset 21. Every rule of this package reads default-domain Q/DQ
only, so without this step such a model would get nothing, or be called unquantized.

Exactness: exact. ORT's contrib ops compute the same function as the standard ones (round half to
even, saturate, ``(q - z) * s``), and the standard op is used only where the model's opset defines
it for that type: 8-bit from opset 10 (per-axis from 13), 16-bit and 4-bit from opset 21. The others
stay in the contrib domain, reported, and every rule treats them as float ops it does not touch.
"""

from __future__ import annotations

import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass

RULE_NAME = "contrib-qdq-to-standard"
_CONTRIB = "com.microsoft"
_WIDE_TYPES_OPSET = 21  # int16/uint16/int4/uint4 in QuantizeLinear/DequantizeLinear


def _standard_opset_needed(node: ir.Node) -> int | str:
    """The default-domain opset that defines ``node``'s type and layout, or why none does."""
    params = qdq_params.quant_params(node, domains=(_CONTRIB,))
    if params is None:
        return "non-constant scale or zero point"
    if params.dtype in qdq_params.EIGHT_BIT:
        needed = 10 if params.is_per_tensor else qdq_params.PER_AXIS_OPSET
    elif params.dtype in qdq_params.INTEGER_RANGES:
        needed = _WIDE_TYPES_OPSET
    elif params.dtype == ir.DataType.INT32 and node.op_type == qdq_params.DEQUANTIZE:
        needed = 10 if params.is_per_tensor else qdq_params.PER_AXIS_OPSET
    else:
        return f"{params.dtype.name} has no standard QuantizeLinear/DequantizeLinear"
    return needed


class ContribQDQToStandardPass(ReportingPass):
    """com.microsoft Q/DQ to the default domain where the model's opset defines them; exact."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, opset, modified = model.graph, qdq_params.default_opset(model), False
        for node in list(graph):
            if node.domain != _CONTRIB or node.op_type not in (qdq_params.QUANTIZE, qdq_params.DEQUANTIZE):
                continue
            where = node.name or node.op_type
            needed = _standard_opset_needed(node)
            if isinstance(needed, str):
                self.refused(where, needed)
                continue
            if opset < needed:
                self.refused(where, f"its type or per-axis layout needs opset {needed}; the model has {opset}")
                continue
            standard = ir.Node(
                "", node.op_type, node.inputs, attributes=list(node.attributes.values()), num_outputs=1,
                name=node.name,
            )
            graph.insert_before(node, standard)
            old, new = node.outputs[0], standard.outputs[0]
            name, value_type, shape = old.name, old.type, old.shape
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            graph.remove(node, safe=True)
            new.name, new.type, new.shape = name, value_type, shape
            self.changed(where, f"com.microsoft.{node.op_type} -> {node.op_type}", exact=True)
            modified = True
        return ir.passes.PassResult(model, modified=modified)

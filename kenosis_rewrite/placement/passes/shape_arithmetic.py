"""Shape arithmetic stays float: ``Q -> DQ`` round trips on tensors computed from shapes are removed.

Transformation::

    v -> Q(s, z) -> DQ(s, z) -> consumers   ==>   v -> consumers
    where v is computed from a tensor's shape (Shape/Size/EyeLike) or an index generator
    (Range/ConstantOfShape), by any ops, from nothing else but constants

Why: a detector builds anchors, grids and priors from its feature maps' shapes, and an exporter
computes padding from the input's shape. Node-by-node quantizers wrap those float computations in
Q/DQ like any activation: their exact values (pixel offsets, counts) move onto an 8-bit grid
calibrated on one input size. A count that goes through ``Ceil``/``Floor`` after rounding can change
and with it a tensor's shape (measured: a face detector's priors 12600 vs 12672, a broadcast error
at run time). Without the round trip, the values are the float model's, exactly; and no later rule
can retype the pair or move its parameters, since there is none.

Refused too where a DQ feeds a Conv/MatMul/Gemm (a weight computed as ``W + ConstantOfShape(Shape(W))``,
a table built from Range): without the Q/DQ ONNX Runtime runs that product in float, and such an
operand is no count or index whose rounding could change a shape.

Exactness: not exact with respect to the input model: the affected tensors take their float
values, i.e. the FP32 model's exactly (the rounding removed was an error, never a clamp a Relu relies
on: shape arithmetic has no activation to fold). Refused where the Q's output is read by anything
but a DequantizeLinear, or the DQ's output is a graph output (its name is the interface).
"""

from __future__ import annotations

import onnx_ir as ir

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass, remove_unused_nodes
from kenosis_rewrite.graph.value_origins import Origin, value_origins

RULE_NAME = "float-shape-arithmetic"

class FloatShapeArithmeticPass(ReportingPass):
    """Remove ``Q -> DQ`` round trips on shape arithmetic; see the module docstring."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, modified = model.graph, False
        origins = value_origins(graph)
        for node in list(graph):
            if not qdq_params.is_quantize(node) or origins.get(node.inputs[0]) is not Origin.SHAPE:
                continue
            where = node.name or node.outputs[0].name
            consumers = qdq_params.dequantize_consumers(node.outputs[0])
            if not consumers or node.outputs[0].is_graph_output():
                self.refused(where, "the quantized shape arithmetic is read by more than DequantizeLinear nodes")
                continue
            if any(dq.outputs[0].is_graph_output() for dq in consumers):
                self.refused(where, "the dequantized shape arithmetic is a graph output (its name is the interface)")
                continue
            if any(_feeds_weighted_op(dq) for dq in consumers):
                # its quantized operand is what lets ORT run the product in integers (fuzz 30000684)
                self.refused(where, "the shape arithmetic feeds a Conv/MatMul/Gemm, which runs in integers "
                                    "only on its quantized form")
                continue
            for dq in consumers:
                dq.outputs[0].replace_all_uses_with(node.inputs[0])
            modified = True
            self.changed(where, f"{node.inputs[0].name} (computed from shapes) keeps its float value", exact=False)
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)


def _feeds_weighted_op(dequantize: ir.Node) -> bool:
    return any(user.op_type in op_tables.WEIGHTED_OPS and user.domain in qdq_params.DEFAULT_DOMAINS
               for user, _ in dequantize.outputs[0].uses())

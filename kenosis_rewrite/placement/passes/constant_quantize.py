"""Quantize constants ahead of time: ``QuantizeLinear(constant)`` becomes an integer initializer.

Transformation::

    Q(c; s, z) -> DQ(.; s, z)   with c, s, z constants   ==>   q_c -> DQ(.; s, z)

where ``q_c = clip(rint(c / s) + z)`` (round half to even, as the ONNX spec and ORT compute it).

where ``c`` may also be computed from constants alone: a DequantizeLinear of constants, and the
Identity/Reshape/Squeeze/Unsqueeze/Flatten of either (:func:`~kenosis_rewrite.graph.qdq_params.reshaped_constant`),
computed as ONNX Runtime computes them (float32). Codes that come out equal share one initializer.

Why: exporters that store weights as Constant nodes (Paddle2ONNX) lead quantize_static to treat
them as activations: the weight is re-quantized at every run, and rules that need to read integer
weights (BatchNormalization folding, bias requantization) cannot. With the integer initializer,
the weight is a plain int8 weight again (and stays int8: the uint8 retyping leaves weights alone).
A weight shared through Identity nodes (an ALBERT-style encoder reusing one layer's weights, as
PyTorch exports it) gets, from NNCF, ``DQ(w) -> Identity -> Q -> DQ -> MatMul`` at every use: ONNX
Runtime dequantized and requantized each copy at every run (chython-rxnmap: 112 ms of its 176 ms
per inference in DequantizeLinear), and the MatMuls could not read int8 weights.

Exactness: exact; the same computation, done once.
"""

from __future__ import annotations

import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass, remove_unused_nodes

RULE_NAME = "fold-constant-quantize"


class FoldConstantQuantizePass(ReportingPass):
    """``Q(constant)`` → integer initializer; see the module docstring."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, modified = model.graph, False
        names = qdq_params.NameAllocator(graph)  # one scan of the graph for every constant quantized
        folded: dict[tuple, ir.Value] = {}
        for node in list(graph):
            if not qdq_params.is_quantize(node) or node.outputs[0].is_graph_output():
                continue
            params = qdq_params.quant_params(node)
            if params is None or params.block_size or params.dtype not in qdq_params.INTEGER_RANGES:
                continue
            if params.dtype not in qdq_params.EIGHT_BIT and params.dtype not in (ir.DataType.INT16, ir.DataType.UINT16):
                continue  # 4-bit packing is left to the weight-only tools
            values = qdq_params.reshaped_constant(node.inputs[0])
            if values is None:
                continue
            quantized = qdq_params.quantize_array(values, params)
            # one initializer for equal codes (a weight shared through Identity nodes, each copy with
            # the same quantizer: an ALBERT layer's weights, read by every layer)
            key = (params.dtype, quantized.shape, quantized.tobytes())
            initializer = folded.get(key)
            if initializer is None:
                name = names.fresh(f"{node.inputs[0].name or 'constant'}_quantized")
                initializer = folded[key] = qdq_params.add_initializer(graph, ir.tensor(quantized, dtype=params.dtype, name=name), name)
            node.outputs[0].replace_all_uses_with(initializer)
            modified = True
            self.changed(node.name or initializer.name, f"{node.inputs[0].name} quantized once, offline", exact=True)
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)

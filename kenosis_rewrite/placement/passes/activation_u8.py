"""int8 → uint8 retyping of activation QuantizeLinear/DequantizeLinear.

Transformation, per quantized activation tensor ``Q(x; s, z) -> DQ(.; s, z)``::

    Q(x; s, z: int8) -> DQ(.; s, z)   ==>   Q(x; s, z + 128: uint8) -> DQ(.; s, z + 128)

and, for an int8 constant that feeds a DequantizeLinear outside a weight slot (an activation-typed
constant, e.g. the constant operand of a quantized Add), ``data + 128`` with ``z + 128``.

Exactness: exact. ``rint(x/s) + z`` clamped to [-128, 127] and shifted by 128 equals
``rint(x/s) + z + 128`` clamped to [0, 255], and ``(q + 128) - (z + 128) = q - z``, so every
dequantized value is bit-identical.

Why: onnxruntime on x86 converts int8 activations to uint8 itself, but only for tensors with a
single consumer; every tensor with several consumers (residual branches, SiLU, concat inputs)
keeps int8 and its producer and consumers run as float kernels (shared research,
ort-cpu-facts.md §2). Weights (input 1 of Conv/ConvTranspose/MatMul/Gemm) stay int8: u8
activations with s8 weights is the combination ORT's integer kernels are fastest at.

Refused (and reported): a Q whose output is a graph output (its type is part of the interface),
a Q that feeds anything but DequantizeLinear, DQs whose parameters disagree with their Q, int8
graph inputs, and per-axis activations next to an AveragePool (NNCF places such Qs; in uint8
ONNX Runtime fuses ``DQ -> AveragePool -> Q`` into QLinearAveragePool, which refuses per-axis
parameters: the model would not load, measured on an NNCF fingerprint net, afis 1.2.7).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass

RULE_NAME = "activation-int8-to-uint8"
_SHIFT = 128


def _is_weight_use(node: ir.Node, index: int) -> bool:
    """A weight slot, directly or through Identity nodes (a weight shared by several layers)."""
    if node.op_type == "Identity" and node.domain in ("", "ai.onnx"):
        return any(_is_weight_use(user, slot) for user, slot in node.outputs[0].uses())
    return index == 1 and node.op_type in op_tables.WEIGHTED_OPS and node.domain in ("", "ai.onnx")


def _set_input(node: ir.Node, index: int, value: ir.Value | None) -> None:
    if len(node.inputs) <= index:
        node.resize_inputs(index + 1)
    node.replace_input_with(index, value)


class ActivationInt8ToUint8Pass(ReportingPass):
    """Retype every int8 activation Q/DQ (fan-out tensors included) to uint8. Exact."""

    rule_name = RULE_NAME


    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = qdq_params.NameAllocator(graph)
        shifted: dict[object, tuple] = {}  # id(old int8 constant) -> (old, uint8 replacement)
        retyped = 0
        for node in list(graph):
            if qdq_params.is_quantize(node):
                retyped += self._retype_quantize(graph, node, names, shifted)
            elif qdq_params.is_dequantize(node):
                retyped += self._retype_constant_input(graph, node, names, shifted)
        _remove_unused_initializers(graph, shifted)
        return ir.passes.PassResult(model, modified=retyped > 0)

    def _shifted_constant(
        self, graph: ir.Graph, value: ir.Value | None, like_shape: tuple[int, ...],
        names: qdq_params.NameAllocator, shifted: dict[object, tuple],
    ) -> ir.Value:
        """The uint8 (+128) twin of int8 constant ``value`` (None = implicit zero point 0)."""
        key = id(value) if value is not None else ("implicit zero point", like_shape)
        if key in shifted:
            return shifted[key][1]
        if value is None:
            data = np.zeros(like_shape, dtype=np.int8)
            base = "zero_point_u8"
        else:
            data = qdq_params.const_array(value)
            base = f"{value.name or 'constant'}_u8"
        new_data = (data.astype(np.int16) + _SHIFT).astype(np.uint8)
        name = names.fresh(base)
        new_value = qdq_params.add_initializer(
            graph, ir.tensor(new_data, dtype=ir.DataType.UINT8, name=name), name
        )
        shifted[key] = (value, new_value)
        return new_value

    def _retype_quantize(
        self, graph: ir.Graph, node: ir.Node, names: qdq_params.NameAllocator,
        shifted: dict[object, tuple],
    ) -> int:
        params = qdq_params.quant_params(node)
        if params is None or params.dtype != ir.DataType.INT8:
            return 0
        if qdq_params.const_array(node.inputs[0]) is not None:
            return 0  # Q(constant) quantizes a weight or a constant, not an activation
        output = node.outputs[0]
        where = node.name or output.name or "QuantizeLinear"
        if output.is_graph_output():
            self.refused(where, f"int8 tensor {output.name!r} is a graph output; its type is part of the model's interface")
            return 0
        dequantizers = []
        for consumer, index in output.uses():
            if not qdq_params.is_dequantize(consumer) or index != 0:
                self.refused(where, f"int8 tensor {output.name!r} feeds {consumer.op_type}, which needs int8")
                return 0
            consumer_params = qdq_params.quant_params(consumer)
            if consumer_params is None or not consumer_params.same_as(params):
                self.refused(where, f"DequantizeLinear {consumer.name!r} disagrees with its QuantizeLinear's parameters")
                return 0
            dequantizers.append(consumer)
        if not params.is_per_tensor and _pools_around(node, dequantizers):
            self.refused(where, f"per-axis int8 tensor {output.name!r} next to an AveragePool: ONNX Runtime fuses "
                                "uint8 DQ -> AveragePool -> Q into QLinearAveragePool, which refuses per-axis parameters")
            return 0
        zero_point = node.inputs[2] if len(node.inputs) > 2 else None
        new_zero_point = self._shifted_constant(graph, zero_point, params.scale.shape, names, shifted)
        _set_input(node, 2, new_zero_point)
        if "output_dtype" in node.attributes:
            node.attributes["output_dtype"] = ir.AttrInt64("output_dtype", ir.DataType.UINT8)
        output.type = ir.TensorType(ir.DataType.UINT8)
        for consumer in dequantizers:
            _set_input(consumer, 2, new_zero_point)
        self.changed(where, f"{output.name}: {params.describe()} -> uint8 zp+128", exact=True)
        return 1

    def _retype_constant_input(
        self, graph: ir.Graph, node: ir.Node, names: qdq_params.NameAllocator,
        shifted: dict[object, tuple],
    ) -> int:
        data_value = node.inputs[0]
        if data_value is None or data_value.dtype != ir.DataType.INT8 or data_value.producer() is not None:
            return 0
        where = node.name or "DequantizeLinear"
        if data_value.is_graph_input():
            self.refused(where, f"int8 graph input {data_value.name!r} is part of the model's interface")
            return 0
        if data_value.const_value is None:
            return 0
        output = node.outputs[0]
        if any(_is_weight_use(consumer, index) for consumer, index in output.uses()) or output.is_graph_output():
            return 0  # a weight: int8 weights are what ORT's kernels want
        params = qdq_params.quant_params(node)
        if params is None:
            return 0
        zero_point = node.inputs[2] if len(node.inputs) > 2 else None
        new_data = self._shifted_constant(graph, data_value, (), names, shifted)
        new_zero_point = self._shifted_constant(graph, zero_point, params.scale.shape, names, shifted)
        node.replace_input_with(0, new_data)
        _set_input(node, 2, new_zero_point)
        self.changed(where, f"constant {data_value.name}: int8 -> uint8 (+128)", exact=True)
        return 1


_POOLS = ("AveragePool", "GlobalAveragePool")


def _pools_around(quantize: ir.Node, dequantizers: list[ir.Node]) -> bool:
    """Whether the Q reads an average pool's output or one of its DQs feeds an average pool."""
    producer = quantize.inputs[0].producer() if quantize.inputs[0] is not None else None
    if producer is not None and producer.op_type in _POOLS:
        return True
    return any(user.op_type in _POOLS for dq in dequantizers for user, _ in dq.outputs[0].uses())


def _remove_unused_initializers(graph: ir.Graph, shifted: dict[object, tuple]) -> None:
    """Drop the int8 constants we replaced once nothing uses them any more."""
    for old, _ in shifted.values():
        if old is None or old.uses() or old.is_graph_output() or old.is_graph_input():
            continue
        if old.name in graph.initializers and graph.initializers[old.name] is old:
            graph.initializers.pop(old.name)

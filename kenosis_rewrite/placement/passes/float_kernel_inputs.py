"""The ops ONNX Runtime runs in float read the float tensor, not its quantize-dequantize copy, where that
copy serves nothing else.

Transformation, for an activation round trip ``DQ(Q(x))`` (the same parameters on both; ops that
only select elements may stand between Q and DQ, on the codes, and are then applied to ``x``) whose readers,
directly or through ops that only select its elements (MaxPool, Transpose, Reshape, ...), are all
Conv/ConvTranspose/MatMul/Gemm that ORT runs as float kernels, reading it as their data input, with
float constant weights (``float-weights-for-float-kernels`` runs first; which ops ORT runs in float,
and which quantizers it keeps on their own, the caller asks ORT after that step:
:func:`kenosis_rewrite.diagnosis.explain.kernel_facts`)::

    x -> Q -> DQ -> MaxPool -> Conv(float kernel)   ==>   x -> MaxPool -> Conv(float kernel)
    x -> Q -> MaxPool -> DQ -> Conv(float kernel)   ==>   x -> MaxPool -> Conv(float kernel)

Exactness: approximate by design, towards the float model. The rewired ops read exactly the tensor
the model computes before the quantizer, clamped where the Q's clamp stands for a Relu or Clip the
quantizer deleted (``Clip(lo, hi)``: :func:`~kenosis_rewrite.graph.value_range.implied_clamp`), so the
result equals the input model with that Q/DQ pair deleted, or replaced by that clamp (tested bit for
bit); the difference from the input is that pair's rounding error, at most half a quantization step
per element, and ``fix()`` holds it to its run-time guard.

Why: a quantizer whose every reader runs in float buys no integer kernel, only a rounding and two
memory passes, and ORT's QDQ propagation then runs a MaxPool behind it on the 8-bit codes in its
generic NCHW ``MaxPool<uint8_t>`` loop (fast ``NhwcMaxPool`` only between integer kernels): MTCNN O-Net
by NNCF, whose Convs ORT runs in float (PRelu after them, no output quantizer), spent 0.41 of 0.89 ms
per image in three such pools at one thread (scratch ORT profile).

Left alone: a round trip read by anything else (an integer kernel, a QDQ node unit, a graph output,
a float op ORT does not run as a heavy kernel), a float kernel that keeps quantized weights (4-bit,
blocked: quantized for size, with their activation), a MatMul reading it as its second operand, a quantizer
whose input ORT may compute in an integer kernel (a heavy op ORT runs integer, directly or through a
Relu/Clip it fuses in, or an op other than element selection whose activation inputs are all
dequantized: a QDQ node unit), round trips on constants, and quantizers other than 8-bit (a 16-bit
activation is chosen for accuracy or for another runtime, as ``float-weights-for-float-kernels`` leaves it).
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from kenosis_rewrite.core import model_io, op_tables
from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.graph.dequantize import insert_clamp
from kenosis_rewrite.graph.pass_base import ReportingPass, remove_unused_nodes

__all__ = ["RULE_NAME", "FloatKernelInputsPass"]

RULE_NAME = "float-kernels-read-float"


def _live_outputs(node: ir.Node) -> list[ir.Value]:
    return [output for output in node.outputs if output.uses() or output.is_graph_output()]


def _float_readers(value: ir.Value, float_ops: frozenset[str], found: list[ir.Node]) -> bool:
    """Whether every reader of ``value``, through single-output value-selecting ops, is a float kernel
    reading it as its data input; those kernels are appended to ``found``."""
    if value.is_graph_output() or not value.uses():
        return False
    for reader, index in value.uses():
        if reader.domain not in op_tables.DEFAULT_DOMAINS or index != 0:
            return False
        if reader.op_type in op_tables.WEIGHTED_OPS and reader.name in float_ops:
            if not all(v is None or qdq_params.const_array(v) is not None for v in reader.inputs[1:]):
                return False  # weights it keeps quantized (4-bit, blocked: for size) keep their activation too
            found.append(reader)
            continue
        live = _live_outputs(reader)
        if reader.op_type not in op_tables.VALUE_SELECTING_OPS or live != list(reader.outputs[:1]):
            return False
        if not _float_readers(live[0], float_ops, found):
            return False
    return True


def _integer_source(quantize: ir.Node, float_ops: frozenset[str], kept_quantizers: frozenset[str] | None) -> bool:
    """Whether ORT may compute the input of ``quantize`` in an integer kernel with it: it fused the Q
    away (``kept_quantizers``: the Qs it runs on their own), or, by the graph alone, a heavy op it runs
    integer (through a Relu/Clip it fuses in) or a QDQ node unit (activation inputs all dequantized)
    computes it. Ops that only move or compare codes (MaxPool, Transpose) never count."""
    producer = quantize.inputs[0].producer()
    while producer is not None and producer.op_type in op_tables.ORT_ABSORBED_ACTIVATIONS and producer.inputs:
        if producer.inputs[0] is None or len(producer.outputs[0].uses()) != 1:
            break
        producer = producer.inputs[0].producer()
    if producer is None or producer.op_type in op_tables.VALUE_SELECTING_OPS:  # moves or compares codes only
        return False
    # ORT folds a BatchNormalization or a constant Add/Mul into a Conv with float weights and may then
    # quantize them itself (a QLinearConv with this Q as its output): only ORT's graph tells
    if kept_quantizers is not None and quantize.name and quantize.name not in kept_quantizers:
        return True
    if producer.op_type in op_tables.WEIGHTED_OPS:
        return producer.name not in float_ops
    activations = [v for v in producer.inputs if v is not None and qdq_params.const_array(v) is None]
    return bool(activations) and all(qdq_params.is_dequantize(v.producer()) for v in activations)


def _round_trip(dequantize: ir.Node) -> tuple[ir.Node, list[ir.Node]] | None:
    """``(Q, ops)`` when ``dequantize`` reads ``Q(x)`` with the same parameters, through value-selecting
    ``ops`` on the codes (ORT's and ``move-q-backward``'s placement around a MaxPool), ``x`` computed."""
    if not qdq_params.is_dequantize(dequantize) or dequantize.inputs[0] is None:
        return None
    chain, value = [], dequantize.inputs[0]
    producer = value.producer()
    while (producer is not None and producer.op_type in op_tables.VALUE_SELECTING_OPS
           and producer.domain in op_tables.DEFAULT_DOMAINS and value is producer.outputs[0]
           and _live_outputs(producer) == list(producer.outputs[:1]) and producer.inputs and producer.inputs[0] is not None):
        chain.append(producer)
        value = producer.inputs[0]
        producer = value.producer()
    if not qdq_params.is_quantize(producer) or producer.inputs[0] is None:
        return None
    source = producer.inputs[0]
    if qdq_params.const_array(source) is not None:
        return None
    params, dequantized = qdq_params.quant_params(producer), qdq_params.quant_params(dequantize)
    if (params is None or dequantized is None or not params.is_per_tensor or not params.same_as(dequantized)
            or params.dtype not in qdq_params.EIGHT_BIT):
        return None
    return producer, chain[::-1]


def _clamped_source(quantize: ir.Node, reader: ir.Node, names: qdq_params.NameAllocator) -> ir.Value:
    """The quantizer's float input, clamped where the Q's clamp stands for an activation the quantizer
    deleted (:func:`~kenosis_rewrite.graph.value_range.implied_clamp`: quantize_static lets the Q of a
    Relu or Clip it removed do its clamping)."""
    source = quantize.inputs[0]
    clamp = value_range.implied_clamp(quantize)  # per-tensor constant parameters: checked by _round_trip
    if clamp is None:
        return source
    dtype = qdq_params.quant_params(quantize).scale.dtype
    return insert_clamp(quantize.graph, source, *clamp, dtype, source.name or "activation", reader, names)


def _float_copy(chain: list[ir.Node], source: ir.Value, before: ir.Node, names: qdq_params.NameAllocator) -> ir.Value:
    """The value-selecting ``chain`` applied to the float ``source`` (new nodes before ``before``)."""
    value = source
    for op in chain:
        copy = ir.Node(op.domain, op.op_type, [value, *op.inputs[1:]], attributes=list(op.attributes.values()),
                       num_outputs=1, name=names.fresh(f"{op.name or op.op_type}_float"))
        before.graph.insert_before(before, copy)
        value = copy.outputs[0]
    return value


class FloatKernelInputsPass(ReportingPass):
    """Float kernels read ``x`` instead of ``DQ(Q(x))`` where nothing else reads it; see the module docstring."""

    rule_name = RULE_NAME

    def __init__(self, float_ops: Iterable[str], report=None, kept_quantizers: Iterable[str] | None = None):
        """``float_ops``: the heavy ops ORT runs in float; ``kept_quantizers``: the QuantizeLinear nodes it
        runs on their own (None: unknown, the graph alone decides), both by name, asked of ORT."""
        super().__init__(report)
        self.float_ops = frozenset(float_ops)
        self.kept_quantizers = None if kept_quantizers is None else frozenset(kept_quantizers)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        # a rewired pair can make the one before it serve only float kernels too (Quark's Q/DQ on both
        # sides of a MaxPool): again until nothing changes, at most once per quantizer
        for _ in range(sum(1 for node in model.graph if qdq_params.is_dequantize(node))):
            if not self._rewire_once(model):
                break
            modified = True
        return ir.passes.PassResult(model, modified=modified)

    def _rewire_once(self, model: ir.Model) -> bool:
        modified, names = False, None
        for dequantize in list(model.graph):
            if dequantize.graph is None:  # removed earlier in this sweep
                continue
            round_trip = _round_trip(dequantize)
            readers: list[ir.Node] = []
            if round_trip is None or not _float_readers(dequantize.outputs[0], self.float_ops, readers):
                continue
            site = dequantize.name or dequantize.outputs[0].name
            if self.held(site, dequantize):
                continue
            quantize, chain = round_trip
            if _integer_source(quantize, self.float_ops, self.kept_quantizers):
                self.refused(site, "ORT may compute the quantizer's input in an integer kernel with it")
                continue
            names = names or qdq_params.NameAllocator(model.graph)
            float_value = _float_copy(chain, _clamped_source(quantize, dequantize, names), dequantize, names)
            for reader, index in list(dequantize.outputs[0].uses()):
                reader.replace_input_with(index, float_value)
            for reader in readers:
                reader.metadata_props[model_io.FLOAT_INPUT_KEY] = RULE_NAME
            modified = True
            readers_named = ", ".join(sorted(reader.name for reader in readers))
            self.changed(site, f"ORT runs every reader of this quantized copy in float ({readers_named}): they read "
                         "the float tensor, without its rounding", exact=False, site=site)
        remove_unused_nodes(model, modified)  # so that the next sweep sees the pairs before these unread
        return modified

"""Keep a quantized Softmax in float on ORT CPU x86: QLinearSoftmax is slower than DQ + Softmax + Q.

Transformation (``softmax-float-input``), for a per-tensor 8-bit DequantizeLinear read only by a
Softmax whose output only a per-tensor 8-bit QuantizeLinear reads::

    x_q = P_n(...P_1(c)) -> DQ -> Softmax -> Q
    ==>
    c -> DQ -> Flatten(axis=0) -> Reshape(shape(c)) -> P_1 -> ... -> P_n -> Softmax -> Q

where ``P_i`` is data movement (Reshape, Transpose, Squeeze, Unsqueeze, Flatten, Slice, ...) that
the DQ's input went through from the codes ``c``, on the codes or as quantize_static writes it
(``DQ -> P -> Q`` with the DQ's parameters; redundant ``DQ -> Q`` pairs are crossed too), each value
on the way read by nothing else; ``n = 0`` where none is (attention scores, logits).

Why: at session time ORT's QDQ selector fuses every ``DQ -> Softmax -> Q`` of 8-bit per-tensor
parameters into ``com.microsoft.QLinearSoftmax``, and on x86 its kernel is slower than the
DequantizeLinear, float Softmax and QuantizeLinear it replaces at every shape measured, on one
thread and two: 0.16-0.81x of the fused time on one thread, 0.21-0.92x on two (onnxruntime 1.32.0,
AMD EPYC with AVX512-VNNI, interleaved medians; ``python benchmarks/qlinear_softmax.py`` measures
it). One thread, fused vs float, microseconds: a DFL head ``[1,4,2100,16]`` over the last axis 331
vs 108; YOLOv8n's head as ORT runs it, ``[1,4,16,2100]`` over axis 2, 343 vs 143 (two threads 181
vs 103); attention scores ``[1,12,256,256]`` 1637 vs 268; ``[1,1000]`` logits 6.1 vs 4.9.
quantize_static surrounds every Softmax with such a pair: on YOLOv8n, quantize() ran at 0.95-0.96x
of NNCF -> fix(), which leaves the Softmax's input float, and at 1.00x with this rule.

The selector needs the DQ to write the Softmax's input, so the rule puts data movement between them
that ORT neither removes nor crosses: its QDQ propagation carries a DQ forward through Reshape,
Transpose, Squeeze, Unsqueeze, Slice and MaxPool, re-creating ``DQ -> Softmax`` (measured: a plain
``DQ -> Reshape -> Softmax -> Q`` still runs as QLinearSoftmax; ``qdq_propagation.cc``,
``CanNodePropagate``), but not through Flatten. ``Flatten`` to ``[1, size]`` and ``Reshape`` back
alias their input in ORT (no copy), so the float path costs DequantizeLinear, Softmax and
QuantizeLinear, and the Q still feeds the integer op after it (the DFL head's QLinearConv). The
data movement ``P_i`` goes after that barrier so that ORT's transpose optimizer can still move a
Transpose past the Softmax: YOLOv8's ``Reshape -> Transpose(0,2,1,3) -> Softmax(axis=1)`` runs as
``Reshape -> Softmax(axis=2) -> Q -> Transpose`` on ``[1,4,16,N]``, as in NNCF's float graph; with the
Transpose left on the codes before the DQ, the Softmax ran over axis 1 of ``[1,16,4,N]`` (a general
4-D transpose inside ORT's kernel), 826 us instead of 158 (ORT's profiler, YOLOv8n, one thread).

Exactness: exact, bit for bit, against the graph's own semantics: a per-tensor DQ is elementwise,
so it commutes with data movement; ``Q(DQ(c)) = c`` for identical parameters (the wrappers and pairs
crossed are identities on the codes); Flatten then Reshape to the tensor's own shape is the
identity. The Softmax reads the values it read before.
Against ORT's fused execution of the input model, the output codes change where QLinearSoftmax's
lookup-table arithmetic rounded differently from the float Softmax the graph specifies: measured
at most 1 code, on 0-6% of the elements (the rule removes that deviation).

Int8 parameters: ORT on x86 fuses those too where its int8 -> uint8 conversion of a ``Q -> DQ``
pair reaches them (quantize_static's placement); where it does not (int8 codes moved before the
DQ) the Softmax already runs float, and the rewrite changes the graph only (Flatten and Reshape
cost nothing).

Left alone: DQs with per-axis or blocked parameters and non-8-bit types (ORT does not fuse them),
Softmaxes whose output is read by anything but one QuantizeLinear, or is a graph output. Targets:
``ort-cpu`` only (ARM's QLinearSoftmax is not measured here).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_base import ReportingRule, acceptance, refusal

__all__ = ["SoftmaxFloatInput", "softmax_float_input_rules", "RULE_NAME"]

RULE_NAME = "softmax-float-input"
_ALLOWZERO_OPSET = 14  # Reshape's allowzero: a 0 in the shape is a 0, not "copy this dimension"


def _fusible_params(node: ir.Node | None) -> str | None:
    """Why ORT would not fuse ``node`` (a Q or DQ) into QLinearSoftmax, or None when it would."""
    params = qdq_params.quant_params(node) if node is not None else None
    if params is None:
        return "its scale or zero point is not a constant"
    if not params.is_per_tensor:
        return "per-axis or blocked parameters"
    if params.dtype not in qdq_params.EIGHT_BIT:
        return f"{params.dtype.name.lower()} parameters"
    return None


def _sole_reader(value: ir.Value) -> bool:
    return len(value.uses()) == 1 and not value.is_graph_output()


def _movement(node: ir.Node | None) -> bool:
    return node is not None and node.op_type in op_tables.DATA_MOVEMENT_OPS and node.domain in qdq_params.DEFAULT_DOMAINS \
        and len(node.outputs) == 1 and bool(node.inputs) and node.inputs[0] is not None


def _same_params(node: ir.Node | None, params: qdq_params.QuantParams) -> bool:
    other = qdq_params.quant_params(node) if node is not None else None
    return other is not None and other.same_as(params)


def data_movement_chain(codes: ir.Value, params: qdq_params.QuantParams) -> tuple[ir.Value, list[ir.Node]]:
    """Walk back from ``codes`` (quantized with ``params``) through what only moves its elements: data
    movement on the codes, ``DQ -> P -> Q`` with the same parameters (quantize_static's wrapping of a
    data-movement op P), redundant ``DQ -> Q`` pairs. Returns the codes the chain starts from and the
    data-movement ops in graph order; each value left behind has no other reader."""
    movement: list[ir.Node] = []
    while _sole_reader(codes):
        producer = codes.producer()
        if _movement(producer):
            movement.insert(0, producer)
            codes = producer.inputs[0]
            continue
        if not _same_params(producer, params) or not qdq_params.is_quantize(producer) or not _sole_reader(producer.inputs[0]):
            break
        inner = producer.inputs[0].producer()  # the float tensor the Q reads
        node = inner if _movement(inner) else None
        dq = node.inputs[0].producer() if node is not None else inner
        if not qdq_params.is_dequantize(dq) or not _same_params(dq, params) or node is not None and not _sole_reader(dq.outputs[0]):
            break
        if node is not None:
            movement.insert(0, node)
        codes = dq.inputs[0]
    return codes, movement


class SoftmaxFloatInput(ReportingRule):
    """``P(c) -> DQ -> Softmax -> Q`` ==> ``DQ(c) -> Flatten -> Reshape -> P -> Softmax -> Q`` (no QLinearSoftmax). Exact."""

    def __init__(self, report: FixReport | None = None):
        super().__init__(RULE_NAME, report)

    def pattern(self, op, x_q):
        dequantized = op.DequantizeLinear(x_q, _allow_other_inputs=True, _outputs=["dq"])
        return op.Softmax(dequantized, _outputs=["probs"])

    def check(self, context, x_q, dq, probs, **_) -> MatchResult:
        del context, x_q
        dq_node, softmax = dq.producer(), probs.producer()
        if softmax.domain not in qdq_params.DEFAULT_DOMAINS:
            return MatchResult().fail("not a default-domain Softmax")
        users = probs.uses()
        if probs.is_graph_output() or len(users) != 1 or not qdq_params.is_quantize(users[0].node):
            return MatchResult().fail("the Softmax's output is not quantized: nothing for ORT to fuse")
        where = softmax.name or str(probs.name)
        for role, node in (("input", dq_node), ("output", users[0].node)):
            reason = _fusible_params(node)
            if reason is not None:
                return refusal(where, f"the {role} quantizer has {reason}: ORT does not fuse it")
        return acceptance(where)

    def rewrite(self, op, x_q, dq, probs, **_):
        dq_node, softmax = dq.producer(), probs.producer()
        graph = softmax.graph
        codes, movement = data_movement_chain(x_q, qdq_params.quant_params(dq_node))
        value = op.DequantizeLinear(codes, *dq_node.inputs[1:], **{k: a.value for k, a in dq_node.attributes.items()})
        shape = codes.shape
        if shape is not None and all(isinstance(dim, int) for dim in shape):
            name = self.fresh_name(graph, f"{softmax.name or 'softmax'}_input_shape")
            dims = op.initializer(ir.tensor(np.array(list(shape), dtype=np.int64), name=name), name=name)
        else:
            dims = op.Shape(codes)  # no second reader of the float tensor
        opset = qdq_params.default_opset(graph) if graph is not None else 1
        allowzero = {"allowzero": 1} if opset >= _ALLOWZERO_OPSET else {}
        value = op.Reshape(op.Flatten(value, axis=0), dims, **allowzero)
        for node in movement:  # the data movement again, now on the float tensor
            value = getattr(op, node.op_type)(value, *node.inputs[1:], **{k: a.value for k, a in node.attributes.items()})
        moved = f", dequantized before {len(movement)} data-movement op(s)" if movement else ""
        self.record(softmax.name or str(probs.name),
                    f"Softmax reads a float tensor no DequantizeLinear writes: no QLinearSoftmax{moved}", exact=True)
        return op.Softmax(value, **{k: a.value for k, a in softmax.attributes.items()})


def softmax_float_input_rules(report: FixReport | None = None) -> RewriteRuleSet:
    return RewriteRuleSet([SoftmaxFloatInput.rule(report)])

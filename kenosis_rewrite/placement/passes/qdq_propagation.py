"""Move DequantizeLinear forward and QuantizeLinear backward through ops that commute with them,
and remove the pairs that become redundant.

Commuting ops ``P``: data-movement ops (Reshape, Transpose, Flatten, Squeeze, Unsqueeze, Slice,
Identity, DepthToSpace, SpaceToDepth), MaxPool, and Concat when every input has the same
parameters.

* **DQ forward**: ``DQ(q; s, z) -> P``  ==>  ``P(q) -> DQ(.; s, z)``.
  Proof: DQ is elementwise and strictly increasing for ``s > 0``. A data-movement op only selects
  and places elements, so applying it before or after an elementwise map gives the same tensor;
  ``max`` commutes with any increasing map (``max f(a_i) = f(max a_i)``), so MaxPool does too;
  Concat of tensors dequantized with one (s, z) is the dequantization of their concatenation.
  Exact. (MaxPool on 8-bit tensors needs opset >= 12 and has no 16-bit kernel; refused there.)
* **Q backward**: ``P -> Q(s, z)``  ==>  ``Q(s, z) -> P``. Same proof: Q is elementwise and
  non-decreasing (rounding then clamping), so it commutes with selection and with max. Exact.
* **DQ past Split**: ``DQ(q; s, z) -> Split -> y_i``  ==>  ``Split(q) -> DQ(.; s, z) -> y_i``, one DQ
  per used output. Split only selects elements; exact by the same proof. NNCF writes
  ``Q -> DQ -> Split -> Conv`` (YOLOv8's C2f blocks); ORT fuses a Conv only when a DQ feeds it directly.
* **DQ past Pad** (opset >= 11): ``DQ(q; s, z) -> Pad(mode, v)``  ==>  ``Pad(q, mode, c) -> DQ(.; s, z)``.
  ``edge``/``reflect``/``wrap`` only copy elements: exact by the same proof. ``constant`` fills with
  ``v``; on the codes it fills with ``c = z + v / s``, exact when ``c`` is an integer of the type's range
  (``v = 0``: ``c = z``, which dequantizes to 0 exactly). Per-axis parameters: ``v = 0`` with one zero
  point for every channel, and no padding along the parameters' axis. ORT fuses a Conv only when a DQ
  feeds it directly; EfficientNet exports pad each Conv's input with a static ``Pad`` (``static_padding``).
* **Redundant pairs**: ``DQ(s, z) -> Q(s, z)`` with identical parameters and type is the identity
  on the quantized tensor (``rint((q - z) s / s) + z = q``, already in range), so consumers of the
  Q read the DQ's input. Exact. Together with DQ forward this also removes ``Q -> DQ -> Q -> DQ``.

TensorRT's explicit-quantization guide asks for this placement: Q/DQ pairs sit right at the inputs
of the ops that consume them, with data movement done on int8 tensors.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass, remove_unused_nodes


def commutes_with_qdq(node: ir.Node, opset: int, params: qdq_params.QuantParams | None = None) -> bool:
    """True when ``node`` commutes with Q/DQ of ``params`` and runs on their quantized type."""
    if node.domain not in op_tables.DEFAULT_DOMAINS or node.op_type not in op_tables.QDQ_COMMUTING_OPS:
        return False
    if node.op_type == "MaxPool":  # 8-bit MaxPool from opset 12; no 16-bit kernel
        eight_bit = params is None or params.dtype in qdq_params.EIGHT_BIT
        return opset >= 12 and eight_bit and not (len(node.outputs) > 1 and node.outputs[1].uses())
    return True


def _copy_node(
    graph: ir.Graph, node: ir.Node, inputs: list[ir.Value | None], anchor: ir.Node, names: qdq_params.NameAllocator,
) -> ir.Node:
    copy = ir.Node(
        node.domain, node.op_type, inputs, attributes=list(node.attributes.values()),
        num_outputs=1, name=names.fresh(f"{node.name or node.op_type}_q"),
    )
    graph.insert_after(anchor, copy)
    return copy


def _dequantize_like(dq: ir.Node, value: ir.Value, names: qdq_params.NameAllocator, suffix: str,
                     unnamed: str = "dq") -> ir.Node:
    """A DequantizeLinear of ``value`` with ``dq``'s parameters and attributes (not yet in a graph)."""
    return ir.Node("", "DequantizeLinear", [value, *dq.inputs[1:]], attributes=list(dq.attributes.values()),
                   name=names.fresh(f"{dq.name or unnamed}_{suffix}"))


def _redirect(old: ir.Value, new: ir.Value) -> None:
    """Consumers (and the graph-output slot, keeping its name) of ``old`` read ``new``."""
    graph = old.graph
    if old.is_graph_output():
        name, value_type, shape = old.name, old.type, old.shape
        for index, output in enumerate(graph.outputs):
            if output is old:
                graph.outputs[index] = new
        old.name = None
        new.name, new.type, new.shape = name, value_type, shape
    old.replace_all_uses_with(new)


class DequantizeForwardPass(ReportingPass):
    """``DQ -> P`` ==> ``P -> DQ`` for commuting ops; see the module docstring.

    ``ops`` limits the ops moved past (default: all commuting ops and Concat). With
    ``float_consumers_only`` an op whose output a QuantizeLinear reads is left alone: ORT CPU already
    runs ``DQ -> P -> Q`` on the integer tensor (its own QDQ node units), and only ops whose output
    stays float (NNCF leaves YOLOv8's SPPF ``MaxPool -> Concat -> Conv`` unquantized) gain.
    """

    rule_name = "move-dq-forward"

    def __init__(self, report: FixReport | None = None, ops: frozenset[str] | None = None, float_consumers_only: bool = False):
        super().__init__(report)
        self.ops = ops
        self.float_consumers_only = float_consumers_only

    def _candidate(self, node: ir.Node, opset: int) -> bool:
        if node.graph is None or not commutes_with_qdq(node, opset) and node.op_type != "Concat":
            return False
        if self.ops is not None and node.op_type not in self.ops:
            return False
        return not (self.float_consumers_only and any(qdq_params.is_quantize(use.node) for use in node.outputs[0].uses()))

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, opset, modified, names = model.graph, qdq_params.default_opset(model), False, None
        for node in list(graph):
            if self._candidate(node, opset):
                names = names or qdq_params.NameAllocator(graph)
                modified |= self._move(graph, node, opset, names)
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)

    def _move(self, graph: ir.Graph, node: ir.Node, opset: int, names: qdq_params.NameAllocator) -> bool:
        data_inputs = list(node.inputs) if node.op_type == "Concat" else node.inputs[:1]
        params = qdq_params.shared_dequantize_params(data_inputs)
        if params is None or node.op_type != "Concat" and not commutes_with_qdq(node, opset, params):
            return False
        dequantizers = [v.producer() for v in data_inputs]
        quantized = [dq.inputs[0] for dq in dequantizers]
        moved = _copy_node(graph, node, quantized + list(node.inputs[len(data_inputs):]), node, names)
        dequantize = _dequantize_like(dequantizers[0], moved.outputs[0], names, "forward")
        graph.insert_after(moved, dequantize)
        _redirect(node.outputs[0], dequantize.outputs[0])
        self.changed(node.name or node.op_type, f"{node.op_type} now runs on the quantized tensor", exact=True)
        return True


class DequantizeAfterSplitPass(ReportingPass):
    """``DQ -> Split`` ==> ``Split -> DQ`` on each used output; see the module docstring."""

    rule_name = "move-dq-past-split"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, modified, names = model.graph, False, None
        for node in list(graph):
            if node.op_type == "Split" and node.domain in ("", "ai.onnx") and node.graph is not None:
                names = names or qdq_params.NameAllocator(graph)
                modified |= self._move(graph, node, names)
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)

    def _move(self, graph: ir.Graph, split: ir.Node, names: qdq_params.NameAllocator) -> bool:
        dq = split.inputs[0].producer() if split.inputs and split.inputs[0] is not None else None
        params = qdq_params.quant_params(dq) if qdq_params.is_dequantize(dq) else None
        if params is None or not params.is_per_tensor:
            return False
        moved = ir.Node(
            split.domain, "Split", [dq.inputs[0], *split.inputs[1:]], attributes=list(split.attributes.values()),
            num_outputs=len(split.outputs), name=names.fresh(f"{split.name or 'Split'}_q"),
        )
        graph.insert_after(split, moved)
        anchor = moved
        for old, new in zip(split.outputs, moved.outputs):
            if not old.uses() and not old.is_graph_output():
                continue
            dequantize = _dequantize_like(dq, new, names, "split", unnamed="DequantizeLinear")
            graph.insert_after(anchor, dequantize)
            anchor = dequantize
            _redirect(old, dequantize.outputs[0])
        self.changed(split.name or "Split", "Split now runs on the quantized tensor", exact=True)
        return True


PAD_CODES_OPSET = 11  # Pad takes 8-bit tensors and its pads as an input from opset 11


class DequantizeAfterPadPass(ReportingPass):
    """``DQ -> Pad`` ==> ``Pad -> DQ`` on the codes; see the module docstring."""

    rule_name = "move-dq-past-pad"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, modified, names = model.graph, False, None
        if qdq_params.default_opset(model) < PAD_CODES_OPSET:
            return ir.passes.PassResult(model, modified=False)
        for node in list(graph):
            if qdq_params.is_op(node, "Pad") and node.inputs and qdq_params.is_dequantize(node.inputs[0].producer()):
                names = names or qdq_params.NameAllocator(graph)
                modified |= self._move(graph, node, names)
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)

    def _move(self, graph: ir.Graph, pad: ir.Node, names: qdq_params.NameAllocator) -> bool:
        dq = pad.inputs[0].producer()
        params = qdq_params.quant_params(dq)
        where = pad.name or "Pad"
        if params is None:
            return False
        reason = pad_axis_refusal(pad, params)
        code = None if reason else pad_code(pad, params)
        if reason or isinstance(code, str):
            self.refused(where, reason or code)
            return False
        inputs = [dq.inputs[0], *pad.inputs[1:]]
        if code is not None:
            fill = names.fresh(f"{where}_code")
            value = qdq_params.add_initializer(graph, qdq_params.integer_tensor(np.asarray(code), params.dtype, fill), fill)
            inputs += [None] * (3 - len(inputs))
            inputs[2] = value
        moved = ir.Node(pad.domain, "Pad", inputs, attributes=list(pad.attributes.values()), name=names.fresh(f"{where}_q"))
        graph.insert_after(pad, moved)
        dequantize = _dequantize_like(dq, moved.outputs[0], names, "pad")
        graph.insert_after(moved, dequantize)
        _redirect(pad.outputs[0], dequantize.outputs[0])
        self.changed(where, "Pad now runs on the quantized tensor" + (f" (fill code {code})" if code is not None else ""),
                     exact=True)
        return True


def pad_code(pad: ir.Node, params: qdq_params.QuantParams) -> int | str | None:
    """The code a constant Pad fills with on the quantized tensor (None: not a constant Pad), or why none is exact."""
    if pad.attributes.get_string("mode", "constant") != "constant":
        return None
    fill = pad.inputs[2] if len(pad.inputs) > 2 else None
    value = 0.0
    if fill is not None:
        array = qdq_params.const_array(fill)
        if array is None or array.size != 1:
            return "the pad value is not a constant scalar"
        value = float(array.reshape(-1)[0])
    zero_points = np.unique(params.zero_point)
    if len(zero_points) != 1 or (not params.is_per_tensor and value != 0.0):
        return "per-channel parameters with a pad value other than 0 or zero points that differ"
    code = float(zero_points[0]) + value / float(np.asarray(params.scale).reshape(-1)[0])
    if code != round(code) or not params.qmin <= code <= params.qmax:
        return f"the pad value {value:g} is not a value of the quantized grid"
    return int(round(code))


def pad_axis_refusal(pad: ir.Node, params: qdq_params.QuantParams) -> str:
    """Why per-axis parameters cannot follow this Pad (it pads their axis, or its pads are unknown); ""."""
    if params.is_per_tensor:
        return ""
    if len(pad.inputs) > 3 and pad.inputs[3] is not None:
        return "a Pad with axes and per-channel parameters"
    pads = qdq_params.const_array(pad.inputs[1]) if len(pad.inputs) > 1 and pad.inputs[1] is not None else None
    if pads is None:
        return "the pads of a Pad before per-channel parameters are not constant"
    rank = pads.size // 2
    axis = params.axis % rank if rank else 0
    if pads.reshape(-1)[axis] or pads.reshape(-1)[axis + rank]:
        return "the Pad pads the axis of the per-channel parameters"
    return ""


class QuantizeBackwardPass(ReportingPass):
    """``P -> Q`` ==> ``Q -> P`` for commuting ops with a float (non-DQ) input."""

    rule_name = "move-q-backward"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, opset, modified, names = model.graph, qdq_params.default_opset(model), False, None
        for node in list(graph):
            if qdq_params.is_quantize(node):
                names = names or qdq_params.NameAllocator(graph)
                modified |= self._move(graph, node, opset, names)
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)

    def _move(self, graph: ir.Graph, quantize: ir.Node, opset: int, names: qdq_params.NameAllocator) -> bool:
        op = quantize.inputs[0].producer()
        if op is None or not commutes_with_qdq(op, opset, qdq_params.quant_params(quantize)) or op.inputs[0] is None:
            return False
        if qdq_params.is_dequantize(op.inputs[0].producer()) or len(op.outputs[0].uses()) != 1:
            return False  # DQ forward handles it / the float output is read elsewhere too
        early = ir.Node(
            "", "QuantizeLinear", [op.inputs[0], *quantize.inputs[1:]], attributes=list(quantize.attributes.values()),
            name=names.fresh(f"{quantize.name or 'q'}_backward"),
        )
        graph.insert_before(op, early)
        moved = _copy_node(graph, op, [early.outputs[0], *op.inputs[1:]], early, names)
        _redirect(quantize.outputs[0], moved.outputs[0])
        self.changed(op.name or op.op_type, f"{op.op_type} now runs on the quantized tensor", exact=True)
        return True


class RedundantQDQPass(ReportingPass):
    """``DQ(s, z) -> Q(s, z)`` ==> nothing: the Q's consumers read the quantized tensor."""

    rule_name = "remove-redundant-qdq"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(model.graph):
            if not qdq_params.is_quantize(node):
                continue
            dq = node.inputs[0].producer()
            if not qdq_params.is_dequantize(dq):
                continue
            if node.outputs[0].is_graph_output() or dq.inputs[0].is_graph_input() or dq.inputs[0].is_initializer():
                continue
            p_dq, p_q = qdq_params.quant_params(dq), qdq_params.quant_params(node)
            if p_dq is None or p_q is None or not p_dq.same_as(p_q):
                continue
            _redirect(node.outputs[0], dq.inputs[0])
            modified = True
            self.changed(node.name or "QuantizeLinear", "DQ -> Q with identical parameters removed", exact=True)
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)

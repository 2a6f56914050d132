"""Fold per-channel activation scales into the weights on both sides of the tensor.

Transformation, for a per-axis (channel axis) activation ``Q``/``DQ`` pair with scales ``s_c`` and one
zero point ``z`` for all channels, written by a Conv and read only by depthwise Convs::

    DQ(x) -> Conv(DQ(w; t_o), b) [-> act] -> Q(s_c, z) -> DQ(s_c, z) -> DWConv(DQ(v; u_o))
        ==>
    DQ(x) -> Conv(DQ(w; t_o S/s_o), b S/s_o) [-> act'] -> Q(S, z) -> DQ(S, z) -> DWConv(DQ(v; u_o s_o/S))

with ``S = max_c s_c``: the producer's output channel ``o`` is divided by its own step ``s_o`` (and
multiplied by the common ``S``) in its weight scale and bias, so that one per-tensor grid of step
``S`` holds exactly the integers the per-channel grid held; a depthwise Conv reads each channel on
its own, so the consumer takes the step back into its per-channel weight scale. The integer weights
are untouched; only scales and the float or int32-dequantized bias change. ``act`` is a Relu or
LeakyRelu (positively homogeneous, kept) or a Clip that the per-axis Q made redundant on every
channel (removed: its bound would otherwise move with each channel's factor).

Why: ORT CPU has no integer kernel for a per-axis activation (QLinearConv wants a scalar input and
output scale), so NNCF's per-channel quantizers at depthwise inputs leave both the producing Conv
and the depthwise Conv in float. OpenVINO folds them the same way; re-quantizing per tensor instead
(:mod:`per_tensor_activations`) costs precision when channel ranges differ (NNCF's PP-LCNet: 40-100x).

Zero points that differ between channels (NNCF's MIXED preset writes int8 with 0 on some channels and
-128 on others) are first all moved to ``qmin`` where the tensor is provably never negative (a Relu
or Clip(0, M) writes it): a channel then uses no integer below its zero point, so ``q - z_c + qmin``
dequantizes to the same values on the channel's old range; above it, where the old Q saturated at
``(qmax - z_c) s_c``, the new one saturates at ``(qmax - qmin) s_c``, nearer the float value.

Exactness: exact in real arithmetic (every Q produces the integers it produced before); in float32,
products of rescaled weights and scales round differently, so a value lying on a rounding tie may
land one step away. Reported as approximate; ``fix()``'s run-time guard measures it.

A Pad between the DQ and a depthwise Conv that pads with 0 (or copies edges) off the channel axis is
read through: it commutes with a per-channel factor (EfficientNet's ``static_padding``).

Refused with a reason: parameters that are not constants or differ between the DQs, zero points
that differ between channels of a tensor that can be negative, a quantized tensor read by anything but DequantizeLinear ->
depthwise Conv input, a producer that is not a Conv with constant dequantized weights (or is
read elsewhere, or a graph output), an activation that is not homogeneous and not absorbed by the
Q. (A per-axis Q exists only from opset 13 on, so the per-axis weight DQs it needs are valid.)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.graph.pass_base import ReportingPass
from kenosis_rewrite.placement.passes.qdq_propagation import pad_axis_refusal, pad_code

RULE_NAME = "fold-per-channel-activation-scales"
_HOMOGENEOUS = ("Relu", "LeakyRelu")  # f(a x) = a f(x) for a > 0: unaffected by per-channel factors


@dataclasses.dataclass
class _Fold:
    """What one fold changes, found before anything is touched."""

    params: qdq_params.QuantParams
    consumers: list[ir.Node]  # the DQs of the quantized tensor
    depthwise: list[ir.Node]  # the depthwise Convs reading them
    producer: ir.Node  # the Conv writing the quantized tensor
    activation: ir.Node | None  # between producer and Q
    zero_points_aligned: bool = False  # the channels' zero points moved to qmin (a non-negative tensor)


def _weight_dequantize(conv: ir.Node) -> ir.Node | str:
    weight = conv.inputs[1] if len(conv.inputs) > 1 else None
    dq = weight.producer() if weight is not None else None
    if not qdq_params.is_dequantize(dq) or qdq_params.const_array(dq.inputs[0]) is None:
        return f"{conv.op_type} {conv.name!r} has no constant dequantized weight"
    params = qdq_params.quant_params(dq)
    rank = qdq_params.const_array(dq.inputs[0]).ndim
    if params is None or params.block_size or not (params.is_per_tensor or params.axis % max(rank, 1) == 0):
        return f"weight of {conv.op_type} {conv.name!r} is not quantized per tensor or per output channel"
    return dq


def _readers_through_pads(value: ir.Value, params: qdq_params.QuantParams) -> list[tuple[ir.Node, int]]:
    """The readers of ``value``, and in place of a Pad that pads with 0 (or copies edges) off the channel
    axis, the Pad's readers: such a Pad commutes with a per-channel factor (EfficientNet's
    ``static_padding`` between NNCF's DQ and the depthwise Conv)."""
    readers = []
    for user, index in value.uses():
        output = user.outputs[0] if qdq_params.is_op(user, "Pad") else None
        if (output is not None and index == 0 and not output.is_graph_output() and not pad_axis_refusal(user, params)
                and pad_code(user, params) in (None, *np.unique(params.zero_point).tolist())):
            readers.extend(output.uses())
        else:
            readers.append((user, index))
    return readers


def _is_depthwise(conv: ir.Node, channels: int) -> bool:
    if conv.op_type != "Conv" or conv.attributes.get_int("group", 1) != channels:
        return False
    dq = _weight_dequantize(conv)
    if isinstance(dq, str):
        return False
    shape = qdq_params.const_array(dq.inputs[0]).shape
    return len(shape) >= 3 and shape[1] == 1 and shape[0] % channels == 0


class FoldPerChannelActivationScalesPass(ReportingPass):
    """Per-axis activation Q/DQ between a Conv and depthwise Convs -> per-tensor; see the module docstring."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, modified = model.graph, False
        names = None
        for node in list(graph):
            if not qdq_params.is_quantize(node) or qdq_params.const_array(node.inputs[0]) is not None:
                continue
            params = qdq_params.quant_params(node)
            if params is None or params.scale.size <= 1 or params.block_size:
                continue
            fold = self._plan(node, params)
            if isinstance(fold, str):
                self.refused(node.name or "QuantizeLinear", fold)
                continue
            names = names or qdq_params.NameAllocator(graph)
            self._apply(graph, node, fold, names)
            modified = True
        return ir.passes.PassResult(model, modified=modified)

    def _plan(self, quantize: ir.Node, params: qdq_params.QuantParams) -> _Fold | str:
        output = quantize.outputs[0]
        channels = params.scale.size
        written = params  # what the Q and its DQs hold now
        if np.unique(params.zero_point).size != 1:
            if value_range.can_be_negative(quantize.inputs[0]):
                return "zero points differ between channels: no per-tensor grid holds the same integers"
            # a non-negative tensor uses no integer below its channel's zero point: every channel
            # moves to qmin with the values it represented (NNCF's MIXED preset: int8 zp 0 and -128)
            params = dataclasses.replace(params, zero_point=np.full_like(params.zero_point, params.qmin))
        if output.is_graph_output():
            return f"quantized tensor {output.name!r} is a graph output"
        consumers = qdq_params.dequantize_consumers(output)
        if not consumers:
            return f"quantized tensor {output.name!r} is read by a non-DequantizeLinear node"
        if any(not (p := qdq_params.quant_params(dq)) or not p.same_as(written) for dq in consumers):
            return "a DequantizeLinear of this tensor has other parameters"
        depthwise = []
        for dq in consumers:
            if dq.outputs[0].is_graph_output():
                return f"dequantized tensor {dq.outputs[0].name!r} is a graph output"
            for user, index in _readers_through_pads(dq.outputs[0], written):
                if index != 0 or not _is_depthwise(user, channels):
                    return (f"{user.op_type} {user.name!r} reads the dequantized tensor and is not a depthwise Conv "
                            "(only a depthwise Conv can take a channel's step into its own weights)")
                depthwise.append(user)
        rank = len(qdq_params.const_array(_weight_dequantize(depthwise[0]).inputs[0]).shape)
        if params.axis not in (1, 1 - rank):
            return f"per-axis quantizer on axis {params.axis}, not the channel axis of the depthwise Conv input"
        producer, activation = self._producer(quantize.inputs[0])
        if isinstance(producer, str):
            return producer
        if activation is not None and activation.op_type not in _HOMOGENEOUS:
            if activation.op_type != "Clip" or not value_range.absorbed_by_quantizer(activation, params):
                return (f"{activation.op_type} {activation.name!r} between the Conv and the quantizer is not "
                        "positively homogeneous nor made redundant by the quantizer's clamp on every channel")
        weight = _weight_dequantize(producer)
        if isinstance(weight, str):
            return weight
        if qdq_params.const_array(weight.inputs[0]).shape[0] != channels:
            return f"Conv {producer.name!r} has not {channels} output channels"
        bias = producer.inputs[2] if len(producer.inputs) > 2 else None
        if bias is not None and not _rescalable_bias(bias):
            return f"bias of Conv {producer.name!r} is neither a constant nor a constant int32 DequantizeLinear"
        return _Fold(params, consumers, depthwise, producer, activation, written is not params)

    @staticmethod
    def _producer(value: ir.Value) -> tuple[ir.Node | str, ir.Node | None]:
        """The Conv writing ``value`` (through one activation), both read only on this path."""
        node, activation = value.producer(), None
        if node is not None and node.op_type in (*_HOMOGENEOUS, "Clip"):
            activation, value = node, node.inputs[0]
            node = value.producer()
            if len(activation.outputs[0].uses()) != 1 or activation.outputs[0].is_graph_output():
                return f"{activation.op_type} {activation.name!r} output is read elsewhere", None
        if node is None or node.op_type != "Conv" or node.domain not in qdq_params.DEFAULT_DOMAINS:
            kind = node.op_type if node is not None else "a graph input"
            return f"the quantized tensor is written by {kind}, not a Conv whose weights can take the channel steps", None
        if len(value.uses()) != 1 or value.is_graph_output():
            return f"output of Conv {node.name!r} is read elsewhere", None
        return node, activation

    def _apply(self, graph: ir.Graph, quantize: ir.Node, fold: _Fold, names: qdq_params.NameAllocator) -> None:
        params = fold.params
        steps = params.scale.astype(np.float64).reshape(-1)
        common = float(steps.max())
        base = quantize.outputs[0].name or "activation"
        # producer: output channel o times S / s_o
        _rescale_weight(graph, fold.producer, common / steps, names)
        if len(fold.producer.inputs) > 2 and fold.producer.inputs[2] is not None:
            _rescale_bias(graph, fold.producer, common / steps, names)
        if fold.activation is not None and fold.activation.op_type == "Clip":
            fold.activation.outputs[0].replace_all_uses_with(fold.activation.inputs[0])
            graph.remove(fold.activation, safe=True)
        # consumers: output channel o reads input channel o // m; times s_c / S
        for conv in fold.depthwise:
            multiplier = qdq_params.const_array(_weight_dequantize(conv).inputs[0]).shape[0] // steps.size
            _rescale_weight(graph, conv, np.repeat(steps / common, multiplier), names)
        qdq_params.set_per_tensor_params(
            graph, (quantize, *fold.consumers), common, int(params.zero_point.reshape(-1)[0]), params, f"{base}_folded", names
        )
        removed = f", {fold.activation.op_type} absorbed by the quantizer removed" if (
            fold.activation is not None and fold.activation.op_type == "Clip") else ""
        if fold.zero_points_aligned:
            removed += "; the channels' zero points moved to qmin (the tensor is never negative)"
        self.changed(
            quantize.name or "QuantizeLinear",
            f"{params.describe()} -> {params.dtype.name.lower()} s={common:.6g} zp={int(params.zero_point.reshape(-1)[0])}; "
            f"channel steps moved into Conv {fold.producer.name!r} and {len(fold.depthwise)} depthwise Conv(s){removed}",
            exact=False,
        )


def _per_channel(params: qdq_params.QuantParams, factors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel (scale * factors, zero point) of a weight or bias quantizer."""
    scale = np.broadcast_to(params.scale.astype(np.float64).reshape(-1), factors.shape) * factors
    zero_point = np.broadcast_to(params.zero_point.reshape(-1), factors.shape)
    return scale.astype(params.scale.dtype), np.ascontiguousarray(zero_point)


def _replace_dequantize(graph: ir.Graph, node: ir.Node, index: int, factors: np.ndarray, names) -> None:
    """Make ``node``'s input ``index`` a private per-axis(0) DQ of the same integers with scales times ``factors``."""
    dq = node.inputs[index].producer()
    params = qdq_params.quant_params(dq)
    scale, zero_point = _per_channel(params, factors)
    base = dq.outputs[0].name or "weight"
    scale_name, zp_name = names.fresh(f"{base}_folded_scale"), names.fresh(f"{base}_folded_zero_point")
    scale_value = qdq_params.add_initializer(graph, ir.tensor(scale, name=scale_name), scale_name)
    zp_value = qdq_params.add_initializer(
        graph, ir.tensor(zero_point.astype(params.dtype.numpy()), dtype=params.dtype, name=zp_name), zp_name)
    new_dq = ir.node(
        qdq_params.DEQUANTIZE, [dq.inputs[0], scale_value, zp_value], attributes={"axis": 0},
        name=names.fresh(f"{dq.name or 'DequantizeLinear'}_folded"), outputs=[ir.Value(name=names.fresh(f"{base}_folded"))],
    )
    new_dq.outputs[0].type, new_dq.outputs[0].shape = dq.outputs[0].type, dq.outputs[0].shape
    graph.insert_before(node, new_dq)
    node.replace_input_with(index, new_dq.outputs[0])


def _rescale_weight(graph: ir.Graph, conv: ir.Node, factors: np.ndarray, names) -> None:
    _replace_dequantize(graph, conv, 1, factors, names)


def _rescalable_bias(bias: ir.Value) -> bool:
    """A constant float bias, or a constant int32 one behind a DequantizeLinear with constant parameters."""
    if qdq_params.const_array(bias) is not None:
        return True
    dq = bias.producer()
    if not qdq_params.is_dequantize(dq) or qdq_params.const_array(dq.inputs[0]) is None:
        return False
    params = qdq_params.quant_params(dq)
    return params is not None and not params.block_size and params.dtype == ir.DataType.INT32


def _rescale_bias(graph: ir.Graph, conv: ir.Node, factors: np.ndarray, names) -> None:
    bias = conv.inputs[2]
    values = qdq_params.const_array(bias)
    if values is None:
        _replace_dequantize(graph, conv, 2, factors, names)
        return
    scaled = (values.astype(np.float64) * factors).astype(values.dtype)
    name = names.fresh(f"{bias.name or 'bias'}_folded")
    value = qdq_params.add_initializer(graph, ir.tensor(scaled, name=name), name)
    conv.replace_input_with(2, value)

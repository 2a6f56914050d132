"""Bias correction: move each quantized layer's mean output error into its bias.

Quantizing a layer's weights and input shifts the mean of each output channel: rounding errors do
not average to zero over a channel's receptive field (depthwise convolutions, with few weights per
channel, shift most). The shift reaches the next layer as a bias. Fast bias correction (NNCF's
default, after Nagel et al., "Data-Free Quantization", 2019) measures it per layer and subtracts it:

    shift[c] = mean over feeds and positions of ( Conv(DQ(Q(x)), DQ(W_q), DQ(b_q)) - Conv(x, W, b) )[c]
    b_q[c]  <- b_q[c] - rint(shift[c] / bias_scale[c])

where ``x`` is the layer's FP32 input on the calibration feeds. Every layer sees the FP32 input, so
each correction is independent of the others and one ONNX Runtime session measures them all: the
FP32 graph with, beside every corrected layer, a copy of the quantized layer reading the same
input, and ``GlobalAveragePool(quantized - float)`` as an extra output (streamed, one feed at a
time); Gemms and Convs of stride 1 with many products per input value are measured from the
means of their input and of its quantization error instead (per kernel tap: the input's sum less a
few edge rows and columns), which equals the copy's measurement in exact arithmetic and costs no
copy of the layer (:func:`_mean_plan`).

Approximate by nature (not exact): it changes the model's outputs, by design towards FP32 on
average. The bound it keeps: each channel's bias moves by the measured shift rounded to the bias
grid, so after correction the mean error of that channel on the calibration feeds is at most half a
bias step (``bias_scale / 2``), which the tests check; a float bias (NNCF keeps them in float) takes
the shift as it is. A shift within ``SIGNIFICANCE_Z`` standard errors of zero over the feeds is left
as it is. A layer is left alone, with a reason, when its input, weights or bias are not the plain
Q/DQ of constants this module can copy, when the FP32 graph has no node of the same op reading the
same input, or when that node's weights are not the quantized ones within one quantization step (a
BatchNormalization folded since, for instance).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.accuracy.layer_matching import float_counterpart, matched_layers, same_weights
from kenosis_rewrite.core import fidelity, ort_sessions
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params

RULE_NAME = "bias-correction"
_CORRECTED_OPS = ("Conv", "Gemm")
_INT32_RANGE = (np.iinfo(np.int32).min, np.iinfo(np.int32).max)
# Shifts within 2 standard errors (over the feeds) of zero are left alone: measured on the zoo with
# 16 calibration scenes and 100 held-out photos, as good as correcting all on CNNs and safer on
# layers that see one position per feed (squeeze-excitation, classifier heads).
SIGNIFICANCE_Z = 2.0
# A layer whose weights are more than this many steps from the FP32 ones is not corrected. Weight
# rounding by output error (kenosis_rewrite.accuracy.weight_rounding) moves some weights up to 2.5 steps; it
# already minimises the layer's mean error too (uncentred H), and those layers are then left alone.
# Measured (16 scenes / 100 objects, defaults): 1 step: MobileNetV2 0.99565 / 98%, EfficientNet-Lite0
# 0.99762 / 98%, PP-OCR cls 0.99032 / 87%, PP-LCNet 0.96376 / 79%; 3 steps (correct them as well):
# 0.99589 / 98%, 0.99769 / 96%, 0.98957 / 88%, 0.96632 / 76%.
WEIGHT_STEPS = 1.0


@dataclasses.dataclass(frozen=True)
class _Layer:
    """A quantized Conv/Gemm and its FP32 counterpart (same op reading the same FP32 tensor)."""

    node: ir.Node
    source: str  # its FP32 input tensor
    reference: str  # the FP32 layer's output
    bias: ir.Value  # the int32 constant behind the bias DequantizeLinear, or the float bias itself
    bias_scale: np.ndarray | None  # None: a float bias (NNCF keeps its biases in float)
    original: onnx.NodeProto  # the FP32 layer


def _where(node: ir.Node) -> str:
    return node.name or node.outputs[0].name


def _layer(node: ir.Node, float_readers: Mapping[str, list[onnx.NodeProto]],
           float_weights: Mapping[str, onnx.TensorProto]) -> _Layer | str:
    """The layer to correct, or why not."""
    if node.op_type == "Gemm" and node.attributes.get_int("transA", 0):
        return "Gemm with transA: output channels are not along axis 1"
    if len(node.inputs) < 3 or node.inputs[2] is None:
        return "no bias to correct"
    input_dq, weight_dq, bias_dq = (value.producer() for value in node.inputs[:3])
    bias_value = node.inputs[2]
    quantize = input_dq.inputs[0].producer() if qdq_params.is_dequantize(input_dq) else None
    concat_source = _codes_concat_source(quantize, float_readers) if quantize is not None else None
    quantized_input = concat_source is not None or (qdq_params.is_quantize(quantize) and qdq_params.quant_params(quantize) is not None)
    if not quantized_input or qdq_params.quant_params(input_dq) is None:
        return "input is not Q -> DQ with constant parameters"
    if (not qdq_params.is_dequantize(weight_dq) or qdq_params.const_array(weight_dq.inputs[0]) is None
            or qdq_params.quant_params(weight_dq) is None):
        return "weights are not DequantizeLinear of a constant"
    float_bias = bias_dq is None and bias_value.const_value is not None and bias_value.const_value.dtype == ir.DataType.FLOAT
    if float_bias:
        if len(bias_value.uses()) != 1 or bias_value.is_graph_output():
            return "bias is shared with another layer"
        bias, bias_scale = bias_value, None
    else:
        bias_params = qdq_params.quant_params(bias_dq) if qdq_params.is_dequantize(bias_dq) else None
        if bias_params is None or bias_params.dtype != ir.DataType.INT32 or qdq_params.const_array(bias_dq.inputs[0]) is None:
            return "bias is neither DequantizeLinear of an int32 constant nor a float32 constant"
        if np.any(bias_params.zero_point != 0):
            return "bias zero point is not 0"
        if len(bias_dq.inputs[0].uses()) != 1 or len(bias_dq.outputs[0].uses()) != 1:
            return "bias is shared with another layer"
        bias, bias_scale = bias_dq.inputs[0], bias_params.scale.astype(np.float64).reshape(-1)
    source = concat_source or quantize.inputs[0].name
    original = float_counterpart(node, source, float_readers)
    if original is None:
        return f"no FP32 {node.op_type} reading {source!r} to compare with"
    if not same_weights(weight_dq, original, float_weights, WEIGHT_STEPS):
        return (f"the FP32 {node.op_type} {original.name or original.output[0]!r} has other weights than the "
                "quantized one beyond rounding (folded BatchNormalization or scale?): not comparable")
    return _Layer(node, source, original.output[0], bias, bias_scale, original)


def _codes_concat_source(node: ir.Node, float_readers: Mapping[str, list[onnx.NodeProto]]) -> str | None:
    """For a Concat of quantized codes (``concat-on-codes``: ``Concat(Q(a), Q(b), ...)``), the output
    of the FP32 Concat of ``a, b, ...`` (same axis): the float tensor the layer's input quantizes."""
    if node.op_type != "Concat" or node.domain not in qdq_params.DEFAULT_DOMAINS:
        return None
    quantizers = [value.producer() if value is not None else None for value in node.inputs]
    if not quantizers or not all(qdq_params.is_quantize(q) for q in quantizers):
        return None
    floats = [q.inputs[0].name for q in quantizers]
    axis = node.attributes.get_int("axis", 0)
    for candidate in float_readers.get(floats[0], ()):
        if candidate.op_type == "Concat" and list(candidate.input) == floats and \
                next((a.i for a in candidate.attribute if a.name == "axis"), 0) == axis:
            return candidate.output[0]
    return None


def _initializer(graph: ir.Graph, names: qdq_params.NameAllocator, value: ir.Value | None) -> ir.Value | None:
    """A copy, in ``graph``, of the constant ``value`` of the quantized model."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    # ir.Tensor, not ir.tensor: the latter's protocol checks cost ~70 us a call (260 copies on PP-OCR cls)
    return qdq_params.add_initializer(graph, ir.Tensor(tensor.numpy(), dtype=tensor.dtype), names.fresh(f"kenosis_bc_{value.name}"))


def _copied(node: ir.Node, inputs: Sequence[ir.Value | None]) -> ir.Node:
    attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
    return ir.Node(node.domain, node.op_type, inputs, attributes, version=node.version, num_outputs=1)


def _names_of(model: onnx.ModelProto) -> set[str]:
    """Every value, initializer and node name of ``model``'s main graph."""
    graph = model.graph
    names = {v.name for v in [*graph.input, *graph.initializer, *graph.output]}
    for node in graph.node:
        names.update(node.output)
        names.add(node.name)
    return names


# A Conv whose products per input value (output channels per group times kernel taps) are fewer
# than this is measured by a copy: its products cost less than the error tensor's passes
# (PP-OCRv4 det's narrow 1x1 Convs at full size; depthwise Convs).
MIN_TAPPED_OUTPUTS = 32
# Slice's starts and ends as inputs (negative ones count from the end) are opset 10's
_TAPS_OPSET = 10
_END = np.iinfo(np.int64).max
_AXES_INPUT_OPSET = 13  # ReduceSum's axes: an input from opset 13, an attribute before


@dataclasses.dataclass(frozen=True)
class _Means:
    """A layer that :func:`_probe` measures by the means of what it reads (see :func:`_mean_plan`):
    a Conv's geometry and ``group`` (its input's mean per kernel tap), or a Gemm's ``alpha`` and
    ``transB``."""

    group: int = 1
    alpha: float = 1.0
    trans_b: int = 0
    kernel: tuple[int, int] = (1, 1)
    strides: tuple[int, int] = (1, 1)
    dilations: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)  # top, left, bottom, right (ONNX order)
    auto_pad: str = "NOTSET"

    @property
    def pointwise(self) -> bool:
        """Every output position reads one input position and every input position is read once:
        the input's mean over positions is all the measurement needs."""
        return (self.kernel == (1, 1) and self.strides == (1, 1) and not any(self.pads)
                and self.auto_pad in ("NOTSET", "VALID"))

    def edge(self, axis: int) -> int:
        """How many rows (``axis`` 0) or columns (1) at each edge of the input a kernel tap may
        skip: ``dilation * (kernel - 1)`` before the first position it reads, ``dilation * (kernel
        - 1) + stride - 1`` after the last (the stride's remainder); at least 1."""
        return max(1, self.dilations[axis] * (self.kernel[axis] - 1) + self.strides[axis] - 1)

    def pads_at(self, size: int, axis: int) -> tuple[int, int]:
        """The padding before and after ``axis`` of an input ``size`` long (auto_pad resolved as
        ONNX defines it)."""
        if self.auto_pad == "VALID":
            return 0, 0
        if self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            stride, reach = self.strides[axis], self.dilations[axis] * (self.kernel[axis] - 1) + 1
            total = max(0, (-(-size // stride) - 1) * stride + reach - size)
            small = total // 2
            return (small, total - small) if self.auto_pad == "SAME_UPPER" else (total - small, small)
        return self.pads[axis], self.pads[axis + 2]


def _reads(attributes: Mapping, op_type: str, weight_shape: Sequence[int]) -> _Means | str:
    """How a layer with these attributes reads its input, or why it is not one :func:`_probe`
    measures by its input means (a Conv that is not 2-D, a Gemm whose ``beta`` scales the bias)."""
    if op_type == "Gemm":
        if float(attributes.get("beta", 1.0)) != 1.0:
            return "Gemm beta"
        return _Means(alpha=float(attributes.get("alpha", 1.0)), trans_b=int(attributes.get("transB", 0)))
    if len(weight_shape) != 4:
        return "not a 2-D Conv"
    auto_pad = attributes.get("auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        return f"auto_pad {auto_pad}"
    return _Means(group=int(attributes.get("group", 1)), kernel=(int(weight_shape[2]), int(weight_shape[3])),
                  strides=tuple(int(v) for v in attributes.get("strides", (1, 1))),
                  dilations=tuple(int(v) for v in attributes.get("dilations", (1, 1))),
                  pads=tuple(int(v) for v in attributes.get("pads", (0, 0, 0, 0))) if auto_pad == "NOTSET" else (0, 0, 0, 0),
                  auto_pad=auto_pad)


def conv_geometry(original: onnx.NodeProto, weight_shape: Sequence[int]) -> _Means | str:
    """How the FP32 2-D Conv ``original`` reads its input (group, kernel, strides, dilations, pads,
    auto_pad), or why it cannot say."""
    return _reads(float_attributes(original), "Conv", weight_shape)


def float_attributes(node: onnx.NodeProto) -> dict:
    """An FP32 node's attributes by name, strings decoded (as onnx_ir gives them)."""
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return {name: value.decode() if isinstance(value, bytes) else value for name, value in values.items()}


def _ir_attributes(node: ir.Node) -> dict:
    return {name: attr.value for name, attr in node.attributes.items()}


def _mean_plan(layer: _Layer, float_weights: Mapping[str, onnx.TensorProto], opset: int = _TAPS_OPSET) -> _Means | None:
    """How :func:`_probe` measures ``layer`` from its input alone, or None: then the probe runs a
    quantized copy of the layer instead.

    A layer's mean output is linear in its input: with ``m_x[c, t]`` the mean, over the output
    positions (and rows), of the FP32 input value that kernel tap ``t`` reads for input channel
    ``c`` (0 where the tap reads padding), and ``m_e[c, t]`` that of its quantization error
    ``DQ(Q(x)) - x``,

        shift = alpha * (W_q . m_e + (W_q - W) . m_x) + (b_q - b)

    which equals the mean of ``layer(DQ(Q(x))) - float layer(x)`` (the copy's measurement) in
    exact arithmetic; both are float sums, neither bit for bit the other. A Gemm or a pointwise
    Conv reads each input value once: its ``m[c]`` is the input's mean. A tap of any other 2-D Conv
    of stride 1 reads the input less a few rows and columns at its edges, so its sum is the input's
    sum less those edges' (:func:`_tap_means`). The means need one subtraction and passes over the
    input, a copy the layer's products: used for Gemms and for Convs of stride 1 with at least
    ``MIN_TAPPED_OUTPUTS`` products per input value, where the FP32 layer has the same attributes
    and a constant bias."""
    original = layer.original
    weight_shape = [int(d) for d in float_weights[original.input[1]].dims]
    plan = _reads(_ir_attributes(layer.node), layer.node.op_type, weight_shape)
    if isinstance(plan, str) or plan != _reads(float_attributes(original), original.op_type, weight_shape):
        return None
    outputs = weight_shape[0] if layer.node.op_type == "Conv" or plan.trans_b else weight_shape[1]
    if len(original.input) > 2 and original.input[2]:
        bias = float_weights.get(original.input[2])
        if bias is None or int(np.prod(bias.dims)) not in (1, outputs):
            return None
    if layer.node.op_type == "Conv":
        if outputs // plan.group * plan.kernel[0] * plan.kernel[1] < MIN_TAPPED_OUTPUTS:
            return None
        # A strided Conv's taps read stride phases: slicing them out cost more than the copies
        # saved (measured: YOLOv8n's and ddddocr's strided 3x3 Convs); strided Convs are copied.
        if not plan.pointwise and (plan.strides != (1, 1) or opset < _TAPS_OPSET):
            return None
    return plan


def _tap_outputs(plan: _Means, z: ir.Value, add, constant, opset: int) -> list[ir.Value]:
    """What :func:`_tap_means` reads of ``z`` (N, C, H, W) for a Conv of stride 1: its sum (N, C,
    1, 1), then ``edge`` rows at the top and bottom and columns at the left and right."""
    if plan.strides != (1, 1):
        raise ValueError("a strided Conv is measured by a copy (see _mean_plan)")
    rows, columns = plan.edge(0), plan.edge(1)
    if opset >= _AXES_INPUT_OPSET:
        totals = add(ir.node("ReduceSum", [z, constant([2, 3])], attributes={"keepdims": 1}))
    else:
        totals = add(ir.node("ReduceSum", [z], attributes={"axes": [2, 3], "keepdims": 1}))

    def strip(start: int, end: int, axis: int) -> ir.Value:
        return add(ir.node("Slice", [z, constant([start]), constant([end]), constant([axis])]))

    return [totals, strip(0, rows, 2), strip(-rows, _END, 2), strip(0, columns, 3), strip(-columns, _END, 3)]


@dataclasses.dataclass(frozen=True)
class _EdgeReads:
    """Along one axis of an input ``size`` long, what a Conv's kernel taps read: each tap's stride
    phase (one-hot, (taps, stride)), the edge positions it skips (``skipped``: (taps, edges), over
    ``positions``, the edge positions in order) and the output size."""

    positions: np.ndarray
    phase: np.ndarray
    skipped: np.ndarray
    outputs: int


def _edge_reads(plan: _Means, size: int, axis: int) -> _EdgeReads:
    """:class:`_EdgeReads` of ``plan`` along ``axis`` for an input ``size`` long."""
    before, after = plan.pads_at(size, axis)
    stride, dilation, kernel, edge = plan.strides[axis], plan.dilations[axis], plan.kernel[axis], plan.edge(axis)
    outputs = (size + before + after - dilation * (kernel - 1) - 1) // stride + 1
    # the edge positions, each once (the two ends overlap on a small input)
    positions = np.array(sorted(set(range(min(edge, size))) | set(range(max(size - edge, 0), size))), np.int64)
    phases, skipped = [], []
    for tap in range(kernel):
        first = tap * dilation - before  # may be negative (padding)
        last = first + stride * (outputs - 1)
        phase = first % stride
        # the tap's phase less the positions it reads: those before ``first`` or after ``last``
        skips = {p for p in range(phase, size, stride) if p < first or p > last}
        if not skips <= set(positions.tolist()):
            raise ValueError("a kernel tap skips input positions beyond the measured edges")  # not for ONNX Conv geometry
        phases.append(phase)
        skipped.append([p in skips for p in positions.tolist()])
    return _EdgeReads(positions, np.eye(stride)[phases], np.array(skipped, np.float64).reshape(kernel, -1), outputs)


def _tap_means(plan: _Means, rows: _EdgeReads, columns: _EdgeReads, totals: np.ndarray, top: np.ndarray,
               bottom: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Per channel and kernel tap (C, taps), the mean over the batch and output positions of the
    input value the tap reads (0 for padding), from :func:`_tap_outputs` and the input's
    :func:`_edge_reads` (``rows`` and ``columns``).

    A tap (i, j) reads the rows of one stride phase a less a set of skipped rows U_i (all within
    ``edge`` of the ends) and the columns of phase b less V_j, so its sum over z is
    ``sum(a, b) - sum(U_i, b) - sum(a, V_j) + sum(U_i, V_j)``: the phase sums from ``totals``, the
    rest from the edge strips (in float64)."""
    batch, channels, height, width = top.shape[0], top.shape[1], left.shape[2], top.shape[3]
    row_stride, column_stride = plan.strides
    phase_sums = totals.reshape(batch, channels, row_stride, column_stride).sum(axis=0, dtype=np.float64)
    # the edge rows (C, rows, W) and columns (C, H, columns), summed over the batch
    row_values = np.concatenate([top, bottom], axis=2).sum(axis=0, dtype=np.float64)[
        :, np.where(rows.positions < top.shape[2], rows.positions, rows.positions - height + 2 * top.shape[2])]
    column_values = np.concatenate([left, right], axis=3).sum(axis=0, dtype=np.float64)[
        :, :, np.where(columns.positions < left.shape[3], columns.positions, columns.positions - width + 2 * left.shape[3])]
    row_sums = np.stack([row_values[..., b::column_stride].sum(axis=2) for b in range(column_stride)], axis=2)
    column_sums = np.stack([column_values[:, a::row_stride].sum(axis=1) for a in range(row_stride)], axis=1)
    corners = row_values[..., columns.positions]  # (C, rows, columns)
    sums = (np.einsum("ia,cab,jb->cij", rows.phase, phase_sums, columns.phase)
            - np.einsum("ir,crb,jb->cij", rows.skipped, row_sums, columns.phase)
            - np.einsum("ia,caq,jq->cij", rows.phase, column_sums, columns.skipped)
            + np.einsum("ir,crq,jq->cij", rows.skipped, corners, columns.skipped))
    return sums.reshape(channels, -1) / (batch * rows.outputs * columns.outputs)


def _probe(float_proto: onnx.ModelProto, layers: Sequence[_Layer], plans: Sequence[_Means | None],
           opset: int) -> tuple[onnx.ModelProto, list[int]]:
    """The FP32 model, computing only (:func:`ort_sessions.computing_only`) the outputs each layer's mean
    shift is computed from, and how many each layer has: where ``plans`` has a plan, its FP32
    input and that input's quantization error as channels ``z = [x; e]`` (a pointwise Conv: their
    means over positions, (N, C, 1, 1) each; any other Conv: :func:`_tap_outputs` of x, then of e;
    Gemm: the (N, 2K) rows themselves); otherwise the mean of (quantized copy - FP32 layer) over
    positions.

    The additions are built in a scratch graph, serialised alone and appended to ``float_proto``'s
    nodes (the FP32 model is not converted to onnx_ir and back)."""
    graph = ir.Graph([], [], nodes=[], name="bias-correction probe")
    names = qdq_params.NameAllocator(graph, also_taken=_names_of(float_proto))
    values: dict[str, ir.Value] = {}
    constants: dict[tuple[int, ...], ir.Value] = {}

    def fp32(name: str) -> ir.Value:
        """The FP32 model's tensor ``name``, as the scratch graph reads it."""
        return values.setdefault(name, ir.Value(name=name))

    def add(node: ir.Node) -> ir.Value:
        """Append ``node``, it and its output named apart from the FP32 model's names; its output."""
        node.name = names.fresh(f"kenosis_bc_{node.op_type}")
        node.outputs[0].name = names.fresh(f"kenosis_bc_{node.op_type}_output")
        graph.append(node)
        return node.outputs[0]

    def constant(ints: Sequence[int]) -> ir.Value:
        key = tuple(ints)
        if key not in constants:
            constants[key] = qdq_params.add_initializer(graph, ir.tensor(np.array(key, np.int64)), names.fresh("kenosis_bc_ints"))
        return constants[key]

    counts = []
    for layer, plan in zip(layers, plans):
        node = layer.node
        input_dq, weight_dq, bias_dq = (value.producer() for value in node.inputs[:3])
        quantize = input_dq.inputs[0].producer()

        def copy(dq_or_q: ir.Node, data: ir.Value) -> ir.Value:
            params = [_initializer(graph, names, v) for v in dq_or_q.inputs[1:]]
            return add(_copied(dq_or_q, [data, *params]))

        x = fp32(layer.source)
        if not qdq_params.is_quantize(quantize):  # a Concat of codes: x quantized as the DQ reads them
            quantize = ir.node("QuantizeLinear", [None, *input_dq.inputs[1:]],
                               attributes={a.name: a.value for a in input_dq.attributes.values()})
        quantized_x = copy(input_dq, copy(quantize, x))
        if plan is not None:
            error = add(ir.node("Sub", [quantized_x, x]))
            if node.op_type == "Conv":
                # x's outputs, then e's: _shifts joins them as z's (z itself would copy both)
                results = ([add(ir.node("GlobalAveragePool", [x])), add(ir.node("GlobalAveragePool", [error]))]
                           if plan.pointwise else
                           [*_tap_outputs(plan, x, add, constant, opset), *_tap_outputs(plan, error, add, constant, opset)])
            else:
                results = [add(ir.node("Concat", [x, error], attributes={"axis": 1}))]
        else:
            weights = copy(weight_dq, _initializer(graph, names, weight_dq.inputs[0]))
            bias = (_initializer(graph, names, node.inputs[2]) if layer.bias_scale is None
                    else copy(bias_dq, _initializer(graph, names, bias_dq.inputs[0])))
            results = [add(ir.node("Sub", [add(_copied(node, [quantized_x, weights, bias])), fp32(layer.reference)]))]
            if node.op_type == "Conv":
                results = [add(ir.node("GlobalAveragePool", results))]
        for result in results:
            result.name = names.fresh(f"kenosis_bias_shift_{len(float_proto.graph.output) + len(graph.outputs)}")
            graph.outputs.append(result)
        counts.append(len(results))
    additions = ir.serde.serialize_graph(graph)
    return ort_sessions.computing_only(float_proto, [output.name for output in additions.output], appended=additions), counts


def _dequantized_weights(layer: _Layer) -> np.ndarray:
    weight_dq = layer.node.inputs[1].producer()
    return qdq_params.dequantize_array(qdq_params.const_array(weight_dq.inputs[0]), qdq_params.quant_params(weight_dq)).astype(np.float64)


def _layer_bias(layer: _Layer) -> np.ndarray:
    """The quantized layer's bias, dequantized, float64, flat."""
    bias = layer.bias.const_value.numpy().astype(np.float64).reshape(-1)
    return bias if layer.bias_scale is None else bias * layer.bias_scale


def _measured_shifts(layer: _Layer, plan: _Means, float_weights: Mapping[str, onnx.TensorProto],
                     per_feed_means: Sequence[np.ndarray]) -> np.ndarray:
    """Per feed, the per-channel mean shift of ``layer`` from the means of what it reads,
    ``[m_x; m_e]`` per channel (and kernel tap) (see :func:`_mean_plan`)."""
    original = layer.original
    weights = onnx.numpy_helper.to_array(float_weights[original.input[1]]).astype(np.float64)
    quantized = _dequantized_weights(layer)
    if layer.node.op_type == "Gemm" and not plan.trans_b:
        weights, quantized = weights.T, quantized.T  # (outputs, inputs) like a Conv's
    outputs, group = weights.shape[0], plan.group
    # (group, outputs per group, inputs per group x taps), like the means below
    weights, quantized = (w.reshape(group, outputs // group, -1) for w in (weights, quantized))
    has_bias = len(original.input) > 2 and original.input[2]
    float_bias = (onnx.numpy_helper.to_array(float_weights[original.input[2]]).astype(np.float64).reshape(-1)
                  if has_bias else np.zeros(1))
    bias_shift = np.broadcast_to(_layer_bias(layer), (outputs,)) - np.broadcast_to(float_bias, (outputs,))
    rounding = quantized - weights
    means = np.stack(per_feed_means)  # (feeds, [x; e]): every feed's products in two matrix products
    feeds, channels = means.shape[0], means.shape[1] // 2
    x, error = (m.reshape(feeds, group, -1).transpose(1, 2, 0) for m in (means[:, :channels], means[:, channels:]))
    products = quantized @ error + rounding @ x  # (group, outputs per group, feeds)
    return plan.alpha * products.transpose(2, 0, 1).reshape(feeds, -1) + bias_shift


def _channel_means(output: np.ndarray) -> np.ndarray:
    """Per channel, the mean over the batch and positions (a Conv's) or rows (a Gemm's)."""
    return output.reshape(output.shape[0], output.shape[1], -1).mean(axis=(0, 2), dtype=np.float64)


def _shifts(float_proto: onnx.ModelProto, layers: Sequence[_Layer], feeds, by_means: bool = True) -> list[np.ndarray]:
    """Per layer, the per-channel mean shift of each feed: an array (feeds, channels).
    ``by_means=False`` measures every layer with a quantized copy (see :func:`_mean_plan`)."""
    float_weights = {init.name: init for init in float_proto.graph.initializer}
    opset = next((o.version for o in float_proto.opset_import if o.domain in ("", "ai.onnx")), 1)
    plans = [_mean_plan(layer, float_weights, opset) if by_means else None for layer in layers]
    at_once = fidelity.concurrent_runs(len(feeds))
    probe, counts = _probe(float_proto, layers, plans, opset)
    session = fidelity.session(probe, at_once=at_once)
    spans = np.cumsum([0, *counts])
    per_feed: list[list[np.ndarray]] = [[] for _ in layers]
    edges: dict[tuple[_Means, int, int], _EdgeReads] = {}  # the feeds mostly share their sizes

    def edge_reads(plan: _Means, size: int, axis: int) -> _EdgeReads:
        if (plan, size, axis) not in edges:
            edges[plan, size, axis] = _edge_reads(plan, size, axis)
        return edges[plan, size, axis]

    for run in fidelity.each_run(session, feeds, at_once):  # the probe's outputs are the shifts' alone
        for i, plan in enumerate(plans):
            outputs = run[spans[i]:spans[i + 1]]
            if len(outputs) > 1:  # a Conv's outputs of x, then of e: z = [x; e]'s, along the channels
                half = len(outputs) // 2
                outputs = [np.concatenate(pair, axis=1) for pair in zip(outputs[:half], outputs[half:])]
            if len(outputs) == 1:
                per_feed[i].append(_channel_means(outputs[0]))
                continue
            _, top, _, left, _ = outputs
            per_feed[i].append(_tap_means(plan, edge_reads(plan, left.shape[2], 0), edge_reads(plan, top.shape[3], 1), *outputs))
    return [_measured_shifts(layer, plan, float_weights, means) if plan is not None else np.stack(means)
            for layer, plan, means in zip(layers, plans, per_feed)]


def _significant_mean(samples: np.ndarray) -> np.ndarray:
    """Per channel, the mean shift over the feeds, or 0 where it is within ``SIGNIFICANCE_Z``
    standard errors of 0 (it differs from feed to feed more than it persists: correcting it would
    fit the calibration feeds, not the layer)."""
    shift = samples.mean(axis=0)
    if len(samples) < 2:
        return shift
    standard_error = samples.std(axis=0, ddof=1) / np.sqrt(len(samples))
    return np.where(np.abs(shift) > SIGNIFICANCE_Z * standard_error, shift, 0.0)


def correct_biases(
    float_model: onnx.ModelProto,
    model: ir.Model,
    feeds: Sequence[Mapping[str, np.ndarray]],
    report: FixReport | None = None,
) -> int:
    """Correct, in place, the bias of every quantized Conv/Gemm of ``model`` (see the module
    docstring) against ``float_model`` on ``feeds``. Returns the number of layers corrected."""
    layers = matched_layers(float_model, model, _CORRECTED_OPS, _layer, RULE_NAME, report)
    if not layers or not feeds:
        return 0
    try:
        measured = _shifts(float_model, layers, feeds)
    except Exception as error:  # noqa: BLE001 - ORT raises many types; the model stays as quantized
        if report is not None:
            report.note(f"bias correction skipped: ONNX Runtime could not run the measuring model ({error})")
        return 0
    for layer, samples in zip(layers, measured):
        shift = _significant_mean(samples)
        bias = layer.bias.const_value.numpy()
        if layer.bias_scale is None:
            steps = shift
            corrected = (bias.astype(np.float64) - shift.reshape(bias.shape)).astype(np.float32)
        else:
            steps = np.rint(shift / layer.bias_scale).astype(np.int64)
            corrected = np.clip(bias.astype(np.int64) - steps.reshape(bias.shape), *_INT32_RANGE).astype(np.int32)
        layer.bias.const_value = ir.Tensor(corrected, name=layer.bias.name)
        if report is not None:
            worst = float(np.max(np.abs(shift)))
            report.changed(RULE_NAME, _where(layer.node), f"mean output shift up to {worst:.3g} moved into the "
                           f"{'float' if layer.bias_scale is None else 'int32'} bias "
                           f"({int(np.count_nonzero(steps))} of {steps.size} channels)", exact=False)
    return len(layers)

"""Weight rounding by output error (GPTQ-style): choose each int8 weight's rounding direction so the
layer's output on the calibration inputs moves least, not each weight's own error.

Round-to-nearest minimises ``|w - w_q|`` weight by weight; what reaches the next layer is
``(W - W_q) X``, and neighbouring inputs (adjacent pixels, correlated channels) let one weight's
rounding error be compensated by the next weights. Per output row, with ``H = X X^T`` over the
layer's FP32 inputs on the calibration feeds (positions subsampled), the weights are rounded one
input column at a time and each rounding error is spread over the columns not yet rounded
(Frantar et al., "GPTQ", 2022, from Hassibi's Optimal Brain Surgeon):

    q_i = clip(rint(w_i / s) + z);  e = (w_i - (q_i - z) s) / U_ii;  w_j -= e U_ij  (j > i)

with ``U`` the upper Cholesky factor of ``(H + damp I)^-1``. The grid is the quantized model's own:
scales, zero points, axis and integer range stay as quantize_static chose them, so only the int8
values change and the graph (and its speed) is the same.

Only layers of small fan-in (at most ``MAX_COLUMNS`` weights per output channel: the stem
convolution's 3x3x3, depthwise 3x3 and 5x5) are re-rounded by default: with few weights per channel
their per-channel grid is coarsest relative to the signal, and they are cheap (a 9x9 or 27x27 ``H``).
Measured on 16 calibration scenes / 100 held-out photos (cosine after bias correction, no
equalization, 256 positions per feed): MobileNetV2 0.99401 -> 0.99454, EfficientNet-Lite0 0.99312
-> 0.99765; every layer instead: 0.99455 and 0.99748 for 3-4 s more. A centred ``H`` (leaving the
mean error to bias correction) measured worse: 0.99216 and 0.99534. Damping 0.1 instead of 0.01:
PP-LCNet +0.001, PP-OCR cls -0.004. 128 positions per feed (the default) with equalization:
0.99565 and 0.99762, as 256 gave. ``H`` is not centred, so the layer's mean output error is part of
what the rounding minimises; bias correction, which runs after, leaves alone a layer whose weights
moved more than one step (``bias_correction.WEIGHT_STEPS``, with the measurement of the other choice).

Approximate (it changes outputs), with a bound the tests check: per output row the quadratic error
``(w - w_q)^T H (w - w_q)`` on the calibration inputs is never above round-to-nearest's (a row where
the sequential rounding measures worse keeps round-to-nearest), every value stays on the original
grid within the integer range, and no weight moves by more than ``MAX_STEPS`` grid steps from its
round-to-nearest value (so a row fitted to few positions cannot drift far from the FP32 weights).
Layers it does not handle (grouped convolutions other than depthwise, non-2D convolutions, shared or
blocked weights, no FP32 counterpart with the same weights) keep round-to-nearest, with a reason, and
so does a layer seen on fewer than ``MIN_SAMPLES_PER_COLUMN`` input samples (positions x feeds) per
weight of an output channel: its ``H`` is then (nearly) rank-deficient, and the rounding fits those
few inputs rather than the layer (a dense layer calibrated on 4 one-row feeds: cosine 0.983 against
round-to-nearest's 0.996 on held-out inputs, fuzz seed 3603132).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.accuracy.bias_correction import conv_geometry
from kenosis_rewrite.accuracy.layer_matching import float_counterpart, matched_layers, same_weights
from kenosis_rewrite.core import ort_sessions
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params

RULE_NAME = "weight-rounding"
_OPS = ("Conv", "Gemm", "MatMul")
DAMPING = 0.01  # of the mean diagonal of H (GPTQ's default)
MAX_POSITIONS = 128  # positions per feed and layer that enter H (evenly spaced)
MAX_COLUMNS = 32  # default: only layers with at most this many weights per output channel
_BLOCK = 128  # columns per lazy-batch block
MAX_STEPS = 2  # no weight moves further than this from its round-to-nearest grid point
MIN_SAMPLES_PER_COLUMN = 2  # input samples per weight of a row below which H is too thin to round by


@dataclasses.dataclass(frozen=True)
class _Layer:
    node: ir.Node
    source: str  # the FP32 tensor the layer reads
    reference: str  # the FP32 layer's output: names the layer whose inputs :class:`InputMoments` gathered
    weights: np.ndarray  # FP32 weights as (rows, columns): rows are output channels
    rows_per_group: int  # depthwise: output channels per input channel; 0: one H for all rows
    kernel: tuple[int, ...]  # Conv: kernel dims; () for Gemm/MatMul
    pads: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    data: ir.Value  # the integer initializer behind the weight DequantizeLinear
    params: qdq_params.QuantParams
    layout: str  # how (rows, columns) maps back onto the initializer: "conv", "rows", "columns"


def _where(node: ir.Node) -> str:
    return node.name or node.outputs[0].name


def _source(value: ir.Value) -> str:
    producer = value.producer()
    if qdq_params.is_dequantize(producer) and qdq_params.is_quantize(producer.inputs[0].producer()):
        return producer.inputs[0].producer().inputs[0].name
    return value.name


def _layer(node: ir.Node, readers, float_weights) -> _Layer | str:
    """The layer to round, or why not."""
    if len(node.inputs) < 2 or node.inputs[0] is None or node.inputs[1] is None:
        return "no weight input"
    weight_dq = node.inputs[1].producer()
    if not qdq_params.is_dequantize(weight_dq) or qdq_params.const_array(weight_dq.inputs[0]) is None:
        return "weights are not DequantizeLinear of a constant"
    params, data = qdq_params.quant_params(weight_dq), weight_dq.inputs[0]
    if params is None or params.block_size or len(data.uses()) != 1 or data.is_graph_output():
        return "weights are blocked, shared or without constant parameters"
    source = _source(node.inputs[0])
    original = float_counterpart(node, source, readers)
    if original is None or not same_weights(weight_dq, original, float_weights):
        return f"no FP32 {node.op_type} with the same weights reading {source!r}"
    weights = onnx.numpy_helper.to_array(float_weights[original.input[1]]).astype(np.float64)
    per_axis = not params.is_per_tensor
    if node.op_type == "Conv":
        geometry = _conv_input_geometry(original, weights)
        if isinstance(geometry, str):
            return geometry
        if per_axis and params.axis % 4 != 0:
            return "per-channel weights not along the output channels"
        return _Layer(node, source, original.output[0], weights.reshape(weights.shape[0], -1), *geometry, data, params, "conv")
    if weights.ndim != 2 or (node.op_type == "Gemm" and node.attributes.get_int("transA", 0)):
        return "not a 2-D weight read from the right"
    by_rows = node.op_type == "Gemm" and node.attributes.get_int("transB", 0)
    if per_axis and params.axis % 2 != (0 if by_rows else 1):
        return "per-channel weights not along the output units"
    return _Layer(node, source, original.output[0], weights if by_rows else weights.T, 0, (), (), (), (), data, params,
                  "rows" if by_rows else "columns")


def _conv_input_geometry(original: onnx.NodeProto, weights: np.ndarray) -> tuple | str:
    """(rows_per_group, kernel, pads, strides, dilations) of an FP32 Conv, or why weight rounding leaves it."""
    if weights.ndim != 4:
        return "not a 2-D convolution"
    geometry = conv_geometry(original, weights.shape)
    if isinstance(geometry, str):
        return geometry
    group = geometry.group
    if group != 1 and weights.shape[1] != 1:
        return f"grouped convolution (group {group}) that is not depthwise"
    if geometry.auto_pad not in ("NOTSET", "VALID"):
        return f"auto_pad {geometry.auto_pad}"
    return (weights.shape[0] // group if group > 1 else 0, weights.shape[2:], geometry.pads, geometry.strides,
            geometry.dilations)


def _positions(count: int) -> np.ndarray:
    return np.arange(count) if count <= MAX_POSITIONS else np.linspace(0, count - 1, MAX_POSITIONS).astype(np.int64)


def _patch_index(layer: _Layer, shape: tuple[int, ...]) -> np.ndarray:
    """Where a Conv's patches come from in an input sample of ``shape`` (channels, height, width): the
    flat positions in the sample padded by the layer's pads (:func:`_padded`), (kernel elements, positions)."""
    top, left, bottom, right = layer.pads
    _, in_height, in_width = shape
    (kh, kw), (sh, sw), (dh, dw) = layer.kernel, layer.strides, layer.dilations
    height = (in_height + top + bottom - (kh - 1) * dh - 1) // sh + 1
    width = (in_width + left + right - (kw - 1) * dw - 1) // sw + 1
    chosen = _positions(height * width)
    # (kh * kw, positions) coordinates in the padded map: every one inside it
    rows = (chosen // width * sh)[None, :] + (np.arange(kh) * dh).repeat(kw)[:, None]
    columns = (chosen % width * sw)[None, :] + np.tile(np.arange(kw) * dw, kh)[:, None]
    return rows * (in_width + left + right) + columns


def _padded(layer: _Layer, x: np.ndarray) -> np.ndarray:
    """One sample (channels, height, width) with the layer's zero padding, as (channels, pixels)."""
    top, left, bottom, right = layer.pads
    if top or left or bottom or right:
        # np.pad's own bookkeeping costs more than the copy on these small maps (PP-OCR cls: 12 ms a build)
        channels, height, width = x.shape
        padded = np.zeros((channels, top + height + bottom, left + width + right), x.dtype)
        padded[:, top:top + height, left:left + width] = x
        x = padded
    return x.reshape(x.shape[0], -1)


def _patches(layer: _Layer, x: np.ndarray, index: np.ndarray | None = None) -> np.ndarray:
    """Input columns of one sample: (channels, kernel elements, positions) for a Conv, (features, rows)
    else. ``index``: :func:`_patch_index` for ``x``'s shape, when the caller has it already."""
    if not layer.kernel:
        flat = x.reshape(-1, x.shape[-1]).T
        return flat[:, _positions(flat.shape[1])]
    positions = index if index is not None else _patch_index(layer, x.shape)
    return np.take(_padded(layer, x), positions, axis=1)  # (C, kh * kw, positions)


class _Moments:
    """Running mean of x x^T per layer: one H (dense layers) or one per input channel (depthwise)."""

    def __init__(self) -> None:
        self.outer: np.ndarray | None = None
        self.count = 0
        # a Conv's patch positions by input shape, and transposed: the same for every feed of one size
        self._index: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def add(self, layer: _Layer, x: np.ndarray) -> None:
        if layer.kernel:
            index = self._index.get(x.shape)
            if index is None:
                positions = _patch_index(layer, x.shape)
                index = self._index[x.shape] = (positions, np.ascontiguousarray(positions.T))
        if layer.kernel and layer.rows_per_group:
            # (C, positions, k) gathered as such: the batched product reads it and its transposed
            # view, one gather and no transposed copy (the same sums)
            columns = np.take(_padded(layer, x), index[1], axis=1)
            outer = np.matmul(np.swapaxes(columns, -1, -2), columns)
            count = columns.shape[1]
        else:
            patches = _patches(layer, x, index[0] if layer.kernel else None)
            if layer.kernel:
                patches = patches.reshape(-1, patches.shape[-1])  # (C * k, positions), the weights' column order
            outer = patches @ patches.T
            count = patches.shape[-1]
        if self.outer is None:
            self.outer = outer.astype(np.float64)
        else:
            self.outer += outer  # in float64, as the sum of the float64 copies
        self.count += count

    def hessian(self) -> np.ndarray:
        return self.outer / max(self.count, 1)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """How an FP32 layer reads its input: what its ``H`` is made from (the fields :func:`_patches` reads)."""

    source: str
    rows_per_group: int
    kernel: tuple[int, ...]
    pads: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]


def _inputs_of(layer: _Layer) -> _Inputs:
    return _Inputs(layer.source, layer.rows_per_group, layer.kernel, layer.pads, layer.strides, layer.dilations)


def _moment_sample(inputs: _Inputs | _Layer, batch: np.ndarray, moment: _Moments) -> None:
    """Add one run's input tensor of the layer to its moments (a Conv's batch one sample at a time)."""
    for sample in (batch if inputs.kernel else [batch]):
        moment.add(inputs, np.asarray(sample, dtype=np.float32))


def _columns(node: onnx.NodeProto, dims: tuple[int, ...]) -> int:
    """Weights per output channel of an FP32 layer with 4-D (Conv) or 2-D weights of shape ``dims``
    (as :func:`_layer` lays them out)."""
    if node.op_type == "Conv":
        return int(np.prod(dims[1:]))
    trans_b = node.op_type == "Gemm" and next((a.i for a in node.attribute if a.name == "transB"), 0)
    return dims[-1] if trans_b else dims[0]


class InputMoments:
    """The ``H`` of every FP32 layer of ``float_model`` weight rounding may re-round (at most
    ``max_columns`` weights per output channel), gathered from runs made for something else:
    :meth:`observe` takes each run's tensors (quantize() passes it to the calibration run, which
    computes them all). :func:`round_weights` then runs the model only for layers not seen here."""

    def __init__(self, float_model: onnx.ModelProto, max_columns: int | None = MAX_COLUMNS):
        weights = {init.name: init for init in float_model.graph.initializer}
        self._inputs: dict[str, _Inputs] = {}
        for node in float_model.graph.node:
            if (node.op_type not in _OPS or node.domain not in qdq_params.DEFAULT_DOMAINS or len(node.input) < 2
                    or not node.input[0] or node.input[1] not in weights):
                continue
            dims = tuple(weights[node.input[1]].dims)
            if len(dims) != (4 if node.op_type == "Conv" else 2):
                continue  # _layer leaves them
            if max_columns is not None and _columns(node, dims) > max_columns:
                continue
            if node.op_type == "Conv":
                geometry = _conv_input_geometry(node, onnx.numpy_helper.to_array(weights[node.input[1]]))
                if isinstance(geometry, str):
                    continue
                self._inputs[node.output[0]] = _Inputs(node.input[0], *geometry)
            else:
                self._inputs[node.output[0]] = _Inputs(node.input[0], 0, (), (), (), ())
        self._moments = {reference: _Moments() for reference in self._inputs}

    def sources(self) -> set[str]:
        """The tensors :meth:`observe` reads (the layers' inputs)."""
        return {inputs.source for inputs in self._inputs.values()}

    def observe(self, values: Mapping[str, np.ndarray]) -> None:
        """Add one run's tensors (by name; those it has of the layers' inputs)."""
        for task in self.tasks(values):
            task()

    def tasks(self, values: Mapping[str, np.ndarray]) -> list[Callable[[], None]]:
        """What :meth:`observe` does, as one independent callable per layer (a calibration
        ``observe`` that returns them has them run on several cores)."""
        return [functools.partial(_moment_sample, inputs, values[inputs.source], self._moments[reference])
                for reference, inputs in self._inputs.items() if inputs.source in values]

    def of(self, layer: _Layer) -> _Moments | None:
        """The moments gathered for ``layer``'s FP32 counterpart, read the way ``layer`` reads it; None if none."""
        moment = self._moments.get(layer.reference)
        if moment is None or not moment.count or self._inputs[layer.reference] != _inputs_of(layer):
            return None
        return moment

    def inverse_factors(self) -> dict[str, np.ndarray | None]:
        """:func:`inverse_factor` of every gathered layer's ``H``, by FP32 layer output. It needs only
        the moments: quantize() computes it on an idle core while quantize_static runs (LAPACK
        releases the GIL), and :func:`round_weights` uses it for the layers :meth:`of` answers."""
        return {reference: inverse_factor(moment.hessian()) for reference, moment in self.gathered()}

    def gathered(self) -> list[tuple[str, _Moments]]:
        """``(FP32 layer output, moments)`` of every layer seen on at least one sample, in graph order."""
        return [(reference, moment) for reference, moment in self._moments.items() if moment.count]


class FactorsInBackground:
    """:meth:`InputMoments.inverse_factors`, computed on a worker thread one layer at a time, in
    the order the layers were gathered (graph order, the order :func:`round_weights` takes them):
    :meth:`get` waits only for the layer asked for, so rounding starts with the first layer's
    factor instead of all of them. What the worker raises, :meth:`get` raises."""

    def __init__(self, moments: InputMoments):
        hessians = moments.gathered()
        self._factors: dict[str, np.ndarray | None] = {}
        self._ready = {reference: threading.Event() for reference, _ in hessians}
        self._error: BaseException | None = None
        threading.Thread(target=self._work, args=(hessians,), name="weight-rounding-factors", daemon=True).start()

    def _work(self, hessians: list[tuple[str, _Moments]]) -> None:
        try:
            for reference, moment in hessians:
                self._factors[reference] = inverse_factor(moment.hessian())
                self._ready[reference].set()
        except BaseException as error:  # noqa: BLE001 - handed to the reader
            self._error = error
            for event in self._ready.values():
                event.set()

    def get(self, reference: str, default=None):
        ready = self._ready.get(reference)
        if ready is None:
            return default
        ready.wait()
        if self._error is not None:
            raise self._error
        return self._factors.get(reference, default)


def _measure(float_model: onnx.ModelProto, layers: Sequence[_Layer], feeds) -> list[_Moments]:
    model = onnx.ModelProto()
    model.CopyFrom(float_model)
    sources = list(dict.fromkeys(layer.source for layer in layers))
    del model.graph.output[:]
    model.graph.output.extend(onnx.ValueInfoProto(name=name) for name in sources)
    session = ort_sessions.session(model, ort_sessions.options(None, level="basic", spinning=False))
    moments = [_Moments() for _ in layers]
    for feed in feeds:
        values = dict(zip(sources, session.run(sources, dict(feed))))
        for layer, moment in zip(layers, moments):
            _moment_sample(layer, values[layer.source], moment)
    return moments


def _moments(float_model: onnx.ModelProto, layers: Sequence[_Layer], feeds, gathered: InputMoments | None) -> list[_Moments]:
    """Per layer, its input moments: ``gathered``'s where it has them, measured on ``feeds`` otherwise."""
    known = [gathered.of(layer) if gathered is not None else None for layer in layers]
    missing = [layer for layer, moment in zip(layers, known) if moment is None]
    measured = iter(_measure(float_model, missing, feeds) if missing else [])
    return [moment if moment is not None else next(measured) for moment in known]


def _grid(layer: _Layer) -> tuple[np.ndarray, np.ndarray]:
    """Per row (scale, zero point) as (rows, 1) float64 arrays."""
    rows = layer.weights.shape[0]
    scale = np.broadcast_to(layer.params.scale.astype(np.float64).reshape(-1), (rows,)).reshape(rows, 1)
    zero = np.broadcast_to(layer.params.zero_point.astype(np.float64).reshape(-1), (rows,)).reshape(rows, 1)
    return scale, zero


def inverse_factor(hessian: np.ndarray, damping: float = DAMPING) -> np.ndarray | None:
    """``U``, the upper Cholesky factor of ``(H + damp I)^-1`` (of each matrix of a stack), or None
    where it does not exist (then :func:`sequential_round` rounds to nearest). Each matrix's factor
    is computed on its own: a stack's is its matrices' stacked."""
    diagonal = np.diagonal(hessian, axis1=-2, axis2=-1)
    damped = hessian + (damping * diagonal.mean(axis=-1)[..., None, None] + 1e-12) * np.eye(hessian.shape[-1])
    try:
        return np.swapaxes(np.linalg.cholesky(np.linalg.inv(damped)), -1, -2)
    except np.linalg.LinAlgError:
        return None


_UNFACTORED = object()  # sequential_round computes U itself


def sequential_round(weights: np.ndarray, hessian: np.ndarray, scale: np.ndarray, zero: np.ndarray,
                     qmin: int, qmax: int, damping: float = DAMPING, upper=_UNFACTORED) -> np.ndarray:
    """Integer weights (rows, columns) rounded column by column with error compensation (see the
    module docstring). ``hessian``: (columns, columns) shared by all rows, or (rows, columns, columns).
    Falls back to round-to-nearest per row where that measures better, and never leaves
    ``MAX_STEPS`` of round-to-nearest. ``upper``: :func:`inverse_factor` of ``hessian`` with
    ``damping``, if already computed."""
    nearest = np.clip(np.rint(weights / scale) + zero, qmin, qmax)
    h = np.broadcast_to(hessian, (weights.shape[0], *hessian.shape[-2:])) if hessian.ndim == 3 else hessian
    if upper is _UNFACTORED:
        upper = inverse_factor(h, damping)
    if upper is None:
        return nearest
    low, high = np.maximum(nearest - MAX_STEPS, qmin), np.minimum(nearest + MAX_STEPS, qmax)
    work, result = weights.copy(), np.empty_like(nearest)
    columns = weights.shape[1]
    for start in range(0, columns, _BLOCK):  # GPTQ's lazy batch: rank-1 updates inside a block, one product after
        stop = min(start + _BLOCK, columns)
        block = upper[..., start:stop, start:stop]
        errors = np.empty((weights.shape[0], stop - start))
        for i in range(stop - start):
            column = start + i
            q = np.clip(np.rint(work[:, column] / scale[:, 0]) + zero[:, 0], low[:, column], high[:, column])
            result[:, column] = q
            pivot = block[..., i, i]
            errors[:, i] = (work[:, column] - (q - zero[:, 0]) * scale[:, 0]) / pivot
            work[:, column + 1 : stop] -= errors[:, i : i + 1] * block[..., i, i + 1 :]
        if stop < columns:
            tail = upper[..., start:stop, stop:]
            work[:, stop:] -= (np.einsum("ri,rij->rj", errors, tail) if tail.ndim == 3 else errors @ tail)
    worse = _quadratic(weights - (result - zero) * scale, h) >= _quadratic(weights - (nearest - zero) * scale, h)
    result[worse] = nearest[worse]
    return result


def _quadratic(difference: np.ndarray, hessian: np.ndarray) -> np.ndarray:
    """Per row ``d^T H d``."""
    if hessian.ndim == 3:
        return np.einsum("ri,ri->r", np.matmul(hessian, difference[:, :, None])[:, :, 0], difference)
    return np.einsum("ri,ri->r", difference @ hessian, difference)


def _store(layer: _Layer, integers: np.ndarray) -> None:
    shape = layer.data.const_value.shape
    if layer.layout == "columns":
        integers = integers.T
    values = integers.reshape(tuple(shape)).astype(layer.params.dtype.numpy())
    layer.data.const_value = qdq_params.integer_tensor(values, layer.params.dtype, layer.data.name)


def round_weights(
    float_model: onnx.ModelProto,
    model: ir.Model,
    feeds: Sequence[Mapping[str, np.ndarray]],
    report: FixReport | None = None,
    max_columns: int | None = MAX_COLUMNS,
    gathered: InputMoments | None = None,
    factors: Mapping[str, np.ndarray | None] | FactorsInBackground | None = None,
) -> int:
    """Re-round, in place, the integer weights of the Conv/Gemm/MatMul layers of ``model`` it can match
    with ``float_model`` (see the module docstring) and whose weights per output channel are at most
    ``max_columns`` (None: every layer). ``gathered``: inputs already seen on ``feeds`` (the layers
    it has are not run again); ``factors``: its :meth:`InputMoments.inverse_factors`, if computed
    (or being computed: :class:`FactorsInBackground`).
    Returns the number of layers re-rounded."""
    layers = [layer for layer in matched_layers(float_model, model, _OPS, _layer, RULE_NAME, report)
              # round-to-nearest is as good on wide layers (measured), and H would cost columns**2
              if max_columns is None or layer.weights.shape[1] <= max_columns]
    if not layers or not feeds:
        return 0
    try:
        moments = _moments(float_model, layers, feeds, gathered)
    except Exception as error:  # noqa: BLE001 - ORT raises many types; the model stays as quantized
        if report is not None:
            report.note(f"weight rounding skipped: ONNX Runtime could not run the FP32 model ({error})")
        return 0
    rounded = 0
    for layer, moment in zip(layers, moments):
        columns = layer.weights.shape[1]
        if moment.count < MIN_SAMPLES_PER_COLUMN * columns:
            if report is not None:
                report.refused(RULE_NAME, _where(layer.node), f"{moment.count} input samples for {columns} weights per "
                               f"output channel (fewer than {MIN_SAMPLES_PER_COLUMN} per weight): the rounding would "
                               "fit these calibration inputs, not the layer")
            continue
        hessian = moment.hessian()
        # the factor computed beforehand belongs to the gathered moments, not to ones measured here
        prefactored = factors is not None and gathered is not None and moment is gathered.of(layer)
        upper = factors.get(layer.reference, _UNFACTORED) if prefactored else _UNFACTORED
        if layer.rows_per_group:
            hessian = np.repeat(hessian, layer.rows_per_group, axis=0)
            if isinstance(upper, np.ndarray):
                upper = np.repeat(upper, layer.rows_per_group, axis=0)  # each channel's matrix, factored alone
        scale, zero = _grid(layer)
        integers = sequential_round(layer.weights, hessian, scale, zero, layer.params.qmin, layer.params.qmax,
                                    upper=upper)
        before = np.clip(np.rint(layer.weights / scale) + zero, layer.params.qmin, layer.params.qmax)
        _store(layer, integers)
        if report is not None:
            report.changed(RULE_NAME, _where(layer.node), f"{int(np.count_nonzero(integers != before))} of "
                           f"{integers.size} weights rounded the other way to cut the output error", exact=False)
        rounded += 1
    return rounded

"""Self-calibration: valid synthetic inputs for any model, inferred from the graph alone.

What is inferred, per graph input (see :func:`infer_inputs`; ``InputSpec.reason`` says which rule fired):

* **Dynamic dims.** The same symbolic name gets the same value in every input. Batch (dim 0) -> 1;
  image H/W -> 224 (or the other spatial dim when one is fixed); image channels -> the first Conv's
  input channels; sequence dims -> 128; any other unknown dim -> 1.
* **Images** (rank-4 float inputs with 1, 3 or 4 channels, read from the shape or the first Conv):
  layout is NHWC when a Transpose(perm=[0,3,1,2]) sits between the input and the first Conv, or
  when only the last dim looks like channels; NCHW otherwise. Pixel content is natural-image-like
  (1/f noise plus a few flat shapes with edges, random contrast), in [0, 1] before normalisation.
  The value range the model expects comes from, in this order:
  1. an in-graph normalisation: Sub/Add/Mul/Div by constants between the input and the first Conv.
     The input is then raw pixels; the pixel scale (1 or 255) is the one whose normalised values
     span closest to 3 (the span of [-1, 1] or ImageNet-normalised images);
  2. otherwise the first Conv: each candidate preprocessing (``CANDIDATE_PREPROCESSING``) is run
     through it. With a following BatchNormalization, the candidate whose per-channel output mean and
     std best match BN's running statistics wins. With a folded BN (a Conv bias), the candidate
     whose per-channel output std is closest to the bias magnitude and whose mean is best cancelled
     by the bias wins (after BN folding, ``bias = beta - gamma*mu/sigma``, so with the right input the
     output is roughly ``gamma * standardised + beta``);
  3. otherwise ImageNet mean/std normalisation of [0, 1] pixels.
* **Token ids** (integer inputs that reach a Gather on a constant table, through Cast/Reshape/
  Unsqueeze/...): uniform in [1, table rows), padded with 0 after the sample's length.
* **Attention masks** (name contains "mask"): ones up to a per-sample length, zeros after (a quarter
  of samples unpadded, the rest of length uniform in [seq/4, seq]); the length is shared by every
  sequence input of that sample.
* **Token-type ids** (name contains "token_type" or "segment"): 0 then 1 from a random split point
  (capped by the type table's rows), 0 in the padding.
* **Position ids** (name contains "position"): 0..seq-1.
* **Other integers**: uniform in [0, rows) when they reach a Gather, else ones.
* **Float metadata** (rank <= 2, at most 16 elements per sample): names with "shape"/"size" get the
  image's (H, W) (and 1.0 for extra entries), names with "scale"/"factor"/"ratio" get 1.0, others
  uniform in [0.5, 2].
* **Other floats**: N(0, 1). Bool inputs: masks as above, or all True.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import numpy_helper

from kenosis_rewrite.core import model_io
from kenosis_rewrite.core import ort_sessions
from kenosis_rewrite.calibration.collect import CalibrationError, _float_proto, _graph_inputs
from kenosis_rewrite.errors import one_line

__all__ = ["InputSpec", "infer_inputs", "synthetic_feeds", "iter_synthetic_feeds", "natural_image",
           "CANDIDATE_PREPROCESSING", "describe", "runnable_synthetic_feeds"]

IMAGE_SIZE = 224
SEQUENCE_LENGTH = 128
_TRANSPARENT = frozenset({"Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand",
                          "Transpose", "Pad", "Slice"})
_AFFINE = frozenset({"Sub", "Add", "Mul", "Div"})
_IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
# name -> (pixel scale, mean, std): model input = (pixels01 * scale - mean) / std, per RGB channel.
CANDIDATE_PREPROCESSING: dict[str, tuple[float, tuple[float, ...], tuple[float, ...]]] = {
    "imagenet": (1.0, *_IMAGENET),
    "unit": (1.0, (0.0,) * 3, (1.0,) * 3),
    "symmetric": (1.0, (0.5,) * 3, (0.5,) * 3),
    "pixels": (255.0, (0.0,) * 3, (1.0,) * 3),
    "caffe": (255.0, (123.7, 116.3, 103.5), (1.0,) * 3),
    "symmetric_255": (255.0, (127.5,) * 3, (127.5,) * 3),
}
_NP = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
       onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32,
       onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.INT8: np.int8, onnx.TensorProto.BOOL: np.bool_}


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """What :func:`synthetic_feeds` generates for one graph input, and why."""

    name: str
    dtype: type
    shape: tuple[int, ...]
    kind: str  # image | token_ids | attention_mask | token_type_ids | position_ids | integer | metadata | float | bool
    reason: str
    layout: str | None = None  # images: "NCHW" or "NHWC"
    vocab: int | None = None  # ids: exclusive upper bound
    pixel_scale: float = 1.0  # images: pixels in [0, pixel_scale] before (x - mean) / std
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)


class _Graph:
    """Read-only index of a model's top-level graph: consumers, constants."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in model.graph.node:
            for index, name in enumerate(node.input):
                self.consumers.setdefault(name, []).append((node, index))
        self.initializers = {init.name: init for init in model.graph.initializer}
        self.constants = {node.output[0]: node for node in model.graph.node
                          if node.op_type == "Constant" and node.attribute}

    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` if it is an initializer or a Constant node's tensor."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.constants.get(name)
        if node is not None and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def downstream(self, name: str, max_depth: int = 8) -> Iterator[tuple[onnx.NodeProto, int, list]]:
        """(consumer, input index, path of transparent nodes) reachable through ``_TRANSPARENT`` ops."""
        frontier = [(name, [])]
        for _ in range(max_depth):
            next_frontier = []
            for value, path in frontier:
                for node, index in self.consumers.get(value, []):
                    yield node, index, path
                    if node.op_type in _TRANSPARENT and index == 0:
                        next_frontier.append((node.output[0], path + [node]))
            frontier = next_frontier


def _gather_rows(graph: _Graph, name: str) -> int | None:
    """Rows of the constant table a Gather indexes with ``name`` (the vocabulary), if any."""
    for node, index, _ in graph.downstream(name):
        if node.op_type == "Gather" and index == 1:
            table = graph.initializers.get(node.input[0])
            if table is not None:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                return int(table.dims[axis])
    return None


def _first_conv(graph: _Graph, name: str) -> tuple[onnx.NodeProto, list, list] | None:
    """The first Conv fed by ``name``, the transparent path to it, and the affine nodes on the way."""
    frontier = [(name, [], [])]
    for _ in range(12):
        next_frontier = []
        for value, path, affine in frontier:
            for node, index in graph.consumers.get(value, []):
                if node.op_type == "Conv" and index == 0:
                    return node, path, affine
                if node.op_type in _TRANSPARENT and index == 0:
                    next_frontier.append((node.output[0], path + [node], affine))
                elif node.op_type in _AFFINE and graph.constant(node.input[1 - index]) is not None:
                    next_frontier.append((node.output[0], path, affine + [(node, index)]))
        frontier = next_frontier
    return None


def _dims(value: onnx.ValueInfoProto) -> list[int | str | None]:
    dims = []
    for dim in value.type.tensor_type.shape.dim:
        # "?" is a Paddle export's unknown dim, not one name shared by every dim it marks
        dims.append(dim.dim_value if dim.dim_value > 0 else (dim.dim_param if dim.dim_param not in ("", "?") else None))
    return dims


def _resolve(dims: list, defaults: list[int], symbols: dict[str, int]) -> tuple[int, ...]:
    """Concrete shape: fixed dims kept, a symbol's first resolution reused, otherwise ``defaults``."""
    shape = []
    for dim, default in zip(dims, defaults):
        if isinstance(dim, int):
            shape.append(dim)
        elif isinstance(dim, str):
            shape.append(symbols.setdefault(dim, default))
        else:
            shape.append(default)
    return tuple(shape)


def _image_layout(dims: list, path: list) -> tuple[str, str]:
    for node in path:
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        if node.op_type == "Transpose" and perm == [0, 3, 1, 2]:
            return "NHWC", "a Transpose(perm=[0,3,1,2]) feeds the first Conv"
    if dims[1] not in (1, 3, 4) and dims[3] in (1, 3, 4):
        return "NHWC", "the last dim looks like channels"
    return "NCHW", "dim 1 looks like channels (or default)"


def _affine_apply(graph: _Graph, affine: list, x: np.ndarray) -> np.ndarray:
    """Apply the in-graph Sub/Add/Mul/Div-by-constant chain to ``x`` (NCHW or broadcastable)."""
    for node, index in affine:
        c = graph.constant(node.input[1 - index]).astype(np.float64)
        if c.ndim == 1 and c.size == x.shape[1] and x.ndim == 4:
            c = c.reshape(1, -1, 1, 1)
        a, b = (x, c) if index == 0 else (c, x)
        x = {"Sub": np.subtract, "Add": np.add, "Mul": np.multiply, "Div": np.divide}[node.op_type](a, b)
    return x


def _conv_response(graph: _Graph, conv: onnx.NodeProto, x: np.ndarray, failures: list[str]) -> np.ndarray | None:
    """First-Conv output (without bias) for NCHW ``x``, via a one-node ORT model; None when there is
    none (why ORT could not give one is appended to ``failures``)."""

    weight = graph.constant(conv.input[1])
    if weight is None or weight.ndim != 4:
        return None
    attributes = [a for a in conv.attribute if a.name != "auto_pad" or a.s != b"NOTSET"]
    node = onnx.helper.make_node("Conv", ["x", "w"], ["y"])
    node.attribute.extend(attributes)
    graph_proto = onnx.helper.make_graph(
        [node], "conv", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight.astype(np.float32), "w")])
    model = onnx.helper.make_model(graph_proto, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    try:
        session = ort_sessions.session(model, ort_sessions.options(None))
        return session.run(None, {"x": x.astype(np.float32)})[0]
    except Exception as error:  # noqa: BLE001 - a heuristic: no answer, and the reason says why
        failures.append(f"the first Conv alone did not run in ONNX Runtime ({one_line(error, 200)})")
        return None


def _batchnorm_after(graph: _Graph, conv: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray] | None:
    for node, index in graph.consumers.get(conv.output[0], []):
        if node.op_type == "BatchNormalization" and index == 0:
            mean, var = graph.constant(node.input[3]), graph.constant(node.input[4])
            if mean is not None and var is not None:
                return mean.astype(np.float64), np.sqrt(var.astype(np.float64) + 1e-5)
    return None


def _candidate_score(response: np.ndarray, bias: np.ndarray | None, bn) -> float | None:
    """Lower is better: how well the conv response matches the statistics the model was trained on."""
    mean = response.mean(axis=(0, 2, 3))
    std = response.std(axis=(0, 2, 3)) + 1e-12
    if bn is not None:
        bn_mean, bn_std = bn
        if bias is not None:
            mean = mean + bias
        return float(np.median(np.abs(np.log(std / bn_std))) + np.median(np.abs(mean - bn_mean) / bn_std))
    if bias is None or not np.any(bias):
        return None
    magnitude = np.abs(bias) + 1e-12
    return float(np.median(np.abs(np.log(std / magnitude))) + np.median(np.abs(mean + bias) / std))


def _preprocessed(pixels: np.ndarray, scale: float, mean, std, channels: int) -> np.ndarray:
    """NHWC pixels in [0,1] -> NCHW model input with (p*scale - mean)/std per channel."""
    if pixels.shape[-1] < channels:  # e.g. RGBA: repeat the colour planes
        pixels = np.concatenate([pixels] * -(-channels // pixels.shape[-1]), axis=-1)
    mean = np.resize(np.asarray(mean, np.float64), channels)
    std = np.resize(np.asarray(std, np.float64), channels)
    return ((pixels[..., :channels] * scale - mean) / std).transpose(0, 3, 1, 2)


def _infer_normalisation(graph: _Graph, found, channels: int, rng, failures: list[str]) -> tuple[float, tuple, tuple, str]:
    """(pixel scale, mean, std, reason) for an image input; see the module docstring. Probes that
    failed are appended to ``failures``."""
    probe = np.stack([natural_image(64, 64, rng) for _ in range(4)])
    if found is not None and found[2]:
        affine = found[2]
        scores = {}
        for scale in (1.0, 255.0):
            normalised = _affine_apply(graph, affine, _preprocessed(probe, scale, (0.0,), (1.0,), channels))
            # per channel: the offsets of a per-channel normalisation must not count as spread
            per_channel = normalised.max(axis=(0, 2, 3)) - normalised.min(axis=(0, 2, 3)) if normalised.ndim == 4 else \
                np.array([normalised.max() - normalised.min()])
            spread = float(np.median(per_channel))
            scores[scale] = abs(np.log(spread / 3.0 + 1e-12))
        scale = min(scores, key=scores.get)
        ops = "/".join(node.op_type for node, _ in affine)
        return scale, (0.0,), (1.0,), f"in-graph normalisation ({ops}) -> raw pixels in [0, {scale:g}]"
    if found is not None:
        conv = found[0]
        bias = graph.constant(conv.input[2]).astype(np.float64) if len(conv.input) > 2 and conv.input[2] else None
        bn = _batchnorm_after(graph, conv)
        scores = {}
        for name, (scale, mean, std) in CANDIDATE_PREPROCESSING.items():
            response = _conv_response(graph, conv, _preprocessed(probe, scale, mean, std, channels), failures)
            score = None if response is None else _candidate_score(response, bias, bn)
            if score is not None:
                scores[name] = score
        if scores:
            best = min(scores, key=scores.get)
            basis = "BatchNormalization statistics" if bn is not None else "Conv bias (folded BN)"
            return (*CANDIDATE_PREPROCESSING[best], f"first Conv vs {basis}: {best} preprocessing")
    return (*CANDIDATE_PREPROCESSING["imagenet"], "no normalisation found: ImageNet mean/std default")


def _reachable_conv(graph: _Graph, name: str, max_depth: int = 24) -> onnx.NodeProto | None:
    """The first Conv (breadth first) whose data input depends on ``name``, through any ops."""
    frontier, seen = [name], {name}
    for _ in range(max_depth):
        next_frontier = []
        for value in frontier:
            for node, index in graph.consumers.get(value, []):
                if node.op_type == "Conv" and index == 0:
                    return node
                for out in node.output:
                    if out not in seen:
                        seen.add(out)
                        next_frontier.append(out)
        frontier = next_frontier
    return None


def _probe_through_model(graph: _Graph, value, shape: tuple[int, ...], layout: str, conv: onnx.NodeProto,
                         candidates: dict, rng, failures: list[str]) -> dict[str, float]:
    """Score candidate preprocessings by running the model up to the first Conv (whatever lies before
    it: Focus slicing, in-graph normalisation) and comparing its output with the statistics it was
    trained for (the following BatchNormalization, or the Conv bias of a folded one). Empty when no
    candidate could be scored; a failed run is appended to ``failures``."""

    bias = graph.constant(conv.input[2]).astype(np.float64) if len(conv.input) > 2 and conv.input[2] else None
    bn = _batchnorm_after(graph, conv)
    if bn is None and (bias is None or not np.any(bias)):
        return {}
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    del model.graph.output[:]
    model.graph.output.append(onnx.ValueInfoProto(name=conv.output[0]))
    try:
        session = ort_sessions.session(model, ort_sessions.options(None))
    except Exception as error:  # noqa: BLE001 - a heuristic: no answer, and the reason says why
        failures.append(f"the model up to the first Conv did not load in ONNX Runtime ({one_line(error, 200)})")
        return {}
    height, width = (shape[2], shape[3]) if layout == "NCHW" else (shape[1], shape[2])
    channels = shape[1] if layout == "NCHW" else shape[3]
    batch = shape[0] if isinstance(shape[0], int) and shape[0] > 0 else 1
    probe = np.stack([natural_image(height, width, rng) for _ in range(batch)])
    others = {}
    for graph_input in _graph_inputs(graph.model):
        if graph_input.name != value.name:
            dims = [d if isinstance(d, int) else 1 for d in _dims(graph_input)]
            others[graph_input.name] = np.ones(dims, _NP.get(graph_input.type.tensor_type.elem_type, np.float32))
    scores = {}
    for name, (scale, mean, std) in candidates.items():
        x = _preprocessed(probe, scale, mean, std, channels)
        x = x if layout == "NCHW" else x.transpose(0, 2, 3, 1)
        try:
            response = session.run(None, {value.name: x.astype(np.float32), **others})[0].astype(np.float64)
        except Exception as error:  # noqa: BLE001
            failures.append(f"the model up to the first Conv did not run ({one_line(error, 200)})")
            return {}
        if response.ndim != 4:
            return {}
        without_bias = response - (bias.reshape(1, -1, 1, 1) if bias is not None else 0.0)
        score = _candidate_score(without_bias, bias, bn)
        if score is not None:
            scores[name] = score
    return scores


def _image_spec(graph: _Graph, value, dims, symbols, rng) -> InputSpec | None:
    found = _first_conv(graph, value.name)
    if found is None and dims[1] not in (1, 3, 4) and dims[3] not in (1, 3, 4):
        return None
    layout, why = _image_layout(dims, found[1] if found else [])
    channel_axis = 1 if layout == "NCHW" else 3
    spatial = (2, 3) if layout == "NCHW" else (1, 2)
    channels = dims[channel_axis] if isinstance(dims[channel_axis], int) else None
    if channels is None and found is not None:
        weight = graph.constant(found[0].input[1])
        group = next((a.i for a in found[0].attribute if a.name == "group"), 1)
        channels = int(weight.shape[1] * group) if weight is not None else 3
    if channels not in (1, 3, 4):
        return None  # a feature map, not an image
    fixed = [dims[a] for a in spatial if isinstance(dims[a], int)]
    size = fixed[0] if fixed else IMAGE_SIZE
    defaults = [1, 1, 1, 1]
    defaults[channel_axis] = channels
    for axis in spatial:
        defaults[axis] = size
    shape = _resolve(dims, defaults, symbols)
    failures: list[str] = []
    scale, mean, std, how = _infer_normalisation(graph, found, channels, rng, failures)
    direct_conv_scored = found is not None and not found[2] and "first Conv vs" in how
    if not direct_conv_scored:
        conv = _reachable_conv(graph, value.name)
        in_graph = found is not None and found[2]
        candidates = ({k: CANDIDATE_PREPROCESSING[k] for k in ("unit", "pixels")} if in_graph
                      else CANDIDATE_PREPROCESSING)
        scores = (_probe_through_model(graph, value, shape, layout, conv, candidates, rng, failures)
                  if conv is not None else {})
        if scores:
            best = min(scores, key=scores.get)
            scale, mean, std = CANDIDATE_PREPROCESSING[best]
            probe = f"model run to the first Conv ({conv.name or conv.output[0]}) vs its statistics"
            how = (f"in-graph normalisation, {probe}: raw pixels in [0, {scale:g}]" if in_graph
                   else f"{probe}: {best} preprocessing")
    if failures and not direct_conv_scored and not scores:
        how += "; probes failed: " + "; ".join(dict.fromkeys(failures))
    return InputSpec(value.name, _NP.get(value.type.tensor_type.elem_type, np.float32), shape, "image",
                     f"{layout} ({why}); {how}", layout, None, scale, tuple(mean), tuple(std))


def _integer_kind(name: str, rows: int | None) -> tuple[str, str]:
    lowered = name.lower()
    if "mask" in lowered:
        return "attention_mask", "name contains 'mask'"
    if "token_type" in lowered or "segment" in lowered:
        return "token_type_ids", "name contains 'token_type'/'segment'"
    if "position" in lowered:
        return "position_ids", "name contains 'position'"
    if rows is not None:
        return "token_ids", f"indexes a Gather table of {rows} rows"
    return "integer", "no Gather table found: ones"


def infer_inputs(model: model_io.ModelLike, seed: int = 0) -> list[InputSpec]:
    """What :func:`synthetic_feeds` will generate for each graph input (see the module docstring)."""
    proto = model if isinstance(model, onnx.ModelProto) else _float_proto(model)
    graph = _Graph(proto)
    rng = np.random.default_rng(seed)
    symbols: dict[str, int] = {}
    inputs = _graph_inputs(proto)
    specs: list[InputSpec] = []
    # images first, so metadata inputs can refer to their size
    ordered = sorted(inputs, key=lambda v: len(_dims(v)) != 4)
    for value in ordered:
        specs.append(_spec(graph, value, symbols, rng, specs))
    order = {v.name: i for i, v in enumerate(inputs)}
    return sorted(specs, key=lambda s: order[s.name])


def _spec(graph: _Graph, value: onnx.ValueInfoProto, symbols: dict, rng, done: list[InputSpec]) -> InputSpec:
    elem = value.type.tensor_type.elem_type
    dtype = _NP.get(elem)
    if dtype is None:
        raise CalibrationError(f"input {value.name!r} has an unsupported element type {elem}")
    dims = _dims(value)
    lowered = value.name.lower()
    if np.issubdtype(dtype, np.floating) and len(dims) == 4 and "mask" not in lowered:
        spec = _image_spec(graph, value, dims, symbols, rng)
        if spec is not None:
            return spec
    if np.issubdtype(dtype, np.integer) or dtype is np.bool_ or "mask" in lowered:
        rows = _gather_rows(graph, value.name)
        kind, why = _integer_kind(value.name, rows)
        if dtype is np.bool_:
            kind, why = ("attention_mask", why) if kind == "attention_mask" else ("bool", "bool: all True")
        defaults = [1] + [SEQUENCE_LENGTH] * (len(dims) - 1)
        if len(dims) == 4:  # [batch, 1, 1, seq] style masks
            defaults = [1, 1, 1, SEQUENCE_LENGTH]
        return InputSpec(value.name, dtype, _resolve(dims, defaults, symbols), kind, why, vocab=rows)
    shape = _resolve(dims, [1] * len(dims), symbols)
    if len(dims) <= 2 and int(np.prod(shape[1:] or (1,))) <= 16:
        return InputSpec(value.name, dtype, shape, "metadata", "small float input: positive metadata")
    return InputSpec(value.name, dtype, shape, "float", "float tensor: N(0, 1)")


def natural_image(height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """An HxWx3 float image in [0, 1] with natural-image statistics: 1/f noise plus flat shapes."""
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    falloff = 1.0 / np.maximum(np.sqrt(fy**2 + fx**2), 1.0 / max(height, width))
    channels = []
    luminance = None
    for c in range(3):
        spectrum = (rng.standard_normal((height, fx.shape[1])) + 1j * rng.standard_normal((height, fx.shape[1])))
        field = np.fft.irfft2(spectrum * falloff, s=(height, width))
        field /= field.std() + 1e-12
        luminance = field if luminance is None else luminance
        channels.append(field if c == 0 else 0.8 * luminance + 0.6 * field)
    image = np.stack(channels, axis=-1)
    yy, xx = np.mgrid[0:height, 0:width]
    for _ in range(rng.integers(2, 6)):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        ry, rx = rng.uniform(0.05, 0.4) * height, rng.uniform(0.05, 0.4) * width
        inside = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1 if rng.random() < 0.5 else (
            (np.abs(yy - cy) < ry) & (np.abs(xx - cx) < rx))
        image[inside] = 0.3 * image[inside] + rng.normal(0, 1.5, 3)
    low, high = np.percentile(image, [1, 99])
    image = (image - low) / max(high - low, 1e-6)
    target_low, target_high = rng.uniform(0.0, 0.2), rng.uniform(0.75, 1.0)
    return np.clip(image * (target_high - target_low) + target_low, 0.0, 1.0)


def _sequence_lengths(specs: list[InputSpec], rng) -> int | None:
    sequence = [s.shape[-1] for s in specs if s.kind in ("token_ids", "attention_mask", "token_type_ids")]
    if not sequence:
        return None
    length = max(sequence)
    if rng.random() < 0.25:
        return length
    return int(rng.integers(max(1, length // 4), length + 1))


def _sample(spec: InputSpec, rng, length: int | None, image_hw: tuple[int, int]) -> np.ndarray:
    """One feed value for ``spec``."""
    shape = spec.shape
    if spec.kind == "image":
        layout_hw = (shape[2], shape[3]) if spec.layout == "NCHW" else (shape[1], shape[2])
        channels = shape[1] if spec.layout == "NCHW" else shape[3]
        batch = np.stack([natural_image(*layout_hw, rng) for _ in range(shape[0])])
        if channels == 1:
            batch = batch.mean(axis=-1, keepdims=True).repeat(3, axis=-1)
        x = _preprocessed(batch, spec.pixel_scale, spec.mean, spec.std, min(channels, 3))
        if channels > 3:
            x = np.concatenate([x, np.ones((x.shape[0], channels - 3) + x.shape[2:])], axis=1)
        if spec.layout == "NHWC":
            x = x.transpose(0, 2, 3, 1)
        return x.astype(spec.dtype)
    seq = shape[-1] if shape else 1
    valid = np.arange(seq) < (length if length is not None else seq)
    if spec.kind == "attention_mask":
        return np.broadcast_to(valid, shape).astype(spec.dtype)
    if spec.kind == "token_ids":
        ids = rng.integers(1 if spec.vocab > 1 else 0, spec.vocab, size=shape)
        return np.where(valid, ids, 0).astype(spec.dtype)
    if spec.kind == "token_type_ids":
        split = int(rng.integers(1, max(2, int(valid.sum()))))
        types = ((np.arange(seq) >= split) & valid).astype(np.int64)
        if spec.vocab is not None:
            types = np.minimum(types, spec.vocab - 1)
        return np.broadcast_to(types, shape).astype(spec.dtype)
    if spec.kind == "position_ids":
        return np.broadcast_to(np.arange(seq), shape).astype(spec.dtype)
    if spec.kind == "integer":
        return np.ones(shape, spec.dtype)
    if spec.kind == "bool":
        return np.ones(shape, np.bool_)
    if spec.kind == "metadata":
        return _metadata(spec, rng, image_hw)
    return rng.standard_normal(shape).astype(spec.dtype)


def _metadata(spec: InputSpec, rng, image_hw: tuple[int, int]) -> np.ndarray:
    lowered = spec.name.lower()
    if "shape" in lowered or "size" in lowered:
        values = np.ones(spec.shape, np.float64)
        flat = values.reshape(spec.shape[0] if spec.shape else 1, -1)
        flat[:, : min(2, flat.shape[1])] = image_hw[: min(2, flat.shape[1])]
        return flat.reshape(spec.shape).astype(spec.dtype)
    if "scale" in lowered or "factor" in lowered or "ratio" in lowered:
        return np.ones(spec.shape, spec.dtype)
    return rng.uniform(0.5, 2.0, spec.shape).astype(spec.dtype)


def iter_synthetic_feeds(model: model_io.ModelLike, n: int, seed: int = 0,
                         specs: list[InputSpec] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Lazily generate ``n`` synthetic feed dicts (one sample in memory at a time)."""
    specs = specs if specs is not None else infer_inputs(model, seed)
    rng = np.random.default_rng(seed + 1)
    images = [s for s in specs if s.kind == "image"]
    image_hw = (IMAGE_SIZE, IMAGE_SIZE)
    if images:
        shape = images[0].shape
        image_hw = (shape[2], shape[3]) if images[0].layout == "NCHW" else (shape[1], shape[2])
    for _ in range(n):
        length = _sequence_lengths(specs, rng)
        yield {spec.name: _sample(spec, rng, length, image_hw) for spec in specs}


def synthetic_feeds(model: model_io.ModelLike, n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` valid synthetic feed dicts for ``model``, inferred from the graph (module docstring)."""
    return list(iter_synthetic_feeds(model, n, seed))


# image sizes tried, in order, where a model does not run at IMAGE_SIZE x IMAGE_SIZE: squares first,
# then each dynamic side widened while the other keeps a size that runs (a text-line recognizer whose
# height must pool down to 1: PP-OCRv2 rec runs at heights 32-63, and calibrates at 48 x 320)
OTHER_IMAGE_SIDES = (320, 256, 640, 160, 96, 64, 48, 32)
_WIDER_SIDES = (320, 224)


def runnable_synthetic_feeds(model: onnx.ModelProto, n: int, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], str]:
    """:func:`synthetic_feeds`, at image sizes the model runs at: ``(feeds, how the size was chosen)``.

    An image input whose height and width are dynamic gets ``IMAGE_SIZE`` on both; where the model
    does not run on such a feed (ONNX Runtime, basic optimizations), the sizes of
    ``OTHER_IMAGE_SIDES`` are tried, then each side of the first that runs is widened. Other inputs,
    and images of fixed size, are as :func:`synthetic_feeds` makes them; a model that runs at none of
    the sizes gets the default ones (calibration then says it does not run)."""
    specs = infer_inputs(model, seed)
    image = next((spec for spec in specs if spec.kind == "image"), None)
    value = next((v for v in _graph_inputs(model) if image is not None and v.name == image.name), None)
    if value is None:
        return list(iter_synthetic_feeds(model, n, seed, specs)), ""
    dims = _dims(value)
    spatial = (2, 3) if image.layout == "NCHW" else (1, 2)
    dynamic = [axis for axis in spatial if not isinstance(dims[axis], int)]
    if not dynamic:
        return list(iter_synthetic_feeds(model, n, seed, specs)), ""
    try:
        session = ort_sessions.session(model, ort_sessions.options(1, level="basic", log_severity=4))  # refusals are expected
    except Exception:  # noqa: BLE001 - a model ONNX Runtime cannot load: calibration says why
        return list(iter_synthetic_feeds(model, n, seed, specs)), ""

    def feeds_at(hw: tuple[int, int], count: int) -> list[dict[str, np.ndarray]]:
        shape = list(image.shape)
        shape[spatial[0]], shape[spatial[1]] = hw
        resized = [dataclasses.replace(spec, shape=tuple(shape)) if spec is image else spec for spec in specs]
        return list(iter_synthetic_feeds(model, count, seed, resized))

    def runs(hw: tuple[int, int]) -> bool:
        try:
            session.run(None, feeds_at(hw, 1)[0])
        except Exception:  # noqa: BLE001 - any refusal: another size
            return False
        return True

    shape = image.shape
    chosen = (shape[spatial[0]], shape[spatial[1]])
    if runs(chosen):
        return feeds_at(chosen, n), ""
    tried = [chosen]
    found = None
    for side in OTHER_IMAGE_SIDES:
        hw = tuple(side if axis in dynamic else chosen[i] for i, axis in enumerate(spatial))
        if hw in tried:
            continue
        tried.append(hw)
        if runs(hw):
            found = hw
            break
    if found is None:
        return feeds_at(chosen, n), ""
    for i, axis in enumerate(spatial):
        if axis not in dynamic:
            continue
        for side in _WIDER_SIDES:
            wider = tuple(side if j == i else found[j] for j in range(2))
            if side > found[i] and runs(wider):
                found = wider
                break
    return feeds_at(found, n), (f"made-up image size {found[0]} x {found[1]} (the model does not run at "
                                f"{chosen[0]} x {chosen[1]})")


def describe(specs: list[InputSpec]) -> str:
    """One line per input: what is generated and why."""
    lines = []
    for s in specs:
        extra = ""
        if s.kind == "image":
            extra = f" pixels*{s.pixel_scale:g} mean={s.mean} std={s.std}"
        elif s.vocab is not None:
            extra = f" vocab={s.vocab}"
        lines.append(f"{s.name}: {s.kind} {np.dtype(s.dtype).name}{list(s.shape)}{extra} ({s.reason})")
    return "\n".join(lines)

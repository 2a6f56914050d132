"""Image inputs of self-calibration: which rank-4 float input is an image, its layout, and the
pixel range and normalisation the model expects, inferred from the graph alone (see
:mod:`kenosis_rewrite.calibration.inputs` for the rules); and natural-looking pixels to feed it.

The normalisation comes from the input's own QuantizeLinear where a quantized model has one (its
range is the one its quantizer measured on real data: the candidate preprocessing whose pixels span
it best wins), from an in-graph Sub/Add/Mul/Div by constants before the first Conv, or
from running candidate preprocessings (``CANDIDATE_PREPROCESSING``) through the first Conv (or the
model up to it) and comparing the response with the statistics the model was trained for (the
following BatchNormalization, or the bias of a folded one); ImageNet's otherwise.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from kenosis_rewrite.calibration.collect import _graph_inputs
from kenosis_rewrite.calibration.input_spec import (
    NUMPY_TYPES,
    TRANSPARENT_OPS,
    InputGraph,
    InputSpec,
    declared_dims,
    resolve_shape,
)
from kenosis_rewrite.core import ort_sessions
from kenosis_rewrite.errors import one_line

__all__ = ["CANDIDATE_PREPROCESSING", "IMAGE_SIZE", "image_spec", "natural_image", "preprocessed"]

IMAGE_SIZE = 224
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

_QUANTIZER_LIMITS = {onnx.TensorProto.UINT8: (0, 255), onnx.TensorProto.INT8: (-128, 127),
                     onnx.TensorProto.UINT16: (0, 65535), onnx.TensorProto.INT16: (-32768, 32767)}


def _input_quantizer_range(graph: InputGraph, name: str) -> tuple[float, float] | None:
    """The range ``[s (qmin - z), s (qmax - z)]`` of a per-tensor QuantizeLinear that reads ``name``
    (through transparent ops): what the model's quantizer measured of the real inputs."""
    for node, index, _path in graph.downstream(name, max_depth=4):
        if node.op_type != "QuantizeLinear" or index != 0 or node.domain not in ("", "ai.onnx", "com.microsoft"):
            continue
        scale = graph.constant(node.input[1])
        zero = graph.constant(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if scale is None or scale.size != 1 or (zero is not None and zero.size != 1) or not float(scale.reshape(-1)[0]) > 0:
            continue
        # no zero point: uint8 (the operator's default)
        limits = _QUANTIZER_LIMITS.get(onnx.helper.np_dtype_to_tensor_dtype(zero.dtype) if zero is not None
                                       else onnx.TensorProto.UINT8)
        if limits is None:
            continue
        step, offset = float(scale.reshape(-1)[0]), float(zero.reshape(-1)[0]) if zero is not None else 0.0
        return step * (limits[0] - offset), step * (limits[1] - offset)
    return None


def _preprocessing_for_range(measured: tuple[float, float], channels: int, rng) -> tuple[float, tuple, tuple, str]:
    """(pixel scale, mean, std, reason): the candidate preprocessing whose natural-image pixels span
    ``measured`` best (log ratio of the spans plus the misplacement of each end, in spans)."""
    probe = np.stack([natural_image(64, 64, rng) for _ in range(4)])
    low, high = measured
    span = max(high - low, 1e-12)
    scores = {}
    for name, (scale, mean, std) in CANDIDATE_PREPROCESSING.items():
        values = preprocessed(probe, scale, mean, std, channels)
        lo, hi = float(values.min()), float(values.max())
        scores[name] = abs(np.log(max(hi - lo, 1e-12) / span)) + (abs(lo - low) + abs(hi - high)) / span
    best = min(scores, key=scores.get)
    return (*CANDIDATE_PREPROCESSING[best],
            f"the input's QuantizeLinear measured [{low:.4g}, {high:.4g}]: {best} preprocessing")


def _first_conv(graph: InputGraph, name: str) -> tuple[onnx.NodeProto, list, list] | None:
    """The first Conv fed by ``name``, the transparent path to it, and the affine nodes on the way."""
    frontier = [(name, [], [])]
    for _ in range(12):
        next_frontier = []
        for value, path, affine in frontier:
            for node, index in graph.consumers.get(value, []):
                if node.op_type == "Conv" and index == 0:
                    return node, path, affine
                if node.op_type in TRANSPARENT_OPS and index == 0:
                    next_frontier.append((node.output[0], path + [node], affine))
                elif node.op_type in _AFFINE and graph.constant(node.input[1 - index]) is not None:
                    next_frontier.append((node.output[0], path, affine + [(node, index)]))
        frontier = next_frontier
    return None

def _image_layout(dims: list, path: list) -> tuple[str, str]:
    for node in path:
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        if node.op_type == "Transpose" and perm == [0, 3, 1, 2]:
            return "NHWC", "a Transpose(perm=[0,3,1,2]) feeds the first Conv"
    if dims[1] not in (1, 3, 4) and dims[3] in (1, 3, 4):
        return "NHWC", "the last dim looks like channels"
    return "NCHW", "dim 1 looks like channels (or default)"


def _affine_apply(graph: InputGraph, affine: list, x: np.ndarray) -> np.ndarray:
    """Apply the in-graph Sub/Add/Mul/Div-by-constant chain to ``x`` (NCHW or broadcastable)."""
    for node, index in affine:
        c = graph.constant(node.input[1 - index]).astype(np.float64)
        if c.ndim == 1 and c.size == x.shape[1] and x.ndim == 4:
            c = c.reshape(1, -1, 1, 1)
        a, b = (x, c) if index == 0 else (c, x)
        x = {"Sub": np.subtract, "Add": np.add, "Mul": np.multiply, "Div": np.divide}[node.op_type](a, b)
    return x


def _conv_response(graph: InputGraph, conv: onnx.NodeProto, x: np.ndarray, failures: list[str]) -> np.ndarray | None:
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


def _batchnorm_after(graph: InputGraph, conv: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray] | None:
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


def preprocessed(pixels: np.ndarray, scale: float, mean, std, channels: int) -> np.ndarray:
    """NHWC pixels in [0,1] -> NCHW model input with (p*scale - mean)/std per channel."""
    if pixels.shape[-1] < channels:  # e.g. RGBA: repeat the colour planes
        pixels = np.concatenate([pixels] * -(-channels // pixels.shape[-1]), axis=-1)
    mean = np.resize(np.asarray(mean, np.float64), channels)
    std = np.resize(np.asarray(std, np.float64), channels)
    return ((pixels[..., :channels] * scale - mean) / std).transpose(0, 3, 1, 2)


def _infer_normalisation(graph: InputGraph, found, channels: int, rng,
                         failures: list[str]) -> tuple[float, tuple, tuple, str]:
    """(pixel scale, mean, std, reason) for an image input; see the module docstring. Probes that
    failed are appended to ``failures``."""
    probe = np.stack([natural_image(64, 64, rng) for _ in range(4)])
    if found is not None and found[2]:
        affine = found[2]
        scores = {}
        for scale in (1.0, 255.0):
            normalised = _affine_apply(graph, affine, preprocessed(probe, scale, (0.0,), (1.0,), channels))
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
            response = _conv_response(graph, conv, preprocessed(probe, scale, mean, std, channels), failures)
            score = None if response is None else _candidate_score(response, bias, bn)
            if score is not None:
                scores[name] = score
        if scores:
            best = min(scores, key=scores.get)
            basis = "BatchNormalization statistics" if bn is not None else "Conv bias (folded BN)"
            return (*CANDIDATE_PREPROCESSING[best], f"first Conv vs {basis}: {best} preprocessing")
    return (*CANDIDATE_PREPROCESSING["imagenet"], "no normalisation found: ImageNet mean/std default")


def _reachable_conv(graph: InputGraph, name: str, max_depth: int = 24) -> onnx.NodeProto | None:
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


def _probe_through_model(graph: InputGraph, value, shape: tuple[int, ...], layout: str, conv: onnx.NodeProto,
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
            dims = [d if isinstance(d, int) else 1 for d in declared_dims(graph_input)]
            dtype = NUMPY_TYPES.get(graph_input.type.tensor_type.elem_type, np.float32)
            others[graph_input.name] = np.ones(dims, dtype)
    scores = {}
    for name, (scale, mean, std) in candidates.items():
        x = preprocessed(probe, scale, mean, std, channels)
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


def image_spec(graph: InputGraph, value, dims, symbols, rng) -> InputSpec | None:
    """What to generate for the rank-4 float input ``value`` (declared ``dims``) as an image: its
    shape (symbols resolved into ``symbols``), layout and normalisation; None where it is not one
    (a feature map: channels other than 1, 3 or 4)."""
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
    shape = resolve_shape(dims, defaults, symbols)
    measured = _input_quantizer_range(graph, value.name)
    if measured is not None:
        scale, mean, std, how = _preprocessing_for_range(measured, channels, rng)
        return InputSpec(value.name, NUMPY_TYPES.get(value.type.tensor_type.elem_type, np.float32), shape, "image",
                         f"{layout} ({why}); {how}", layout, None, scale, tuple(mean), tuple(std))
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
    return InputSpec(value.name, NUMPY_TYPES.get(value.type.tensor_type.elem_type, np.float32), shape, "image",
                     f"{layout} ({why}); {how}", layout, None, scale, tuple(mean), tuple(std))

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

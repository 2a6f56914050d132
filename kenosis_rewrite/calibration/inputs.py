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

Images are recognised and their normalisation inferred in :mod:`kenosis_rewrite.calibration.image_inputs`;
the per-input record and the graph index are :mod:`kenosis_rewrite.calibration.input_spec`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import onnx

from kenosis_rewrite.calibration.collect import CalibrationError, _float_proto, _graph_inputs
from kenosis_rewrite.calibration.image_inputs import (
    CANDIDATE_PREPROCESSING,
    IMAGE_SIZE,
    image_spec,
    natural_image,
    preprocessed,
)
from kenosis_rewrite.calibration.input_spec import (
    NUMPY_TYPES,
    InputGraph,
    InputSpec,
    declared_dims,
    resolve_shape,
)
from kenosis_rewrite.core import model_io, ort_sessions

__all__ = ["InputSpec", "infer_inputs", "synthetic_feeds", "iter_synthetic_feeds", "natural_image",
           "CANDIDATE_PREPROCESSING", "describe", "runnable_synthetic_feeds"]

SEQUENCE_LENGTH = 128


def _gather_rows(graph: InputGraph, name: str) -> int | None:
    """Rows of the constant table a Gather indexes with ``name`` (the vocabulary), if any."""
    for node, index, _ in graph.downstream(name):
        if node.op_type == "Gather" and index == 1:
            table = graph.initializers.get(node.input[0])
            if table is not None:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                return int(table.dims[axis])
    return None

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
    graph = InputGraph(proto)
    rng = np.random.default_rng(seed)
    symbols: dict[str, int] = {}
    inputs = _graph_inputs(proto)
    specs: list[InputSpec] = []
    # images first, so metadata inputs can refer to their size
    ordered = sorted(inputs, key=lambda v: len(declared_dims(v)) != 4)
    for value in ordered:
        specs.append(_spec(graph, value, symbols, rng, specs))
    order = {v.name: i for i, v in enumerate(inputs)}
    return sorted(specs, key=lambda s: order[s.name])


def _spec(graph: InputGraph, value: onnx.ValueInfoProto, symbols: dict, rng, done: list[InputSpec]) -> InputSpec:
    elem = value.type.tensor_type.elem_type
    dtype = NUMPY_TYPES.get(elem)
    if dtype is None:
        raise CalibrationError(f"input {value.name!r} has an unsupported element type {elem}")
    dims = declared_dims(value)
    lowered = value.name.lower()
    if np.issubdtype(dtype, np.floating) and len(dims) == 4 and "mask" not in lowered:
        spec = image_spec(graph, value, dims, symbols, rng)
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
        return InputSpec(value.name, dtype, resolve_shape(dims, defaults, symbols), kind, why, vocab=rows)
    shape = resolve_shape(dims, [1] * len(dims), symbols)
    if len(dims) <= 2 and int(np.prod(shape[1:] or (1,))) <= 16:
        return InputSpec(value.name, dtype, shape, "metadata", "small float input: positive metadata")
    return InputSpec(value.name, dtype, shape, "float", "float tensor: N(0, 1)")


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
        x = preprocessed(batch, spec.pixel_scale, spec.mean, spec.std, min(channels, 3))
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
    dims = declared_dims(value)
    spatial = (2, 3) if image.layout == "NCHW" else (1, 2)
    dynamic = [axis for axis in spatial if not isinstance(dims[axis], int)]
    if not dynamic:
        return list(iter_synthetic_feeds(model, n, seed, specs)), ""
    try:
        # refusals are expected: quiet
        session = ort_sessions.session(model, ort_sessions.options(1, level="basic", log_severity=4))
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

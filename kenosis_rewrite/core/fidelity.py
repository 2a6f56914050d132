"""Fidelity of quantized models against their FP32 original, measured with ONNX Runtime."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

import numpy as np
import onnx
import onnxruntime as ort

from kenosis_rewrite.core import model_io, ort_sessions
from kenosis_rewrite.errors import KenosisError, RuntimeMeasurementError

__all__ = ["random_feeds", "session", "concurrent_runs", "each_run", "run", "ReferenceRuns", "Background", "cosine",
           "sqnr_db", "scores", "compare_to_float", "compare_to_reference"]

_Result = TypeVar("_Result")

_NUMPY_OF_ONNX = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32, onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.INT8: np.int8, onnx.TensorProto.BOOL: np.bool_,
}


# sizes to try, in order, for a dynamic dim other than the batch when the default does not run
# (PP-OCRv3's recognizer, [?, 3, 48, ?], runs at width 320, not 224)
OTHER_DYNAMIC_SIZES = (320, 256, 640, 160, 96, 64, 32)


def _is_static(dim: onnx.TensorShapeProto.Dimension) -> bool:
    return dim.HasField("dim_value") and dim.dim_value > 0


def concrete_shape(value: onnx.ValueInfoProto, size: int | None = None, known: Mapping[int, int] | None = None) -> list[int]:
    """Static dims kept; ``known`` dims (axis -> size) next; a dynamic batch (first) dim -> 1; other
    dynamic dims -> ``size``, by default 224 (images) or 128."""
    dims = value.type.tensor_type.shape.dim
    other = size if size is not None else (224 if len(dims) == 4 else 128)
    known = known or {}
    return [d.dim_value if _is_static(d) else known.get(i, 1 if i == 0 else other) for i, d in enumerate(dims)]


# ops that keep a tensor's last axis its last one and its values' layout (what feature size it needs
# is then what it needs after them)
_KEEP_LAST_AXIS = frozenset({"Identity", "Cast", "QuantizeLinear", "DequantizeLinear", "Relu", "Tanh", "Sigmoid",
                             "Unsqueeze", "Abs", "Neg", "Clip", "LeakyRelu", "Elu", "Softplus"})
_READ_AS_FEATURES = frozenset({"Add", "Sub", "Mul", "Div"})


def _weight_dims(name: str, initializers: Mapping[str, onnx.TensorProto],
                 producers: Mapping[str, onnx.NodeProto]) -> list[int] | None:
    """The dims of constant ``name`` (an initializer, or a DequantizeLinear of one)."""
    if name in initializers:
        return list(initializers[name].dims)
    producer = producers.get(name)
    if producer is not None and producer.op_type == "DequantizeLinear" and producer.input[0] in initializers:
        return list(initializers[producer.input[0]].dims)
    return None


def _needed_last_dim(name: str, initializers: Mapping[str, onnx.TensorProto], producers: Mapping[str, onnx.NodeProto],
                     readers: Mapping[str, list[onnx.NodeProto]], depth: int = 6) -> int | None:
    """The size the readers of ``name`` need its last axis to have: a MatMul's or Gemm's K, a
    recurrent layer's input size, a per-feature constant an elementwise op broadcasts against;
    looked for through ops that keep the last axis (an Unsqueeze adding the batch, a Q/DQ)."""
    for node in readers.get(name, []):
        index = list(node.input).index(name)
        other = [i for i in node.input if i and i != name]
        if node.op_type in ("MatMul", "Gemm") and index == 0 and other:
            dims = _weight_dims(node.input[1], initializers, producers)
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            if dims and len(dims) >= 2 and not any(a.name == "transA" and a.i for a in node.attribute):
                return dims[-1] if trans_b else dims[-2]
        elif node.op_type in ("LSTM", "GRU", "RNN") and index == 0:
            dims = _weight_dims(node.input[1], initializers, producers)
            if dims and len(dims) == 3:
                return dims[2]
        elif node.op_type in _READ_AS_FEATURES and len(other) == 1:
            dims = _weight_dims(other[0], initializers, producers)
            if dims and dims[-1] > 1:
                return dims[-1]
        if node.op_type in _KEEP_LAST_AXIS and depth > 0 and node.output:
            found = _needed_last_dim(node.output[0], initializers, producers, readers, depth - 1)
            if found is not None:
                return found
    return None


def needed_dims(model: onnx.ModelProto) -> dict[str, dict[int, int]]:
    """Per graph input, the dynamic dims whose size the graph's weights fix (axis -> size): the last
    (feature) axis of a sequence input, the channel axis of a Conv's. Random feeds of another size
    would not run (an LSTM with 162 inputs fed 128)."""
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in dict.fromkeys(node.input):
            readers.setdefault(name, []).append(node)
    needed: dict[str, dict[int, int]] = {}
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name in initializers or len(dims) < 2:
            continue
        dynamic = [i for i, d in enumerate(dims) if not _is_static(d)]
        found: dict[int, int] = {}
        if len(dims) - 1 in dynamic:
            size = _needed_last_dim(value.name, initializers, producers, readers)
            if size is not None:
                found[len(dims) - 1] = size
        if 1 in dynamic and len(dims) >= 3:
            for node in readers.get(value.name, []):
                if node.op_type == "Conv" and node.input[0] == value.name:
                    weight = _weight_dims(node.input[1], initializers, producers)
                    group = next((a.i for a in node.attribute if a.name == "group"), 1)
                    if weight and len(weight) == len(dims):
                        found[1] = weight[1] * group
                        break
        if found:
            needed[value.name] = found
    return needed


def has_dynamic_dims(model: onnx.ModelProto) -> bool:
    """Whether a graph input has a dynamic dim other than the batch (first) one."""
    initializers = {init.name for init in model.graph.initializer}
    return any(not _is_static(d) for value in model.graph.input if value.name not in initializers
               for d in list(value.type.tensor_type.shape.dim)[1:])


def random_feeds(model: onnx.ModelProto, n: int = 4, seed: int = 0, size: int | None = None) -> list[dict[str, np.ndarray]]:
    """``n`` random feeds for the graph inputs: floats N(0,1), integers 0, booleans False; dynamic
    dims the weights fix at their size (:func:`needed_dims`), the others as :func:`concrete_shape`
    sets them (``size``).

    For measuring, not calibrating (see :func:`kenosis_rewrite.calibration.synthetic_feeds`).
    """
    rng = np.random.default_rng(seed)
    initializers = {init.name for init in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in initializers]
    known = needed_dims(model)
    feeds = []
    for _ in range(n):
        feed = {}
        for value in inputs:
            dtype = _NUMPY_OF_ONNX.get(value.type.tensor_type.elem_type)
            if dtype is None:
                raise KenosisError(f"cannot make random data for input {value.name!r} of this type")
            shape = concrete_shape(value, size, known.get(value.name))
            floating = np.issubdtype(dtype, np.floating)
            feed[value.name] = rng.standard_normal(shape).astype(dtype) if floating else np.zeros(shape, dtype)
        feeds.append(feed)
    return feeds


_MAX_CONCURRENT_RUNS = 4  # each concurrent run holds its own activations


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def concurrent_runs(feeds: int) -> int:
    """How many feeds to run at once: one per core (at most ``_MAX_CONCURRENT_RUNS``, at most
    ``feeds``). A small model's ops do not split well across cores (MobileNetV2's 16 calibration
    feeds: 0.13 s one after another on two cores, 0.09 s two at a time on one core each)."""
    return max(1, min(feeds, cores(), _MAX_CONCURRENT_RUNS))


def session(model: onnx.ModelProto | bytes, optimized: bool = True, at_once: int = 1,
            one_core: bool = False) -> ort.InferenceSession:
    """An ORT CPU session for computing outputs, not timing them: every core, idle threads sleep
    (:func:`kenosis_rewrite.core.ort_sessions.options`); ``optimized=False`` runs the graph as written
    (ORT_DISABLE_ALL). ``model``: a proto or its serialisation (for a model run more than once:
    serialising a large model costs as much as loading it). ``at_once``: the runs :func:`each_run`
    will make at once; the cores are shared between them. ``one_core``: one thread (runs made
    beside other work, see :class:`Background`).

    ORT's own exception propagates: callers decide whether a refusal is an error or a finding.
    """
    threads = 1 if one_core else None if at_once <= 1 else max(1, cores() // at_once)
    # log level fatal: a run that fails raises its error, which callers report or act on; ORT's own
    # copy on stderr only alarms (the guard tries feeds of several sizes on a model with dynamic dims)
    return ort_sessions.session(model, ort_sessions.options(threads, level="all" if optimized else "none", spinning=False, log_severity=4))


def each_run(session: ort.InferenceSession, feeds: Sequence[Mapping[str, np.ndarray]], at_once: int = 1,
             names: Sequence[str] | None = None) -> list[list[np.ndarray]]:
    """``session``'s outputs (``names``, or all) on each feed, in feed order; ``at_once`` feeds at
    once (from worker threads: a run releases the GIL). ORT's own exception propagates."""
    def one(feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return session.run(None if names is None else list(names), dict(feed))

    if at_once <= 1 or len(feeds) <= 1:
        return [one(feed) for feed in feeds]
    with concurrent.futures.ThreadPoolExecutor(at_once, thread_name_prefix="fidelity") as pool:
        return list(pool.map(one, feeds))


def _session(model: onnx.ModelProto | bytes, optimized: bool = True, at_once: int = 1,
             one_core: bool = False) -> ort.InferenceSession:
    try:
        return session(model, optimized, at_once, one_core)
    except Exception as error:  # noqa: BLE001 - any ORT failure becomes one typed error
        raise RuntimeMeasurementError(f"ONNX Runtime could not load the model: {error}") from None


def run(
    model: onnx.ModelProto | bytes, feeds: Iterable[Mapping[str, np.ndarray]], optimized: bool = True,
    one_core: bool = False,
) -> list[list[np.ndarray]]:
    """Outputs of ``model`` (a proto or its serialisation) on each feed (a :func:`session`;
    ``optimized=False``: the graph as written), several feeds at once (:func:`concurrent_runs`);
    ``one_core``: one feed after another on one thread (runs made beside other work, see
    :class:`Background`)."""
    feeds = list(feeds)
    at_once = 1 if one_core else concurrent_runs(len(feeds))
    session = _session(model, optimized, at_once, one_core)
    try:
        return each_run(session, feeds, at_once)
    except Exception as error:  # noqa: BLE001
        raise RuntimeMeasurementError(f"ONNX Runtime failed to run the model: {error}") from None


class ReferenceRuns:
    """The outputs of one FP32 model on one list of feeds, each feed run at most once per setting.

    quantize() runs the model as given on the calibration feeds in several places (prepare()'s
    verification, as written and optimized; the final fidelity, optimized): sharing one
    ReferenceRuns makes those the same runs. Runs are made when first asked for, in feed order."""

    def __init__(self, model: onnx.ModelProto, feeds: Iterable[Mapping[str, np.ndarray]]):
        self.model = model
        self.feeds = list(feeds)
        self._done: dict[bool, list[list[np.ndarray]]] = {}
        self._serialised: bytes | None = None  # once for every session
        self._prefetching: Background | None = None

    def prefetch(self, *wanted: tuple[bool, int]) -> None:
        """Start, on one core beside the caller's own work (:class:`Background`), the runs that
        ``outputs(optimized, count)`` returns for each ``(optimized, count)`` of ``wanted``;
        :meth:`outputs` waits for them (a run that failed is made, and fails, again there)."""
        self._wait()
        self._prefetching = Background(lambda: [self._outputs(optimized, count, True) for optimized, count in wanted])

    def _wait(self) -> None:
        """Wait for the runs :meth:`prefetch` started."""
        prefetching, self._prefetching = self._prefetching, None
        if prefetching is not None:
            try:
                prefetching.result()
            except RuntimeMeasurementError:
                pass  # outputs() runs that feed again and raises it to the caller who asks

    def outputs(self, optimized: bool = True, count: int | None = None, one_core: bool = False) -> list[list[np.ndarray]]:
        """Outputs on the first ``count`` feeds (all by default), as :func:`run` gives them."""
        self._wait()
        return self._outputs(optimized, count, one_core)

    def _outputs(self, optimized: bool, count: int | None, one_core: bool) -> list[list[np.ndarray]]:
        count = len(self.feeds) if count is None else min(count, len(self.feeds))
        done = self._done.setdefault(optimized, [])
        if len(done) < count:
            if self._serialised is None:
                self._serialised = self.model.SerializeToString()
            done.extend(run(self._serialised, self.feeds[len(done):count], optimized, one_core))
        return done[:count]


class Background(Generic[_Result]):
    """``work()`` started now on a worker thread; :meth:`result` waits for it and returns what it
    returned, or raises what it raised.

    For ONNX Runtime runs (:func:`run` with ``one_core``) made while the caller's own work holds one
    core with Python (graph passes): onnxruntime releases the GIL while it computes, so on a
    two-core machine the runs take the idle core. What ``work`` reads must not change meanwhile."""

    def __init__(self, work: Callable[[], _Result]):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fidelity-background")
        self._future = self._pool.submit(work)
        self._pool.shutdown(wait=False)  # the thread ends with the work

    def result(self) -> _Result:
        return self._future.result()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    # numpy's own sums, not BLAS dot: OpenBLAS threads each dot, and on a busy machine one waits
    # milliseconds for its threads (0.4 s of quantize()'s final fidelity on a YOLOv8n)
    denominator = np.sqrt(np.sum(a * a)) * np.sqrt(np.sum(b * b))
    if denominator == 0:
        return 1.0 if np.array_equal(a, b) else 0.0
    return float(np.sum(a * b) / denominator)


# an output with fewer values than this per feed is a score or a flag: one value's cosine is its sign
# (MediaPipe's pose-presence logit, near 0 on images without a person, flips sign under any rounding)
FEW_VALUES = 8


# an output of one value per feed is a score or a flag: a feed's cosine of it is its sign, so it is
# judged pooled over the feeds. From two values on, feed by feed: a 4-class orientation classifier
# (PP-LCNet by NNCF, fix(calibration=16 scenes)) judged pooled kept rewrites that moved its worst of 24
# object photos from 0.979 to 0.930 against FP32; judged per feed, 0.964 (on 40 photos mixed: the mean
# up 0.0007, another photo down 0.018)
POOLED_BELOW = 2


def feed_cosines(reference: Sequence[Sequence[np.ndarray]], outputs: Sequence[Sequence[np.ndarray]]) -> list[list[float]]:
    """Per float output, its cosine against the reference on each feed; an output of fewer than
    :data:`POOLED_BELOW` values on every feed, one cosine over all feeds at once."""
    found = []
    for index in range(len(reference[0])):
        if not np.issubdtype(np.asarray(reference[0][index]).dtype, np.floating):
            continue
        pairs = [(np.asarray(r[index]), np.asarray(o[index])) for r, o in zip(reference, outputs)]
        if all(r.size < POOLED_BELOW for r, _ in pairs):
            pairs = [(np.concatenate([r.ravel() for r, _ in pairs]), np.concatenate([o.ravel() for _, o in pairs]))]
        found.append([cosine(r, o) for r, o in pairs])
    return found


def mean_cosines(reference: Sequence[Sequence[np.ndarray]], outputs: Sequence[Sequence[np.ndarray]]) -> list[float | None]:
    """Each output's cosine against the reference, feed by feed, averaged over the feeds (None where
    the output is not float)."""
    return [float(np.mean([cosine(r[index], o[index]) for r, o in zip(reference, outputs)]))
            if np.issubdtype(np.asarray(reference[0][index]).dtype, np.floating) else None
            for index in range(len(reference[0]))]


def top1_agreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Share of positions whose argmax over the last axis (the classes) agrees."""
    reference, candidate = np.asarray(reference), np.asarray(candidate)
    classes = reference.shape[-1]
    return float(np.mean(reference.reshape(-1, classes).argmax(1) == candidate.reshape(-1, classes).argmax(1)))


def sqnr_db(reference: np.ndarray, candidate: np.ndarray) -> float:
    reference = np.asarray(reference, np.float64)
    return _sqnr_db_of_sums(np.sum(reference**2), float(np.sum((reference - candidate) ** 2)))


def _sqnr_db_of_sums(signal: float, noise: float) -> float:
    """:func:`sqnr_db` from the sums of reference^2 and (reference - candidate)^2."""
    return float("inf") if noise == 0 else float(10 * np.log10(signal / noise))


def scores(reference: Sequence[Sequence[np.ndarray]], outputs: Sequence[Sequence[np.ndarray]]) -> dict[str, float]:
    """Cosine and SQNR over all feeds' float outputs together, worst per-feed cosine, max abs error.

    Float64 sums a feed at a time, added up over the feeds (one pass over each output, no
    concatenated copy: a text detector's 8 probability maps are 7 M values)."""
    totals = np.zeros(4)  # sum ref*out, ref*ref, out*out, (ref - out)^2
    per_feed, max_abs = [], 0.0
    for ref_outputs, candidate_outputs in zip(reference, outputs):
        sums = np.zeros(4)
        pairs = [(r, c) for r, c in zip(ref_outputs, candidate_outputs) if np.issubdtype(np.asarray(r).dtype, np.floating)]
        if not pairs:
            continue
        for r, c in pairs:
            r, c = np.asarray(r, np.float64).reshape(-1), np.asarray(c, np.float64).reshape(-1)
            difference = r - c
            sums += (np.sum(r * c), np.sum(r * r), np.sum(c * c), np.sum(difference * difference))
            max_abs = max(max_abs, float(np.max(np.abs(difference), initial=0.0)))
        per_feed.append(_cosine_of_sums(sums))
        totals += sums
    if not per_feed:
        return {"cosine": 1.0, "worst_cosine": 1.0, "sqnr_db": float("inf"), "max_abs": 0.0}
    return {
        "cosine": _cosine_of_sums(totals),
        "worst_cosine": float(min(per_feed)),
        "sqnr_db": _sqnr_db_of_sums(totals[1], totals[3]),
        "max_abs": max_abs,
    }


def _cosine_of_sums(sums: np.ndarray) -> float:
    """:func:`cosine` from the sums of a*b, a*a, b*b and (a-b)^2."""
    denominator = np.sqrt(sums[1]) * np.sqrt(sums[2])
    if denominator == 0:
        return 1.0 if sums[3] == 0 else 0.0
    return float(sums[0] / denominator)


def compare_to_float(
    float_model: model_io.ModelLike,
    candidates: Mapping[str, onnx.ModelProto],
    feeds: Iterable[Mapping[str, np.ndarray]] | None = None,
    optimized: bool = True,
) -> dict[str, dict[str, float]]:
    """Fidelity of each candidate's float outputs against FP32 (see :func:`scores`). ``optimized=False``
    compares what the graphs compute, without ORT's (host-dependent) integer kernels."""
    loaded = model_io.load(float_model, require_qdq=False)
    reference_model = model_io.to_output(model_io.LoadedModel(loaded.model, "proto"))
    feeds = list(feeds) if feeds is not None else random_feeds(reference_model)
    return compare_to_reference(ReferenceRuns(reference_model, feeds), candidates, optimized)


def compare_to_reference(
    reference: ReferenceRuns, candidates: Mapping[str, onnx.ModelProto | bytes], optimized: bool = True,
    count: int | None = None,
) -> dict[str, dict[str, float]]:
    """:func:`compare_to_float` on the first ``count`` feeds of ``reference`` (all by default), its
    FP32 runs reused where they were made already."""
    expected = reference.outputs(optimized, count)
    feeds = reference.feeds[: len(expected)]
    return {name: scores(expected, run(model, feeds, optimized)) for name, model in candidates.items()}


# ------------------------------------------------------------------ per-output fidelity (the benchmark's)


@dataclasses.dataclass(frozen=True)
class Fidelity:
    """How close a variant's outputs are to the reference (FP32) outputs."""

    cosine: float  # worst output tensor's cosine similarity, all samples concatenated
    max_abs_err: float
    top1_agreement: float | None  # share of argmax positions (last axis) that agree; None if not a classifier
    samples: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _per_output(runs: Sequence[Sequence[np.ndarray] | np.ndarray]) -> list[list[np.ndarray]]:
    """[sample][output] -> [output][sample]; a bare array counts as a single-output sample."""
    normalised = [[run] if isinstance(run, np.ndarray) else list(run) for run in runs]
    return [list(column) for column in zip(*normalised)]


def output_fidelity(
    reference_outputs: Sequence[Sequence[np.ndarray] | np.ndarray],
    outputs: Sequence[Sequence[np.ndarray] | np.ndarray],
    class_output: int | None = None,
) -> Fidelity:
    """Cosine, max abs error and (when ``class_output`` names an output index) top-1 agreement.

    Both arguments hold one entry per sample: the list of that sample's output arrays (or one
    array for single-output models). Cosine is computed per output over all samples and the
    worst output is reported; top-1 compares argmax over the last axis at every position.
    """
    if len(reference_outputs) != len(outputs) or not outputs:
        raise ValueError(f"need the same, non-zero number of samples, got {len(reference_outputs)} and {len(outputs)}")
    reference = [np.concatenate([r.ravel() for r in column]) for column in _per_output(reference_outputs)]
    candidate = [np.concatenate([c.ravel() for c in column]) for column in _per_output(outputs)]
    if [r.size for r in reference] != [c.size for c in candidate]:
        raise ValueError("reference and outputs differ in number or size of output tensors")
    worst = min(cosine(r, c) for r, c in zip(reference, candidate))
    max_abs = max(float(np.max(np.abs(r.astype(np.float64) - c.astype(np.float64)), initial=0.0))
                  for r, c in zip(reference, candidate))
    top1 = None
    if class_output is not None:
        pairs = zip(_per_output(reference_outputs)[class_output], _per_output(outputs)[class_output])
        top1 = float(np.mean([top1_agreement(r, c) for r, c in pairs]))
    return Fidelity(worst, max_abs, top1, len(outputs))

"""Range collection from the FP32 model with ONNX Runtime, streaming over any number of samples.

A copy of the model exposes every float intermediate tensor (and every float graph input) as a graph
output. Each feed is run once and each exposed tensor updates its :class:`StreamingHistogram`; no
activation is kept after its update, so memory is bounded by two runs' activations (the next run is
computed while the last one's statistics are updated) plus a fixed histogram per tensor. When one
run's activations would exceed ``max_pass_bytes`` (huge models), the tensors are split into groups
and the feeds are read once per group (feeds must then be re-iterable: a list, a
``CalibrationDataReader`` with ``rewind``, or a zero-argument callable returning an iterable).
"""

from __future__ import annotations

import concurrent.futures as concurrent_futures
import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx
import onnxruntime as ort

from kenosis_rewrite.calibration.histogram import METHODS, PercentileTails, StreamingHistogram, range_from_histogram
from kenosis_rewrite.core import fidelity, model_io, ort_sessions
from kenosis_rewrite.core.progress import progress_bar, progress_default
from kenosis_rewrite.errors import CalibrationError

__all__ = [
    "CalibrationError",
    "TensorRanges",
    "collect_histograms",
    "collect_ranges",
    "calibrated_tensors",
    "progress_bar",
    "progress_default",
    "model_hash",
    "quantize_with_ranges",
]

FeedSource = Union[Iterable[Mapping[str, np.ndarray]], Callable[[], Iterable[Mapping[str, np.ndarray]]]]
_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                          onnx.TensorProto.BFLOAT16})
DEFAULT_PASS_BYTES = 1 << 30
# Below this mean size per exposed tensor session.run's copies cost less than onnxruntime's
# per-OrtValue overhead (PP-OCR cls, 171 tensors of 46 KB: 16 runs 0.04 s copied, 0.16 s as views)
_VIEWS_FROM_BYTES = 256 << 10
# Updates of smaller tensors are handed to the binning threads together: one task each costs more
# than binning a small tensor, whose numpy calls mostly hold the GIL anyway
_TASK_BYTES = 4 << 20
# PercentileTails reads each value once but costs more per update; below this size a tensor's full
# histogram is cheaper (16 updates of 13,000 values: 50 us each against 64; of 60,000: 147 against
# 107) and gives the same percentile range, without ever measuring it again
_TAILS_FROM_BYTES = 128 << 10
_FORMAT = "kenosis-calibration/1"


@dataclasses.dataclass
class TensorRanges(Mapping):
    """Per-tensor calibrated ranges: a read-only mapping ``name -> (lo, hi)`` plus provenance."""

    ranges: dict[str, tuple[float, float]]
    method: str = "minmax"
    percentile: float | None = None
    samples: int = 0
    model_sha256: str = ""

    def __getitem__(self, name: str) -> tuple[float, float]:
        return self.ranges[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.ranges)

    def __len__(self) -> int:
        return len(self.ranges)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (see :meth:`save`)."""
        return {
            "format": _FORMAT, "method": self.method, "percentile": self.percentile, "samples": self.samples,
            "model_sha256": self.model_sha256,
            "ranges": {name: [float(lo), float(hi)] for name, (lo, hi) in self.ranges.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorRanges:
        """Inverse of :meth:`to_json`; raises CalibrationError on anything else."""
        if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
            raise CalibrationError(f"not a kenosis calibration file (expected format {_FORMAT!r})")
        ranges = {str(k): (float(v[0]), float(v[1])) for k, v in data["ranges"].items()}
        return cls(ranges, data["method"], data.get("percentile"), int(data.get("samples", 0)),
                   data.get("model_sha256", ""))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the ranges to ``path`` as JSON (atomically) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(temporary, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> TensorRanges:
        """Read ranges written by :meth:`save`."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise CalibrationError(f"cannot read calibration file {os.fspath(path)!r}: {error}") from None
        return cls.from_json(data)

    def to_tensors_data(self):
        """The ranges as onnxruntime's ``TensorsData`` (MinMax), what quantize_static's quantizer consumes."""
        from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

        data = {name: TensorData(lowest=np.array(lo, np.float32), highest=np.array(hi, np.float32))
                for name, (lo, hi) in self.ranges.items()}
        return TensorsData(CalibrationMethod.MinMax, data)

    def to_cached_tensors_data(self):
        """:meth:`to_tensors_data` as ORT reads it back from the cache :meth:`write_ort_cache` writes
        (its JSON round trip, in memory): what quantize_static's quantizer gets from that file."""
        from onnxruntime.quantization.calibrate import CalibrationCacheEncoder, TensorsData

        return TensorsData.from_dict(json.loads(json.dumps(self.to_tensors_data().to_dict(), cls=CalibrationCacheEncoder)))

    def write_ort_cache(self, path: str | os.PathLike) -> Path:
        """Write an ORT calibration cache: ``quantize_static(..., calibration_data_reader=None,
        calibration_cache_path=path)`` (default ``calibrate_method=MinMax``) then uses these ranges."""
        from onnxruntime.quantization.calibrate import save_tensors_data

        save_tensors_data(self.to_tensors_data(), Path(path))
        return Path(path)


def model_hash(model: onnx.ModelProto) -> str:
    """sha256 of the model's deterministic serialisation."""
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def _float_proto(model: model_io.ModelLike) -> onnx.ModelProto:
    loaded = model_io.load(model, require_qdq=False)
    return model_io.to_output(model_io.LoadedModel(loaded.model, "proto"))


def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializers = {init.name for init in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in initializers]


_INLINE_BYTES = 1024  # initializers up to this size keep their data for shape inference (shape tensors)


def _without_data(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """``tensor``, its data over ``_INLINE_BYTES`` replaced by a reference to a file that does not
    exist (as :func:`kenosis_rewrite.core.model_io.graph_only_proto` writes it): shape inference reads only its
    type and dims."""
    if len(tensor.raw_data) <= _INLINE_BYTES:
        return tensor
    light = onnx.TensorProto(name=tensor.name, dims=tensor.dims, data_type=tensor.data_type,
                             data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", model_io.GRAPH_ONLY_LOCATION), ("offset", "0"), ("length", str(len(tensor.raw_data)))):
        light.external_data.add(key=key, value=value)
    return light


def _with_input_shapes(model: onnx.ModelProto, feed: Mapping[str, np.ndarray] | None) -> onnx.ModelProto:
    """A copy of ``model`` for shape inference: its graph inputs have the shapes of ``feed`` (so dynamic
    dims resolve), its large initializers no data (:func:`_without_data`; not copied, not serialised)."""
    graph = model.graph
    copy = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import, functions=model.functions)
    copy.graph.name = graph.name
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(copy.graph, field).extend(getattr(graph, field))
    copy.graph.initializer.extend(_without_data(tensor) for tensor in graph.initializer)
    if feed is None:
        return copy
    for value in copy.graph.input:
        if value.name in feed:
            dims = value.type.tensor_type.shape.dim
            shape = np.shape(feed[value.name])
            if len(dims) == len(shape):
                for dim, size in zip(dims, shape):
                    dim.Clear()
                    dim.dim_value = int(size)
    return copy


def _typed_values(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """name -> type of every value shape inference (or the graph) knows."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - shape inference is best effort
        inferred = model
    graph = inferred.graph
    return {v.name: v.type for v in [*graph.input, *graph.value_info, *graph.output]}


def calibrated_tensors(model: onnx.ModelProto, feed: Mapping[str, np.ndarray] | None = None) -> dict[str, int]:
    """Float tensors to calibrate (graph inputs and top-level node outputs) -> estimated bytes per run.

    Tensors whose type shape inference cannot tell are kept (ORT types them at run time; non-float
    ones are dropped after the first run). Unknown dims count as 64 in the size estimate.
    """
    types = _typed_values(_with_input_shapes(model, feed))
    names = [v.name for v in _graph_inputs(model)]
    names += [out for node in model.graph.node if node.op_type != "Constant" for out in node.output if out]
    selected = {}
    for name in dict.fromkeys(names):
        tensor_type = types[name].tensor_type if name in types else None
        if tensor_type is not None and tensor_type.elem_type and tensor_type.elem_type not in _FLOAT_TYPES:
            continue
        dims = tensor_type.shape.dim if tensor_type is not None and tensor_type.HasField("shape") else []
        size = int(np.prod([d.dim_value if d.dim_value > 0 else 64 for d in dims])) if dims else 64**2
        selected[name] = 4 * size
    return selected


def _augmented(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose outputs are exactly ``names``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.output[:]
    copy.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names)
    return copy


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    try:
        return ort_sessions.session(model, ort_sessions.options(None, level="basic", spinning=False))
    except Exception as error:  # noqa: BLE001
        raise CalibrationError(f"ONNX Runtime cannot load the model for calibration: {error}") from None


def _groups(sizes: Mapping[str, int], budget: int) -> list[list[str]]:
    """Split tensor names into consecutive groups whose estimated bytes stay under ``budget``."""
    groups: list[list[str]] = [[]]
    total = 0
    for name, size in sizes.items():
        if groups[-1] and total + size > budget:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += size
    return groups


def _feed_iterable(feeds: FeedSource) -> Iterable[Mapping[str, np.ndarray]]:
    """One pass over the feeds (calls a factory, rewinds a reader)."""
    if callable(feeds) and not hasattr(feeds, "get_next"):
        return feeds()
    if hasattr(feeds, "get_next"):
        if hasattr(feeds, "rewind"):
            feeds.rewind()
        return iter(feeds.get_next, None)
    return feeds


def _reiterable(feeds: FeedSource) -> bool:
    return callable(feeds) or hasattr(feeds, "rewind") or (
        isinstance(feeds, Iterable) and not isinstance(feeds, Iterator))


def _length(feeds: FeedSource) -> int | None:
    try:
        return len(feeds)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - readers raise NotImplementedError, generators TypeError
        return None


def _progress(iterable: Iterable, progress: bool | None, total: int | None, description: str) -> Iterable:
    bar = progress_bar(progress, iterable, total=total, description=description)
    return iterable if bar is None else bar


Observer = Callable[[Mapping[str, np.ndarray]], Union[Iterable[Callable[[], None]], None]]


def _tensors_of(session: ort.InferenceSession, names: list[str], feed: Mapping[str, Any], views: bool = True) -> list:
    """``session``'s outputs ``names`` on ``feed``: tensors as numpy arrays, anything else as None.
    With ``views`` the arrays are over onnxruntime's own buffers (``session.run`` copies every
    output into a fresh array: a PP-OCR detector's 331 exposed tensors are 680 MB a feed, and the
    copies took 0.9 s of its 1.0 s runs); without, ``session.run``'s copies (small tensors)."""
    if not views:
        return [value if isinstance(value, np.ndarray) else None for value in session.run(names, feed)]
    arrays = [np.ascontiguousarray(value) for value in feed.values()]
    inputs = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in zip(feed, arrays)}
    # .numpy() of a CPU tensor is a view whose base keeps onnxruntime's buffer alive; but an output
    # that is a graph input (or onnxruntime's in-place view of one) is the feed's memory, which
    # nothing keeps alive once the caller drops the feed: those are copied
    outputs = [value.numpy() if value.is_tensor() else None for value in session.run_with_ort_values(names, inputs)]
    return [np.array(output) if output is not None and any(np.may_share_memory(output, array) for array in arrays)
            else output for output in outputs]


def _run_group(session: ort.InferenceSession, names: list[str], feeds: Iterable[Mapping[str, np.ndarray]],
               histograms: dict[str, StreamingHistogram], factory: Callable[[str], StreamingHistogram],
               observe: Observer | None = None, concurrent: bool = True, ahead: bool = True,
               views: bool = True) -> int:
    """Run every feed once, updating the histogram of each float output (and showing the outputs,
    by name, to ``observe``; the callables it returns, independent of each other, run like the
    updates); returns the number of feeds.

    ``concurrent``: a run's tensors update their histograms several at once (the binning's numpy
    loops release the GIL), and with ``ahead`` onnxruntime computes the next feed's run on a worker
    thread meanwhile, so two runs' tensors are alive at once. Each histogram still gets its updates
    in feed order, and ``observe`` its calls, so the statistics are the same as without. ``views``:
    as :func:`_tensors_of`."""
    input_names = {i.name for i in session.get_inputs()}

    def run(index: int, feed: Mapping[str, np.ndarray]) -> list:
        try:
            return _tensors_of(session, names, {k: v for k, v in feed.items() if k in input_names}, views)
        except Exception as error:  # noqa: BLE001
            raise CalibrationError(f"ONNX Runtime failed on calibration sample {index}: {error}") from None

    def histogram(name: str) -> StreamingHistogram:
        if name not in histograms:
            histograms[name] = factory(name)
        return histograms[name]

    def updates(outputs: list) -> list[Callable[[], None]]:
        return [functools.partial(histogram(name).update, value)
                for name, value in zip(names, outputs)
                if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating)]

    def observed(outputs: list) -> list[Callable[[], None]]:
        return list(observe(dict(zip(names, outputs))) or ()) if observe is not None else []

    count = 0
    if not concurrent:
        for count, feed in enumerate(feeds, 1):
            outputs = run(count - 1, feed)
            for update in [*updates(outputs), *observed(outputs)]:
                update()
        return count
    with (concurrent_futures.ThreadPoolExecutor(1, thread_name_prefix="calibration-run") as runner,
          concurrent_futures.ThreadPoolExecutor(fidelity.cores(), thread_name_prefix="calibration-stats") as binners):
        def absorb(outputs: list) -> None:
            # the observer's tasks (weight rounding's moments: matrix products) first, as one task:
            # one thread computes them while the others bin, whose Python holds the GIL the
            # products release (PP-OCR cls, a feed's binning and moments: 9.2 ms one after the
            # other, 6.3 ms side by side; one task each, both threads binned first, then both
            # multiplied)
            observer_tasks = observed(outputs)
            work = [binners.submit(functools.partial(_run_each, observer_tasks))] if observer_tasks else []
            work += [binners.submit(task) for task in _batched(updates(outputs))]
            for done in work:
                done.result()  # every update of this feed before any of the next

        pending = None
        for feed in feeds:
            if ahead:
                submitted = runner.submit(run, count, feed)
                if pending is not None:
                    absorb(pending.result())
                pending = submitted
            else:
                absorb(run(count, feed))
            count += 1
        if pending is not None:
            absorb(pending.result())
    return count


def _batched(updates: list[functools.partial]) -> list[Callable[[], None]]:
    """``updates`` (each a histogram's update of one array) as tasks of at least ``_TASK_BYTES``
    each, but the last: a larger array's update is a task of its own."""
    batches: list[list[functools.partial]] = [[]]
    size = 0
    for update in updates:
        if size >= _TASK_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(update)
        size += update.args[0].nbytes
    return [batch[0] if len(batch) == 1 else functools.partial(_run_each, batch) for batch in batches if batch]


def _run_each(tasks: Sequence[Callable[[], None]]) -> None:
    for task in tasks:
        task()


def collect_histograms(
    float_model: model_io.ModelLike,
    feeds: FeedSource,
    *,
    histogram: bool = True,
    bins: int = 8192,
    max_pass_bytes: int = DEFAULT_PASS_BYTES,
    progress: bool | None = None,
    observe: Observer | None = None,
    tensors: Collection[str] | None = None,
    borrowed: Mapping[str, str | tuple[float, float]] | None = None,
    anchors: Mapping[str, tuple[float, float]] | None = None,
) -> tuple[dict[str, StreamingHistogram], int]:
    """Stream ``feeds`` through ``float_model``; per-tensor statistics and the number of samples.
    ``anchors``: per tensor, the ``(min, max)`` every sample lies in; its histogram then covers that
    interval from the start and never regrows, so histograms of any split of the samples sum exactly
    (:mod:`kenosis_rewrite.calibration.sharded`).

    ``histogram=False`` keeps only min/max (faster; enough for ``method="minmax"``). ``observe``:
    called with each run's tensors by name (split runs: each part, in feed order); any callables it
    returns (independent of each other) run on the binning threads before the next feed's tensors
    are shown. ``tensors``: only these (of those :func:`calibrated_tensors` selects) are exposed
    and measured; the others stay inside the graph, where onnxruntime may fuse them away. ``borrowed``: tensors whose range the quantizer
    sets itself (:func:`~kenosis_rewrite.calibration.ort_static.ranges_the_quantizer_sets`), not
    measured: one that takes a measured tensor's range gets that tensor's statistics (the same
    object), one with a fixed range gets none.
    """
    histograms, samples, aliases = _collect(float_model, feeds, "full" if histogram else "minmax", bins,
                                            max_pass_bytes, progress, observe, tensors, borrowed, anchors=anchors)
    histograms.update({name: histograms[source] for name, source in aliases.items()
                       if isinstance(source, str) and source in histograms})
    return histograms, samples


def _collect(float_model, feeds, kind, bins, max_pass_bytes, progress, observe, tensors, borrowed,
             percentile: float = 99.99, anchors: Mapping[str, tuple[float, float]] | None = None,
             ) -> tuple[dict[str, StreamingHistogram], int, dict[str, str | tuple[float, float]]]:
    """The statistics of the measured tensors, the number of samples, and the borrowed tensors left
    unmeasured (each -> its source, as in ``borrowed``). ``kind``: ``"full"`` histograms,
    ``"minmax"`` only, or ``"tails"`` (:class:`PercentileTails` for tensors of ``_TAILS_FROM_BYTES`` or more,
    full histograms below: both give the same percentile range)."""
    model = float_model if isinstance(float_model, onnx.ModelProto) else _float_proto(float_model)
    first_pass = _feed_iterable(feeds)
    iterator = iter(first_pass)
    first = next(iterator, None)
    if first is None:
        raise CalibrationError("no calibration samples: the feeds are empty")
    selected = calibrated_tensors(model, first)
    if tensors is not None:
        wanted = set(tensors)
        selected = {name: size for name, size in selected.items() if name in wanted}
    aliases = {name: source for name, source in (borrowed or {}).items()
               if name in selected and (not isinstance(source, str) or source in selected)}
    selected = {name: size for name, size in selected.items() if name not in aliases}
    groups = _groups(selected, max_pass_bytes)
    if len(groups) > 1 and not _reiterable(feeds):
        groups = [[name for group in groups for name in group]]  # one pass is all a generator allows
    histograms: dict[str, StreamingHistogram] = {}
    def factory(name: str) -> StreamingHistogram:
        if kind == "tails" and selected[name] >= _TAILS_FROM_BYTES:
            return PercentileTails(bins, percentile)
        # only entropy and mse ("full") leave the zeros out
        made = StreamingHistogram(bins, keep_histogram=kind != "minmax", count_zeros=kind == "full")
        if anchors and name in anchors and made.keep_histogram:
            made.cover(*anchors[name])
        return made

    total = _length(feeds)
    samples = 0
    for index, names in enumerate(groups):
        session = _session(_augmented(model, names))
        if index == 0:
            stream: Iterable = _chain(first, iterator)
        else:
            stream = _feed_iterable(feeds)
        label = "calibration" if len(groups) == 1 else f"calibration {index + 1}/{len(groups)}"
        # running ahead holds two runs' tensors: only where two fit in the budget
        ahead = 2 * sum(selected[name] for name in names) <= max_pass_bytes
        views = sum(selected[name] for name in names) >= _VIEWS_FROM_BYTES * len(names)
        samples = _run_group(session, names, _progress(stream, progress, total, label), histograms, factory,
                             observe, ahead=ahead, views=views)
        del session
    return histograms, samples, aliases


def _chain(first: Mapping[str, np.ndarray], rest: Iterator[Mapping[str, np.ndarray]]) -> Iterator:
    yield first
    yield from rest


def _cache_file(cache: str | os.PathLike, key: str) -> Path:
    path = Path(cache)
    return path / f"{key}.json" if path.is_dir() or not path.suffix else path


def collect_ranges(
    float_model: model_io.ModelLike,
    feeds: FeedSource,
    method: str = "minmax",
    percentile: float = 99.99,
    progress: bool | None = None,
    *,
    cache: str | os.PathLike | None = None,
    bins: int = 8192,
    max_pass_bytes: int = DEFAULT_PASS_BYTES,
    serialised: bool = False,
    observe: Observer | None = None,
    tensors: Collection[str] | None = None,
    borrowed: Mapping[str, str | tuple[float, float]] | None = None,
    extremes: Collection[str] = (),
) -> TensorRanges:
    """Per-tensor ``(lo, hi)`` ranges of every float tensor of ``float_model`` over ``feeds``.

    ``method``: ``"minmax"``, ``"percentile"`` (two-sided, ``percentile`` % of the mass kept),
    ``"entropy"`` (KL) or ``"mse"`` (see :mod:`kenosis_rewrite.calibration.histogram`).
    ``cache``: a JSON file, or a directory holding files named by the cache key (sha256 of the model
    + method + percentile). A matching cache is returned without running anything; otherwise the
    result is written there. The cache does not know the feeds: use a new file for new data.
    ``serialised``: ``float_model`` is a ModelProto that onnx_ir serialised (quantize()'s), used as it
    is: loading and serialising it again would give the same proto. ``observe``: as in
    :func:`collect_histograms` (not called when the ranges come from the cache). ``tensors``: only
    these, as in :func:`collect_histograms` (not with ``cache``: a ranges file holds every tensor);
    ``borrowed`` likewise. ``extremes``: tensors whose range is their exact min/max whatever the
    method (:mod:`~kenosis_rewrite.calibration.output_extremes`; not with ``cache`` either). With any
    of these three the result's ``model_sha256`` is empty: saved, it matches no model as a cache.
    ``progress=True``: a tqdm bar over the samples (none unless asked; the command line asks on a terminal).
    """
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}; known: {METHODS}")
    if cache is not None and (tensors is not None or borrowed or extremes):
        raise ValueError("a calibration cache holds the ranges of every tensor by one method: pass tensors=, "
                         "borrowed= or extremes=, or cache=, not both")
    model = float_model if serialised else _float_proto(float_model)
    # a partial measurement is no cache of the model's ranges: no model hash for it to match (and
    # none computed: serialising and hashing EfficientNet-Lite0 costs 28 ms of quantize())
    partial = tensors is not None or bool(borrowed) or bool(extremes)
    digest = "" if partial else model_hash(model)
    used_percentile = percentile if method == "percentile" else None
    cache_path = None
    if cache is not None:
        key = hashlib.sha256(f"{digest}:{method}:{used_percentile}".encode()).hexdigest()[:24]
        cache_path = _cache_file(cache, key)
        if cache_path.is_file():
            cached = TensorRanges.load(cache_path)
            if (cached.model_sha256, cached.method, cached.percentile) == (digest, method, used_percentile):
                return cached
    # a percentile needs only the histogram's tails, where the feeds can be read again for the rare
    # tensor whose tails do not settle it (PercentileTails)
    tails = method == "percentile" and _reiterable(feeds)
    kind = "tails" if tails else "minmax" if method == "minmax" else "full"
    histograms, samples, aliases = _collect(model, feeds, kind, bins, max_pass_bytes, progress, observe,
                                            tensors, borrowed, percentile)
    if tails:
        ranges = {name: h.percentile_range(percentile) if isinstance(h, PercentileTails)
                  else range_from_histogram(h, method, percentile) for name, h in histograms.items()}
        unsettled = [name for name, found in ranges.items() if found is None]
        if unsettled:
            again, _, _ = _collect(model, feeds, "full", bins, max_pass_bytes, progress, None, unsettled, None)
            ranges.update({name: range_from_histogram(h, method, percentile) for name, h in again.items()})
    else:
        ranges = {name: range_from_histogram(h, method, percentile) for name, h in histograms.items()}
    for name in set(extremes) & set(histograms):  # both histogram kinds keep the exact min/max
        histogram = histograms[name]
        ranges[name] = (float(histogram.minimum), float(histogram.maximum)) if histogram.count else (0.0, 0.0)
    # a fixed range: the quantizer needs the name, with any range (it sets its own)
    ranges.update({name: ranges[source] if isinstance(source, str) else source for name, source in aliases.items()
                   if not isinstance(source, str) or source in ranges})
    result = TensorRanges(ranges, method, used_percentile, samples, digest)
    if cache_path is not None:
        result.save(cache_path)
    return result


def quantize_with_ranges(float_model: model_io.ModelLike, ranges: TensorRanges, *, serialised: bool = False,
                         **quantize_static_kwargs) -> onnx.ModelProto:
    """``onnxruntime.quantization.quantize_static`` (QDQ by default) using precomputed ``ranges``.

    The ranges go in as ORT's own calibration cache (``calibration_cache_path``), so no
    calibration inference runs inside quantize_static; per-channel weight parameters are computed a
    tensor at a time (:mod:`kenosis_rewrite.calibration.ort_static`, the same model). Where
    ``ort_static`` handles the arguments, the model and the cache stay in memory (the same model as
    through files). ``serialised``: as in :func:`collect_ranges`. Any other keyword goes to quantize_static.
    """
    import tempfile

    from onnxruntime.quantization import CalibrationMethod, QuantFormat

    from kenosis_rewrite.calibration import ort_static

    if quantize_static_kwargs.get("calibrate_method", CalibrationMethod.MinMax) != CalibrationMethod.MinMax:
        raise ValueError("precomputed ranges enter quantize_static as a MinMax cache; drop calibrate_method")
    quantize_static_kwargs.setdefault("quant_format", QuantFormat.QDQ)
    model = float_model if serialised else _float_proto(float_model)
    if ort_static.handles(**quantize_static_kwargs):
        return ort_static.quantize_static_qdq_proto(model, ranges.to_cached_tensors_data(), **quantize_static_kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        source, target, cache = (os.path.join(tmp, f) for f in ("float.onnx", "qdq.onnx", "ranges.json"))
        onnx.save(model, source)
        ranges.write_ort_cache(cache)
        ort_static.quantize_static_qdq(source, target, cache, **quantize_static_kwargs)
        return onnx.load(target)

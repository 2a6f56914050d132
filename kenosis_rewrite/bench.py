"""Benchmark FP32 vs ``quantize_static`` vs ``fix()``-ed models on ONNX Runtime CPU.

Rules the harness follows so that numbers from one run can be compared with each other:

* one process, every variant's session built up front, single-thread by default
  (``intra_op_num_threads=threads``, ``inter_op_num_threads=1``, sequential execution);
* ``warmup`` runs per variant, then ``runs`` timed runs per variant, **interleaved round-robin**
  in turns of ~0.2 s, the order reversed every other round, so that drift in clock speed or noisy
  neighbours hits every variant alike; each turn starts with ~30 ms of untimed runs, because the
  first runs after a session switch are up to 15% slower (caches full of the other model) and
  made medians of short turns swing by 20-40% between identical runs;
* median, p90 and FPS per variant; speedup against FP32 and against the unfixed model;
* a stability check: the medians of the first and second half of each variant's runs; when they
  differ by more than 5% the machine changed speed while timing, the whole measurement is repeated
  (``retries``) and the steadiest kept, and the report says how steady it was.

    result = run_bench("zoo:mtcnn_onet", configs=("default", "u8s8"))
    print(result.to_markdown())

The CLI's ``kenosis-rewrite bench`` calls :func:`bench_main`.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from kenosis_rewrite import _io, _timing
from kenosis_rewrite.fidelity import random_feeds
from kenosis_rewrite.errors import KenosisError, NotAnOnnxModelError, RuntimeMeasurementError

__all__ = [
    "LatencyStats",
    "Fidelity",
    "ThroughputStats",
    "VariantResult",
    "BenchResult",
    "session_options",
    "measure_latency",
    "measure_throughput",
    "fidelity",
    "synthetic_feeds",
    "run_bench",
    "bench_main",
]

ModelLike = onnx.ModelProto | bytes
FP32 = "fp32"
UNSTEADY_DRIFT = 0.05  # halves of a variant's runs further apart than this: the machine was not steady
FIX_SUFFIX = "+fix"


# --------------------------------------------------------------------------- sessions and timing


def session_options(threads: int = 1) -> ort.SessionOptions:
    """Single-stream CPU options: ``threads`` intra-op threads, 1 inter-op, sequential, all optimisations."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return options


def _model_bytes(model: ModelLike) -> bytes:
    if isinstance(model, bytes):
        return model
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString()
    raise TypeError(f"expected onnx.ModelProto or bytes, got {type(model).__name__}")


def _session(name: str, model: ModelLike, threads: int) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(_model_bytes(model), session_options(threads), providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime raises its own exception types
        raise RuntimeMeasurementError(f"ONNX Runtime could not load variant {name!r}: {error}") from error


def _run(name: str, session: ort.InferenceSession, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    try:
        return session.run(None, dict(feed))
    except Exception as error:
        raise RuntimeMeasurementError(f"ONNX Runtime failed to run variant {name!r}: {error}") from error


@dataclasses.dataclass(frozen=True)
class LatencyStats:
    """Latency of one variant over its timed runs, in milliseconds."""

    median_ms: float
    p90_ms: float
    mean_ms: float
    min_ms: float
    runs: int
    # |median of the first half of the runs - median of the second half| / median: a machine that
    # got busier (or quieter) during the measurement shows here, so a report can say so
    drift: float = 0.0

    @property
    def fps(self) -> float:
        """Inferences per second at the median latency."""
        return 1000.0 / self.median_ms if self.median_ms > 0 else float("inf")

    @classmethod
    def from_seconds(cls, samples: Sequence[float]) -> LatencyStats:
        ms = np.asarray(samples, dtype=np.float64) * 1000.0
        median = float(np.median(ms))
        half = len(ms) // 2
        drift = abs(float(np.median(ms[:half])) - float(np.median(ms[half:]))) / median if half and median > 0 else 0.0
        return cls(median, float(np.percentile(ms, 90)), float(ms.mean()), float(ms.min()), len(ms), drift)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "fps": self.fps}


def measure_latency(
    models: Mapping[str, ModelLike],
    feed: Mapping[str, np.ndarray],
    threads: int = 1,
    warmup: int = 20,
    runs: int = 100,
    min_seconds: float = 0.0,
    turn_seconds: float = _timing.TURN_SECONDS,
) -> dict[str, LatencyStats]:
    """Latency of every model on ``feed``: ``warmup`` runs each, then interleaved timed runs each.

    At least ``runs`` timed runs per model, more when needed to spend ``min_seconds`` on each
    (sub-millisecond models need thousands of runs for a stable median on a shared VM); turns and
    settling runs as in :func:`kenosis_rewrite._timing.turn_plan`.
    """
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    sessions = {name: _session(name, model, threads) for name, model in models.items()}
    samples = _timing.interleaved_samples(sessions, feed, warmup=warmup, runs=runs, min_seconds=min_seconds,
                                          turn_seconds=turn_seconds)
    return {name: LatencyStats.from_seconds(times) for name, times in samples.items()}


@dataclasses.dataclass(frozen=True)
class ThroughputStats:
    """Sustained throughput of ``streams`` sessions running concurrently, each on its own thread."""

    streams: int
    seconds: float
    runs_per_stream: tuple[int, ...]

    @property
    def total_fps(self) -> float:
        return sum(self.runs_per_stream) / self.seconds if self.seconds > 0 else 0.0

    @property
    def fps_per_stream(self) -> float:
        return self.total_fps / self.streams

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_fps": self.total_fps, "fps_per_stream": self.fps_per_stream}


def measure_throughput(
    model: ModelLike,
    feed: Mapping[str, np.ndarray],
    streams: int = 2,
    seconds: float = 5.0,
    warmup: int = 5,
) -> ThroughputStats:
    """Run ``streams`` sessions (1 intra-op thread each) on ``streams`` threads for ``seconds``; count runs.

    onnxruntime releases the GIL inside ``run``, so the streams really run in parallel.
    """
    if streams < 1 or seconds <= 0:
        raise ValueError(f"need streams >= 1 and seconds > 0, got streams={streams}, seconds={seconds}")
    data = _model_bytes(model)
    sessions = [_session(f"stream {i}", data, 1) for i in range(streams)]
    feed = dict(feed)
    for index, session in enumerate(sessions):
        for _ in range(warmup):
            _run(f"stream {index}", session, feed)
    counts = [0] * streams
    errors: list[BaseException] = []
    start_line = threading.Barrier(streams + 1)
    deadline = [0.0]

    def worker(index: int) -> None:
        start_line.wait()
        try:
            while time.perf_counter() < deadline[0]:
                sessions[index].run(None, feed)
                counts[index] += 1
        except Exception as error:  # reported after join
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    deadline[0] = started + seconds
    start_line.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeMeasurementError(f"a throughput stream failed: {errors[0]}")
    return ThroughputStats(streams, elapsed, tuple(counts))


# --------------------------------------------------------------------------- fidelity


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


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64).ravel()
    b = b.astype(np.float64).ravel()
    norms = np.linalg.norm(a) * np.linalg.norm(b)
    if norms == 0:
        return 1.0 if np.array_equal(a, b) else 0.0
    return float(np.dot(a, b) / norms)


def _top1(reference: np.ndarray, candidate: np.ndarray) -> float:
    classes = reference.shape[-1]
    return float(np.mean(reference.reshape(-1, classes).argmax(1) == candidate.reshape(-1, classes).argmax(1)))


def fidelity(
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
    cosine = min(_cosine(r, c) for r, c in zip(reference, candidate))
    max_abs = max(float(np.max(np.abs(r.astype(np.float64) - c.astype(np.float64)), initial=0.0))
                  for r, c in zip(reference, candidate))
    top1 = None
    if class_output is not None:
        pairs = zip(_per_output(reference_outputs)[class_output], _per_output(outputs)[class_output])
        top1 = float(np.mean([_top1(np.asarray(r), np.asarray(c)) for r, c in pairs]))
    return Fidelity(cosine, max_abs, top1, len(outputs))


# --------------------------------------------------------------------------- feeds

# Random N(0,1) feeds for a user model (one implementation, shared with fix()'s fidelity check).
synthetic_feeds = random_feeds


# --------------------------------------------------------------------------- results


@dataclasses.dataclass
class VariantResult:
    """Everything measured for one variant (FP32, a quantize_static config, or that config fixed)."""

    name: str
    config: str | None
    fixed: bool
    size_bytes: int | None = None
    node_count: int | None = None
    integer_mac_fraction: float | None = None
    latency: LatencyStats | None = None
    speedup_vs_fp32: float | None = None
    speedup_vs_unfixed: float | None = None
    fidelity: Fidelity | None = None
    error: str | None = None
    build_s: float | None = None  # wall time to make this variant (the quantizer's, or fix()'s)
    # x FP32 at the other thread counts asked for (``run_bench(also_threads=...)``)
    speedup_by_threads: dict[int, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["latency"] = self.latency.to_dict() if self.latency else None
        return data


def _fmt(value: float | None, pattern: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, pattern)


def _size(size: int | None) -> str:
    if size is None:
        return "n/a"
    return f"{size / 1e6:.2f} MB" if size >= 1e5 else f"{size / 1e3:.1f} kB"


_COLUMNS = ("variant", "median ms", "p90 ms", "FPS", "x FP32", "x unfixed", "int MACs",
            "cosine", "max abs err", "top-1", "size", "nodes", "build s")


def _columns(also_threads: Sequence[int]) -> tuple[str, ...]:
    index = _COLUMNS.index("x unfixed")
    return _COLUMNS[:index] + tuple(f"x FP32 ({n} thr)" for n in also_threads) + _COLUMNS[index:]


def _row(variant: VariantResult, also_threads: Sequence[int] = ()) -> list[str]:
    lat = variant.latency
    fid = variant.fidelity
    mac = None if variant.integer_mac_fraction is None else 100 * variant.integer_mac_fraction
    return [
        variant.name,
        _fmt(lat and lat.median_ms, ".3f"), _fmt(lat and lat.p90_ms, ".3f"), _fmt(lat and lat.fps, ".1f"),
        _fmt(variant.speedup_vs_fp32, ".2f"),
        *(_fmt(variant.speedup_by_threads.get(n), ".2f") for n in also_threads),
        _fmt(variant.speedup_vs_unfixed, ".2f", "-"),
        _fmt(mac, ".1f") + ("%" if mac is not None else ""),
        _fmt(fid and fid.cosine, ".5f"), _fmt(fid and fid.max_abs_err, ".4g"),
        _fmt(None if fid is None or fid.top1_agreement is None else 100 * fid.top1_agreement, ".0f", "-")
        + ("%" if fid is not None and fid.top1_agreement is not None else ""),
        _size(variant.size_bytes), _fmt(variant.node_count, "d"), _fmt(variant.build_s, ".1f", "-"),
    ]


@dataclasses.dataclass
class BenchResult:
    """The outcome of :func:`run_bench`: one :class:`VariantResult` per variant plus the setup."""

    model: str
    threads: int
    runs: int
    warmup: int
    feeds: str  # where the inputs came from
    variants: list[VariantResult]
    throughput: dict[str, ThroughputStats] = dataclasses.field(default_factory=dict)
    environment: dict[str, str] = dataclasses.field(default_factory=dict)
    also_threads: tuple[int, ...] = ()

    def variant(self, name: str) -> VariantResult:
        for variant in self.variants:
            if variant.name == name:
                return variant
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "threads": self.threads, "also_threads": list(self.also_threads),
            "runs": self.runs, "warmup": self.warmup,
            "feeds": self.feeds, "environment": dict(self.environment),
            "variants": [variant.to_dict() for variant in self.variants],
            "throughput": {name: stats.to_dict() for name, stats in self.throughput.items()},
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _setup_line(self) -> str:
        env = ", ".join(f"{k} {v}" for k, v in self.environment.items())
        return (f"{self.threads} thread(s), {self.warmup} warm-up + at least {self.runs} interleaved runs per variant (3 s of runs for fast models); "
                f"fidelity vs FP32 on {self.feeds}. {env}")

    def stability_note(self) -> str:
        """One sentence on how steady the machine was while timing (see :attr:`LatencyStats.drift`)."""
        drifts = {v.name: v.latency.drift for v in self.variants if v.latency is not None}
        if not drifts:
            return ""
        name = max(drifts, key=drifts.get)
        text = f"Stability: the first and second half of each variant's runs agree within {drifts[name]:.1%} ({name})."
        if drifts[name] > UNSTEADY_DRIFT:
            text += " The machine's speed changed while timing: re-run on an idle machine before comparing runs."
        return text

    def to_markdown(self) -> str:
        lines = [f"### {self.model}", "", self._setup_line(), "", self.stability_note(), "",
                 "| " + " | ".join(_columns(self.also_threads)) + " |", "|" + "---|" * len(_columns(self.also_threads))]
        lines += ["| " + " | ".join(_row(v, self.also_threads)) + " |" for v in self.variants if v.error is None]
        failed = [v for v in self.variants if v.error is not None]
        if failed:
            lines += ["", "Failed variants:"] + [f"- {v.name}: {v.error}" for v in failed]
        if self.throughput:
            lines += ["", "| variant | streams | total FPS | FPS per stream |", "|---|---|---|---|"]
            lines += [f"| {name} | {t.streams} | {t.total_fps:.1f} | {t.fps_per_stream:.1f} |"
                      for name, t in self.throughput.items()]
        return "\n".join(lines) + "\n"

    def to_html(self) -> str:
        """A self-contained page: an inline SVG bar chart of median latency, then the full table."""
        title = html.escape(f"kenosis-rewrite bench: {self.model}")
        table = _html_table(_columns(self.also_threads), [_row(v, self.also_threads) for v in self.variants if v.error is None])
        failed = "".join(f"<li>{html.escape(v.name)}: {html.escape(v.error)}</li>"
                         for v in self.variants if v.error is not None)
        throughput = ""
        if self.throughput:
            rows = [[name, str(t.streams), f"{t.total_fps:.1f}", f"{t.fps_per_stream:.1f}"]
                    for name, t in self.throughput.items()]
            throughput = "<h2>Concurrent throughput</h2>" + _html_table(
                ("variant", "streams", "total FPS", "FPS per stream"), rows)
        return (
            "<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>{title}</title><style>{_CSS}</style></head><body>"
            f"<h1>{title}</h1><p>{html.escape(self._setup_line())}</p><p>{html.escape(self.stability_note())}</p>"
            f"<h2>Median latency (ms, lower is better)</h2>{_latency_svg(self.variants)}"
            f"<h2>Latency and fidelity</h2>{table}"
            + (f"<h2>Failed variants</h2><ul>{failed}</ul>" if failed else "")
            + throughput + "</body></html>\n"
        )


_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em;color:#222}"
    "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
    "td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}"
    ".bar{fill:#4a7fb5}.bar.fix{fill:#3a9a5b}.bar.fp32{fill:#999}svg text{font-size:12px}"
)


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _latency_svg(variants: Sequence[VariantResult]) -> str:
    """Horizontal bars of median latency, one per measured variant."""
    measured = [v for v in variants if v.latency is not None]
    if not measured:
        return "<p>no latency measured</p>"
    longest = max(v.latency.median_ms for v in measured) or 1.0
    label_w, bar_w, row_h = 150, 420, 24
    rows = []
    for index, variant in enumerate(measured):
        y = index * row_h
        width = max(1.0, bar_w * variant.latency.median_ms / longest)
        kind = " fp32" if variant.name == FP32 else (" fix" if variant.fixed else "")
        rows.append(
            f"<text x='0' y='{y + 16}'>{html.escape(variant.name)}</text>"
            f"<rect class='bar{kind}' x='{label_w}' y='{y + 4}' width='{width:.1f}' height='{row_h - 8}'/>"
            f"<text x='{label_w + width + 6:.1f}' y='{y + 16}'>{variant.latency.median_ms:.3f} ms</text>"
        )
    height = row_h * len(measured)
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{label_w + bar_w + 110}' height='{height}' "
            f"role='img' aria-label='median latency per variant'>{''.join(rows)}</svg>")


# --------------------------------------------------------------------------- the benchmark


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """The FP32 model and the feeds a benchmark uses."""

    label: str
    model: onnx.ModelProto
    calibration: list[dict[str, np.ndarray]]
    evaluation: list[dict[str, np.ndarray]]
    class_output: int | None
    source: str


def _load_user_model(path: str) -> onnx.ModelProto:
    _io.refuse_over_2gb(path)  # bench runs the model in memory: over 2 GB, a typed refusal before reading it
    try:
        return onnx.load(path)
    except FileNotFoundError:
        raise
    except Exception as error:
        raise NotAnOnnxModelError(f"{path}: not a readable ONNX model ({error})") from error


def _zoo_inputs(name: str, calibration_samples: int, cache_dir: str | None, photos: str = "default") -> _Inputs:
    """Real photos through the model's preprocessing: first ones calibrate, the rest evaluate.
    ``photos="large"``: calibrate on scenes, evaluate on 100 photos of objects (``zoo.PHOTO_SETS``)."""
    from kenosis_rewrite import zoo  # noqa: PLC0415

    entry = zoo.get_model(name)
    model = zoo.load_model(entry.name, cache_dir)
    if photos == "large":
        calibration = zoo.model_feeds(entry.name, zoo.load_photo_set("scenes", max(1, calibration_samples), cache_dir))
        evaluation = zoo.model_feeds(entry.name, zoo.load_photo_set("objects", cache_dir=cache_dir))
        return _Inputs(f"zoo:{entry.name}", model, calibration, evaluation, entry.class_output,
                       f"{len(evaluation)} held-out real photos of objects (calibrated on {len(calibration)} scenes)")
    if photos != "default":
        raise ValueError(f"photos must be 'default' or 'large', not {photos!r}")
    feeds = zoo.model_feeds(entry.name, zoo.load_photos(cache_dir=cache_dir))
    count = max(1, min(calibration_samples, len(feeds) - 1))
    calibration, evaluation = feeds[:count], feeds[count:]
    return _Inputs(f"zoo:{entry.name}", model, calibration, evaluation, entry.class_output,
                   f"{len(evaluation)} held-out real photos (calibrated on {len(calibration)})")


def _path_inputs(path: str, calibration_samples: int) -> _Inputs:
    model = _load_user_model(path)
    calibration = synthetic_feeds(model, max(1, calibration_samples), seed=0)
    evaluation = synthetic_feeds(model, 4, seed=1)
    return _Inputs(os.path.basename(path), model, calibration, evaluation, None,
                   "4 random N(0,1) inputs (synthetic; a user model has no known preprocessing)")


def _resolve_inputs(model: str, calibration_samples: int, cache_dir: str | None, photos: str = "default") -> _Inputs:
    if model.startswith("zoo:"):
        return _zoo_inputs(model[len("zoo:"):], calibration_samples, cache_dir, photos)
    return _path_inputs(model, calibration_samples)


def _integer_mac_fraction(model: onnx.ModelProto, threads: int) -> float | None:
    try:
        from kenosis_rewrite.explain import explain  # noqa: PLC0415

        return float(explain(model, threads=threads).integer_mac_fraction)
    except Exception:  # explain is informative only: n/a rather than a failed benchmark
        return None


def _outputs(name: str, model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]],
             threads: int) -> list[list[np.ndarray]]:
    session = _session(name, model, threads)
    return [_run(name, session, feed) for feed in feeds]


def _error_text(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


class _Variants:
    """The models a benchmark compares and what was recorded making them (failures recorded, not raised)."""

    def __init__(self, inputs: _Inputs, say: Callable[[str], None]):
        self.inputs, self.say = inputs, say
        self.models: dict[str, onnx.ModelProto] = {FP32: inputs.model}
        self.results: list[VariantResult] = [VariantResult(FP32, None, False)]

    def make(self, name: str, config: str | None, fixed: bool, build: Callable[[], onnx.ModelProto],
             progress: str | None = None) -> onnx.ModelProto | None:
        """Record variant ``name`` made by ``build()`` (timed); None when it failed."""
        self.say(progress or name)
        start = time.perf_counter()
        try:
            model = build()
        except Exception as error:  # noqa: BLE001 - one variant's failure is a finding, not the bench's
            self.results.append(VariantResult(name, config, fixed, error=_error_text(error)))
            return None
        result = VariantResult(name, config, fixed, build_s=time.perf_counter() - start)
        if isinstance(model, tuple):  # (model, seconds the tool itself reports)
            model, result.build_s = model
        self.models[name] = model
        self.results.append(result)
        return model


def _quantize_variants(variants: _Variants) -> None:
    """kenosis ``quantize()`` with the calibration photos and with self-calibration."""
    from kenosis_rewrite.quantize import quantize  # noqa: PLC0415

    inputs = variants.inputs
    variants.make("quantize()", None, True, lambda: quantize(inputs.model, inputs.calibration))
    variants.make("quantize(synthetic)", None, True, lambda: quantize(inputs.model, None))


def parse_peer(spec: str) -> tuple[str, str | None]:
    """``"quark:INT8_CNN_DEFAULT"`` -> ``("quark", "INT8_CNN_DEFAULT")``; ``"nncf"`` -> ``("nncf", None)``."""
    name, _, preset = spec.partition(":")
    return name.strip().lower(), (preset.strip() or None)


def _peer_variants(variants: _Variants, peer_specs: Sequence[str], include_fix: bool, cache_dir: str | None) -> None:
    """Each peer's output on the calibration feeds (its own venv, :mod:`kenosis_rewrite.peers`) and its fix()."""
    from kenosis_rewrite import peers  # noqa: PLC0415
    from kenosis_rewrite.pipeline import fix  # noqa: PLC0415

    inputs = variants.inputs
    for spec in peer_specs:
        name, preset = parse_peer(spec)

        def run_peer(name=name, preset=preset):
            done = peers.quantize_with_peer(name, inputs.model, inputs.calibration, preset=preset, cache_dir=cache_dir)
            return done.model, done.wall_s

        label = name if preset is None else f"{name}:{preset}"
        quantized = variants.make(label, label, False, run_peer, progress=f"peer {label}")
        if quantized is not None and include_fix:
            # fix() gets the calibration feeds: peers that leave weighted outputs unquantized (NNCF) need ranges
            variants.make(label + FIX_SUFFIX, label, True, lambda q=quantized: fix(q, calibration=inputs.calibration),
                          progress=f"fix ({label})")


def _build_variants(inputs: _Inputs, configs: Sequence[str], include_fix: bool,
                    say: Callable[[str], None], include_latency: bool = False,
                    include_quantize: bool = False, peer_specs: Sequence[str] = (),
                    cache_dir: str | None = None) -> tuple[dict[str, onnx.ModelProto], list[VariantResult]]:
    """FP32, quantize(), each peer and its fix(), each quantize_static config and its fix()."""
    from kenosis_rewrite.ort_quantize import quantize_with_ort  # noqa: PLC0415
    from kenosis_rewrite.pipeline import fix  # noqa: PLC0415

    variants = _Variants(inputs, say)
    if include_quantize:
        _quantize_variants(variants)
    _peer_variants(variants, peer_specs, include_fix, cache_dir)
    for config in configs:
        quantized = variants.make(config, config, False, lambda c=config: quantize_with_ort(inputs.model, inputs.calibration, c),
                                  progress=f"quantize_static ({config})")
        if quantized is None or not include_fix:
            continue
        variants.make(config + FIX_SUFFIX, config, True, lambda q=quantized: fix(q), progress=f"fix ({config})")
        if include_latency:
            variants.make(config + FIX_SUFFIX + "+latency", config, True,
                          lambda q=quantized: fix(q, optimize_for="latency", calibration=inputs.calibration[:1]),
                          progress=f"fix ({config}, optimize_for=latency)")
    return variants.models, variants.results


def _describe(variant: VariantResult, model: onnx.ModelProto, inputs: _Inputs,
              reference: list[list[np.ndarray]], threads: int) -> None:
    """Fill size, node count, integer MAC share and fidelity of one variant (errors recorded)."""
    variant.size_bytes = model.ByteSize()
    variant.node_count = len(model.graph.node)
    variant.integer_mac_fraction = _integer_mac_fraction(model, threads)
    try:
        outputs = _outputs(variant.name, model, inputs.evaluation, threads)
        variant.fidelity = fidelity(reference, outputs, inputs.class_output)
    except (KenosisError, ValueError) as error:
        variant.error = _error_text(error)


def _max_drift(latencies: Mapping[str, LatencyStats]) -> float:
    return max((stats.drift for stats in latencies.values()), default=0.0)


def _steadiest_latency(models, feed, threads, warmup, runs, min_seconds, retries, say) -> dict[str, LatencyStats]:
    """:func:`measure_latency`, repeated up to ``retries`` times while the machine is not steady."""
    best = measure_latency(models, feed, threads, warmup, runs, min_seconds)
    for attempt in range(retries):
        if _max_drift(best) <= UNSTEADY_DRIFT:
            break
        say(f"machine not steady (runs drifted {_max_drift(best):.0%}): timing again ({attempt + 1}/{retries})")
        again = measure_latency(models, feed, threads, warmup, runs, min_seconds)
        if _max_drift(again) < _max_drift(best):
            best = again
    return best


def _speedups(results: Sequence[VariantResult]) -> None:
    by_name = {v.name: v for v in results}
    fp32 = by_name[FP32].latency
    for variant in results:
        if variant.latency is None:
            continue
        variant.speedup_vs_fp32 = fp32.median_ms / variant.latency.median_ms if fp32 else None
        unfixed = by_name.get(variant.config) if variant.fixed else None
        if unfixed is not None and unfixed.latency is not None:
            variant.speedup_vs_unfixed = unfixed.latency.median_ms / variant.latency.median_ms


def _environment() -> dict[str, str]:
    return {
        "onnxruntime": ort.__version__,
        "cpu": _timing.cpu_description(),
        "logical cpus": str(os.cpu_count()),
        "python": platform.python_version(),
    }


def run_bench(
    model: str,
    configs: Sequence[str] = ("default", "u8s8", "sym"),
    threads: int = 1,
    runs: int = 100,
    warmup: int = 20,
    calibration_samples: int = 6,
    include_fix: bool = True,
    streams: int = 0,
    stream_seconds: float = 5.0,
    cache_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
    include_latency: bool = False,
    include_quantize: bool = False,
    min_seconds: float = 0.0,
    retries: int = 2,
    peers: Sequence[str] = (),
    also_threads: Sequence[int] = (),
    photos: str = "default",
) -> BenchResult:
    """FP32 vs ``quantize_static`` in each config vs its ``fix()``: latency, size, integer MACs, fidelity.

    Args:
        model: a path to an FP32 ``.onnx`` model, or ``"zoo:NAME"`` for a registered real model
            (real photos, the model's own preprocessing; the first ``calibration_samples``
            photos calibrate, the others evaluate fidelity; ``photos="large"``: scenes calibrate,
            100 photos of objects evaluate). A user path gets random N(0,1)
            inputs with dynamic dims set to 1 (batch) or 224/128.
        configs: names from :data:`kenosis_rewrite.ort_quantize.ORT_CONFIGS`.
        streams: when > 0, also measure concurrent throughput with that many 1-thread sessions.
        progress: called with a short message before each step (e.g. print to stderr).
        include_latency: also ``fix(..., optimize_for="latency")`` of each config.
        include_quantize: also kenosis ``quantize()`` (calibration photos, and self-calibration).
        min_seconds: more timed runs than ``runs`` when needed to spend this long on each variant.
        retries: times the whole latency measurement is repeated when the machine's speed changed
            during it (:attr:`LatencyStats.drift` above ``UNSTEADY_DRIFT``); the steadiest is kept.
        peers: peer quantizers to run on the same calibration feeds, each from its own virtual
            environment (:mod:`kenosis_rewrite.peers`): ``"nncf"``, ``"inc"``, ``"quark"`` or
            ``"quark:PRESET"``; each gives a variant and its ``fix()``. A peer that is not installed
            is a failed variant whose message says how to install it.
        also_threads: other intra-op thread counts to time every variant at (x FP32 columns).
    """
    say = progress or (lambda message: None)
    from kenosis_rewrite.ort_quantize import ORT_CONFIGS  # noqa: PLC0415

    unknown = [c for c in configs if c not in ORT_CONFIGS]
    if unknown:
        raise KenosisError(f"unknown quantize_static config(s) {unknown}; known: {', '.join(ORT_CONFIGS)}")
    say(f"loading {model}")
    inputs = _resolve_inputs(model, calibration_samples, cache_dir, photos)
    models, results = _build_variants(inputs, configs, include_fix, say, include_latency, include_quantize,
                                      peers, cache_dir)
    say("FP32 reference outputs")
    reference = _outputs(FP32, inputs.model, inputs.evaluation, threads)
    for variant in results:
        if variant.error is None:
            say(f"describing {variant.name}")
            _describe(variant, models[variant.name], inputs, reference, threads)
    measurable = {v.name: models[v.name] for v in results if v.error is None}
    say(f"timing {len(measurable)} variants: {warmup} warm-up + {runs} interleaved runs each")
    latencies = _steadiest_latency(measurable, inputs.evaluation[0], threads, warmup, runs, min_seconds, retries, say)
    for variant in results:
        variant.latency = latencies.get(variant.name)
    _speedups(results)
    for count in also_threads:
        say(f"timing {len(measurable)} variants at {count} threads")
        at_count = _steadiest_latency(measurable, inputs.evaluation[0], count, warmup, runs, min_seconds, retries, say)
        for variant in results:
            if variant.name in at_count:
                variant.speedup_by_threads[count] = at_count[FP32].median_ms / at_count[variant.name].median_ms
    throughput = {}
    for name, proto in measurable.items() if streams > 0 else ():
        say(f"throughput {name}: {streams} streams x {stream_seconds:g} s")
        throughput[name] = measure_throughput(proto, inputs.evaluation[0], streams, stream_seconds)
    return BenchResult(inputs.label, threads, runs, warmup, inputs.source, results, throughput,
                       _environment(), tuple(also_threads))


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kenosis-rewrite bench",
        description="Measure FP32 vs quantize_static vs fix() side by side on ONNX Runtime CPU.",
    )
    parser.add_argument("model", help="FP32 .onnx model, or zoo:NAME for a registered real model")
    parser.add_argument("--configs", default="default,u8s8,sym",
                        help="comma-separated quantize_static configs (default: default,u8s8,sym)")
    parser.add_argument("--threads", default="1",
                        help="intra-op threads per session; a list (1,2) times every variant at each (default 1)")
    parser.add_argument("--peers", default="",
                        help="peer quantizers on the same calibration feeds, each from its own venv: nncf,inc,quark "
                             "or quark:PRESET (install with `kenosis-rewrite peers install NAME`)")
    parser.add_argument("--runs", type=int, default=100, help="timed runs per variant (default 100)")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up runs per variant (default 20)")
    parser.add_argument("--retries", type=int, default=2,
                        help="time again (up to this many times) when the machine's speed changed while timing (default 2)")
    parser.add_argument("--min-seconds", type=float, default=3.0,
                        help="more runs when needed to time each variant this long (default 3)")
    parser.add_argument("--calibration-samples", type=int, default=6, help="calibration inputs (default 6)")
    parser.add_argument("--photos", choices=("default", "large"), default="default",
                        help="zoo models: 'large' calibrates on scenes and evaluates on 100 photos of objects "
                             "(ai-benchmark 0.1.2 wheel, fetched once)")
    parser.add_argument("--no-fix", action="store_true", help="leave out the fix() variants")
    parser.add_argument("--latency", action="store_true",
                        help="also fix(optimize_for='latency') of each config (measured placement)")
    parser.add_argument("--quantize", action="store_true",
                        help="also kenosis quantize() (photo and self-calibration)")
    parser.add_argument("--streams", type=int, default=0, help="also measure N concurrent 1-thread streams")
    parser.add_argument("--stream-seconds", type=float, default=5.0, help="seconds per throughput measurement")
    parser.add_argument("--cache-dir", help="where zoo models and photos are cached (default $KENOSIS_CACHE)")
    parser.add_argument("--json", metavar="OUT", help="write the result as JSON")
    parser.add_argument("--markdown", metavar="OUT", help="write the markdown table to a file")
    parser.add_argument("--html", metavar="OUT", help="write a self-contained HTML report")
    return parser


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def _progress_printer(stream=sys.stderr) -> Callable[[str], None]:
    start = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=stream, flush=True)

    return say


def bench_main(argv: Sequence[str] | None = None) -> int:
    """``kenosis-rewrite bench``: run the benchmark, print markdown to stdout; 0 ok, 1 refused, 2 usage."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    try:
        threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    except ValueError:
        threads = [0]
    if not threads or min(threads) < 1 or args.runs < 1 or args.warmup < 0 or args.streams < 0 or args.retries < 0:
        print("kenosis-rewrite bench: error: --threads and --runs must be >= 1, --warmup, --streams and --retries >= 0",
              file=sys.stderr)
        return 2
    try:
        result = run_bench(
            args.model, configs, threads=threads[0], runs=args.runs, warmup=args.warmup,
            calibration_samples=args.calibration_samples, include_fix=not args.no_fix,
            streams=args.streams, stream_seconds=args.stream_seconds, cache_dir=args.cache_dir,
            progress=_progress_printer() if sys.stderr.isatty() else None,
            include_latency=args.latency, include_quantize=args.quantize, min_seconds=args.min_seconds,
            retries=args.retries, peers=tuple(p for p in args.peers.split(",") if p.strip()),
            also_threads=tuple(threads[1:]), photos=args.photos,
        )
    except (KenosisError, OSError) as error:
        print(f"kenosis-rewrite bench: error: {error}", file=sys.stderr)
        return 1
    markdown = result.to_markdown()
    print(markdown, end="")
    for path, text in ((args.json, result.to_json()), (args.markdown, markdown), (args.html, result.to_html())):
        if path:
            _write(path, text)
    return 0

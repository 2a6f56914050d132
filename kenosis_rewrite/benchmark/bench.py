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
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from kenosis_rewrite.benchmark.pages import (  # re-exported: the results were defined here
    FP32,
    UNSTEADY_DRIFT,
    BenchResult,
    LatencyStats,
    ThroughputStats,
    VariantResult,
)
from kenosis_rewrite.core import interleaved_timing, model_io, ort_sessions
from kenosis_rewrite.core.fidelity import Fidelity, random_feeds
from kenosis_rewrite.core.fidelity import output_fidelity as fidelity
from kenosis_rewrite.errors import KenosisError, NotAnOnnxModelError, RuntimeMeasurementError, one_line
from kenosis_rewrite.zoo.task_metrics import TaskMetric

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
FIX_SUFFIX = "+fix"


# --------------------------------------------------------------------------- sessions and timing


def session_options(threads: int = 1) -> ort.SessionOptions:
    """Single-stream CPU options: ``threads`` intra-op threads, 1 inter-op, sequential, all optimisations."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return ort_sessions.options(threads)


def _model_bytes(model: ModelLike) -> bytes:
    if isinstance(model, bytes):
        return model
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString()
    raise TypeError(f"expected onnx.ModelProto or bytes, got {type(model).__name__}")


def _session(name: str, model: ModelLike, threads: int) -> ort.InferenceSession:
    try:
        return ort_sessions.session(_model_bytes(model), session_options(threads))
    except Exception as error:  # onnxruntime raises its own exception types
        raise RuntimeMeasurementError(f"ONNX Runtime could not load variant {name!r}: {error}") from error


def _run(name: str, session: ort.InferenceSession, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    try:
        return session.run(None, dict(feed))
    except Exception as error:
        raise RuntimeMeasurementError(f"ONNX Runtime failed to run variant {name!r}: {error}") from error


def measure_latency(
    models: Mapping[str, ModelLike],
    feed: Mapping[str, np.ndarray],
    threads: int = 1,
    warmup: int = 20,
    runs: int = 100,
    min_seconds: float = 0.0,
    turn_seconds: float = interleaved_timing.TURN_SECONDS,
) -> dict[str, LatencyStats]:
    """Latency of every model on ``feed``: ``warmup`` runs each, then interleaved timed runs each.

    At least ``runs`` timed runs per model, more when needed to spend ``min_seconds`` on each
    (sub-millisecond models need thousands of runs for a stable median on a shared VM); turns and
    settling runs as in :func:`kenosis_rewrite.core.interleaved_timing.turn_plan`.
    """
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    sessions = {name: _session(name, model, threads) for name, model in models.items()}
    samples = interleaved_timing.interleaved_samples(sessions, feed, warmup=warmup, runs=runs, min_seconds=min_seconds,
                                          turn_seconds=turn_seconds)
    return {name: LatencyStats.from_seconds(times) for name, times in samples.items()}


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


# Random N(0,1) feeds for a user model (one implementation, shared with fix()'s fidelity check).
synthetic_feeds = random_feeds


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
    task: TaskMetric | None = None  # the zoo model's task score against FP32


def _load_user_model(path: str) -> onnx.ModelProto:
    model_io.refuse_over_2gb(path)  # bench runs the model in memory: over 2 GB, a typed refusal before reading it
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
                       f"{len(evaluation)} held-out real photos of objects (calibrated on {len(calibration)} scenes)",
                       entry.task)
    if photos != "default":
        raise ValueError(f"photos must be 'default' or 'large', not {photos!r}")
    feeds = zoo.model_feeds(entry.name, zoo.load_photos(cache_dir=cache_dir))
    count = max(1, min(calibration_samples, len(feeds) - 1))
    calibration, evaluation = feeds[:count], feeds[count:]
    return _Inputs(f"zoo:{entry.name}", model, calibration, evaluation, entry.class_output,
                   f"{len(evaluation)} held-out real photos (calibrated on {len(calibration)})", entry.task)


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


def _integer_mac_fraction(variant: VariantResult, model: onnx.ModelProto, threads: int) -> float | None:
    """explain()'s integer MAC share; None (n/a) when explain fails, the cause kept in ``variant.notes``.
    explain's own notes (e.g. shapes it measured, or could not) are kept there too."""
    try:
        from kenosis_rewrite.diagnosis.explain import explain  # noqa: PLC0415

        report = explain(model, threads=threads)
    except Exception as error:  # noqa: BLE001 - informative only: n/a and a note, not a failed variant
        variant.notes.append(f"integer MAC share not measured: explain() failed ({one_line(error)})")
        return None
    variant.notes.extend(f"explain: {note}" for note in getattr(report, "notes", ()))
    return float(report.integer_mac_fraction)


def _outputs(name: str, model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]],
             threads: int) -> list[list[np.ndarray]]:
    session = _session(name, model, threads)
    return [_run(name, session, feed) for feed in feeds]


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
            self.results.append(VariantResult(name, config, fixed, error=one_line(error)))
            return None
        result = VariantResult(name, config, fixed, build_s=time.perf_counter() - start)
        if isinstance(model, tuple):  # (model, seconds the tool itself reports)
            model, result.build_s = model
        self.models[name] = model
        self.results.append(result)
        return model


def _quantize_variants(variants: _Variants) -> None:
    """kenosis ``quantize()`` with the calibration photos and with self-calibration."""
    from kenosis_rewrite.quantization.pipeline import quantize  # noqa: PLC0415

    inputs = variants.inputs
    variants.make("quantize()", None, True, lambda: quantize(inputs.model, inputs.calibration))
    variants.make("quantize(synthetic)", None, True, lambda: quantize(inputs.model, None))


def parse_peer(spec: str) -> tuple[str, str | None]:
    """``"quark:INT8_CNN_DEFAULT"`` -> ``("quark", "INT8_CNN_DEFAULT")``; ``"nncf"`` -> ``("nncf", None)``."""
    name, _, preset = spec.partition(":")
    return name.strip().lower(), (preset.strip() or None)


def _peer_variants(variants: _Variants, peer_specs: Sequence[str], include_fix: bool, cache_dir: str | None) -> None:
    """Each peer's output on the calibration feeds (its own venv, :mod:`kenosis_rewrite.benchmark.peers`) and its fix()."""
    from kenosis_rewrite.benchmark import peers  # noqa: PLC0415
    from kenosis_rewrite.placement.pipeline import fix  # noqa: PLC0415

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
    from kenosis_rewrite.core.ort_quantize import quantize_with_ort  # noqa: PLC0415
    from kenosis_rewrite.placement.pipeline import fix  # noqa: PLC0415

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
    variant.integer_mac_fraction = _integer_mac_fraction(variant, model, threads)
    try:
        outputs = _outputs(variant.name, model, inputs.evaluation, threads)
        variant.fidelity = fidelity(reference, outputs, inputs.class_output)
        if inputs.task is not None:
            variant.task = inputs.task(reference, outputs)
    except (KenosisError, ValueError) as error:
        variant.error = one_line(error)


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
        "cpu": interleaved_timing.cpu_description(),
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
        configs: names from :data:`kenosis_rewrite.core.ort_quantize.ORT_CONFIGS`.
        streams: when > 0, also measure concurrent throughput with that many 1-thread sessions.
        progress: called with a short message before each step (e.g. print to stderr).
        include_latency: also ``fix(..., optimize_for="latency")`` of each config.
        include_quantize: also kenosis ``quantize()`` (calibration photos, and self-calibration).
        min_seconds: more timed runs than ``runs`` when needed to spend this long on each variant.
        retries: times the whole latency measurement is repeated when the machine's speed changed
            during it (:attr:`LatencyStats.drift` above ``UNSTEADY_DRIFT``); the steadiest is kept.
        peers: peer quantizers to run on the same calibration feeds, each from its own virtual
            environment (:mod:`kenosis_rewrite.benchmark.peers`): ``"nncf"``, ``"inc"``, ``"quark"`` or
            ``"quark:PRESET"``; each gives a variant and its ``fix()``. A peer that is not installed
            is a failed variant whose message says how to install it.
        also_threads: other intra-op thread counts to time every variant at (x FP32 columns).
    """
    say = progress or (lambda message: None)
    from kenosis_rewrite.core.ort_quantize import ORT_CONFIGS  # noqa: PLC0415

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
    task = None if inputs.task is None else f"{inputs.task.name}: {inputs.task.description}"
    return BenchResult(inputs.label, threads, runs, warmup, inputs.source, results, throughput,
                       _environment(), tuple(also_threads), task)


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
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a bar over the steps on stderr (default: on a terminal, not in CI)")
    return parser


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def _progress_printer(stream=sys.stderr) -> Callable[[str], None]:
    start = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=stream, flush=True)

    return say


def _progress_reporter(wanted: bool | None) -> tuple[Callable[[str], None] | None, Callable[[], None]]:
    """``run_bench``'s progress and what closes it: a tqdm bar whose steps are its messages (on a
    terminal and not in CI, unless ``wanted`` says otherwise), timed lines without tqdm, or None."""
    from kenosis_rewrite.core.progress import progress_bar, progress_default  # noqa: PLC0415

    if not (progress_default() if wanted is None else wanted):
        return None, lambda: None
    bar = progress_bar(True, description="bench", unit="step", leave=False)
    if bar is None:
        return _progress_printer(), lambda: None

    def say(message: str) -> None:
        bar.update(1)
        bar.set_postfix_str(message[:60], refresh=True)

    return say, bar.close


def bench_main(argv: Sequence[str] | None = None) -> int:
    """``kenosis-rewrite bench``: run the benchmark, print markdown to stdout.

    Exit status: 0 every variant measured, 1 refused (bad model, unknown config), 2 usage, 3 some
    variants failed (the report lists each with its cause; the others are measured and written).
    """
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
    say, close = _progress_reporter(args.progress)
    try:
        result = run_bench(
            args.model, configs, threads=threads[0], runs=args.runs, warmup=args.warmup,
            calibration_samples=args.calibration_samples, include_fix=not args.no_fix,
            streams=args.streams, stream_seconds=args.stream_seconds, cache_dir=args.cache_dir,
            progress=say,
            include_latency=args.latency, include_quantize=args.quantize, min_seconds=args.min_seconds,
            retries=args.retries, peers=tuple(p for p in args.peers.split(",") if p.strip()),
            also_threads=tuple(threads[1:]), photos=args.photos,
        )
    except (KenosisError, OSError) as error:
        print(f"kenosis-rewrite bench: error: {error}", file=sys.stderr)
        return 1
    finally:
        close()
    markdown = result.to_markdown()
    print(markdown, end="")
    for path, text in ((args.json, result.to_json()), (args.markdown, markdown), (args.html, result.to_html())):
        if path:
            _write(path, text)
    return 3 if any(variant.error is not None for variant in result.variants) else 0

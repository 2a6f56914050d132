"""Latency-aware placement: per heavy op, integer or float, whichever ORT CPU runs faster here.

Which layers gain from int8 is a property of the runtime and the machine, not of the graph: on
x86 ORT CPU a PP-LCNet classifier runs *slower* quantized than in FP32, because HardSwish has no
integer kernel (every activation becomes a DQ -> HardSigmoid -> Mul -> Q float island) while
depthwise convolutions gain little from int8. This pass measures instead of assuming:

0. First of all, run the HardSwish islands on integer kernels (:mod:`kenosis_rewrite.placement.rules.hardswish`,
   approximate by less than half an output step) if that alone measures faster; every candidate
   after that has the HardSwish islands left next to integer layers on integer kernels too.
1. Profile the model as it is (integer) and fully dequantized (float), and attribute kernel time
   to each Conv/MatMul/Gemm: its integer kernel plus the Q/DQ and float-island kernels around it,
   against its float kernel (:mod:`kenosis_rewrite.diagnosis.profiler`).
2. Return to float every layer whose estimated gain is positive (all at once), and keep the result
   only if an interleaved A/B measurement says the whole model got faster.
3. Try float prefixes of the network (early, memory-bound layers float, late ones integer: also
   fewer layout changes between integer and float kernels).
4. Refine greedily while the time budget lasts: toggle single layers, most uncertain first, each
   kept only when measured faster by more than ``min_gain``.
5. Compare with the fully float model; never return anything slower than the input.

Returning a layer to float (:mod:`kenosis_rewrite.graph.dequantize`) dequantizes its weights and
removes the Q/DQ pairs that only connected it to float neighbours: quantization steps only go away.
Stage 0 is the one approximate choice; the report says when it was taken.
Decisions are cached under a hash of the model and the machine, and reported with their gains.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from kenosis_rewrite.core import interleaved_timing
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.diagnosis import profiler
from kenosis_rewrite.errors import one_line
from kenosis_rewrite.graph.dequantize import DequantizeAllPass, FloatRegionsPass
from kenosis_rewrite.graph.pass_base import remove_unused_nodes

RULE_NAME = "latency-placement"
ALL_FLOAT = "*"


@dataclasses.dataclass
class PlacementResult:
    """What the search decided and measured (milliseconds per run, median)."""

    float_layers: list[str]
    base_ms: float
    best_ms: float
    float_ms: float | None
    trials: int
    seconds: float
    cached: bool = False
    integer_hardswish: bool = False  # HardSwish islands left next to integer layers on QLinear kernels

    @property
    def speedup(self) -> float:
        return self.base_ms / self.best_ms if self.best_ms else 1.0


def _machine_signature(threads: int) -> str:
    return f"{interleaved_timing.cpu_description()}|{os.cpu_count()}|ort {ort.__version__}|threads {threads}"


def _cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("KENOSIS_CACHE", Path.home() / ".cache" / "kenosis_rewrite")) / "placement"


class PlacementCache:
    """Measured placement decisions on disk: one JSON file per (model bytes, machine, thread count).

    A file that cannot be read back (truncated, edited, from an older version) is not a decision:
    :meth:`load` says why, and the search runs again and overwrites it.
    """

    def __init__(self, directory: str | os.PathLike | None, threads: int):
        self.directory, self.threads = _cache_dir(directory), threads

    def path(self, base: bytes) -> Path:
        digest = hashlib.sha256(base + _machine_signature(self.threads).encode()).hexdigest()[:32]
        return self.directory / f"{digest}.json"

    def load(self, base: bytes) -> tuple[PlacementResult | None, str | None]:
        """(the cached decision, None), (None, None) when there is none, (None, why) when unreadable."""
        path = self.path(base)
        if not path.is_file():
            return None, None
        try:
            result = PlacementResult(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError) as error:  # JSONDecodeError is a ValueError
            return None, f"the cached decision {path} is unreadable ({one_line(error, 200)}); measured again"
        result.cached = True
        return result, None

    def store(self, base: bytes, result: PlacementResult) -> None:
        path = self.path(base)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(result)), encoding="utf-8")


def _serialize(model: ir.Model) -> bytes:
    return ir.serde.serialize_model(model).SerializeToString()


def _with_integer_hardswish(model: ir.Model, report: FixReport | None = None) -> int:
    from kenosis_rewrite.placement.rules.hardswish import hardswish_rules  # noqa: PLC0415

    count = hardswish_rules(report).apply_to_model(model)
    remove_unused_nodes(model, count > 0)
    return count


def _variant(base: bytes, float_layers: list[str], integer_hardswish: bool = False) -> bytes:
    model = ir.serde.deserialize_model(_load_proto(base))
    if float_layers == [ALL_FLOAT]:
        DequantizeAllPass()(model)
        return _serialize(model)
    if float_layers:
        FloatRegionsPass(float_layers)(model)
    if integer_hardswish:  # after the float regions: only islands still next to integer layers
        _with_integer_hardswish(model)
    return _serialize(model)


def _load_proto(data: bytes):
    import onnx  # noqa: PLC0415

    return onnx.load_from_string(data)


class _Search:
    """Greedy, measured search over which heavy ops run float."""

    def __init__(self, base: bytes, feed: Mapping[str, np.ndarray], threads: int, budget_s: float, min_gain: float):
        self.base, self.feed, self.threads = base, dict(feed), threads
        # the closing comparisons (all-float, never-slower, integer HardSwish) run after the deadline
        self.deadline = time.monotonic() + 0.8 * budget_s
        self.min_gain = min_gain
        self.trials = 0
        self.integer_hardswish = False
        graph = _load_proto(base).graph
        self.layer_order = [n.name for n in graph.node if n.op_type in ("Conv", "ConvTranspose", "MatMul", "Gemm")]

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def compare(self, current: bytes, candidate: bytes) -> tuple[float, float]:
        """(current ms, candidate ms), interleaved in this process."""
        self.trials += 1
        sessions = {"current": interleaved_timing.session(current, self.threads),
                    "candidate": interleaved_timing.session(candidate, self.threads)}
        medians = interleaved_timing.interleaved_medians(sessions, self.feed, warmup=10, seconds=0.3, runs=20)
        return medians["current"] * 1e3, medians["candidate"] * 1e3

    def estimates(self, float_variant: bytes) -> dict[str, float]:
        """Estimated microseconds saved by running each heavy op float."""
        integer = profiler.profile(_load_proto(self.best), self.feed, runs=10, warmup=3, threads=self.threads)
        floating = profiler.profile(_load_proto(float_variant), self.feed, runs=10, warmup=3, threads=self.threads)
        gains = {}
        for name, layer in integer.layers.items():
            if layer.kernel not in profiler.INTEGER_KERNELS:
                continue  # already float: nothing to decide
            other = floating.layers.get(name)
            gains[name] = layer.total_us - (other.total_us if other is not None else 0.0)
        return gains

    def _try(self, layers: list[str], min_gain: float | None = None) -> None:
        """Measure ``layers`` in float against the best so far; keep it when clearly faster."""
        if self.out_of_time() or sorted(layers) == sorted(self.best_layers):
            return
        candidate = _variant(self.base, layers, self.integer_hardswish)
        if self._faster(candidate, self.min_gain if min_gain is None else min_gain):
            self.best, self.best_layers = candidate, list(layers)

    def _faster(self, candidate: bytes, min_gain: float | None = None) -> bool:
        """Is ``candidate`` faster than the best so far by ``min_gain``, in two A/B measurements?

        One interleaved comparison on a shared machine wrongly says "faster" often enough that
        a greedy search collects scattered float layers (each adding layout changes); a second,
        independent comparison is run only for apparent wins, so it costs few trials.
        """
        min_gain = self.min_gain if min_gain is None else min_gain
        for _ in range(2):
            current_ms, candidate_ms = self.compare(self.best, candidate)
            self.base_ms = self.base_ms if self.base_ms is not None else current_ms
            if candidate_ms >= current_ms * (1 - min_gain):
                return False
        return True

    def _integer_hardswish_wins(self) -> bool:
        """Stage 0: are the HardSwish islands faster on integer kernels (approximate) in this model?"""
        model = ir.serde.deserialize_model(_load_proto(self.base))
        if not _with_integer_hardswish(model):
            return False  # no HardSwish island to rewrite
        candidate = _serialize(model)
        if self._faster(candidate):
            self.best = candidate
            return True
        return False

    def run(self) -> PlacementResult:
        start = time.monotonic()
        float_variant = _variant(self.base, [ALL_FLOAT])
        self.best, self.best_layers, self.base_ms = self.base, [], None
        # 0. HardSwish islands on integer kernels; every later candidate keeps that choice
        self.integer_hardswish = self._integer_hardswish_wins()
        gains = self.estimates(float_variant)
        order = [n for n in self.layer_order if n in gains]
        # 1. every layer the profiles say is faster in float, together
        self._try(sorted((n for n in gains if gains[n] > 0), key=lambda n: -gains[n]))
        # 2. float prefixes: early layers (large maps, few channels) float, late ones integer;
        #    contiguous regions also mean fewer layout changes between integer and float kernels.
        steps = 8
        for index in range(1, steps):
            self._try(order[: round(len(order) * index / steps)])
        # 3. toggle single layers, the least certain estimates first; one layer moves the total by
        #    a few percent at most, so a toggle must win by twice the margin (noise would otherwise
        #    scatter float layers, each adding layout changes)
        for name in sorted(gains, key=lambda n: abs(gains[n])):
            if name in self.best_layers:
                self._try([n for n in self.best_layers if n != name], 2 * self.min_gain)
            else:
                self._try(self.best_layers + [name], 2 * self.min_gain)
        # 4. the whole model in float (also when every integer layer went float one by one: the
        #    full dequantization drops the stray Q/DQ pairs too), if not slower
        best_ms, float_ms = self.compare(self.best, float_variant)
        best_layers, best_model, integer_hardswish = self.best_layers, self.best, self.integer_hardswish
        covers_all = bool(gains) and set(gains) <= set(best_layers)
        if float_ms < best_ms * (1 - self.min_gain) or (covers_all and float_ms <= best_ms):
            best_layers, best_model, best_ms, integer_hardswish = [ALL_FLOAT], float_variant, float_ms, False
        # 5. never anything slower than the input, checked once more head to head
        base_ms = self.base_ms if self.base_ms is not None else best_ms
        if best_layers or integer_hardswish:
            # three head-to-head comparisons, medians: the decision the user gets must not hang on
            # one short measurement taken while a neighbour on the host was busy
            pairs = [self.compare(self.base, best_model) for _ in range(3)]
            base_ms, best_ms = (float(np.median([pair[i] for pair in pairs])) for i in (0, 1))
            wins = sum(candidate < current * (1 - self.min_gain / 2) for current, candidate in pairs)
            if wins < 2:  # a change must pay for itself
                best_layers, best_ms, integer_hardswish = [], base_ms, False
        return PlacementResult(best_layers, base_ms, best_ms, float_ms, self.trials, time.monotonic() - start,
                               integer_hardswish=integer_hardswish)


class LatencyPlacementPass(ir.passes.InPlacePass):
    """Return heavy ops to float where ORT CPU measures that faster; see the module docstring."""

    def __init__(
        self,
        feed: Mapping[str, np.ndarray],
        report: FixReport | None = None,
        *,
        budget_s: float = 60.0,
        threads: int = 1,
        min_gain: float = 0.015,
        cache_dir: str | os.PathLike | None = None,
        use_cache: bool = True,
    ):
        super().__init__()
        self.feed = dict(feed)
        self.report = report
        self.budget_s = budget_s
        self.threads = threads
        self.min_gain = min_gain
        self.cache_dir = cache_dir
        self.use_cache = use_cache
        self.result: PlacementResult | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        base = _serialize(model)
        cache = PlacementCache(self.cache_dir, self.threads) if self.use_cache else None
        cached, unreadable = cache.load(base) if cache is not None else (None, None)
        if unreadable is not None and self.report is not None:
            self.report.note(f"latency placement: {unreadable}")
        if cached is not None:
            self.result = cached
        else:
            self.result = _Search(base, self.feed, self.threads, self.budget_s, self.min_gain).run()
            if cache is not None:
                cache.store(base, self.result)
        self._apply(model, self.result)
        return ir.passes.PassResult(model, modified=bool(self.result.float_layers) or self.result.integer_hardswish)

    def _apply(self, model: ir.Model, result: PlacementResult) -> None:
        gain = f"model {result.base_ms:.3f} -> {result.best_ms:.3f} ms"
        if result.float_layers == [ALL_FLOAT]:
            DequantizeAllPass()(model)
        elif result.float_layers:
            FloatRegionsPass(result.float_layers, self.report, {n: gain for n in result.float_layers})(model)
        if result.integer_hardswish:  # after the float regions: only islands next to integer layers
            _with_integer_hardswish(model, self.report)
        if self.report is not None:
            how = "cached decision" if result.cached else f"{result.trials} measured trials in {result.seconds:.1f} s"
            if result.float_layers == [ALL_FLOAT]:
                self.report.changed(RULE_NAME, "whole model", f"float is fastest here: {result.base_ms:.3f} -> {result.best_ms:.3f} ms",
                                    exact=True)
            if result.float_layers == [ALL_FLOAT]:
                kept = "whole model to float"
            elif result.float_layers:
                kept = f"{len(result.float_layers)} layer(s) to float"
            else:
                kept = "all layers stay integer"
            float_ms = f"{result.float_ms:.3f} ms" if result.float_ms is not None else "n/a"
            self.report.note(
                f"latency placement: {kept}; {result.base_ms:.3f} -> {result.best_ms:.3f} ms "
                f"(x{result.speedup:.2f}; all-float {float_ms}); {how}"
            )

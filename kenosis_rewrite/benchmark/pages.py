"""What :func:`kenosis_rewrite.benchmark.bench.run_bench` measured, and its renderings (markdown, HTML, JSON).

Pure data and formatting: nothing here runs a model.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import platform
from collections.abc import Sequence

import numpy as np
import onnxruntime

from kenosis_rewrite.core.fidelity import Fidelity

FP32 = "fp32"
UNSTEADY_DRIFT = 0.05  # halves of a variant's runs further apart than this: the machine was not steady


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
    task: float | None = None  # the model's task score against FP32 (``BenchResult.task`` says which)
    error: str | None = None
    build_s: float | None = None  # wall time to make this variant (the quantizer's, or fix()'s)
    # x FP32 at the other thread counts asked for (``run_bench(also_threads=...)``)
    speedup_by_threads: dict[int, float] = dataclasses.field(default_factory=dict)
    # what could not be measured for a variant that did not fail (e.g. its integer MAC share), with the cause
    notes: list[str] = dataclasses.field(default_factory=list)

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
            "cosine", "max abs err", "top-1", "task", "size", "nodes", "build s")


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
        _fmt(variant.task, ".3f", "-"),
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
    task: str | None = None  # the task column's metric and how it is decoded (None: the model has none)

    def variant(self, name: str) -> VariantResult:
        for variant in self.variants:
            if variant.name == name:
                return variant
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "threads": self.threads, "also_threads": list(self.also_threads),
            "runs": self.runs, "warmup": self.warmup,
            "feeds": self.feeds, "task": self.task, "environment": dict(self.environment),
            "variants": [variant.to_dict() for variant in self.variants],
            "throughput": {name: stats.to_dict() for name, stats in self.throughput.items()},
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _setup_line(self) -> str:
        env = ", ".join(f"{k} {v}" for k, v in self.environment.items())
        task = f"Task: {self.task}. " if self.task else ""
        return (f"{self.threads} thread(s), {self.warmup} warm-up + at least {self.runs} interleaved runs per variant "
                "(3 s of runs for fast models); "
                f"fidelity vs FP32 on {self.feeds}. {task}{env}")

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
        noted = [(v.name, note) for v in self.variants for note in v.notes]
        if noted:
            lines += ["", "Notes:"] + [f"- {name}: {note}" for name, note in noted]
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
        notes = "".join(f"<li>{html.escape(v.name)}: {html.escape(note)}</li>" for v in self.variants for note in v.notes)
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
            + (f"<h2>Notes</h2><ul>{notes}</ul>" if notes else "")
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


def variants_record(kind: str, model: str, script: str, argv: Sequence[str], **fields) -> dict:
    """The head of a benchmark script's results JSON (``"kind"``: ``tools/gen_docs.py`` renders its
    ``"variants"`` as a table): what ran, the command that reproduces it, and the machine."""
    return {"kind": kind, "model": model, **fields, "command": f"python {script} " + " ".join(argv),
            "onnxruntime": onnxruntime.__version__, "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "variants": {}}


def save_variants_record(record: dict, path: str | None) -> None:
    """Print the record's variants and write the whole record to ``path`` (its folder made) when given."""
    print(json.dumps(record["variants"], indent=1))
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as handle:
            json.dump(record, handle, indent=1)

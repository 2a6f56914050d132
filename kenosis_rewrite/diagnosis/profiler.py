"""Per-layer time on ONNX Runtime CPU, attributed to the heavy ops of the input graph.

``profile(model, feed)`` runs the model with ORT's profiler and maps each kernel of the graph ORT
actually runs back to the Conv/ConvTranspose/MatMul/Gemm it implements (through
:func:`kenosis_rewrite.diagnosis.ort_graph.match_optimized`). The time of each heavy op is split into its own
kernel and its *overhead*: the DequantizeLinear/QuantizeLinear and float island kernels between it
and the neighbouring integer kernels, which exist only because the op is quantized.

Kernel times come from ORT's ``*_kernel_time`` events, averaged over the profiled runs; they
include no framework overhead, so they add up to slightly less than wall-clock latency.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from kenosis_rewrite.core import model_io, ort_sessions
from kenosis_rewrite.diagnosis.ort_graph import FLOAT_HEAVY_OPS, INTEGER_KERNELS, match_optimized, write_model
from kenosis_rewrite.errors import RuntimeMeasurementError

__all__ = ["LayerTime", "ModelProfile", "profile"]

# Kernels that carry a heavy op's quantization overhead when they sit next to it.
_OVERHEAD_BOUNDARY = INTEGER_KERNELS | {"Conv", "FusedConv", "MatMul", "Gemm", "FusedGemm", "FusedMatMul"}


@dataclasses.dataclass(frozen=True)
class LayerTime:
    """Time of one heavy op of the input graph, in microseconds per run."""

    name: str
    op_type: str
    kernel: str  # optimized op type that runs it ("" when ORT's graph has no match)
    kernel_us: float
    overhead_us: float  # Q/DQ and float-island kernels around it

    @property
    def total_us(self) -> float:
        return self.kernel_us + self.overhead_us


@dataclasses.dataclass
class ModelProfile:
    layers: dict[str, LayerTime]
    node_us: dict[str, float]  # optimized node name -> microseconds per run
    node_types: dict[str, str]
    total_us: float

    def by_op_type(self) -> dict[str, float]:
        totals: collections.Counter = collections.Counter()
        for name, us in self.node_us.items():
            totals[self.node_types.get(name, "?")] += us
        return dict(totals.most_common())

    def summary(self, top: int = 15) -> str:
        lines = [f"kernel time {self.total_us / 1000:.3f} ms per run"]
        for layer in sorted(self.layers.values(), key=lambda item: -item.total_us)[:top]:
            lines.append(
                f"  {layer.name:40s} {layer.kernel or '-':22s} {layer.kernel_us:9.1f} us"
                f" + {layer.overhead_us:8.1f} us Q/DQ and float islands"
            )
        return "\n".join(lines)


def _session(path: str, optimized_path: str, prefix: str, threads: int) -> ort.InferenceSession:
    try:
        return ort_sessions.session(path, ort_sessions.options(threads, optimized_path=optimized_path, profile_prefix=prefix))
    except Exception as error:  # noqa: BLE001 - ORT raises several unrelated exception types
        raise RuntimeMeasurementError(f"ONNX Runtime could not build a session for the model: {error}") from None


def _kernel_times(trace_path: str) -> tuple[dict[str, float], dict[str, str]]:
    """Median kernel time per node over the profiled runs (the median drops warm-up outliers)."""
    with open(trace_path, encoding="utf-8") as handle:
        events = json.load(handle)
    times: dict[str, list[float]] = collections.defaultdict(list)
    types: dict[str, str] = {}
    for event in events:
        name = event.get("name", "")
        if event.get("cat") == "Node" and name.endswith("_kernel_time"):
            node = name[: -len("_kernel_time")]
            times[node].append(float(event.get("dur", 0)))
            types[node] = event.get("args", {}).get("op_name", "?")
    return {node: float(np.median(values)) for node, values in times.items()}, types


def _overhead(start: onnx.NodeProto, graph: onnx.GraphProto, node_us: Mapping[str, float]) -> float:
    """Kernel time of the non-heavy, non-integer nodes reachable from ``start`` in both directions."""
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    seen, total = {id(start)}, 0.0
    frontier = [start]
    while frontier:
        node = frontier.pop()
        neighbours = [producers[i] for i in node.input if i in producers]
        neighbours += [c for out in node.output for c in consumers.get(out, [])]
        for other in neighbours:
            if id(other) in seen or other.op_type in _OVERHEAD_BOUNDARY:
                continue
            seen.add(id(other))
            total += node_us.get(other.name, 0.0)
            frontier.append(other)
    return total


def profile(
    model: model_io.ModelLike, feed: Mapping[str, np.ndarray], *, runs: int = 20, warmup: int = 5, threads: int = 1
) -> ModelProfile:
    """Profile ``model`` on ``feed`` and attribute kernel time to its heavy ops."""
    loaded = model_io.load(model, require_qdq=False)
    with tempfile.TemporaryDirectory() as directory:
        path = write_model(loaded.model, directory, "model")
        optimized_path = os.path.join(directory, "optimized.onnx")
        session = _session(path, optimized_path, os.path.join(directory, "trace"), threads)
        try:
            for _ in range(warmup + runs):
                session.run(None, dict(feed))
            trace = session.end_profiling()
        except Exception as error:  # noqa: BLE001
            raise RuntimeMeasurementError(f"ONNX Runtime failed to run the model: {error}") from None
        node_us, node_types = _kernel_times(trace)
        optimized = onnx.load(optimized_path, load_external_data=False)
    layers = {}
    for node in loaded.model.graph:
        if node.op_type not in FLOAT_HEAVY_OPS or node.domain not in ("", "ai.onnx"):
            continue
        match = match_optimized(node, optimized.graph.node)
        name = node.name or node.outputs[0].name
        if match is None:
            layers[name] = LayerTime(name, node.op_type, "", 0.0, 0.0)
            continue
        layers[name] = LayerTime(
            name, node.op_type, match.op_type, node_us.get(match.name, 0.0), _overhead(match, optimized.graph, node_us)
        )
    return ModelProfile(layers, node_us, node_types, float(sum(node_us.values())))


@dataclasses.dataclass(frozen=True)
class LayerComparison:
    """One heavy op as it runs now (its integer kernel plus overhead) and in float."""

    name: str
    op_type: str
    kernel: str
    integer_us: float
    float_us: float

    @property
    def float_gain_us(self) -> float:
        """Microseconds saved per run if this layer ran float (negative: integer is faster)."""
        return self.integer_us - self.float_us


def compare_integer_and_float(
    model: model_io.ModelLike, feed: Mapping[str, np.ndarray], *, runs: int = 20, threads: int = 1
) -> list[LayerComparison]:
    """Per heavy op: time as it runs now (kernel + Q/DQ and float islands) vs fully dequantized."""
    from kenosis_rewrite.graph.dequantize import DequantizeAllPass  # noqa: PLC0415 - avoids a cycle

    loaded = model_io.load(model, require_qdq=False)
    as_is = profile(loaded.model, feed, runs=runs, threads=threads)
    dequantized = ir.serde.deserialize_model(ir.serde.serialize_model(loaded.model))
    DequantizeAllPass()(dequantized)
    floating = profile(dequantized, feed, runs=runs, threads=threads)
    rows = []
    for name, layer in as_is.layers.items():
        other = floating.layers.get(name)
        rows.append(LayerComparison(name, layer.op_type, layer.kernel, layer.total_us, other.total_us if other else 0.0))
    return rows


def comparison_table(rows: list[LayerComparison]) -> str:
    lines = [
        "| layer | op | kernel now | now (us) | float (us) | float saves (us) |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row in sorted(rows, key=lambda r: -r.float_gain_us):
        lines.append(
            f"| {row.name} | {row.op_type} | {row.kernel or '-'} | {row.integer_us:.1f} | {row.float_us:.1f} | {row.float_gain_us:+.1f} |"
        )
    total_now, total_float = sum(r.integer_us for r in rows), sum(r.float_us for r in rows)
    lines.append(f"| **all heavy ops** | | | {total_now:.1f} | {total_float:.1f} | {total_now - total_float:+.1f} |")
    return "\n".join(lines)

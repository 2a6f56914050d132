"""``explain()``: which heavy ops ONNX Runtime CPU runs in integer kernels, and why the others stay float.

The "doctor" builds an ORT CPU session at ``ORT_ENABLE_ALL``, saves the optimized graph, and maps
every node of it back to the input graph's heavy ops (Conv, ConvTranspose, MatMul, Gemm). A heavy op
counts as *integer* when ORT turned it into one of :data:`INTEGER_KERNELS`; otherwise it is *float*
and the input graph around it is analysed for the reason ORT's QDQ selectors refused it, plus the
kenosis rule that fixes that reason (when one exists).

The pieces, one job each: :mod:`kenosis_rewrite.diagnosis.ort_graph` (the graph ORT runs, and which of its
nodes runs each heavy op), :mod:`kenosis_rewrite.diagnosis.macs` (shapes and multiply-accumulates),
:mod:`kenosis_rewrite.diagnosis.float_reasons` (why a heavy op stays float), :mod:`kenosis_rewrite.diagnosis.float_islands`
(float regions of ORT's graph) and :mod:`kenosis_rewrite.diagnosis.fusion_report` (the report). Their public
names stay importable from here.
"""

from __future__ import annotations

import collections
import dataclasses
import tempfile
from collections.abc import Sequence

import onnx
import onnx_ir as ir

from kenosis_rewrite.core import model_io
from kenosis_rewrite.diagnosis.float_islands import build_islands
from kenosis_rewrite.diagnosis.float_reasons import (  # noqa: F401 - re-exported: the reasons are explain's vocabulary
    ABSORBABLE_ACTIVATIONS,
    BIAS_RTOL,
    EIGHT_BIT_ONNX,
    FLOAT_OUTPUT_OK,
    NO_INTEGER_KERNEL_ACTIVATIONS,
    NO_QDQ_FUSION_OPS,
    R_ACTIVATION,
    R_ACTIVATION_PRODUCT,
    R_BIAS_TYPE,
    R_DTYPE,
    R_FANOUT,
    R_FLOAT_WEIGHTS,
    R_GRAPH_OUTPUT,
    R_INT8_NO_Q,
    R_MISSING,
    R_NO_KERNEL,
    R_PER_AXIS_ACTIVATION,
    R_STALE_BIAS,
    R_UNKNOWN,
    R_UNSUPPORTED_TYPE,
    R_WEIGHT_ONLY,
    R_ZP_NOT_QMIN,
    RULE_FOLD,
    RULE_PRELU,
    RULE_STALE_BIAS,
    RULE_U8,
    explain_float_op,
    integer_warning,
)
from kenosis_rewrite.diagnosis.fusion_report import FloatIsland, FusionReport, HeavyOp
from kenosis_rewrite.diagnosis.macs import heavy_op_macs, with_shapes
from kenosis_rewrite.diagnosis.ort_graph import (  # noqa: F401 - re-exported for the profiler and users
    FLOAT_HEAVY_KERNELS,
    FLOAT_HEAVY_OPS,
    HEAVY_OPS,
    INTEGER_KERNELS,
    QDQ_OPS,
    TRIVIAL_OPS,
    base_name,
    label,
    match_optimized,
    optimized_graph,
)

__all__ = ["FusionReport", "HeavyOp", "FloatIsland", "explain", "float_kernels", "kernel_facts", "KernelFacts", "INTEGER_KERNELS"]


def _heavy_nodes(model: ir.Model) -> list[ir.Node]:
    return [node for node in model.graph if node.op_type in HEAVY_OPS]


def _classify(node: ir.Node, optimized: Sequence[onnx.NodeProto]) -> tuple[HeavyOp, onnx.NodeProto | None]:
    """The heavy op as ORT runs it: integer (with any warning), or float with every reason found."""
    match = match_optimized(node, optimized)
    name = node.name or (node.outputs[0].name or node.op_type)
    macs = heavy_op_macs(node)
    if node.op_type in INTEGER_KERNELS or (match is not None and match.op_type in INTEGER_KERNELS):
        kernel = label(match) if match is not None else node.op_type
        return HeavyOp(name, node.op_type, macs, "integer", kernel, warning=integer_warning(node)), match
    reasons = explain_float_op(node)
    first = reasons[0]
    return HeavyOp(
        name, node.op_type, macs, "float", label(match) if match is not None else None,
        first.text, first.rule, first.detail, tuple(r.text for r in reasons[1:]),
    ), match


def explain(model: model_io.ModelLike, *, threads: int = 1) -> FusionReport:
    """Report which heavy ops of ``model`` ORT CPU runs in integer kernels, and why the others are float.

    ``model`` is a path, an onnx.ModelProto or an onnx_ir.Model (QDQ, QOperator or float); it is
    not modified. Raises a ``KenosisError`` subclass for input that is not an ONNX model, and
    ``RuntimeMeasurementError`` when ONNX Runtime cannot build a session for it. What could not be
    determined (shapes, hence MACs) is said in :attr:`FusionReport.notes`.
    """
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    loaded = model_io.load(model, require_qdq=False, lazy=True)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kenosis_explain_") as directory:
        optimized = optimized_graph(loaded.model, directory, threads, source=loaded.path)
        shaped = with_shapes(loaded.model, directory, notes)
        nodes = list(optimized.graph.node)
        ops, matched = [], {}
        for node in _heavy_nodes(shaped):
            op, match = _classify(node, nodes)
            ops.append(op)
            if match is not None:
                matched[op.name] = match.name
        input_nodes = {node.name: node for node in shaped.graph if node.name}
        islands = build_islands(optimized.graph, ops, matched, input_nodes)
    counts = collections.Counter(label(node) for node in nodes)
    return FusionReport(ops=ops, float_islands=islands, optimized_op_counts=counts, notes=notes)


@dataclasses.dataclass(frozen=True)
class KernelFacts:
    """What ORT CPU's optimized graph says about a model, by the names of its top graph's nodes."""

    float_heavy: frozenset[str]  # Conv/ConvTranspose/MatMul/Gemm ORT runs as float kernels
    kept_quantizers: frozenset[str]  # QuantizeLinear nodes ORT runs on their own (not fused into a kernel)


def kernel_facts(model: ir.Model, *, threads: int = 1) -> KernelFacts:
    """Which heavy ops of ``model`` ORT CPU runs as float kernels, and which of its QuantizeLinear nodes
    it runs on their own; an op ORT replaced by nothing recognisable, or unnamed, is left out of the
    first, an unnamed Q out of the second. ``model`` is not modified. Raises ``RuntimeMeasurementError``
    when ORT cannot build a session."""
    with tempfile.TemporaryDirectory(prefix="kenosis_float_kernels_") as directory:
        nodes = list(optimized_graph(model, directory, threads).graph.node)
    float_heavy = set()
    for node in model.graph:
        if node.op_type not in FLOAT_HEAVY_OPS or not node.name:
            continue
        match = match_optimized(node, nodes)
        if match is not None and match.op_type not in INTEGER_KERNELS:
            float_heavy.add(node.name)
    kept = {node.name for node in nodes if node.op_type == "QuantizeLinear" and node.name}
    return KernelFacts(frozenset(float_heavy), frozenset(kept))


def float_kernels(model: ir.Model, *, threads: int = 1) -> frozenset[str]:
    """Names of the Conv/ConvTranspose/MatMul/Gemm nodes of ``model`` (top graph) that ORT CPU runs as
    float kernels in its optimized graph (:func:`kernel_facts`)."""
    return kernel_facts(model, threads=threads).float_heavy

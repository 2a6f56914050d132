"""The one place that builds ONNX Runtime CPU sessions.

Every caller used to assemble its own ``SessionOptions``; they differed only in the few knobs named
below, so those are the parameters and everything else is fixed: CPU provider, sequential
execution, one inter-op thread, warnings off (ORT's NCHWc "hardware specific" warning is expected).
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import onnxruntime as ort

__all__ = ["LEVELS", "computing_only", "options", "session"]

LEVELS = {
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}


def options(
    threads: int | None = 1,
    *,
    level: str = "all",
    log_severity: int = 3,
    spinning: bool = True,
    optimized_path: str | None = None,
    profile_prefix: str | None = None,
) -> ort.SessionOptions:
    """Session options: ``threads`` intra-op threads (None: ORT's default, all cores), one inter-op thread.

    ``spinning``: False stops idle intra-op threads from spinning between ops. For the sessions that
    compute something rather than measure latency (calibration, statistics): on a busy machine a
    spinning thread takes the core the working one needs (8 calibration runs of a ResNet-50 took
    3.8 s with two spinning threads, 1.6 s with two that sleep, one other process at 100% of one of
    the two cores). Outputs are the same: spinning changes when threads wait, not what they compute.
    ``optimized_path``: ORT writes the graph it runs there, its weights kept in an external file
    (only the structure is read back). ``profile_prefix``: profiling on, files start with it.
    """
    result = ort.SessionOptions()
    if threads is not None:
        result.intra_op_num_threads = threads
    result.inter_op_num_threads = 1
    result.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    result.graph_optimization_level = LEVELS[level]
    result.log_severity_level = log_severity
    if not spinning:
        result.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if optimized_path is not None:
        result.optimized_model_filepath = optimized_path
        result.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", "optimized.data"
        )
        result.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    if profile_prefix is not None:
        result.enable_profiling = True
        result.profile_file_prefix = profile_prefix
    return result


def session(model: onnx.ModelProto | bytes | str, session_options: ort.SessionOptions | None = None
            ) -> ort.InferenceSession:
    """A CPU session for ``model`` (a proto, its bytes, or a path). ORT's own exception propagates:
    callers decide whether a refusal is an error (and which) or a finding."""
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    return ort.InferenceSession(model, session_options or options(), providers=["CPUExecutionProvider"])


def computing_only(model: onnx.ModelProto, outputs: Sequence[str],
                   appended: onnx.GraphProto | None = None) -> onnx.ModelProto:
    """``model`` with ``outputs`` as its outputs and without the nodes they do not depend on (onnxruntime
    runs every node of a graph, needed or not: a detector's head after the last observed tensor is
    most of its run). Graph inputs stay (the feeds name them all). ``appended``'s nodes and
    initializers count as the end of ``model``'s graph (a probe's additions, copied once)."""
    needed = set(outputs)
    kept = []
    extra_nodes = list(appended.node) if appended is not None else []
    extra_initializers = list(appended.initializer) if appended is not None else []
    for node in reversed([*model.graph.node, *extra_nodes]):  # a graph's nodes are in topological order
        if any(name in needed for name in node.output):
            kept.append(node)
            needed.update(node.input)
            needed.update(_names_read_inside(node))
    source = model.graph
    graph = onnx.GraphProto(name=source.name)
    graph.input.extend(source.input)
    graph.initializer.extend(tensor for tensor in [*source.initializer, *extra_initializers] if tensor.name in needed)
    graph.sparse_initializer.extend(tensor for tensor in source.sparse_initializer if tensor.values.name in needed)
    graph.node.extend(reversed(kept))
    graph.output.extend(onnx.ValueInfoProto(name=name) for name in outputs)
    probe = onnx.ModelProto(ir_version=model.ir_version, graph=graph)
    probe.opset_import.extend(model.opset_import)
    probe.functions.extend(model.functions)
    return probe


def _names_read_inside(node: onnx.NodeProto) -> set[str]:
    """Every name a node's subgraphs (If/Loop/Scan bodies) read, their own included."""
    names: set[str] = set()
    for attribute in node.attribute:
        for graph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
            for inner in graph.node:
                names.update(inner.input)
                names.update(_names_read_inside(inner))
    return names

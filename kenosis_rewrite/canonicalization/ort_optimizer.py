"""onnxruntime's basic-level optimizer (standard ops only) as a canonicalization step.

Its transpose optimizer cancels the NHWC Transposes around residual Adds, which local rewrite
rules cannot (the Add's inputs fan out). The optimized graph is kept only where onnxruntime loads
it and writes standard ops only; the user's model header, metadata, opsets and declared output
shapes stay the user's.
"""

from __future__ import annotations

import os
import tempfile

import onnx
import onnx_ir as ir
import onnxruntime as ort

from kenosis_rewrite.core.report import FixReport

__all__ = ["ort_basic_optimized", "rename_introduced_values"]

_PROTOBUF_LIMIT = 2**31 - 1


def rename_introduced_values(optimized: onnx.ModelProto, before: onnx.ModelProto) -> None:
    """Give the tensors ORT's optimizer introduced names it will not generate again.

    ORT names the tensors of its rewrites after the rewrite (MatMulAddFusion: ``gemm_input_shape``);
    when it loads the saved model and fuses a second site, it adds an initializer of the same name
    and refuses the model ("Attempt to replace the existing tensor", onnxruntime 1.32, seen on
    MiniLM with pinned shapes)."""
    graph = before.graph
    known = {value.name for value in [*graph.input, *graph.output, *graph.initializer, *graph.value_info]}
    known.update(name for node in graph.node for name in [*node.input, *node.output])
    renamed: dict[str, str] = {}

    def fresh(name: str) -> str:
        if not name or name in known:
            return name
        if name not in renamed:
            renamed[name] = f"{name}__kenosis_prepared"
        return renamed[name]

    new_graph = optimized.graph
    for tensor in new_graph.initializer:
        tensor.name = fresh(tensor.name)
    for info in new_graph.value_info:
        info.name = fresh(info.name)
    for node in new_graph.node:
        node.input[:] = [fresh(name) for name in node.input]
        node.output[:] = [fresh(name) for name in node.output]


def _ort_optimized(serialized: bytes, proto: onnx.ModelProto, report: FixReport) -> ir.Model | None:
    """``serialized`` as onnxruntime's basic optimizer writes it (its introduced names made fresh
    against ``proto``); None, with the report saying why, where onnxruntime refuses it."""
    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = os.path.join(folder, "basic.onnx")
        options.log_severity_level = 3
        try:
            ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
            optimized_proto = onnx.load(options.optimized_model_filepath)
            rename_introduced_values(optimized_proto, proto)
            return ir.serde.deserialize_model(optimized_proto)
        except Exception as error:  # noqa: BLE001 - ORT's refusal leaves our canonical graph as is
            report.note(f"prepare: onnxruntime's basic optimizer skipped ({type(error).__name__}: {error})")
            return None


def ort_basic_optimized(model: ir.Model, report: FixReport) -> ir.Model:
    """onnxruntime's basic (level 1, standard ops only) optimizer: its transpose optimizer cancels the
    NHWC Transposes that fan out (residual blocks), which local sinking cannot. Kept when it loads."""
    proto = ir.serde.serialize_model(model)
    try:
        serialized = proto.SerializeToString()  # once: its length is the size check too
    except ValueError:  # protobuf refuses messages over 2 GB
        serialized = b""
    if not serialized or len(serialized) >= _PROTOBUF_LIMIT:
        report.note("prepare: onnxruntime's basic optimizer skipped (model over 2 GB)")
        return model
    optimized = _ort_optimized(serialized, proto, report)
    if optimized is None:
        return model
    if any(node.domain not in ("", "ai.onnx") for node in optimized.graph.all_nodes()):
        report.note("prepare: onnxruntime's basic optimizer wrote non-standard ops; not used")
        return model
    # ORT writes its own model header; the user's metadata, producer and opsets stay the user's
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(optimized, field, getattr(model, field))
    optimized.metadata_props.clear()
    optimized.metadata_props.update(model.metadata_props)
    optimized.opset_imports.clear()
    optimized.opset_imports.update(model.opset_imports)
    optimized.graph.name = model.graph.name
    # and the output shapes the user declared: where they contradict the graph, ORT writes its own
    # silently, and the repair is prepare()'s to make and report (repair-declared-output-shapes)
    declared = {value.name: value.shape for value in model.graph.outputs}
    for value in optimized.graph.outputs:
        if value.name in declared:
            value.shape = None if declared[value.name] is None else ir.Shape(declared[value.name])
    return optimized

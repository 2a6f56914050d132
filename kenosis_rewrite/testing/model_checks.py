"""Helpers shared by the test modules: run with ORT, compare, inspect graphs."""

from __future__ import annotations

import collections
import os
import tempfile

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from kenosis_rewrite.core import fidelity, ort_sessions
from kenosis_rewrite.core.report import FixReport


def session(model: onnx.ModelProto, optimized: bool = True) -> ort.InferenceSession:
    return fidelity.session(model, optimized)


def apply_pass(proto: onnx.ModelProto, make_pass) -> tuple[onnx.ModelProto, FixReport]:
    """Run the onnx-ir pass ``make_pass(report)`` on a copy of ``proto``; the result passes full_check."""
    model = ir.serde.deserialize_model(proto)
    report = FixReport()
    make_pass(report)(model)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    return out, report


def apply_rules(proto: onnx.ModelProto, *rule_sets) -> tuple[onnx.ModelProto, int]:
    """Apply onnxscript ``RewriteRuleSet``s in turn to a copy of ``proto``; the result passes full_check.
    Returns the result and the number of rewrites."""
    model = ir.serde.deserialize_model(proto)
    count = sum(rules.apply_to_model(model) for rules in rule_sets)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    return out, count


def apply_reporting_rules(proto: onnx.ModelProto, make_rules) -> tuple[onnx.ModelProto, FixReport, int]:
    """Apply the ``RewriteRuleSet`` ``make_rules(report)`` to a copy of ``proto``; the result passes
    full_check. Returns the result, the report the rules wrote, and the number of rewrites."""
    model = ir.serde.deserialize_model(proto)
    report = FixReport()
    count = make_rules(report).apply_to_model(model)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    return out, report, count


def outputs(model: onnx.ModelProto, feed: dict, optimized: bool = True) -> list[np.ndarray]:
    return session(model, optimized).run(None, feed)


def graph_cosine(float_model: onnx.ModelProto, model: onnx.ModelProto, feeds) -> float:
    """Cosine against FP32 of what ``model``'s graph computes: ORT with graph optimizations off,
    so no host-dependent integer kernel (see ``interleaved_timing.u8s8_saturates``) enters the comparison."""
    return fidelity.compare_to_float(float_model, {"model": model}, feeds, optimized=False)["model"]["cosine"]


def saturation_tolerance(strict: float) -> float:
    """``strict`` on hosts whose ORT integer kernels reproduce the float graph; fix()'s run-time guard
    tolerance where uint8 x int8 kernels saturate (x86 without VNNI), which the guard measures there."""
    from kenosis_rewrite.core import interleaved_timing  # noqa: PLC0415
    from kenosis_rewrite.placement import guard

    return max(strict, guard.DEFAULT_TOLERANCE) if interleaved_timing.u8s8_saturates() else strict


def op_types(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(node.op_type for node in model.graph.node)


def node_by_name(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(node for node in model.graph.node if node.name == name)


def producer_of(model: onnx.ModelProto, tensor: str) -> onnx.NodeProto | None:
    return next((node for node in model.graph.node if tensor in node.output), None)


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return next(onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def ort_optimized(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph ORT CPU actually runs (ORT_ENABLE_ALL, one thread)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        ort_sessions.session(model, ort_sessions.options(1, optimized_path=path))
        return onnx.load(path)


def ort_optimized_op_types(model: onnx.ModelProto) -> collections.Counter:
    """Op types of the graph ORT CPU actually runs (ORT_ENABLE_ALL, one thread)."""
    return op_types(ort_optimized(model))


sqnr_db = fidelity.sqnr_db

"""Running a fuzz case's models in ONNX Runtime and comparing them (:mod:`kenosis_rewrite.testing.fuzz`):
outputs, fidelity, interfaces and graph structure."""

from __future__ import annotations

import collections
import tempfile
import traceback

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import numpy_helper

from kenosis_rewrite.core import fidelity, ort_sessions
from kenosis_rewrite.diagnosis import ort_graph

_LEVELS = {"enable_all": "all", "disable_all": "none"}


def _session(model_bytes: bytes, level: str) -> ort.InferenceSession:
    return ort_sessions.session(model_bytes, ort_sessions.options(1, level=_LEVELS[level], log_severity=4))


def run_model(model_bytes: bytes, feeds, level: str) -> tuple[list[str], list[list[np.ndarray]]]:
    """(output names, outputs per feed) at one optimization level; raises what ORT raises."""
    session = _session(model_bytes, level)
    return [o.name for o in session.get_outputs()], [session.run(None, feed) for feed in feeds]


def float_weighted_ops(model_bytes: bytes) -> list[str]:
    """Names of the Conv/Gemm/MatMul nodes ORT CPU runs in float (ORT_ENABLE_ALL), those that write a
    graph output excepted, directly or through the clamp of an activation quantize_static deleted
    (output protection computes those in float on purpose)."""
    with tempfile.TemporaryDirectory() as tmp:
        graph = ort_graph.optimized_graph(ir.serde.deserialize_model(onnx.load_from_string(model_bytes)), tmp).graph
    outputs = {value.name for value in graph.output}
    readers = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)

    def reaches_output(name: str) -> bool:
        return name in outputs or any(r.op_type in ("Identity", "Relu", "Clip") and reaches_output(r.output[0])
                                      for r in readers[name])

    return [node.name for node in graph.node if node.op_type in ort_graph.FLOAT_HEAVY_KERNELS
            and not any(reaches_output(name) for name in node.output)]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    """:func:`kenosis_rewrite.core.fidelity.cosine`, NaN when the sizes differ (a shape change is its own finding)."""
    if np.size(a) != np.size(b):
        return float("nan")
    return fidelity.cosine(a, b)


def min_cosine(reference: list[list[np.ndarray]], candidate: list[list[np.ndarray]]) -> float:
    """Per output: cosine over all feeds concatenated; the minimum over outputs."""
    scores = []
    for index in range(len(reference[0])):
        ref = np.concatenate([np.ravel(outputs[index]) for outputs in reference])
        out = np.concatenate([np.ravel(outputs[index]) for outputs in candidate])
        scores.append(_cosine(ref, out))
    return float(min(scores))


def max_abs_diff(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> float:
    diffs = [
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0))
        for xs, ys in zip(a, b) for x, y in zip(xs, ys) if np.shape(x) == np.shape(y)
    ]
    return max(diffs, default=float("nan"))


def all_equal(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> bool:
    return all(np.array_equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else "")[:limit]


def short_traceback(error: BaseException, frames: int = 4) -> str:
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    tail = lines[-(frames + 1):]
    return "".join(tail)[-1500:]


def _attribute_key(attribute: onnx.AttributeProto) -> tuple:
    return (attribute.name, attribute.SerializeToString(deterministic=True))


def _node_key(node: onnx.NodeProto) -> tuple:
    return (node.domain, node.op_type, tuple(node.input), tuple(node.output), tuple(sorted(_attribute_key(a) for a in node.attribute)))


def _node_text(key: tuple) -> str:
    return f"{key[1]}({', '.join(key[2])}) -> {', '.join(key[3])}"


def _structure(model: onnx.ModelProto) -> tuple[list[tuple], dict[str, tuple]]:
    nodes = [_node_key(node) for node in model.graph.node]
    initializers = {}
    for tensor in model.graph.initializer:
        array = numpy_helper.to_array(tensor)
        initializers[tensor.name] = (str(array.dtype), array.shape, array.tobytes())
    return nodes, initializers


def structural_diff(first: onnx.ModelProto, second: onnx.ModelProto) -> str | None:
    """None when both graphs have the same nodes (any order, names ignored) and initializer values."""
    nodes_a, inits_a = _structure(first)
    nodes_b, inits_b = _structure(second)
    problems = []
    if collections.Counter(nodes_a) != collections.Counter(nodes_b):
        ops_a = collections.Counter(n[1] for n in nodes_a)
        ops_b = collections.Counter(n[1] for n in nodes_b)
        gone, new = ops_a - ops_b, ops_b - ops_a
        problems.append(f"nodes {len(nodes_a)} -> {len(nodes_b)}; op types removed {dict(gone)} added {dict(new)}")
        set_a, set_b = set(nodes_a), set(nodes_b)
        only_a = [_node_text(n) for n in nodes_a if n not in set_b]
        only_b = [_node_text(n) for n in nodes_b if n not in set_a]
        problems.append(f"{len(only_a)} node(s) only before, e.g. {only_a[:3]}; {len(only_b)} only after, e.g. {only_b[:3]}")
    removed, added = sorted(set(inits_a) - set(inits_b)), sorted(set(inits_b) - set(inits_a))
    changed = sorted(k for k in set(inits_a) & set(inits_b) if inits_a[k] != inits_b[k])
    if removed or added or changed:
        problems.append(f"initializers removed {removed[:4]} added {added[:4]} changed {changed[:4]}")
    if first.graph.output != second.graph.output or first.graph.input != second.graph.input:
        problems.append("graph input/output declarations differ")
    return "; ".join(problems) or None


def _activation_scale_names(model: onnx.ModelProto) -> set[str]:
    """The scale tensors of the QuantizeLinear nodes (the activation quantizers: a weight's scale
    is read by its DequantizeLinear alone); their DQs read the same tensors."""
    return {node.input[1] for node in model.graph.node
            if node.op_type == "QuantizeLinear" and len(node.input) > 1 and node.input[1]}


def scale_jittered(model: onnx.ModelProto, rng: np.random.Generator, spread: float) -> onnx.ModelProto:
    """A copy of ``model`` with each activation scale (initializer or Constant) multiplied by its
    own factor drawn uniformly from ``[1 - spread, 1 + spread]``: the same quantizers, each step
    within ``spread`` of the original, so every tensor's rounding noise power within ``(1 +
    spread)**2`` of it."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    names = _activation_scale_names(copy)

    def jittered(tensor: onnx.TensorProto) -> onnx.TensorProto:
        array = numpy_helper.to_array(tensor)
        factor = rng.uniform(1.0 - spread, 1.0 + spread)
        return numpy_helper.from_array((array.astype(np.float64) * factor).astype(array.dtype), tensor.name)

    for tensor in copy.graph.initializer:
        if tensor.name in names:
            tensor.CopyFrom(jittered(tensor))
    for node in copy.graph.node:
        if node.op_type == "Constant" and node.output[0] in names:
            for attribute in node.attribute:
                if attribute.name == "value":
                    attribute.t.CopyFrom(jittered(attribute.t))
    return copy


def jittered_cosines(model: onnx.ModelProto, feeds, reference: list[list[np.ndarray]], seed: int,
                     copies: int = 8, spread: float = 0.01) -> list[float]:
    """:func:`min_cosine` against ``reference`` of ``copies`` :func:`scale_jittered` copies of
    ``model`` (ORT_DISABLE_ALL): how far one graph's fidelity moves when nothing but each
    quantizer's step moves by at most ``spread``. On a well-conditioned graph the cosines barely
    move; where a normalisation amplifies rounding noise (a LayerNorm over a row of near-equal
    values) the output is a different random draw for each copy, and so is the fidelity of any
    rewrite of it."""
    rng = np.random.default_rng(seed)
    cosines = []
    for _ in range(copies):
        _, outputs = run_model(scale_jittered(model, rng, spread).SerializeToString(), feeds, "disable_all")
        cosines.append(min_cosine(reference, outputs))
    return cosines

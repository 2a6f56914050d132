"""Fidelity protections: model outputs in FP32, metadata inputs never quantized.

* **Model-output protection** (``OutputProtectionPass``): a graph output that leaves through
  ``Q -> DQ`` loses resolution exactly where the user reads it (a softmax probability of 0.8 becomes
  102/127). The pair is removed: the output is the producer's float value; a Clip(0, top) stands in
  where the Q's clamp may have replaced a Relu (see :func:`passes.dequantize.remove_qdq_pair`).
  ORT then runs a MatMul/Gemm producer as MatMulIntegerToFloat/QGemm with float output and a
  Conv producer in float: the producing op computes in float when that is what it takes. Nodes
  that also read the output tensor keep reading its quantized form (a Gemm reading a protected
  output would otherwise run in float).
* **Metadata-input protection** (``metadata_nodes``): float inputs that are not the image
  (scale factors, image shapes, anchors) carry a handful of exact values; quantizing them with a
  range calibrated on synthetic data corrupts them. Every node that reads a tensor computed only
  from such inputs (and constants) is excluded from quantization.
* **Shape-path protection** (``protected_nodes``): the same for tensors computed from a tensor's
  shape (``Shape``/``Size``) or only from constants by other nodes: padding amounts, anchors, grids
  and priors a detector builds in the graph. Quantized, their exact values move onto an 8-bit grid
  (anchor offsets in pixels) and broadcasting arithmetic on them can break. The origin analysis is
  :func:`passes.shape_arithmetic.value_origins`, which ``fix()`` uses to take such Q/DQ back out.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import onnx
import onnx_ir as ir

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.graph.dequantize import IMPLIED, remove_qdq_pair
from kenosis_rewrite.graph.pass_base import remove_unused_nodes
from kenosis_rewrite.graph.value_origins import Origin, value_origins

OUTPUT_RULE = "protect-model-outputs"
METADATA_RULE = "protect-metadata-inputs"


class OutputProtectionPass(ir.passes.InPlacePass):
    """Graph outputs leave in float: the Q/DQ pair in front of each is removed.

    The removed Q may have stood for a Relu/Clip that quantize_static deleted (its clamp did the
    work). With ``float_graph`` (the FP32 graph the model was quantized from) the pass knows: when
    the float graph computes the output's tensor with a Relu/Clip that the quantized graph no longer
    has, that activation comes back with its own bounds; when it has none, nothing is added. Without
    it, the clamp the graph proves comes back (:func:`passes.dequantize.remove_qdq_pair`).
    ``quantized_nodes``: the node names of quantize_static's output, when rewrites ran since.
    """

    def __init__(self, report: FixReport | None = None, float_graph: ir.Graph | None = None,
                 quantized_nodes: Collection[str] | None = None):
        super().__init__()
        self.report = report
        self.float_values = _values_by_name(float_graph) if float_graph is not None else None
        # the node names of the graph quantize_static returned, before any rewrite: a float-graph
        # activation missing from them was deleted (a rewrite's new node may reuse its name)
        self.quantized_nodes = frozenset(quantized_nodes) if quantized_nodes is not None else None

    def _clamp(self, quantize: ir.Node, output_name: str | None):
        """What to put back for the removed Q: the clamp of the float graph's activations that the
        quantized graph lost (composed: ``Relu -> Clip(-1, 1)`` is ``Clip(0, 1)``), None when it lost
        none, or IMPLIED when the float graph does not say."""
        if self.float_values is None:
            return IMPLIED
        # quantize_static renames the producer of a graph output; the output keeps the float name
        name = output_name if output_name in self.float_values else quantize.inputs[0].name
        if name not in self.float_values:
            return IMPLIED
        present = self.quantized_nodes
        if present is None:
            present = {node.name for node in quantize.graph if node.name}
        removed = []
        node = self.float_values[name].producer()
        while node is not None and node.op_type in ("Relu", "Clip") and node.domain in qdq_params.DEFAULT_DOMAINS:
            if node.name in present:
                break  # still in the quantized graph: it and what precedes it were kept
            removed.insert(0, node)
            node = node.inputs[0].producer() if node.inputs[0] is not None else None
        if not removed:
            return None
        reach = value_range.Interval()
        for node in removed:
            bounds = value_range.activation_bounds(node)
            if isinstance(bounds, str):
                return IMPLIED
            reach = reach.clamp(*bounds)
        return tuple(None if math.isinf(bound) else bound for bound in (reach.lo, reach.hi))

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for output in list(model.graph.outputs):
            dq = output.producer()
            if not qdq_params.is_dequantize(dq) or not qdq_params.is_quantize(dq.inputs[0].producer()):
                continue
            quantize = dq.inputs[0].producer()
            name = output.name
            if remove_qdq_pair(quantize, self._clamp(quantize, name), outputs_only=True):
                modified = True
                if self.report is not None:
                    self.report.changed(OUTPUT_RULE, name or "output", "graph output computed in float", exact=False)
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)


def _values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    """The values of a graph by name (graph inputs, initializers, node outputs)."""
    values = {v.name: v for v in graph.inputs if v.name}
    values.update(graph.initializers)
    for node in graph:
        values.update({v.name: v for v in node.outputs if v.name})
    return values


def metadata_nodes(model: onnx.ModelProto, metadata_inputs: set[str]) -> list[str]:
    """Names of the nodes that read a tensor computed only from ``metadata_inputs`` and constants."""
    return protected_nodes(model, metadata_inputs, shape_paths=False)


def protected_nodes(model: onnx.ModelProto | ir.Model, metadata_inputs: set[str], shape_paths: bool = True) -> list[str]:
    """Names of the nodes quantize() must leave in float: every node that reads a float tensor computed
    only from ``metadata_inputs``, from tensor shapes (``Shape``/``Size``, index generators; with
    ``shape_paths``) or only from constants by other nodes (anchors, grids, priors generated in the graph).
    An integer tensor computed so (a Reshape's shape, a Gather's indices) protects nothing where the
    node's float inputs are data: quantize_static never quantizes it, and the data stays on the grid.

    The origins are :func:`passes.shape_arithmetic.value_origins` (one definition for quantize()
    and fix()); on the float model, a tensor computed from constants alone is protected too.
    """
    graph = (model if isinstance(model, ir.Model) else ir.serde.deserialize_model(model)).graph  # only read
    computed = Origin.SHAPE if shape_paths else Origin.CONSTANT
    origins = value_origins(graph, metadata_inputs, shape_paths=shape_paths, computed_constants=computed)
    excluded = []
    for node in graph:
        if node.op_type == "Constant":
            continue
        inputs = [origins.get(v, Origin.CONSTANT) for v in node.inputs if v is not None]
        # quantize_static quantizes float tensors only, and of a data-movement op only the data: a
        # Reshape's shape, a Gather's indices, a Resize's scales computed from shapes leave the data
        # input to be quantized
        read = node.inputs[:1] if node.op_type in _FIRST_INPUT_QUANTIZED else node.inputs
        data = [origins.get(v, Origin.CONSTANT) for v in read if v is not None and _may_be_float(v)]
        reads_shapes = Origin.SHAPE in data or (Origin.SHAPE in inputs and Origin.DATA not in data)
        if reads_shapes or (shape_paths and all(kind is Origin.CONSTANT for kind in inputs)):
            excluded.append(node.name)
    return [name for name in excluded if name]


# ops whose first input is the only one quantize_static quantizes (onnxruntime 1.32's QDQ registry:
# QDQDirect8BitOp, QDQResize, QDQMaxPool, QDQSplit, QDQGather)
_FIRST_INPUT_QUANTIZED = frozenset({
    "AveragePool", "Flatten", "Gather", "GatherElements", "MaxPool", "Reshape", "Resize", "Slice", "Split",
    "Squeeze", "TopK", "Transpose", "Unsqueeze",
})


def _may_be_float(value: ir.Value) -> bool:
    """False for a value whose type says it holds integers or booleans (never quantized)."""
    return value.dtype is None or value.dtype.is_floating_point()


def unshare_protected_constants(model: onnx.ModelProto, protected: Collection[str]) -> int:
    """Give each node of ``protected`` its own copy of every initializer a node outside it reads too;
    returns how many inputs were rewired. quantize_static quantizes a tensor for all of its readers:
    a constant a protected node shares with a quantized op (prepare()'s deduplication merges equal
    constants: a grid's stride and the box offsets' scale, both 8.0) would reach it dequantized."""
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            if name in initializers:
                readers.setdefault(name, set()).add(node.name)
    protected = set(protected)
    taken = set(initializers) | {name for node in model.graph.node for name in [*node.input, *node.output]}
    copies: dict[str, str] = {}
    rewired = 0
    for node in model.graph.node:
        if node.name not in protected:
            continue
        for index, name in enumerate(node.input):
            if name not in initializers or not readers[name] - protected:
                continue
            if name not in copies:
                fresh, suffix = f"{name}_float", 0
                while fresh in taken:
                    suffix += 1
                    fresh = f"{name}_float_{suffix}"
                taken.add(fresh)
                copy = onnx.TensorProto()
                copy.CopyFrom(initializers[name])
                copy.name = fresh
                model.graph.initializer.append(copy)
                copies[name] = fresh
            node.input[index] = copies[name]
            rewired += 1
    return rewired

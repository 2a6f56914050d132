"""The FP32 graph quantize_static is given: canonicalized, constants lifted, equalized, at the opset it needs.

Stages of :func:`kenosis_rewrite.quantize`: :func:`canonical_graph` runs ``prepare()`` (verified
against the model as given), :func:`quantizable_graph` makes the graph quantize_static reads. Also
the marks that carry what quantize_static deletes (a Relu/Clip's clamp) to the rules after it.
"""

from __future__ import annotations

import collections
import dataclasses

import onnx
import onnx_ir as ir
from onnx_ir.passes import common as common_passes

from kenosis_rewrite._upstream.lift_constants import LiftAllConstantsPass
from kenosis_rewrite.accuracy.equalization import ChannelMaxima, equalize
from kenosis_rewrite.canonicalization.pipeline import prepare_serialized
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import ControlFlowError
from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.quantization.configuration import opset_for_per_channel
from kenosis_rewrite.quantization.settings import QuantizeSettings

# layers worth quantizing: what a model that quantize() leaves float entirely still computes
_LAYER_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "LSTM", "GRU", "RNN"})


@dataclasses.dataclass
class QuantizableGraph:
    """The prepared FP32 graph and the proto quantize_static reads.

    ``proto`` is ``prepared``'s serialisation (equalized weights aside) unless the opset converter
    made it (``unconverted`` False); ``per_channel`` is the weight granularity that opset allows.
    """

    prepared: ir.Model
    proto: onnx.ModelProto
    unconverted: bool
    per_channel: bool | str

    @property
    def protected_graph(self) -> ir.Model | onnx.ModelProto:
        """Where protection reads the graph: the prepared model where ``proto`` is its serialisation."""
        return self.prepared if self.unconverted else self.proto


def canonical_graph(original: onnx.ModelProto, work: ir.Model, feeds: list[dict], float_runs: fidelity.ReferenceRuns,
                    settings: QuantizeSettings, report: FixReport) -> tuple[ir.Model, ChannelMaxima | None]:
    """The canonical FP32 model (``prepare()``, its changes and notes copied into ``report``), and
    equalization's channel maxima, observed on prepare()'s runs of the prepared model."""
    maxima = ChannelMaxima() if settings.equalization else None
    if not settings.canonicalize:
        return work, maxima  # what deserialising ``original`` would give
    preparation = FixReport(target="prepare")
    # synthetic feeds have made-up sizes: they must not fix the model's input dims
    prepared = prepare_serialized(original, feeds, preparation, reference=float_runs,
                                  pin_shapes=not settings.self_calibrated, observer=maxima, work=work)
    report.changes.extend(preparation.changes)
    report.notes.extend(preparation.notes)
    return prepared, maxima


def quantizable_graph(prepared: ir.Model, feeds: list[dict], maxima: ChannelMaxima | None,
                      settings: QuantizeSettings, report: FixReport) -> QuantizableGraph:
    """``prepared`` as quantize_static needs it: constants as initializers, Gemm row biases as
    vectors, unique node names, no layers only inside control flow; equalized; converted to opset 13
    where per-channel weights pay for it."""
    # Constant nodes become initializers: quantize_static then treats them as weights (int8,
    # per-channel, quantized once), not as activations re-quantized at every run.
    LiftAllConstantsPass()(prepared)
    _gemm_row_biases_as_vectors(prepared, report)
    common_passes.RemoveUnusedNodesPass()(prepared)  # the rows no Gemm reads any more
    common_passes.NameFixPass()(prepared)  # quantize_static excludes nodes by name
    proto = ir.serde.serialize_model(prepared)
    _check_control_flow(proto, report)
    if settings.equalization:
        proto, equalized = equalize(proto, feeds, report, observed=maxima)
        report.note(f"activation equalization: {equalized} tensors")
    serialised = proto  # equalize() keeps a proto onnx_ir serialised as onnx_ir would serialise it
    proto, per_channel = opset_for_per_channel(proto, settings.per_channel, report)  # "auto" needs opset 13 too
    # calibration and quantize_static read the model as onnx_ir serialises it: what equalize() and
    # prepare() return already; the opset converter's proto is serialised so once, before calibration
    return QuantizableGraph(prepared, proto, proto is serialised, per_channel)


def _layers_in_bodies(graph: onnx.GraphProto) -> tuple[collections.Counter, list[str]]:
    """The layers (:data:`_LAYER_OPS`) inside the If/Loop/Scan bodies of ``graph``'s nodes, by op
    type, and the control-flow nodes that hold them (outermost)."""
    counts: collections.Counter = collections.Counter()
    holders: list[str] = []
    for node in graph.node:
        for attribute in node.attribute:
            for body in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs):
                inner = collections.Counter(n.op_type for n in body.node if n.op_type in _LAYER_OPS)
                nested, _ = _layers_in_bodies(body)
                if inner or nested:
                    counts += inner + nested
                    holders.append(node.name or node.op_type)
    return counts, list(dict.fromkeys(holders))


def _check_control_flow(proto: onnx.ModelProto, report: FixReport) -> None:
    """quantize_static quantizes the main graph only: refuse a model whose layers are all inside
    If/Loop/Scan bodies (the result would be the FP32 model, reported as unchanged), and say which
    layers stay float where only some are."""
    inside, holders = _layers_in_bodies(proto.graph)
    if not inside:
        return
    found = ", ".join(f"{count} {op_type}" for op_type, count in inside.most_common())
    where = ", ".join(repr(name) for name in holders[:3]) + (" ..." if len(holders) > 3 else "")
    if not any(node.op_type in _LAYER_OPS for node in proto.graph.node):
        raise ControlFlowError(
            f"quantize() has nothing to quantize outside control flow: the model's {found} are inside the bodies "
            f"of {where}, and quantize_static quantizes only the main graph, so the result would be the FP32 model. "
            "Export the network without control flow around it (one model per branch, its condition fixed, for "
            "instance), then quantize that.")
    report.note(f"quantize: {found} inside the bodies of {where} stay FP32 (quantize_static quantizes only the main graph)")


def _gemm_row_biases_as_vectors(model: ir.Model, report: FixReport) -> None:
    """A Gemm's constant ``C`` of shape ``[1, N]`` as ``[N]`` (the same broadcast onto ``(M, N)``):
    quantize_static's per-channel int32-bias check indexes ``C`` channel by channel and fails on a
    row (``ValueError: The truth value of an array ...``; ONNX Runtime's basic optimizer writes such
    a ``C`` when it fuses MatMul + Add of a ``[1, N]`` bias, as on magika 1.0.3's model)."""
    names = qdq_params.NameAllocator(model.graph)
    for node in model.graph:
        if node.op_type != "Gemm" or node.domain not in qdq_params.DEFAULT_DOMAINS or len(node.inputs) < 3:
            continue
        bias = node.inputs[2]
        if bias is None or bias.const_value is None or len(bias.const_value.shape) != 2 or bias.const_value.shape[0] != 1:
            continue
        vector = bias.const_value.numpy().reshape(-1)
        node.replace_input_with(2, qdq_params.add_initializer(model.graph, ir.tensor(vector), names.fresh(f"{bias.name}_vector")))
        report.note(f"quantize: Gemm {node.name!r} bias {list(bias.const_value.shape)} read as [{vector.size}] for quantize_static")


def mark_deleted_activations(float_proto: onnx.ModelProto, quantized: ir.Model, kept: set[str]) -> None:
    """Mark each Q whose clamp stands for a Relu/Clip quantize_static deleted from ``float_proto``
    (:func:`value_range.mark_deleted_activation`): a deleted ``Clip(-1, 1)`` leaves a Q whose range
    the graph cannot tell from a calibrated one, and a rewrite that folds through it (a BatchNorm
    into the Conv before the Clip) would drop the clamp. quantize_static renames the producer's
    output to the activation's, so the Q reads the activation's output name. ``kept``: the node
    names of quantize_static's output."""
    deleted = {node.output[0]: node.op_type for node in float_proto.graph.node
               if node.op_type in ("Relu", "Clip") and node.domain in qdq_params.DEFAULT_DOMAINS and node.name not in kept}
    for node in quantized.graph:
        if qdq_params.is_quantize(node) and node.inputs[0] is not None and node.inputs[0].name in deleted:
            value_range.mark_deleted_activation(node, deleted[node.inputs[0].name])


def unmark(model: ir.Model) -> None:
    for node in model.graph:
        node.metadata_props.pop(value_range.DELETED_ACTIVATION_KEY, None)

"""Per-layer SNR sensitivity analysis, and keeping the fragile layers in FP32.

For every Conv/ConvTranspose/MatMul/Gemm of a quantized model, against its FP32 original on
calibration feeds (ONNX Runtime, reference semantics: no graph optimisation):

* **weight SNR**: ``10 log10(|w|^2 / |w - DQ(w_q)|^2)`` of the float weights against the
  dequantized ones;
* **output SQNR**: of the layer's output tensor in the quantized model against the same tensor of
  the FP32 model (accumulated error);
* **local SQNR**: the noise this layer adds, noise powers being additive:
  ``N_local = N_out - N_in`` (relative to the signal), ``local = 10 log10(S / N_local)``.

``select_fp32_layers`` turns that into decisions: every layer whose weight SNR or local SQNR is
below ``threshold_db``; or, given a fidelity target (cosine of the model outputs against FP32 on the
feeds), the fewest layers, most sensitive first, that reach it (binary search on the count).
Keeping a layer in FP32 dequantizes its weights and removes the Q/DQ pairs on its input and its
output (:func:`keep_fp32`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.accuracy.layer_matching import first_input_readers, float_counterpart, same_weights
from kenosis_rewrite.core import fidelity, model_io, ort_sessions
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import KenosisError
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.dequantize import dequantize_constants, remove_qdq_pair
from kenosis_rewrite.graph.pass_base import remove_unused_nodes

RULE_NAME = "keep-fp32-sensitive-layer"


@dataclasses.dataclass(frozen=True)
class LayerSensitivity:
    name: str
    op_type: str
    weight_snr_db: float
    output_sqnr_db: float
    local_sqnr_db: float
    # the FP32 model's weights and bias of this layer, where they are the ones quantized (not folded since)
    float_weight: tuple[np.ndarray, np.ndarray | None] | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def score_db(self) -> float:
        """Lower is more sensitive."""
        return min(self.weight_snr_db, self.local_sqnr_db)


def _snr_db(reference: np.ndarray, candidate: np.ndarray) -> float:
    return fidelity.sqnr_db(np.asarray(reference, np.float64), np.asarray(candidate, np.float64))


def _source_name(value: ir.Value | None) -> str | None:
    """The float tensor a dequantized activation stands for (the input of its QuantizeLinear)."""
    producer = value.producer() if value is not None else None
    if qdq_params.is_dequantize(producer):
        quantize = producer.inputs[0].producer()
        if qdq_params.is_quantize(quantize):
            return quantize.inputs[0].name
    return value.name if value is not None else None


def _with_outputs(proto: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    existing = {o.name for o in model.graph.output}
    for name in names:
        if name not in existing:
            model.graph.output.append(onnx.ValueInfoProto(name=name))
    return model


def _run_all(proto: onnx.ModelProto, names: list[str], feeds) -> dict[str, list[np.ndarray]]:
    session = ort_sessions.session(_with_outputs(proto, names), ort_sessions.options(None, level="none"))
    available = {o.name for o in session.get_outputs()}
    wanted = [n for n in names if n in available]
    results: dict[str, list[np.ndarray]] = {n: [] for n in wanted}
    for feed in feeds:
        for name, value in zip(wanted, session.run(wanted, dict(feed))):
            results[name].append(value)
    return results


def analyze(float_model: model_io.ModelLike, quantized: model_io.ModelLike,
            feeds: Sequence[Mapping[str, np.ndarray]]) -> list[LayerSensitivity]:
    """Sensitivity of every heavy op of ``quantized`` (see the module docstring).

    Each layer is compared with its FP32 counterpart (the same op reading the same FP32 tensor), not
    with the FP32 tensor of the same name: fix() may give a layer's output the name of an
    activation it folded into the quantizer, and that FP32 tensor is clamped where the layer's is not.
    The input compared is what the layer reads (the dequantized tensor) against its FP32 source.
    """
    float_proto = model_io.to_output(model_io.LoadedModel(model_io.load(float_model, require_qdq=False).model, "proto"))
    loaded = model_io.load(quantized, require_qdq=False).model
    float_values = {v for node in float_proto.graph.node for v in node.output} | {i.name for i in float_proto.graph.input}
    float_weights = {init.name: init for init in float_proto.graph.initializer}
    readers = first_input_readers(float_proto)
    layers, float_names, quantized_names = [], set(), set()
    for node in loaded.graph:
        if node.op_type not in qdq_params.WEIGHTED_OPS or node.inputs[0] is None:
            continue
        source = _source_name(node.inputs[0])
        original = float_counterpart(node, source, readers) if source in float_values else None
        if original is None:
            continue
        layers.append((node, original, source))
        float_names.update((source, original.output[0]))
        quantized_names.update((node.inputs[0].name, node.outputs[0].name))
    reference = _run_all(float_proto, sorted(float_names), feeds)
    quantized_values = _run_all(ir.serde.serialize_model(loaded), sorted(quantized_names), feeds)
    results = []
    for node, original, source in layers:
        out_sqnr = _series_sqnr(reference.get(original.output[0]), quantized_values.get(node.outputs[0].name))
        in_sqnr = _series_sqnr(reference.get(source), quantized_values.get(node.inputs[0].name))
        results.append(LayerSensitivity(
            node.name or node.outputs[0].name, node.op_type, _weight_snr(node, original, float_weights),
            out_sqnr, _local_db(in_sqnr, out_sqnr), _float_weight(node, original, float_weights),
        ))
    return results


# weight rounding moves a weight by a step or two: still the layer quantized, not one folded since
_SAME_LAYER_STEPS = 4.0


def _float_weight(node: ir.Node, original: onnx.NodeProto, float_weights: dict) -> tuple[np.ndarray, np.ndarray | None] | None:
    """``original``'s FP32 weights and bias (None without one) where ``node``'s dequantized weights are
    those weights rounded (within a few steps)."""
    dq = node.inputs[1].producer() if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if not qdq_params.is_dequantize(dq) or qdq_params.const_array(dq.inputs[0]) is None or qdq_params.quant_params(dq) is None:
        return None
    if not same_weights(dq, original, float_weights, steps=_SAME_LAYER_STEPS):
        return None
    bias = float_weights.get(original.input[2]) if len(original.input) > 2 else None
    return (onnx.numpy_helper.to_array(float_weights[original.input[1]]),
            None if bias is None else onnx.numpy_helper.to_array(bias))


def _series_sqnr(reference: list | None, candidate: list | None) -> float:
    if not reference or not candidate:
        return float("inf")
    return _snr_db(np.concatenate([r.reshape(-1) for r in reference]), np.concatenate([c.reshape(-1) for c in candidate]))


def _local_db(in_db: float, out_db: float) -> float:
    noise = 10 ** (-out_db / 10) - (10 ** (-in_db / 10) if np.isfinite(in_db) else 0.0)
    return float("inf") if noise <= 0 else float(-10 * np.log10(noise))


def _weight_snr(node: ir.Node, original: onnx.NodeProto, float_weights: dict) -> float:
    dq = node.inputs[1].producer() if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if len(original.input) < 2 or original.input[1] not in float_weights or not qdq_params.is_dequantize(dq):
        return float("inf")
    params, data = qdq_params.quant_params(dq), qdq_params.const_array(dq.inputs[0])
    if params is None or data is None or params.block_size:
        return float("inf")
    weights = onnx.numpy_helper.to_array(float_weights[original.input[1]])
    dequantized = qdq_params.dequantize_array(data, params)
    if weights.shape != dequantized.shape:
        return float("inf")  # folded (e.g. BatchNormalization): not comparable
    return _snr_db(weights, dequantized)


_ACTIVATIONS = frozenset({"Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSwish", "HardSigmoid", "Tanh", "PRelu"})


def _output_quantizers(node: ir.Node) -> list[ir.Node]:
    """The Qs reading ``node``'s output, directly or through a chain of single-consumer activations."""
    value = node.outputs[0]
    for _ in range(4):
        users = [user for user, _ in value.uses()]
        if len(users) == 1 and users[0].op_type in _ACTIVATIONS:
            value = users[0].outputs[0]
            continue
        break
    return [user for user, _ in value.uses() if qdq_params.is_quantize(user)]


def keep_fp32(model: ir.Model, names: Sequence[str], report: FixReport | None = None,
              reasons: Mapping[str, str] | None = None, float_weights: Mapping[str, tuple | None] | None = None,
              rule: str = RULE_NAME) -> int:
    """Return the named layers to FP32: float weights, unquantized input and output.

    ``float_weights``: the FP32 model's weights per layer name (:attr:`LayerSensitivity.float_weight`);
    a layer without them keeps its dequantized weights (their rounding error stays). ``rule``: the name
    the report lists the changes under (the caller's reason to keep them in FP32). The Q/DQ pairs
    on the layer's input and output are removed even when a neighbour then loses its integer kernel:
    fidelity first; the report says which layers, and the benchmark what it costs.
    """
    wanted, count = set(names), 0
    fresh = qdq_params.NameAllocator(model.graph)
    for node in list(model.graph):
        if node.name not in wanted or node.op_type not in qdq_params.WEIGHTED_OPS:
            continue
        dequantize_constants(node, model.graph, names=fresh)
        _restore_float_parameters(model.graph, node, (float_weights or {}).get(node.name), fresh)
        dq = node.inputs[0].producer() if node.inputs[0] is not None else None
        if qdq_params.is_dequantize(dq) and qdq_params.is_quantize(dq.inputs[0].producer()):
            remove_qdq_pair(dq.inputs[0].producer(), names=fresh)
        for quantize in _output_quantizers(node):
            remove_qdq_pair(quantize, names=fresh)
        count += 1
        if report is not None:
            report.changed(rule, node.name, (reasons or {}).get(node.name, "kept in FP32"), exact=False)
    remove_unused_nodes(model)
    return count


def with_layers_in_fp32(quantized: ir.Model, names: Sequence[str],
                        float_weights: Mapping[str, tuple | None] | None = None) -> onnx.ModelProto:
    """A copy of ``quantized`` with the named layers returned to FP32 (:func:`keep_fp32`); ``quantized``
    is left as it is."""
    copy = ir.serde.deserialize_model(ir.serde.serialize_model(quantized))
    keep_fp32(copy, names, float_weights=float_weights)
    return ir.serde.serialize_model(copy)


def _restore_float_parameters(graph: ir.Graph, node: ir.Node, original: tuple | None, names: qdq_params.NameAllocator) -> None:
    """``node`` (its constants dequantized) reads the FP32 model's weight and bias where they fit."""
    for index, values in enumerate(original or (), start=1):
        current = node.inputs[index] if len(node.inputs) > index else None
        if values is None or current is None or current.const_value is None or tuple(current.const_value.shape) != values.shape:
            continue
        name = names.fresh(f"{node.name}_fp32_{'weight' if index == 1 else 'bias'}")
        tensor = ir.tensor(values.astype(current.const_value.dtype.numpy()), name=name)
        node.replace_input_with(index, qdq_params.add_initializer(graph, tensor, name))


def _cosine(reference: list[list[np.ndarray]], proto: onnx.ModelProto, feeds) -> float:
    outputs = fidelity.run(proto, feeds)
    return fidelity.scores(reference, outputs)["cosine"]


def check_target_cosine(target_cosine: float | None) -> None:
    """Raise KenosisError unless ``target_cosine`` is None or in (0, 1]."""
    if target_cosine is not None and not 0.0 < target_cosine <= 1.0:
        raise KenosisError(f"target_cosine must be in (0, 1], got {target_cosine!r}")


def select_fp32_layers(
    float_model: model_io.ModelLike,
    quantized: ir.Model,
    feeds: Sequence[Mapping[str, np.ndarray]],
    *,
    threshold_db: float | None = None,
    target_cosine: float | None = None,
) -> tuple[list[str], list[LayerSensitivity], dict[str, str], str | None]:
    """(layers to keep in FP32, the analysis, a reason per chosen layer, a note or None).

    ``target_cosine``: the fewest of the weakest layers whose keeping in FP32 brings the output
    cosine on ``feeds`` to the target. Where keeping every layer does not reach it either (the error
    is the activations' rounding, which no layer's weights hold), the one of none or every layer
    with the higher cosine, and the note says so: keeping them all made PP-OCRv5's recognizer
    slower and less faithful (0.9786 -> 0.9713 on its calibration feeds).
    """
    check_target_cosine(target_cosine)
    analysis = analyze(float_model, quantized, feeds)
    ranked = sorted(analysis, key=lambda layer: layer.score_db)
    reasons = {
        layer.name: f"weight SNR {layer.weight_snr_db:.1f} dB, local SQNR {layer.local_sqnr_db:.1f} dB"
        for layer in analysis
    }
    chosen: list[str] = []
    note = None
    weights = {layer.name: layer.float_weight for layer in analysis}
    if threshold_db is not None:
        chosen = [layer.name for layer in ranked if layer.score_db < threshold_db]
    if target_cosine is not None:
        float_proto = model_io.to_output(model_io.LoadedModel(model_io.load(float_model, require_qdq=False).model, "proto"))
        reference = fidelity.run(float_proto, feeds)
        measured: dict[int, float] = {}

        def cosine_with(count: int) -> float:
            if count not in measured:
                names = sorted(set(chosen) | {layer.name for layer in ranked[:count]})
                measured[count] = _cosine(reference, with_layers_in_fp32(quantized, names, weights), feeds)
            return measured[count]

        low, high = 0, len(ranked)
        if cosine_with(0) < target_cosine:
            if cosine_with(high) < target_cosine:  # unreachable: the better of none and all
                low = max(measured, key=lambda count: (measured[count], -count))
                note = (f"target cosine {target_cosine:g} not reached by keeping layers in FP32: "
                        f"{measured[high]:.5f} with all {high}, {measured[0]:.5f} with none; kept {low}")
            else:
                while low < high:  # smallest count reaching the target (cosine grows with the count)
                    middle = (low + high) // 2
                    if cosine_with(middle) >= target_cosine:
                        high = middle
                    else:
                        low = middle + 1
            chosen = sorted(set(chosen) | {layer.name for layer in ranked[:low]}, key=[entry.name for entry in ranked].index)
    return chosen, analysis, reasons, note

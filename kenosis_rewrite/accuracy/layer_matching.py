"""Each quantized layer matched with the FP32 layer it was quantized from.

Bias correction, weight rounding and sensitivity analysis compare a quantized Conv/Gemm/MatMul with
its FP32 original on the same inputs; these helpers find that original (same op reading the same FP32
tensor, with the weights that were quantized).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params


def first_input_readers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    """FP32 nodes by the tensor they read as first input."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        if node.input:
            readers.setdefault(node.input[0], []).append(node)
    return readers


def matched_layers(float_model: onnx.ModelProto, model: ir.Model, ops: Sequence[str], match,
                   rule_name: str, report: FixReport | None) -> list:
    """What ``match(node, float_readers, float_weights)`` returns for each standard-domain node of
    ``model`` whose op is in ``ops``: the layers it matched with ``float_model``, in graph order; the
    reasons it returned (strings) for the others go into ``report`` as refusals of ``rule_name``."""
    float_weights = {init.name: init for init in float_model.graph.initializer}
    float_readers = first_input_readers(float_model)
    layers = []
    for node in model.graph:
        if node.op_type not in ops or node.domain not in qdq_params.DEFAULT_DOMAINS:
            continue
        found = match(node, float_readers, float_weights)
        if not isinstance(found, str):
            layers.append(found)
        elif report is not None:
            report.refused(rule_name, node.name or node.outputs[0].name, found)
    return layers


def float_counterpart(node: ir.Node, source: str, float_readers: Mapping[str, list[onnx.NodeProto]]) -> onnx.NodeProto | None:
    """The FP32 node ``node`` was quantized from: same op reading ``source``; its own name decides
    between several (fix() may have renamed the output, e.g. to the activation it absorbed)."""
    candidates = [n for n in float_readers.get(source, ()) if n.op_type == node.op_type and n.input[0] == source]
    named = [n for n in candidates if n.name and n.name == node.name]
    if named:
        return named[0]
    return candidates[0] if len(candidates) == 1 else None


def same_weights(weight_dq: ir.Node, original: onnx.NodeProto, float_weights: Mapping[str, onnx.TensorProto],
                 steps: float = 1.0) -> bool:
    """The FP32 layer's weights equal the dequantized ones within ``steps`` quantization steps: it is
    the layer that was quantized, not one a BatchNormalization or a scale was folded into since."""
    if len(original.input) < 2 or original.input[1] not in float_weights:
        return False
    weights = onnx.numpy_helper.to_array(float_weights[original.input[1]])
    data, params = qdq_params.const_array(weight_dq.inputs[0]), qdq_params.quant_params(weight_dq)
    if params.block_size or weights.shape != data.shape:
        return False
    dequantized = qdq_params.dequantize_array(data, params)
    step = np.abs(qdq_params.dequantize_array(data.astype(np.int32) + 1, params) - dequantized)
    return bool(np.all(np.abs(weights - dequantized) <= step * steps * 1.01))

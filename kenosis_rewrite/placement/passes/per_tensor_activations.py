"""Re-quantize per-channel (per-axis) activation quantizers per tensor.

Transformation, for an activation (non-constant) ``Q``/``DQ`` pair with per-axis parameters::

    Q(x; s_c, z_c, axis) -> DQ(.; s_c, z_c, axis)    ==>    Q(x; s, z) -> DQ(.; s, z)

where ``[lo, hi]`` is the union of the channels' ranges, ``lo = min_c s_c (qmin - z_c)``,
``hi = max_c s_c (qmax - z_c)``, ``s = (hi - lo) / (qmax - qmin)`` and ``z = qmin - lo / s`` rounded
(exactly qmin when ``lo == 0``, so a clamp at 0 stays a clamp at 0).

Why: ORT CPU has no integer kernel that takes a per-axis activation (QLinearConv, QLinearMatMul and
their selectors want a scalar input scale). NNCF puts per-channel quantizers at the inputs of
depthwise convolutions, and every one of those Convs then runs in float between a per-axis DQ and
its output Q (measured: its MobileNetV2 runs at 0.35x FP32 on ORT CPU, shared research peers.md).

Exactness: approximate. Every value any channel could represent stays inside the new range (no new
clamp at the tensor's bounds; a channel whose calibrated range was narrower loses that narrower
bound), and each channel's step grows from ``s_c`` to ``s``: the error per element is at most
``s / 2`` instead of ``s_c / 2``. The pass converts a tensor only when the estimated SQNR of its
worst channel on the per-tensor grid, that channel filling its own calibrated range, is at least
:data:`MIN_ESTIMATED_SQNR_DB` (``20 log10(min_c s_c (qmax - qmin) / s)``; the worst channel is what
counts, since a depthwise convolution reads each channel on its own): 30 dB allows channel ranges
about 8x apart in 8 bits. Channels whose ranges differ more keep their per-channel quantizer, with
the estimate as the reason (measured: NNCF's PP-LCNet has ratios of 40-100x, and converting them
costs 0.07 cosine). ``fix()``'s run-time guard measures the result on data.

Refused with a reason: parameters that are not constants, DQ consumers with other parameters, a
quantized output that is a graph output or read by anything but DequantizeLinear, blocked
parameters, an estimate below the threshold.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass

RULE_NAME = "per-tensor-activations"
MIN_ESTIMATED_SQNR_DB = 30.0


def per_tensor_params(params: qdq_params.QuantParams) -> tuple[float, int, float]:
    """``(scale, zero_point, estimated worst-channel SQNR in dB)`` of one grid covering every channel's range."""
    scale = params.scale.astype(np.float64).reshape(-1)
    zero_point = params.zero_point.astype(np.float64).reshape(-1)
    levels = params.qmax - params.qmin
    lo = float(np.min(scale * (params.qmin - zero_point)))
    hi = float(np.max(scale * (params.qmax - zero_point)))
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    new_scale = (hi - lo) / levels if hi > lo else float(scale.max())
    new_zero_point = params.qmin if lo == 0.0 else int(np.clip(np.rint(params.qmin - lo / new_scale), params.qmin, params.qmax))
    # the channel with the finest grid loses the most: its span over the new step, in dB
    estimate = 20.0 * np.log10(float(scale.min()) * levels / new_scale) if new_scale > 0 else float("inf")
    return new_scale, new_zero_point, float(estimate)


class PerTensorActivationsPass(ReportingPass):
    """Per-axis activation Q/DQ pairs -> per-tensor ones; see the module docstring."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, modified = model.graph, False
        for node in list(graph):
            if qdq_params.is_quantize(node) and qdq_params.const_array(node.inputs[0]) is None:
                modified |= self._convert(graph, node)
        return ir.passes.PassResult(model, modified=modified)

    def _convert(self, graph: ir.Graph, quantize: ir.Node) -> bool:
        params = qdq_params.quant_params(quantize)
        if params is None or params.scale.size <= 1 or params.block_size:
            return False
        where = quantize.name or "QuantizeLinear"
        output = quantize.outputs[0]
        consumers = qdq_params.requantizable(output)
        if isinstance(consumers, str):
            self.refused(where, consumers)
            return False
        if not consumers:  # no reader at all: refused as before, with the same words
            self.refused(where, f"quantized tensor {output.name!r} is read by a non-DequantizeLinear node")
            return False
        if any(not (p := qdq_params.quant_params(dq)) or not p.same_as(params) for dq in consumers):
            self.refused(where, "a DequantizeLinear of this tensor has other parameters")
            return False
        scale, zero_point, estimate = per_tensor_params(params)
        if estimate < MIN_ESTIMATED_SQNR_DB:
            self.refused(
                where, f"channel ranges differ too much for one grid: estimated SQNR {estimate:.1f} dB "
                f"< {MIN_ESTIMATED_SQNR_DB:g} dB (kept per channel; ORT runs its consumer in float)",
            )
            return False
        base = f"{output.name or 'activation'}_per_tensor"
        qdq_params.set_per_tensor_params(graph, (quantize, *consumers), scale, zero_point, params, base, qdq_params.NameAllocator(graph))
        self.changed(
            where, f"{params.describe()} -> {params.dtype.name.lower()} s={scale:.6g} zp={zero_point} "
            f"(estimated SQNR {estimate:.1f} dB)", exact=False,
        )
        return True

"""Requantize biases to int32 at input scale × weight scale: stale int32 scales, and narrower integer biases.

Transformation, for Conv/ConvTranspose/Gemm with dequantized input, weight and integer bias::

    DQ(b_q; s_b, z_b)   ==>   DQ(rint((b_q - z_b) * s_b / (s_x * s_w)); s_x * s_w, 0)

Why: ORT CPU folds the bias into QLinearConv/QGemm only when ``s_b == s_x * s_w`` (per output
channel for per-channel weights); otherwise the op stays float. quantize_static always satisfies
it, but any rule that changes an activation scale upstream (the Relu/Clip island rules) breaks it.
A bias stored in another integer type (Quark's XINT8 preset writes int8 biases with their own
power-of-two scale) keeps ORT from fusing at all: it becomes int32 the same way.

Exactness: approximate, by at most half a step of the new bias scale per channel (the bias is
re-rounded onto the grid the integer kernel accumulates on); values beyond int32 are clamped and
reported. Refused with a reason: Gemm with alpha or beta other than 1, a bias DQ with a
non-constant input, per-tensor/per-channel shapes that do not line up.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass

RULE_NAME = "requantize-stale-bias"
_BIASED_OPS = ("Conv", "ConvTranspose", "Gemm")
_INT32 = np.iinfo(np.int32)


def _dequantized_input(node: ir.Node, index: int) -> ir.Node | None:
    value = node.inputs[index] if len(node.inputs) > index else None
    producer = value.producer() if value is not None else None
    return producer if qdq_params.is_dequantize(producer) else None


class BiasRescalePass(ReportingPass):
    """Make every int32 bias scale equal to input scale × weight scale again."""

    rule_name = RULE_NAME

    def __init__(self, report: FixReport | None = None, rtol: float = 1e-6):
        super().__init__(report)
        self.rtol = rtol

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        names = qdq_params.NameAllocator(model.graph)  # one scan of the graph for every bias rescaled
        for node in list(model.graph):
            if node.op_type in _BIASED_OPS and node.domain in ("", "ai.onnx"):
                modified |= self._rescale(model.graph, names, node)
        return ir.passes.PassResult(model, modified=modified)

    def _rescale(self, graph: ir.Graph, names: qdq_params.NameAllocator, node: ir.Node) -> bool:
        dq_x, dq_w, dq_b = (_dequantized_input(node, i) for i in range(3))
        if dq_x is None or dq_w is None or dq_b is None:
            return False
        p_x, p_w, p_b = (qdq_params.quant_params(n) for n in (dq_x, dq_w, dq_b))
        if (p_x is None or p_w is None or p_b is None
                or (p_b.dtype != ir.DataType.INT32 and p_b.dtype not in qdq_params.INTEGER_RANGES) or p_b.block_size):
            return False
        if not p_x.is_per_tensor:
            return False
        expected = (p_x.scalar_scale * p_w.scale.astype(np.float64)).reshape(-1)
        current = p_b.scale.astype(np.float64).reshape(-1)
        is_int32 = p_b.dtype == ir.DataType.INT32
        # compared in the scale's own type: a float16 scale never equals the float64 product
        typed = expected.astype(p_b.scale.dtype).astype(np.float64)
        if is_int32 and current.size == expected.size and np.allclose(current, typed, rtol=self.rtol, atol=0):
            return False
        where = node.name or node.op_type
        if node.op_type == "Gemm" and (
            node.attributes.get_float("alpha", 1.0) != 1.0 or node.attributes.get_float("beta", 1.0) != 1.0
        ):
            self.refused(where, "Gemm with alpha or beta other than 1 has no integer bias")
            return False
        bias_q = qdq_params.const_array(dq_b.inputs[0])
        if bias_q is None:
            self.refused(where, "the bias is not a constant")
            return False
        if current.size not in (1, bias_q.size) or expected.size not in (1, bias_q.size):
            self.refused(where, "bias and weight scales do not line up per channel")
            return False
        bias = (bias_q.astype(np.float64) - p_b.zero_point.astype(np.float64).reshape(-1)) * current
        per_channel = expected.size > 1
        scale = (expected if per_channel else expected.reshape(p_b.scale.shape)).astype(p_b.scale.dtype)
        requantized = np.rint(bias / scale.astype(np.float64).reshape(-1)).reshape(bias_q.shape)
        clamped = int(np.count_nonzero((requantized < _INT32.min) | (requantized > _INT32.max)))
        requantized = np.clip(requantized, _INT32.min, _INT32.max).astype(np.int32)
        base = dq_b.inputs[0].name or "bias"
        data_name = names.fresh(f"{base}_rescaled")
        scale_name = names.fresh(f"{base}_rescaled_scale")
        data = qdq_params.add_initializer(graph, ir.tensor(requantized, name=data_name), data_name)
        scale_value = qdq_params.add_initializer(graph, ir.tensor(scale, name=scale_name), scale_name)
        if len(dq_b.outputs[0].uses()) > 1:
            replacement = ir.Node(
                "", "DequantizeLinear", [data, scale_value],
                name=names.fresh(f"{dq_b.name or 'bias'}_rescaled"),
            )
            replacement.outputs[0].name = names.fresh(f"{base}_rescaled_dequantized")
            graph.insert_before(node, replacement)
            node.replace_input_with(2, replacement.outputs[0])
            dq_node = replacement
        else:
            dq_b.replace_input_with(0, data)
            dq_b.replace_input_with(1, scale_value)
            dq_b.resize_inputs(2)  # int32 bias: zero point 0, implicit
            dq_node = dq_b
        if per_channel:
            dq_node.attributes["axis"] = ir.AttrInt64("axis", 0)
        else:
            dq_node.attributes.pop("axis", None)
        detail = f"bias scale -> input scale x weight scale ({expected.size} channel(s))"
        if not is_int32:
            detail = f"{p_b.dtype.name.lower()} bias -> int32 at input scale x weight scale ({expected.size} channel(s))"
        if clamped:
            detail += f"; {clamped} value(s) clamped to int32"
        self.changed(where, detail, exact=False)
        return True

"""3-D Convs run in float on ONNX Runtime CPU, whose integer 3-D Conv loses to its float one.

Transformation, for a Conv whose weight has 5 dimensions (a 3-D convolution) in QDQ form::

    DQ(x) -> Conv(., DQ(w)) -> Q -> DQ     ==>     DQ(x) -> Conv(., w_float) -> consumers

through :class:`~kenosis_rewrite.graph.dequantize.FloatRegionsPass`: the weights become their
dequantized float values and the Q/DQ pairs that only served this Conv go (their neighbours keep
theirs).

Why (measured, onnxruntime 1.32.0, x86 AVX512-VNNI, interleaved medians; data and command in
``docs/benchmarks/float_3d_conv/``): two 1x11x11 Conv3D layers over [1, 4, 2, 48, 48] run 10.7 ms as
ORT's integer 3-D Convs against 2.65 ms in float at one thread (0.25x FP32 as quantized, 0.98x
after this pass). A 3x3x3 kernel, timed once on a busy host, was within 10% either way at one and
two threads. ORT has no fused integer 3-D Conv comparable to its 2-D one, so the integer form wins
little where it wins and loses up to 4x (a watermark decoder of 1x11x11 Convs: 2.05x FP32 as
quantized, 1.09x after its last Convs were made integer).

Exactness: the Conv computes on the same dequantized values; exact where no Q/DQ pair is removed,
otherwise the removed roundings make it closer to FP32 (reported as approximate). ``fix()``'s
run-time guard checks the result.
"""

from __future__ import annotations

import onnx_ir as ir

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.dequantize import FloatRegionsPass
from kenosis_rewrite.graph.pass_base import ReportingPass

RULE_NAME = "float-3d-conv"
_RANK_3D = 5  # [out, in, depth, height, width]


def _is_quantized_3d_conv(node: ir.Node) -> bool:
    if node.op_type not in ("Conv", "ConvTranspose") or node.domain not in op_tables.DEFAULT_DOMAINS or len(node.inputs) < 2:
        return False
    weight = node.inputs[1].producer() if node.inputs[1] is not None else None
    if not qdq_params.is_dequantize(weight):
        return False
    codes = qdq_params.const_array(weight.inputs[0])
    return codes is not None and codes.ndim == _RANK_3D


class Float3DConvPass(ReportingPass):
    """Quantized 3-D Convs back to float; see the module docstring."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        convs = [node for node in model.graph if _is_quantized_3d_conv(node)]
        if not convs:
            return ir.passes.PassResult(model, modified=False)
        allocator = qdq_params.NameAllocator(model.graph)
        for node in convs:
            node.name = node.name or allocator.fresh("Conv3D")  # FloatRegionsPass selects by name
        names = [node.name for node in convs]
        inner = FloatRegionsPass(names)
        result = inner(model)
        for name in names:
            self.changed(name, "3-D Conv runs float: ORT CPU's integer 3-D Conv is slower", exact=False)
        return ir.passes.PassResult(model, modified=result.modified)

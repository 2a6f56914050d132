"""A QDQ model with float16 scales, run in float32 between float16 inputs and outputs.

Transformation, where a QuantizeLinear/DequantizeLinear of the main graph has a float16 scale
(opset 19 and later allow it; quantize_static writes it for a float16 model)::

    x: float16 -> Q(s16) -> DQ(s16) -> Conv(float16) -> ... -> y: float16
        ==>
    x: float16 -> Cast(FLOAT) -> Q(s32) -> DQ(s32) -> Conv(float32) -> ... -> Cast(FLOAT16) -> y: float16

every float16 scale, constant and value made float32 (:mod:`kenosis_rewrite.canonicalization.float16`),
the graph's inputs and outputs keeping their float16 type through a Cast each.

Why: ONNX Runtime's CPU QDQ fusions (QLinearConv, QGemm, QLinearAdd, ...) take float32 scales only.
A float16 QDQ model (quantize_static's ResNet-style toy with every scale and float tensor float16)
ran 0 of its 8 heavy ops as integer kernels on onnxruntime 1.32 (x86): ORT wrapped each float16
node in Casts to float32 and back instead; after this pass the rules see float32 scales and all 8
fuse. Measured: ``tests/unit/placement/passes/test_float16_qdq.py``.

Exactness: every scale, zero point and constant keeps its value exactly (float16 -> float32 is
exact), and so does each input passing its Cast; the float ops between compute in float32 instead
of rounding each result to float16, at least as precisely as before; the outputs are rounded to
float16 once, at the end. Not bit for bit the input, so recorded inexact: the run-time guard holds
it to its cosine budget. Models whose Q/DQ scales are all float32 are left alone (their float16
islands too).
"""

from __future__ import annotations

import onnx_ir as ir

from kenosis_rewrite.canonicalization import float16
from kenosis_rewrite.graph.pass_base import ReportingPass

RULE_NAME = "float16-qdq-to-float32"
_SITE = "graph"


class Float16QDQToFloat32Pass(ReportingPass):
    """Float16 Q/DQ scales (and the float16 graph around them) to float32, the interface kept float16."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.held(_SITE) or not float16.has_float16_scales(model):
            return ir.passes.PassResult(model, modified=False)
        half = float16.to_float32(model)
        if half is None:  # has_float16_scales found a float16 scale: not reached
            return ir.passes.PassResult(model, modified=False)
        float16.cast_interface(model, half)
        self.changed(_SITE, half.note("float16 Q/DQ scales made float32 for ONNX Runtime's integer fusions"),
                     exact=False, site=_SITE)
        return ir.passes.PassResult(model, modified=True)

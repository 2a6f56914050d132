"""The op tables: which ONNX ops the package treats alike, defined once.

Every module that asks "is this a quantizer?", "does this op carry a weight?" or "does this op pass
its input's values through unchanged?" reads the answer here, so two rules cannot disagree. Tables
that look alike but hold different ops answer different questions, and their names say which.
"""

from __future__ import annotations

__all__ = [
    "AFFINE_OPS", "DATA_MOVEMENT_OPS", "DEFAULT_DOMAINS", "DEQUANTIZE", "INTEGER_WITH_FLOAT_OUTPUT_OPS", "ORDER_PRESERVING_OPS",
    "ORT_ABSORBED_ACTIVATIONS", "PER_AXIS_OPSET", "QDQ_COMMUTING_OPS", "QUANTIZE", "VALUE_SELECTING_OPS",
    "WEIGHTED_OPS",
]

QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"
DEFAULT_DOMAINS = ("", "ai.onnx")
PER_AXIS_OPSET = 13  # QuantizeLinear/DequantizeLinear's axis attribute (per-axis parameters)

# Ops whose second input is a weight (a constant that quantizers quantize as weights): the heavy ops of
# a model, which ORT CPU runs as integer kernels (QLinearConv, QLinearMatMul, QGemm, ...) where it can.
WEIGHTED_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")

# Weighted ops ORT CPU runs as integer kernels with a float output when no Q follows them
# (MatMulIntegerToFloat, QGemm): an output quantizer adds a rounding and no integer MACs.
INTEGER_WITH_FLOAT_OUTPUT_OPS = frozenset({"MatMul", "Gemm"})

# Elementwise binary arithmetic an affine map ``a * x + c`` is written with (per-channel ``a``, ``c``
# fold into a Conv's or Gemm's weights and bias); in the order rules are built for them.
AFFINE_OPS = ("Mul", "Div", "Add", "Sub")

# Activations ORT CPU absorbs into QLinearConv/QLinearMatMul/QGemm when the Q after them makes them
# redundant (its clamp is theirs); a weighted op's output Q may sit after one of them.
ORT_ABSORBED_ACTIVATIONS = ("Relu", "Clip")

# Ops that only rearrange or select the elements of their first input (no arithmetic, no comparison):
# a per-tensor elementwise map such as a Q or a DQ commutes with them.
DATA_MOVEMENT_OPS = frozenset({
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Identity", "DepthToSpace", "SpaceToDepth",
})

# Ops a per-tensor Q/DQ commutes with and that run on quantized tensors: data movement, and MaxPool (a
# monotone map commutes with max; ORT's 8-bit MaxPool from opset 12).
QDQ_COMMUTING_OPS = DATA_MOVEMENT_OPS | {"MaxPool"}

# Ops whose every output value is one of the values of their first input (selection, layout, max/min):
# their outputs lie in the input's range (value_range's pass-through ops).
VALUE_SELECTING_OPS = frozenset({
    "MaxPool", "GlobalMaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze",
    "Slice", "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Identity",
    "DepthToSpace", "SpaceToDepth", "ReduceMax", "ReduceMin", "Split",
})

# Ops whose each output value is an input value, or a monotone function of one input value alone
# (data movement, and monotone activations; Softmax and LogSoftmax keep each row's order): where a
# tensor's extremes come from (calibration.output_extremes' pass-through ops).
ORDER_PRESERVING_OPS = frozenset({
    # data movement
    "Concat", "Split", "Slice", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Gather", "Expand",
    "Tile", "Identity", "Cast", "Dropout", "MaxPool", "GlobalMaxPool",
    # monotone, value by value
    "Sigmoid", "Tanh", "Relu", "LeakyRelu", "Clip", "HardSigmoid", "Softmax", "LogSoftmax", "Exp", "Elu", "Selu",
})

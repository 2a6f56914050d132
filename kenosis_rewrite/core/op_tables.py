"""The op tables: which ONNX ops the package treats alike, defined once.

Every module that asks "is this a quantizer?", "does this op carry a weight?" or "does this op pass
its input's values through unchanged?" reads the answer here, so two rules cannot disagree.
"""

from __future__ import annotations

__all__ = ["DEFAULT_DOMAINS", "DEQUANTIZE", "PER_AXIS_OPSET", "QUANTIZE"]

QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"
DEFAULT_DOMAINS = ("", "ai.onnx")
PER_AXIS_OPSET = 13  # QuantizeLinear/DequantizeLinear's axis attribute (per-axis parameters)

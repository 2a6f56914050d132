"""Float16 copies of FP32 and QDQ models, as exporters (and quantize_static on them) write float16 graphs.

For the tests and benchmarks of float16 inputs (:mod:`kenosis_rewrite.canonicalization.float16`):
every float32 constant, value and type attribute becomes float16, rounded to nearest, so the copy
computes what its FP32 original does up to float16 rounding. A QDQ model's scales become float16
too, which QuantizeLinear/DequantizeLinear accept from opset 19: pass ``opset=19`` (or later).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.canonicalization.float16 import retype_floats

__all__ = ["FLOAT16_QDQ_OPSET", "float16_feeds", "float16_model"]

FLOAT16_QDQ_OPSET = 19  # QuantizeLinear/DequantizeLinear with float16 scales


def float16_model(model: onnx.ModelProto, opset: int | None = None) -> onnx.ModelProto:
    """A float16 copy of ``model`` (the module docstring), converted to ``opset`` first when given;
    it passes ``onnx.checker`` with ``full_check``."""
    if opset is not None:
        model = onnx.version_converter.convert_version(model, opset)
    converted = ir.serde.deserialize_model(model)
    retype_floats(converted, ir.DataType.FLOAT, ir.DataType.FLOAT16)
    proto = ir.serde.serialize_model(converted)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def float16_feeds(feeds: Iterable[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """``feeds`` with every float32 array as float16 (rounded to nearest)."""
    return [{name: np.asarray(array, np.float16) if np.asarray(array).dtype == np.float32 else array
             for name, array in feed.items()} for feed in feeds]

"""A QDQ model whose Q/DQ its opset does not have, moved to opset 13 so that it is valid and runs.

onnxruntime's ``quantize_static(per_channel=True)`` of an FP32 model below opset 13 writes
QuantizeLinear/DequantizeLinear nodes with an ``axis`` attribute, which those ops only have from
opset 13; Quark keeps an opset-9 model's opset (Caffe-era exports: open_nsfw) and writes Q/DQ,
which exist from opset 10. The checker refuses the result and onnxruntime cannot load it: the user
is left with nothing. :func:`upgraded_for_per_axis` converts the model to opset 13 with onnx's
version converter (which has no adapter for a Q/DQ below 10: those pass through it in a private
domain, unchanged, as their opset-13 form computes the same).

Exactness: the conversion changes op versions, not values, and it is checked: the model's float
counterpart (every Q/DQ removed, weights dequantized; valid at any opset) before and after the
conversion must give the same outputs on random feeds, to float32 rounding (ops whose newer version
is written differently, Softmax-11 as Flatten/Softmax-13/Reshape, may round differently). Refused
(the original error stands) where the converter fails or the check does not hold.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.core import fidelity, model_io, op_tables
from kenosis_rewrite.errors import InvalidModelError
from kenosis_rewrite.graph.dequantize import DequantizeAllPass

UPGRADE_FEEDS = 2
# float32 rounding of ops written differently at the two versions: relative to each output's scale
UPGRADE_TOLERANCE = 1e-5


_QDQ_OPSET = 10  # QuantizeLinear/DequantizeLinear exist from here
_PASSING_DOMAIN = "kenosis.unconverted"  # Q/DQ below opset 10 cross the converter in this domain


def needs_per_axis_upgrade(error: InvalidModelError) -> bool:
    """Whether ``error`` is the checker's refusal of per-axis Q/DQ below opset 13, or of Q/DQ below 10."""
    message = str(error)
    if "QuantizeLinear" not in message and "DequantizeLinear" not in message:
        return False
    return "Unrecognized attribute: axis" in message or "No Op registered for" in message


def _sorted(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with its nodes in topological order (Quark writes some out of order), as a copy."""
    model = ir.serde.deserialize_model(proto)
    model.graph.sort()
    return ir.serde.serialize_model(model)


def _converted(proto: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """onnx's version converter to opset 13, the Q/DQ of a model below 10 carried across unchanged."""
    if opset >= _QDQ_OPSET:
        return onnx.version_converter.convert_version(proto, op_tables.PER_AXIS_OPSET)
    marked = onnx.ModelProto()
    marked.CopyFrom(proto)
    carried = [node for node in marked.graph.node if node.domain in op_tables.DEFAULT_DOMAINS
               and node.op_type in (op_tables.QUANTIZE, op_tables.DEQUANTIZE)]
    for node in carried:
        node.domain = _PASSING_DOMAIN
    marked.opset_import.append(onnx.helper.make_opsetid(_PASSING_DOMAIN, 1))
    converted = onnx.version_converter.convert_version(marked, op_tables.PER_AXIS_OPSET)
    for node in converted.graph.node:
        if node.domain == _PASSING_DOMAIN:
            node.domain = ""
    kept = [o for o in converted.opset_import if o.domain != _PASSING_DOMAIN]
    del converted.opset_import[:]
    converted.opset_import.extend(kept)
    return converted


def _proto(model: model_io.ModelLike) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, ir.Model):
        return ir.serde.serialize_model(model)
    return onnx.load(os.fspath(model))


def _float_outputs(proto: onnx.ModelProto, feeds: list[dict]) -> list:
    model = ir.serde.deserialize_model(proto)
    DequantizeAllPass()(model)
    return fidelity.run(ir.serde.serialize_model(model), feeds)


def _same_outputs(before: list, after: list) -> bool:
    for run_before, run_after in zip(before, after):
        for a, b in zip(run_before, run_after):
            if a.shape != b.shape:
                return False
            scale = float(np.max(np.abs(a))) if a.size else 0.0
            if a.size and float(np.max(np.abs(a.astype(np.float64) - b))) > UPGRADE_TOLERANCE * max(scale, 1.0):
                return False
    return True


def upgraded_for_per_axis(model: model_io.ModelLike, error: InvalidModelError) -> tuple[onnx.ModelProto, str]:
    """``model`` converted to opset 13 and a note saying so; raises ``error`` where that is refused."""
    proto = _sorted(_proto(model))
    opset = next((o.version for o in proto.opset_import if o.domain in op_tables.DEFAULT_DOMAINS), None)
    if opset is None or opset >= op_tables.PER_AXIS_OPSET:
        raise error
    try:
        converted = _converted(proto, opset)
        model_io.check_model(converted, full_check=True)
        feeds = fidelity.random_feeds(converted, UPGRADE_FEEDS)
        same = _same_outputs(_float_outputs(proto, feeds), _float_outputs(converted, feeds))
    except Exception as failure:  # noqa: BLE001 - the converter, checker and ORT raise many types
        raise InvalidModelError(f"{error} (converting it to opset {op_tables.PER_AXIS_OPSET} failed too: "
                                f"{type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''})") from None
    if not same:
        raise InvalidModelError(f"{error} (its conversion to opset {op_tables.PER_AXIS_OPSET} changed the float "
                                "outputs, so it was not used)") from None
    what = "per-channel QuantizeLinear/DequantizeLinear need" if opset >= _QDQ_OPSET else \
        f"QuantizeLinear/DequantizeLinear (from opset {_QDQ_OPSET}; per-channel from"
    return converted, (f"opset {opset} -> {op_tables.PER_AXIS_OPSET}: the model's {what} opset {op_tables.PER_AXIS_OPSET}"
                       f"{')' if opset < _QDQ_OPSET else ''} (onnxruntime refuses them below); "
                       "converted with onnx's version converter, its float outputs checked unchanged")

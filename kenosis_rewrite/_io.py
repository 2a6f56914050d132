"""Loading, validating and returning models: the boundary where bad input becomes a KenosisError."""

from __future__ import annotations

import dataclasses
import os
from typing import Union

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from kenosis_rewrite import _qdq
from kenosis_rewrite.errors import (
    InvalidModelError,
    ModelTooLargeError,
    NoQDQError,
    NotAnOnnxModelError,
    QOperatorFormatError,
    UnsupportedOpsetError,
)

ModelLike = Union[onnx.ModelProto, ir.Model, str, os.PathLike]

# Ops that only exist in QOperator-format models (quantize_static with QuantFormat.QOperator).
QOPERATOR_OPS = frozenset(
    {
        "QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "QLinearAdd", "QLinearMul",
        "QGemm", "QLinearConcat", "QLinearLeakyRelu", "QLinearSigmoid", "QLinearAveragePool",
        "QLinearGlobalAveragePool", "QLinearSoftmax", "QLinearWhere", "DynamicQuantizeLinear",
    }
)
MIN_OPSET = 10  # QuantizeLinear/DequantizeLinear appeared in opset 10.
_PROTOBUF_LIMIT = 2**31 - 1


@dataclasses.dataclass
class LoadedModel:
    """A private, mutable copy of the user's model plus how to hand the result back."""

    model: ir.Model
    returns: str  # "proto" or "ir"
    notes: list[str] = dataclasses.field(default_factory=list)  # what loading changed, for the report


def _load_path(path: os.PathLike | str) -> onnx.ModelProto:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise NotAnOnnxModelError(f"{path!r} does not exist or is not a file.")
    try:
        return onnx.load(path, load_external_data=True)
    except (DecodeError, RuntimeError, ValueError, OSError) as error:
        raise NotAnOnnxModelError(f"{path!r} is not a readable ONNX model: {error}") from None


def _check_proto(proto: onnx.ModelProto) -> None:
    if not proto.HasField("graph") or not proto.graph.node:
        raise NotAnOnnxModelError("The model has no graph nodes: not an ONNX model or an empty one.")
    try:
        size = proto.ByteSize()
    except ValueError:
        size = _PROTOBUF_LIMIT + 1
    if size > _PROTOBUF_LIMIT:
        raise ModelTooLargeError(
            "The model is larger than protobuf's 2 GB limit. Save it with external data "
            "(onnx.save(..., save_as_external_data=True)) and pass an onnx_ir.Model loaded with ir.load()."
        )
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as error:
        raise InvalidModelError(f"The input model fails the ONNX checker: {error}") from None


_UNSORTED = "topologically sorted"
SORTED_NOTE = "the input graph was not in topological order (ONNX Runtime sorts on load; the checker refuses): sorted"


def _needs_sort(proto: onnx.ModelProto | None) -> bool:
    """Check ``proto`` (the input serialised; None beyond 2 GB, already validated by onnx-ir); True when
    its only fault is node order (Quark's XINT8 output: ONNX Runtime sorts on load, the checker refuses)."""
    if proto is None:
        return False
    try:
        _check_proto(proto)
        return False
    except InvalidModelError as error:
        if _UNSORTED not in str(error):
            raise
    return True


def _sort(copy: ir.Model) -> list[str]:
    """Sort ``copy`` topologically and check it again; returns the note for the report."""
    try:
        copy.graph.sort()
    except ValueError as error:  # a cycle: no order exists
        raise InvalidModelError(f"The input graph has a cycle, so no node order is valid: {error}") from None
    _check_proto(in_memory_proto(copy))
    return [SORTED_NOTE]


def check_quantized(model: ir.Model) -> None:
    """Refuse models that are not QDQ-quantized or use opsets we do not handle."""
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    max_opset = onnx.defs.onnx_opset_version()
    if opset is None or opset < MIN_OPSET or opset > max_opset:
        raise UnsupportedOpsetError(
            f"Default-domain opset {opset} is not supported: kenosis_rewrite handles opsets "
            f"{MIN_OPSET}..{max_opset} (QDQ needs opset >= {MIN_OPSET})."
        )
    op_types = {node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph)}
    qoperator = sorted(op_types & QOPERATOR_OPS)
    if qoperator:
        raise QOperatorFormatError(
            f"The model is in QOperator format (it has {', '.join(qoperator)}). kenosis_rewrite works on "
            "QDQ models: quantize with quant_format=QuantFormat.QDQ."
        )
    has_qdq = any(
        node.op_type in (_qdq.QUANTIZE, _qdq.DEQUANTIZE) and node.domain in (*_qdq.DEFAULT_DOMAINS, "com.microsoft")
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
    )
    if not has_qdq:
        raise NoQDQError(
            "The model has no QuantizeLinear/DequantizeLinear nodes: it is not QDQ-quantized, so there is "
            "nothing to fix. Quantize it first (onnxruntime.quantization.quantize_static or "
            "kenosis_rewrite.quantize)."
        )


def external_base_dir(model: ir.Model) -> str | None:
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            return tensor.base_dir
    return None


def in_memory_proto(model: ir.Model) -> onnx.ModelProto | None:
    """``model`` as a self-contained ModelProto (external data read in), None beyond 2 GB.

    The model itself is not touched: external tensors are read into a separate copy.
    """
    proto = ir.serde.serialize_model(model)
    base_dir = external_base_dir(model)
    if base_dir is None:
        return proto
    copy = ir.serde.deserialize_model(proto)
    ir.external_data.set_base_dir(copy.graph, base_dir)
    ir.external_data.load_to_model(copy)
    proto = ir.serde.serialize_model(copy)
    try:
        return proto if proto.ByteSize() <= _PROTOBUF_LIMIT else None
    except ValueError:
        return None


def _copy_ir_model(model: ir.Model) -> tuple[ir.Model, onnx.ModelProto | None]:
    """A private copy of an onnx_ir.Model whose external tensors keep pointing at their files."""
    try:
        proto = ir.serde.serialize_model(model)
        copy = ir.serde.deserialize_model(proto)
        base_dir = external_base_dir(model)
        if base_dir is not None:
            ir.external_data.set_base_dir(copy.graph, base_dir)
        checkable = in_memory_proto(model)
    except Exception as error:  # noqa: BLE001 - any serialisation failure means a broken model
        # the cause stays chained: a missing or unreadable external-data file is not a broken graph
        raise InvalidModelError(
            f"The onnx_ir.Model could not be serialised or its external data read ({type(error).__name__}: {error})"
        ) from error
    return copy, checkable


def load(model: ModelLike, *, require_qdq: bool = True) -> LoadedModel:
    """A private onnx-ir copy of ``model``; the caller's object is never touched."""
    if isinstance(model, ir.Model):
        copy, checkable = _copy_ir_model(model)
        notes = _sort(copy) if _needs_sort(checkable) else []
        if require_qdq:
            check_quantized(copy)
        return LoadedModel(copy, "ir", notes)
    if isinstance(model, onnx.ModelProto):
        proto = model
        returns = "proto"
    elif isinstance(model, (str, os.PathLike)):
        proto = _load_path(model)
        returns = "proto"
    elif isinstance(model, (bytes, bytearray)):
        try:
            proto = onnx.load_from_string(bytes(model))
        except DecodeError as error:
            raise NotAnOnnxModelError(f"The bytes are not an ONNX model: {error}") from None
        returns = "proto"
    else:
        raise NotAnOnnxModelError(
            f"Expected an onnx.ModelProto, onnx_ir.Model or a path, got {type(model).__name__}."
        )
    unsorted = _needs_sort(proto)
    # Tensors of the copy may view the proto's bytes; the proto is never written to, so that is safe.
    copy = ir.serde.deserialize_model(proto)
    notes = _sort(copy) if unsorted else []
    if require_qdq:
        check_quantized(copy)
    return LoadedModel(copy, returns, notes)


def to_output(loaded: LoadedModel) -> onnx.ModelProto | ir.Model:
    if loaded.returns == "ir":
        return loaded.model
    return ir.serde.serialize_model(loaded.model)

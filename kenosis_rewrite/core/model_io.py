"""Loading, validating and returning models: the boundary where bad input becomes a KenosisError."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Union

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.errors import (
    AlreadyQuantizedError,
    InvalidModelError,
    KenosisError,
    ModelTooLargeError,
    NoQDQError,
    NotAnOnnxModelError,
    QOperatorFormatError,
    UnsupportedOpsetError,
    UnsupportedValueTypeError,
    one_line,
)

ModelLike = Union[onnx.ModelProto, ir.Model, str, os.PathLike]

# Ops that only exist in QOperator-format models (quantize_static with QuantFormat.QOperator).
# MatMulInteger and DynamicQuantizeLinear are not: fix() writes MatMulInteger for an integer MatMul
# whose bias ORT then fuses (rules.integer_matmul_bias), quantize() both for run-time activation
# ranges (passes.dynamic_activations), and fix() must accept its own output; it leaves them alone.
QOPERATOR_OPS = frozenset(
    {
        "QLinearConv", "QLinearMatMul", "ConvInteger", "QLinearAdd", "QLinearMul",
        "QGemm", "QLinearConcat", "QLinearLeakyRelu", "QLinearSigmoid", "QLinearAveragePool",
        "QLinearGlobalAveragePool", "QLinearSoftmax", "QLinearWhere",
    }
)
MIN_OPSET = 10  # QuantizeLinear/DequantizeLinear appeared in opset 10.
_PROTOBUF_LIMIT = 2**31 - 1
# Models whose tensors add up to more than this are "large": they are never gathered into one
# ModelProto. Loaded from a path, their external tensors stay on disk (memory-mapped, read one at a
# time); they are checked without their data and written with external data. Tests lower it.
LARGE_MODEL_BYTES = _PROTOBUF_LIMIT
# A path whose external data exceeds this is loaded lazily (onnx-ir, memory-mapped tensors), not
# read whole into a ModelProto; the result is still a ModelProto up to LARGE_MODEL_BYTES.
LAZY_LOAD_BYTES = 256 << 20
GRAPH_ONLY_LOCATION = "kenosis-graph-only.data"  # never read: stands in for tensor data in checks


@dataclasses.dataclass
class LoadedModel:
    """A private, mutable copy of the user's model plus how to hand the result back."""

    model: ir.Model
    returns: str  # "proto" or "ir"
    notes: list[str] = dataclasses.field(default_factory=list)  # what loading changed, for the report
    path: str | None = None  # the file a model was loaded lazily from (its tensors are read from there)

    @property
    def large(self) -> bool:
        """Whether the model is too large to hold as one ModelProto (see :data:`LARGE_MODEL_BYTES`)."""
        return is_large(self.model)


def tensor_bytes(model: ir.Model) -> int:
    """Bytes of every initializer of ``model``'s main graph, external ones included (nothing is read)."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def is_large(model: ir.Model) -> bool:
    return tensor_bytes(model) > LARGE_MODEL_BYTES


def _all_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of ``graph``: initializers and attribute tensors, subgraphs' included."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            for body in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _all_tensors(body)


def _external_bytes(proto: onnx.ModelProto) -> int:
    """Bytes of ``proto``'s tensors stored in external files (from their ``length`` entries)."""
    total = 0
    for tensor in _all_tensors(proto.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {entry.key: entry.value for entry in tensor.external_data}
            length = info.get("length")
            total += int(length) if length else int(np.prod(tensor.dims, dtype=np.int64)) * 4
    return total


def _load_path(path: os.PathLike | str, lazy: bool) -> onnx.ModelProto | None:
    """The model at ``path`` with its external data read in, or None (``lazy``) when that exceeds
    LAZY_LOAD_BYTES; without ``lazy``, a model over LARGE_MODEL_BYTES is refused before it is read."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise NotAnOnnxModelError(f"{path!r} does not exist or is not a file.")
    try:
        proto = onnx.load(path, load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as error:
        raise NotAnOnnxModelError(f"{path!r} is not a readable ONNX model: {error}") from None
    external = _external_bytes(proto)
    if lazy and external and proto.ByteSize() + external > LAZY_LOAD_BYTES:
        return None
    if external and proto.ByteSize() + external > LARGE_MODEL_BYTES:
        raise ModelTooLargeError(_TOO_LARGE.format(path=path))
    try:
        if external:
            onnx.load_external_data_for_model(proto, os.path.dirname(os.path.abspath(path)))
    except (RuntimeError, ValueError, OSError, onnx.checker.ValidationError) as error:
        # onnx refuses a location outside the model's folder with a ValidationError naming the tensor
        raise InvalidModelError(f"The external data of {path!r} cannot be read: {error}") from None
    return proto


_TOO_LARGE = (
    "{path!r} is over 2 GB with its external data, and this step needs the whole model in memory as one "
    "protobuf. fix(), explain() and quantize_weights() read such models lazily; for a float model, "
    "quantize its weights with quantize_weights() (weight-only int4/int8) instead of quantize()."
)


def refuse_over_2gb(path: os.PathLike | str) -> None:
    """ModelTooLargeError when the model at ``path`` with its external data is over LARGE_MODEL_BYTES.

    For steps that need the model in memory (bench, profile); reads the graph, not the tensors. An
    unreadable file passes: the caller's own loading reports it.
    """
    try:
        proto = onnx.load(os.fspath(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - not our error to report
        return
    external = _external_bytes(proto)
    if external and proto.ByteSize() + external > LARGE_MODEL_BYTES:
        raise ModelTooLargeError(_TOO_LARGE.format(path=os.fspath(path)))


def graph_only_proto(model: ir.Model) -> onnx.ModelProto:
    """``model`` as a ModelProto without tensor data, whatever its size: what the checker reads.

    In-memory tensors over 1 KiB are serialised as references to an external file that does not
    exist; external tensors keep their references. The checker (``full_check`` included) and shape
    inference read no tensor data from a ModelProto, so this checks the graph of a model of any size.
    ``model`` is left as it was.
    """
    swapped = []
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None and not isinstance(tensor, ir.ExternalTensor) and tensor.nbytes > 1024:
            value.const_value = ir.ExternalTensor(
                GRAPH_ONLY_LOCATION, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape, name=tensor.name or value.name,
            )
            swapped.append((value, tensor))
    try:
        return ir.serde.serialize_model(model)
    finally:
        for value, tensor in swapped:
            value.const_value = tensor


def check_model(proto: onnx.ModelProto, *, full_check: bool = False) -> None:
    """``onnx.checker.check_model`` on the graph of ``proto``, its external tensors not read.

    Initializers stored externally (those of :func:`graph_only_proto` or a large model) are checked
    as graph inputs of their type and shape: the checker then needs neither their data nor their
    files. Raises what ``onnx.checker.check_model`` raises.
    """
    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        inputs = {value.name for value in copy.graph.input}
        kept = [t for t in copy.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
        copy.graph.input.extend(
            onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external if t.name not in inputs
        )
        del copy.graph.initializer[:]
        copy.graph.initializer.extend(kept)
        proto = copy
    onnx.checker.check_model(proto, full_check=full_check)


def full_check_problem(proto: onnx.ModelProto) -> str | None:
    """Why ``proto`` fails :func:`check_model` with ``full_check`` (shape inference included), or None."""
    try:
        check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        return str(error)
    return None


def _check_large_path(path: str) -> bool:
    """Check the model at ``path`` without reading its tensors; True when its only fault is node order."""
    try:
        onnx.checker.check_model(path)
    except onnx.checker.ValidationError as error:
        if _UNSORTED in str(error):
            return True
        raise InvalidModelError(f"The input model fails the ONNX checker: {error}") from None
    return False


def _type_text(type_proto: onnx.TypeProto) -> str:
    """``seq(map(int64, tensor(float)))`` and the like."""
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type":
        return f"tensor({onnx.helper.tensor_dtype_to_np_dtype(type_proto.tensor_type.elem_type).name})" \
            if type_proto.tensor_type.elem_type else "tensor"
    if kind == "sequence_type":
        return f"seq({_type_text(type_proto.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({_type_text(type_proto.optional_type.elem_type)})"
    if kind == "map_type":
        key = onnx.helper.tensor_dtype_to_np_dtype(type_proto.map_type.key_type).name
        return f"map({key}, {_type_text(type_proto.map_type.value_type)})"
    return str(kind)


def _map_typed_values(graph: onnx.GraphProto) -> list[str]:
    """Names of the inputs, outputs and annotated values of ``graph`` (and its subgraphs) whose type
    holds a map, with that type written out."""
    def holds_map(type_proto: onnx.TypeProto) -> bool:
        kind = type_proto.WhichOneof("value")
        if kind == "map_type":
            return True
        if kind == "sequence_type":
            return holds_map(type_proto.sequence_type.elem_type)
        if kind == "optional_type":
            return holds_map(type_proto.optional_type.elem_type)
        return False

    found = [f"{info.name} ({_type_text(info.type)})"
             for info in [*graph.input, *graph.output, *graph.value_info] if holds_map(info.type)]
    for node in graph.node:
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                found += _map_typed_values(sub)
    return found


def _deserialized(proto: onnx.ModelProto) -> ir.Model:
    """``ir.serde.deserialize_model(proto)``; a graph onnx_ir cannot read is a typed error."""
    try:
        return ir.serde.deserialize_model(proto)
    except ir.serde.SerdeError as error:
        maps = _map_typed_values(proto.graph)
        if maps:
            raise UnsupportedValueTypeError(
                f"The graph has values of a map type, which onnx_ir (the graph library kenosis_rewrite works "
                f"on) cannot represent: {', '.join(maps[:4])}. That is the ZipMap output of a scikit-learn "
                "or LightGBM classifier converted with its default options; there is nothing to quantize in "
                "a tree ensemble, and a neural network with such an output should be converted without it "
                "(skl2onnx: options={'zipmap': False}; onnxmltools: zipmap=False) or have the ZipMap removed "
                "before quantization and added back after."
            ) from None
        raise InvalidModelError(f"onnx_ir cannot read this model: {one_line(error.__cause__ or error)}") from error


def _load_lazy(path: os.PathLike | str) -> LoadedModel:
    """The model at ``path``, its external tensors left on disk (memory-mapped when read)."""
    path = os.fspath(path)
    unsorted = _check_large_path(path)
    try:
        model = ir.load(path)
    except Exception as error:  # noqa: BLE001 - onnx-ir raises several types for a broken file
        raise NotAnOnnxModelError(f"{path!r} is not a readable ONNX model: {error}") from None
    if not len(model.graph):
        raise NotAnOnnxModelError("The model has no graph nodes: not an ONNX model or an empty one.")
    return LoadedModel(model, "proto", _sort(model) if unsorted else [], path=path)


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
        check_model(proto)
    except onnx.checker.ValidationError as error:
        raise InvalidModelError(f"The input model fails the ONNX checker: {error}{_advice(proto, error)}") from None


def _advice(proto: onnx.ModelProto, error: onnx.checker.ValidationError) -> str:
    """What to do about a checker failure we know the cause of; "" otherwise."""
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    message = str(error)
    if (opset is not None and opset < op_tables.PER_AXIS_OPSET and "Unrecognized attribute: axis" in message
            and ("QuantizeLinear" in message or "DequantizeLinear" in message)):
        return (f". Per-channel QuantizeLinear/DequantizeLinear (their axis attribute) need opset {op_tables.PER_AXIS_OPSET}, and "
                f"this model imports opset {opset}: onnxruntime's quantize_static(per_channel=True) writes that for an "
                "FP32 model below opset 13, and onnxruntime cannot load the result either. Re-quantize with "
                "per_channel=False, or convert the FP32 model to opset 13 first (onnx.version_converter."
                "convert_version(model, 13)), or quantize it with kenosis_rewrite.quantize(), which converts it where "
                "per-channel weights pay and keeps them per-tensor where they do not")
    return ""


FUSED_WEIGHT_ONLY_OPS = frozenset({"MatMulNBits", "GatherBlockQuantized", "MatMulBnb4"})
ALREADY_FUSED_NOTE = (
    "the model has no QuantizeLinear/DequantizeLinear: its weights are already in ONNX Runtime's fused "
    "weight-only form (com.microsoft.MatMulNBits), which is what fix() would produce; left unchanged"
)
# node metadata fix() writes on a Conv/MatMul/Gemm ORT runs in float once it dropped the quantizer that
# served only such ops (float-kernels-read-float): explain() says why it reads a float tensor, and a
# later fix() of a model left with no quantizer at all returns it as it is
FLOAT_INPUT_KEY = "kenosis_rewrite.float_input"
ALL_FLOAT_NOTE = (
    "the model has no QuantizeLinear/DequantizeLinear left: an earlier fix() found ONNX Runtime running every "
    "quantized op in float and dropped their quantizers (float-kernels-read-float); left unchanged"
)
DYNAMIC_INTEGER_OPS = frozenset({"DynamicQuantizeLinear", "MatMulInteger"})
DYNAMIC_NOTE = (
    "the model has no QuantizeLinear/DequantizeLinear: its integer MatMuls quantize their inputs at run "
    "time (DynamicQuantizeLinear -> MatMulInteger, as quantize_dynamic and quantize()'s weighted plan "
    "write them), which ORT fuses as they are; fix() rewrites only the float graph around them"
)
_UNSORTED = "topologically sorted"
SORTED_NOTE = "the input graph was not in topological order (ONNX Runtime sorts on load; the checker refuses): sorted"


def _needs_sort(proto: onnx.ModelProto) -> bool:
    """Check ``proto`` (the input serialised, or its graph alone for a large model); True when its only
    fault is node order (Quark's XINT8 output: ONNX Runtime sorts on load, the checker refuses)."""
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
    proto = in_memory_proto(copy)
    _check_proto(graph_only_proto(copy) if proto is None else proto)
    return [SORTED_NOTE]


def check_quantized(model: ir.Model) -> list[str]:
    """Refuse models that are not QDQ-quantized or use opsets we do not handle.

    A model without Q/DQ whose weights are already in ONNX Runtime's fused weight-only form
    (``com.microsoft.MatMulNBits``, ...) is accepted with a note: there is nothing to fix in it.
    """
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    max_opset = onnx.defs.onnx_opset_version()
    if opset is None or opset < MIN_OPSET or opset > max_opset:
        raise UnsupportedOpsetError(
            f"Default-domain opset {opset} is not supported: kenosis_rewrite handles opsets "
            f"{MIN_OPSET}..{max_opset} (QDQ needs opset >= {MIN_OPSET})."
        )
    op_types = {node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph)}
    qoperator = sorted(op_types & QOPERATOR_OPS)
    if qoperator == ["ConvInteger"] and "DynamicQuantizeLinear" in op_types:
        raise QOperatorFormatError(
            "The model is dynamically quantized (ConvInteger after DynamicQuantizeLinear: its Convs quantize "
            "their inputs at run time, as quantize_dynamic and Quark's UINT8_DYNAMIC_QUANT write them); "
            "kenosis_rewrite rewrites QDQ models. ONNX Runtime's CPU ConvInteger is rarely faster than the "
            "float Conv: quantize the FP32 model statically instead (kenosis_rewrite.quantize(fp32, calibration=...))."
        )
    if qoperator:
        raise QOperatorFormatError(
            f"The model is in QOperator format (it has {', '.join(qoperator)}). kenosis_rewrite works on "
            "QDQ models: quantize with quant_format=QuantFormat.QDQ."
        )
    has_qdq = any(
        node.op_type in (op_tables.QUANTIZE, op_tables.DEQUANTIZE) and node.domain in (*op_tables.DEFAULT_DOMAINS, "com.microsoft")
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
    )
    if not has_qdq and any(node.op_type in FUSED_WEIGHT_ONLY_OPS and node.domain == "com.microsoft"
                           for node in ir.traversal.RecursiveGraphIterator(model.graph)):
        return [ALREADY_FUSED_NOTE]
    if not has_qdq and any(node.op_type in DYNAMIC_INTEGER_OPS and node.domain in op_tables.DEFAULT_DOMAINS
                           for node in ir.traversal.RecursiveGraphIterator(model.graph)):
        return [DYNAMIC_NOTE]
    if not has_qdq and any(FLOAT_INPUT_KEY in node.metadata_props for node in ir.traversal.RecursiveGraphIterator(model.graph)):
        return [ALL_FLOAT_NOTE]
    if not has_qdq:
        raise NoQDQError(
            "The model has no QuantizeLinear/DequantizeLinear nodes: it is not QDQ-quantized, so there is "
            "nothing to fix. Quantize it first (onnxruntime.quantization.quantize_static or "
            "kenosis_rewrite.quantize)."
        )
    return []


# Ops that only a quantized model has: Q/DQ, QOperator and dynamic (run-time) integer ops, and
# onnxruntime's contrib forms of them (com.microsoft: QGemm, QAttention, MatMulNBits, QLinear*, QOrdered*)
QUANTIZED_OPS = frozenset({
    op_tables.QUANTIZE, op_tables.DEQUANTIZE, *QOPERATOR_OPS, *DYNAMIC_INTEGER_OPS, *FUSED_WEIGHT_ONLY_OPS,
    "QGemm", "QAttention", "QEmbedLayerNormalization", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
    "DynamicQuantizeLSTM",
})
_QUANTIZED_PREFIXES = ("QLinear", "QOrdered")


def check_float(model: ir.Model, caller: str) -> None:
    """Refuse a model that is already quantized where ``caller`` needs the FP32 one: quantizing its
    integer ops again fails deep inside quantize_static (a dynamic model's ``KeyError: '140_scale'``)
    or returns it unchanged (QOperator)."""
    counts: dict[str, int] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain in (*op_tables.DEFAULT_DOMAINS, "com.microsoft") and (
                node.op_type in QUANTIZED_OPS or node.op_type.startswith(_QUANTIZED_PREFIXES)):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    if not counts:
        return
    found = ", ".join(f"{count} {op_type}" for op_type, count in sorted(counts.items(), key=lambda item: -item[1]))
    dynamic = any(op_type in DYNAMIC_INTEGER_OPS or op_type.startswith("DynamicQuantize") for op_type in counts)
    # fix() takes a QDQ model; a dynamic one it leaves as ORT runs it, a QOperator one it refuses
    qdq = (op_tables.QUANTIZE in counts or op_tables.DEQUANTIZE in counts) and not QOPERATOR_OPS.intersection(counts) and not dynamic
    if qdq:
        advice = "; or, to make this QDQ model faster as it is, use kenosis_rewrite.fix() (`kenosis-rewrite fix`)."
    elif dynamic:
        advice = (": it quantizes its activations at run time (quantize_dynamic's form), which ONNX Runtime fuses as "
                  "it is, so fix() has no placement to change in it either.")
    else:
        advice = "."
    raise AlreadyQuantizedError(
        f"{caller} takes an FP32 model, and this one is already quantized (it has {found}). Pass the FP32 "
        "model it was quantized from" + advice
    )


def external_base_dir(model: ir.Model) -> str | None:
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            return tensor.base_dir
    return None


def in_memory_proto(model: ir.Model) -> onnx.ModelProto | None:
    """``model`` as a self-contained ModelProto (external data read in), None for a large model.

    The model itself is not touched: external tensors are read into the proto, one at a time.
    """
    if is_large(model):
        return None
    proto = ir.serde.serialize_model(model)
    base_dir = external_base_dir(model)
    if base_dir is not None:
        onnx.load_external_data_for_model(proto, base_dir)
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
        # the input's own check: with its data when small, on the graph alone (no copy) when not
        checkable = None if tensor_bytes(model) > LAZY_LOAD_BYTES else in_memory_proto(model)
    except Exception as error:  # noqa: BLE001 - any serialisation failure means a broken model
        # the cause stays chained: a missing or unreadable external-data file is not a broken graph
        raise InvalidModelError(
            f"The onnx_ir.Model could not be serialised or its external data read ({type(error).__name__}: {error})"
        ) from error
    return copy, checkable


def _sorted_notes(copy: ir.Model, checkable: onnx.ModelProto | None) -> list[str]:
    unsorted = _needs_sort(graph_only_proto(copy) if checkable is None else checkable)
    return _sort(copy) if unsorted else []


def load(model: ModelLike, *, require_qdq: bool = True, lazy: bool = False) -> LoadedModel:
    """A private onnx-ir copy of ``model``; the caller's object is never touched.

    ``lazy``: a path whose external data exceeds LAZY_LOAD_BYTES keeps its tensors on disk
    (memory-mapped) for callers that work tensor by tensor (fix, explain, quantize_weights); others
    get every tensor in memory, and a path over 2 GB is refused with ModelTooLargeError.
    """
    if isinstance(model, ir.Model):
        copy, checkable = _copy_ir_model(model)
        notes = _sorted_notes(copy, checkable)
        if require_qdq:
            notes += check_quantized(copy)
        return LoadedModel(copy, "ir", notes)
    if isinstance(model, onnx.ModelProto):
        # onnx_ir's tensors view the proto they were read from and write some fields back into it
        # (a Constant's tensor takes its output's name when read, a renamed value its initializer's
        # name): the caller's proto would change under fix() (crnn_captcha's Constant nodes)
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        returns = "proto"
    elif isinstance(model, (str, os.PathLike)):
        proto = _load_path(model, lazy)
        if proto is None:
            loaded = _load_lazy(model)
            if require_qdq:
                loaded.notes += check_quantized(loaded.model)
            return loaded
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
    # tensors of the copy view ``proto``'s bytes: a proto of our own (a copy, or read from a path)
    copy = _deserialized(proto)
    notes = _sort(copy) if unsorted else []
    if require_qdq:
        notes += check_quantized(copy)
    return LoadedModel(copy, returns, notes)


def to_output(loaded: LoadedModel) -> onnx.ModelProto | ir.Model:
    """The result, of the kind the caller gave; an onnx_ir.Model whatever was given when it is large
    (a ModelProto cannot hold it: save it with :func:`kenosis_rewrite.save`)."""
    if loaded.returns == "ir" or loaded.large:
        return loaded.model
    proto = ir.serde.serialize_model(loaded.model)
    base_dir = external_base_dir(loaded.model)
    if base_dir is not None:  # a model from a large path, small again (quantize_weights): read the rest in
        onnx.load_external_data_for_model(proto, base_dir)
    return proto


def save(model: onnx.ModelProto | ir.Model, path: str | os.PathLike, *, external_data: bool | None = None) -> None:
    """Write ``model`` (an onnx.ModelProto or onnx_ir.Model) to ``path``.

    With ``external_data`` True, or by default when the model is large or already reads tensors
    from external files, tensors over 1 KiB go to ``<file name>.data`` next to ``path``, written one
    at a time (an onnx_ir.Model from a large path streams its unchanged weights from the input's
    files). The model is not modified.
    """
    path = os.fspath(path)
    model = model if isinstance(model, ir.Model) else ir.serde.deserialize_model(model)
    if external_data is None:
        external_data = is_large(model) or external_base_dir(model) is not None
    if not external_data:
        ir.save(model, path)
        return
    location = os.path.basename(path) + ".data"
    target = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(path)), location))
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and os.path.realpath(tensor.path) == target:
            raise KenosisError(f"Saving to {path!r} would overwrite {target!r}, which the model still reads its weights from.")
    ir.save(model, path, external_data=location, size_threshold_bytes=1024)


def constant_names(model: onnx.ModelProto) -> set[str]:
    """The main graph's initializers and Constant node outputs."""
    names = {init.name for init in model.graph.initializer}
    names.update(out for node in model.graph.node if node.op_type == "Constant" for out in node.output)
    return names

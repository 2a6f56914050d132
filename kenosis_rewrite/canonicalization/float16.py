"""Float16 graphs computed in float32, their float16 inputs and outputs kept at the boundary.

Transformation (in place, on the main graph and every If/Loop/Scan body)::

    float16 initializer / Constant / ConstantOfShape value   ==>  the same values in float32
    Cast(to=FLOAT16), RandomNormal(dtype=FLOAT16), ...        ==>  the same op with FLOAT
    every float16 value (tensor, sequence or optional of it)  ==>  float32
    QuantizeLinear/DequantizeLinear with float16 scales       ==>  the same scales in float32

:func:`to_float32` makes the whole graph float32, graph inputs and outputs included, and returns
which inputs and outputs were float16 (a :class:`Float16Interface`); :func:`cast_interface` then
gives those back their float16 type with a ``Cast`` at each (``x: float16 -> Cast(FLOAT) -> ...`` and
``... -> Cast(FLOAT16) -> y: float16``), so the caller's interface is unchanged.

Why: ONNX Runtime's CPU provider has no float16 kernel for most ops and wraps each float16 node in
Casts to float32 and back (its InsertCastTransformer), and its QDQ fusions (QLinearConv, QGemm, ...)
take float32 scales only: a float16 QDQ model ran 0 of its 8 heavy ops as integer kernels on
onnxruntime 1.32 (x86), the same model in float32 all 8. quantize_static on a float16 graph writes
float16 scales, which QuantizeLinear accepts only from opset 19 (an EfficientNet-B4 U-Net shipped
in float16 failed onnx shape inference that way).

Exactness: every float16 number is a float32 number, so each constant, scale and zero point keeps
its value exactly, and so does every graph input passing its Cast. The float ops between then
compute in float32 instead of rounding each result to float16: not bit for bit the float16 model,
but at least as precise at every op (each op's float32 result is the exact one rounded to 24
instead of 11 significant bits). The outputs are rounded to float16 once, by the last Cast.
Integer, bool and float32/float64 values are untouched; so are bfloat16 ones (not converted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params

__all__ = ["Float16Interface", "cast_interface", "float32_feeds", "has_float16", "has_float16_scales", "retype_floats",
           "to_float32"]

_HALF, _SINGLE = ir.DataType.FLOAT16, ir.DataType.FLOAT
# integer attributes naming an element type: Cast's ``to``; RandomNormal(Like), RandomUniform(Like),
# EyeLike, Bernoulli, SequenceEmpty's ``dtype``; Q/DQ's ``output_dtype``
_TYPE_ATTRIBUTES = frozenset({"to", "dtype", "output_dtype"})


@dataclasses.dataclass(frozen=True)
class Float16Interface:
    """What :func:`to_float32` changed: the graph inputs and outputs that were float16, and counts."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    initializers: int = 0
    attributes: int = 0

    def note(self, what: str) -> str:
        """One report line: ``what`` (e.g. "float16 graph quantized in float32") and how."""
        kept = []
        if self.inputs:
            kept.append(f"input(s) {', '.join(self.inputs)}")
        if self.outputs:
            kept.append(f"output(s) {', '.join(self.outputs)}")
        boundary = f"; {' and '.join(kept)} keep float16 (a Cast at each)" if kept else ""
        return (f"{what}: {self.initializers} float16 constant(s) and {self.attributes} float16 type attribute(s) "
                f"converted to float32 exactly{boundary}; the float ops between compute in float32 (ONNX Runtime's "
                "CPU kernels and its integer fusions are float32)")


def _graphs(graph: ir.Graph) -> Iterator[ir.Graph]:
    """``graph`` and every subgraph of its nodes, nested ones included."""
    yield graph
    for node in graph:
        for attribute in node.attributes.values():
            if attribute.type == ir.AttributeType.GRAPH:
                yield from _graphs(attribute.value)
            elif attribute.type == ir.AttributeType.GRAPHS:
                for body in attribute.value:
                    yield from _graphs(body)


def _values(graph: ir.Graph) -> Iterator[ir.Value]:
    """Every value ``graph`` defines: inputs, initializers and node outputs (subgraphs' not)."""
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in graph:
        yield from node.outputs


def _retyped(value_type: ir.TypeProtocol | None, source: ir.DataType, target: ir.DataType) -> ir.TypeProtocol | None:
    """``value_type`` with ``source`` elements as ``target``; None where it holds no ``source``."""
    if isinstance(value_type, ir.TensorType):
        return ir.TensorType(target) if value_type.dtype == source else None
    if isinstance(value_type, (ir.SequenceType, ir.OptionalType)):
        inner = _retyped(value_type.elem_type, source, target)
        return None if inner is None else type(value_type)(inner)
    return None


def _is(tensor: ir.TensorProtocol | None, dtype: ir.DataType) -> bool:
    return tensor is not None and tensor.dtype == dtype


def _as(tensor: ir.TensorProtocol, target: ir.DataType) -> ir.Tensor:
    return ir.tensor(tensor.numpy().astype(target.numpy()), name=tensor.name)


def _retyped_attributes(node: ir.Node, source: ir.DataType, target: ir.DataType) -> list[ir.Attr]:
    """``node``'s attributes that make or name ``source``, each in its ``target`` form."""
    converted = []
    for name, attribute in node.attributes.items():
        if (attribute.type == ir.AttributeType.INT and name in _TYPE_ATTRIBUTES and attribute.value == source
                and node.domain in qdq_params.DEFAULT_DOMAINS):
            converted.append(ir.AttrInt64(name, int(target)))
        elif attribute.type == ir.AttributeType.TENSOR and _is(attribute.value, source):
            converted.append(ir.AttrTensor(name, _as(attribute.value, target)))
        elif attribute.type == ir.AttributeType.TENSORS and any(_is(t, source) for t in attribute.value):
            converted.append(ir.AttrTensors(name, [_as(t, target) if _is(t, source) else t for t in attribute.value]))
    return converted


def has_float16(model: ir.Model) -> bool:
    """Whether any value, constant or type attribute of ``model`` (subgraphs included) is float16."""
    for graph in _graphs(model.graph):
        if any(_retyped(value.type, _HALF, _SINGLE) is not None or _is(value.const_value, _HALF)
               for value in _values(graph)):
            return True
        if any(_retyped_attributes(node, _HALF, _SINGLE) for node in graph):
            return True
    return False


def has_float16_scales(model: ir.Model) -> bool:
    """Whether a QuantizeLinear/DequantizeLinear of ``model``'s main graph has a float16 scale."""
    for node in model.graph:
        if node.op_type in (qdq_params.QUANTIZE, qdq_params.DEQUANTIZE) and len(node.inputs) > 1:
            scale = node.inputs[1]
            if scale is not None and (scale.dtype == _HALF or _is(scale.const_value, _HALF)):
                return True
    return False


def to_float32(model: ir.Model) -> Float16Interface | None:
    """Make every float16 value, constant and type attribute of ``model`` float32, in place (the
    module docstring); the float16 graph inputs and outputs, or None where there was nothing float16."""
    if not has_float16(model):
        return None
    return retype_floats(model, _HALF, _SINGLE)


def retype_floats(model: ir.Model, source: ir.DataType, target: ir.DataType) -> Float16Interface:
    """:func:`to_float32`'s work for any two float types, in place: every ``source`` value, constant
    and type attribute as ``target``; the graph inputs and outputs that were ``source``. Exact only
    where ``target`` holds every ``source`` number (widening); the tests make float16 models with it."""
    # graph inputs that are initializers too (IR version < 4 lists them) are constants, not the interface
    inputs = tuple(v.name for v in model.graph.inputs if _retyped(v.type, source, target) is not None and v.name
                   and v.name not in model.graph.initializers)
    outputs = tuple(v.name for v in model.graph.outputs if _retyped(v.type, source, target) is not None and v.name)
    initializers = attributes = 0
    for graph in _graphs(model.graph):
        for value in _values(graph):
            if _is(value.const_value, source):
                value.const_value = _as(value.const_value, target)
                initializers += 1
            retyped = _retyped(value.type, source, target)
            if retyped is not None:
                value.type = retyped
        for node in graph:
            for attribute in _retyped_attributes(node, source, target):
                node.attributes[attribute.name] = attribute
                attributes += 1
    return Float16Interface(inputs, outputs, initializers, attributes)


def _cast(value: ir.Value, to: ir.DataType, name: str) -> ir.Node:
    return ir.Node("", "Cast", [value], attributes=[ir.AttrInt64("to", int(to))], num_outputs=1, name=name)


def cast_interface(model: ir.Model, interface: Float16Interface) -> None:
    """Give the graph inputs and outputs ``interface`` names their float16 type back, in place:
    a ``Cast`` to float32 after each such input, one to float16 before each such output."""
    graph, names = model.graph, qdq_params.NameAllocator(model.graph)
    first = next(iter(graph), None)
    for index, value in enumerate(list(graph.inputs)):
        if value.name not in interface.inputs:
            continue
        name = value.name
        boundary = ir.Value(name=name, type=ir.TensorType(_HALF), shape=value.shape)
        value.name = names.fresh(f"{name}_float32")
        cast = _cast(boundary, _SINGLE, names.fresh(f"{name}_to_float32"))
        passed_through = [i for i, output in enumerate(graph.outputs) if output is value]
        value.replace_all_uses_with(cast.outputs[0], replace_graph_outputs=True)
        cast.outputs[0].name, cast.outputs[0].type, cast.outputs[0].shape = value.name, value.type, value.shape
        graph.inputs[index] = boundary
        for position in passed_through:  # an input that is an output as well stays one, float16
            graph.outputs[position] = boundary
        if first is None:
            graph.append(cast)
        else:
            graph.insert_before(first, cast)
    for index, value in enumerate(list(graph.outputs)):
        if value.name not in interface.outputs or value.dtype != _SINGLE:
            continue
        name = value.name
        value.name = names.fresh(f"{name}_float32")
        cast = _cast(value, _HALF, names.fresh(f"{name}_to_float16"))
        cast.outputs[0].name, cast.outputs[0].type, cast.outputs[0].shape = name, ir.TensorType(_HALF), value.shape
        graph.append(cast)
        graph.outputs[index] = cast.outputs[0]


def float32_feeds(feeds: Iterable[Mapping[str, np.ndarray]], interface: Float16Interface) -> list[dict[str, np.ndarray]]:
    """``feeds`` for the float32 graph: the float16 arrays of ``interface``'s inputs as float32
    (exact); float32 arrays, other inputs and other types as given."""
    converted = []
    for feed in feeds:
        converted.append({name: (np.asarray(array, np.float32) if name in interface.inputs
                                 and np.asarray(array).dtype == np.float16 else array)
                          for name, array in feed.items()})
    return converted

"""Input shapes for canonicalization: which dims are symbolic, which shapes are in use, pinning them,
and the static dims ONNX shape inference finds by propagating shape values.

A graph whose Pad/Resize parameters are computed from shapes (TF-style "same" padding, a ViT's
position embeddings resized to its patch grid) folds only once those shapes are known; prepare()
(:mod:`kenosis_rewrite.canonicalization.pipeline`) pins them only where that is so
(:func:`computed_layout_parameters`), and reports every pinned dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import KenosisError
from kenosis_rewrite.graph.value_origins import Origin, value_origins

__all__ = ["computed_layout_parameters", "negative_dims_as_symbolic", "pin_input_shapes", "propagated_dims",
           "reads_shapes", "shapes_in_use", "symbolic_inputs"]

_SHAPE_READERS = ("Shape", "Size")
# the parameter inputs of the layout ops whose run-time values keep a quantized graph from fusing: a
# Pad that cannot move into its Conv (TF "same" padding), a Resize of a table the graph computes from
# constants and shapes (a ViT's position embeddings resized to its patch grid: it folds away once the
# shapes are known)
_LAYOUT_PARAMETERS = {"Pad": (1, 2), "Resize": (1, 2, 3), "Upsample": (1,)}
# the opset from which ONNX's Reshape inference reads a target shape known only by data propagation
_RESHAPE_INFERS_PROPAGATED_SHAPE = 14


def reads_shapes(model: ir.Model) -> bool:
    """Whether any node of ``model`` (subgraphs included) reads a shape or a size."""
    return any(node.op_type in _SHAPE_READERS for node in model.graph.all_nodes())


def computed_layout_parameters(model: ir.Model) -> list[str]:
    """The Pad/Resize/Upsample nodes (names) whose parameters the graph computes at run time: what
    pinning input shapes is for. A graph that reads shapes only for anything else (a recurrent
    state's batch size, an attention mask's length, anchors) folds nothing a quantizer needs there;
    nor does a Resize of data to a computed size (``interpolate(size=y.shape[2:])``): it runs the
    same quantized (the same Q/DQ in ORT's optimized graph, with ``shape-of-codes``; the fuzz's
    dynamic-batch graphs), and pinned, the model would refuse every other batch and image size."""
    found, origins = [], None
    for node in model.graph.all_nodes():
        indices = _LAYOUT_PARAMETERS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if not indices or not any(index < len(node.inputs) and node.inputs[index] is not None
                                  and node.inputs[index].const_value is None for index in indices):
            continue
        if node.op_type != "Pad":
            origins = value_origins(model.graph) if origins is None else origins
            if origins.get(node.inputs[0]) is Origin.DATA:
                continue
        found.append(node.name or node.op_type)
    return found


def _is_static(dim) -> bool:
    return isinstance(dim, int) and dim >= 0


def symbolic_inputs(model: ir.Model) -> list[ir.Value]:
    """The graph inputs with an unknown shape or a dim that is not a static size."""
    return [value for value in model.graph.inputs if value.shape is None or not all(_is_static(d) for d in value.shape)]


def negative_dims_as_symbolic(model: ir.Model, report: FixReport) -> None:
    """Paddle exports write an unknown dim as -1; read as a size, constant folding computes with it."""
    values = [*model.graph.inputs, *model.graph.outputs]
    for value in values:
        if value.shape is None or all(not isinstance(d, int) or d >= 0 for d in value.shape):
            continue
        old = list(value.shape)
        value.shape = ir.Shape([None if isinstance(d, int) and d < 0 else d for d in old])
        report.changed("negative-dims-as-symbolic", value.name, f"declared dims {old}: -1 read as unknown", exact=True)
    for node in model.graph.all_nodes():
        for value in node.outputs:
            if value.shape is not None and any(isinstance(d, int) and d < 0 for d in value.shape):
                value.shape = None  # an inferred-shape annotation carrying -1: let inference redo it


def shapes_in_use(model: ir.Model, feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, list[int | None]]:
    """Per input, the dims every feed agrees on (None where they differ)."""
    shapes: dict[str, list[int | None]] = {}
    for value in model.graph.inputs:
        seen = [np.shape(feed[value.name]) for feed in feeds if value.name in feed]
        if not seen or len({len(shape) for shape in seen}) != 1:
            continue
        shapes[value.name] = [dims[0] if len(set(dims)) == 1 else None for dims in zip(*seen)]
    return shapes


def pin_input_shapes(model: ir.Model, shapes: Mapping[str, Sequence[int | None]], source: str,
                     report: FixReport) -> bool:
    """Replace symbolic input dims by ``shapes``' static ones; True when anything was pinned."""
    pinned = False
    for value in symbolic_inputs(model):
        wanted = shapes.get(value.name)
        if wanted is None:
            continue
        old = list(value.shape) if value.shape is not None else None
        if old is not None and len(old) != len(wanted):
            raise KenosisError(f"input {value.name!r} has rank {len(old)}, the shapes in use have rank {len(wanted)}")
        new = [
            dim if _is_static(dim) else (wanted[i] if wanted[i] is not None else dim)
            for i, dim in enumerate(old if old is not None else wanted)
        ]
        if old is not None and new == old:
            continue
        value.shape = ir.Shape(new)
        pinned = True
        shown = [str(d) if d is not None else "?" for d in old] if old is not None else ["?"]
        pinned_dims = ", ".join(str(d) if d is not None else "?" for d in new)
        report.changed(
            "pin-input-shapes", value.name,
            f"dims [{', '.join(shown)}] -> [{pinned_dims}] ({source}) so shape "
            "computations fold; the prepared model accepts only these shapes",
            exact=True,
        )
    return pinned


def propagated_dims(model: ir.Model) -> bool:
    """Fill the unknown dims of the main graph's values with the static ones ONNX shape inference
    finds when it propagates shape values (``data_prop``): behind a Resize to a computed size
    (``Concat(Shape(x)[0:2], Shape(x)[2:4] * 2)``) node-by-node inference knows no spatial dim, and
    the padding computed from them would only fold with the batch pinned too (fuzz seed 20002019).
    Nothing changes where inference fails. True when a dim became known.

    An opset-13 graph is inferred as opset 14, the same ops but for Reshape's ``allowzero``
    (default off, the same semantics): Reshape-13's inference ignores a propagated target shape,
    and a padding computed behind ``Reshape(x, Concat(Shape(x)[0:1], [...]))`` pinned the batch
    (fuzz seed 20002086)."""
    try:
        proto = ir.serde.serialize_model(model)
        for opset in proto.opset_import:
            if opset.domain in ("", "ai.onnx") and opset.version == _RESHAPE_INFERS_PROPAGATED_SHAPE - 1:
                opset.version = _RESHAPE_INFERS_PROPAGATED_SHAPE
        found = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a help here, not a requirement
        return False
    changed = False
    values = {value.name: value for node in model.graph for value in node.outputs}
    for info in [*found.graph.value_info, *found.graph.output]:
        value = values.get(info.name)
        tensor = info.type.tensor_type
        if value is None or not tensor.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if value.shape is None:
            if value.type is not None and any(d is not None for d in dims):
                value.shape, changed = ir.Shape(dims), True
            continue
        if len(value.shape) != len(dims):
            continue
        merged = [old if isinstance(old, int) or new is None else new for old, new in zip(value.shape, dims)]
        if merged != list(value.shape):
            value.shape, changed = ir.Shape(merged), True
    return changed

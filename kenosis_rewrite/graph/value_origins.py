"""Where each value's contents come from: data, shapes (exact index arithmetic) or constants.

Used by ``fix()`` to keep shape arithmetic float, by ``prepare()`` to fold it, and by ``quantize()``
to protect it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import onnx_ir as ir

# Ops whose output describes a tensor's shape, not its values.
SHAPE_READERS = frozenset({"Shape", "Size", "EyeLike"})
# Ops that generate indices or fills: grids and priors start here even from constant inputs.
INDEX_GENERATORS = frozenset({"Range", "ConstantOfShape"})


class Origin(enum.Enum):
    """Where a value's contents come from."""

    DATA = "data"  # computed from a data input's values
    SHAPE = "shape"  # from shapes, indices or metadata inputs, and constants: exact arithmetic
    CONSTANT = "constant"  # from constants only (weights, and their Q/DQ)


def value_origins(
    graph: ir.Graph, metadata_inputs: Iterable[str] = (), *, shape_paths: bool = True,
    computed_constants: Origin = Origin.CONSTANT,
) -> dict[ir.Value, Origin]:
    """The origin of every value of ``graph`` (top level).

    Graph inputs are DATA unless named in ``metadata_inputs`` (SHAPE then). A node's outputs are
    DATA when it reads DATA (a shape reader's only with ``shape_paths=False``), SHAPE when it reads
    SHAPE or is a shape reader of a non-constant / an index generator (with ``shape_paths``), and
    otherwise -- every input constant -- ``computed_constants``: the shape of a constant is a
    constant (``W + Expand(b, Shape(W))`` is a weight computed at run time, not shape arithmetic).
    Nodes with subgraphs count as DATA producers when they read DATA, like any node.
    """
    metadata = set(metadata_inputs)
    origins: dict[ir.Value, Origin] = {}
    for value in graph.inputs:
        origins[value] = Origin.SHAPE if value.name in metadata else Origin.DATA
    for value in graph.initializers.values():
        origins.setdefault(value, Origin.CONSTANT)
    for node in graph:  # topological order
        kinds = {origins.get(v, Origin.CONSTANT) for v in node.inputs if v is not None}
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            kind = Origin.CONSTANT
        elif shape_paths and node.op_type in SHAPE_READERS and kinds != {Origin.CONSTANT}:
            kind = Origin.SHAPE
        elif Origin.DATA in kinds:
            kind = Origin.DATA
        elif Origin.SHAPE in kinds or (shape_paths and node.op_type in INDEX_GENERATORS):
            kind = Origin.SHAPE
        else:
            kind = computed_constants
        for value in node.outputs:
            origins[value] = kind
    return origins

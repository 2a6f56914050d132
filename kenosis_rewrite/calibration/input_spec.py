"""What synthetic calibration inputs are made of: the record of what is generated for one graph
input (:class:`InputSpec`), a read-only index of the model's graph the inference walks, and the
declared dims resolved to a concrete shape. Shared by :mod:`kenosis_rewrite.calibration.inputs`
and :mod:`kenosis_rewrite.calibration.image_inputs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["InputGraph", "InputSpec", "NUMPY_TYPES", "TRANSPARENT_OPS", "declared_dims", "resolve_shape"]

TRANSPARENT_OPS = frozenset({"Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand",
                             "Transpose", "Pad", "Slice"})
NUMPY_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
               onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32,
               onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.INT8: np.int8, onnx.TensorProto.BOOL: np.bool_}


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """What :func:`~kenosis_rewrite.calibration.inputs.synthetic_feeds` generates for one graph input, and why."""

    name: str
    dtype: type
    shape: tuple[int, ...]
    kind: str  # image | token_ids | attention_mask | token_type_ids | position_ids | integer | metadata | float | bool
    reason: str
    layout: str | None = None  # images: "NCHW" or "NHWC"
    vocab: int | None = None  # ids: exclusive upper bound
    pixel_scale: float = 1.0  # images: pixels in [0, pixel_scale] before (x - mean) / std
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)


class InputGraph:
    """Read-only index of a model's top-level graph: consumers, constants."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in model.graph.node:
            for index, name in enumerate(node.input):
                self.consumers.setdefault(name, []).append((node, index))
        self.initializers = {init.name: init for init in model.graph.initializer}
        self.constants = {node.output[0]: node for node in model.graph.node
                          if node.op_type == "Constant" and node.attribute}

    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` if it is an initializer or a Constant node's tensor."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.constants.get(name)
        if node is not None and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def downstream(self, name: str, max_depth: int = 8) -> Iterator[tuple[onnx.NodeProto, int, list]]:
        """(consumer, input index, path of transparent nodes) reachable through ``TRANSPARENT_OPS``."""
        frontier = [(name, [])]
        for _ in range(max_depth):
            next_frontier = []
            for value, path in frontier:
                for node, index in self.consumers.get(value, []):
                    yield node, index, path
                    if node.op_type in TRANSPARENT_OPS and index == 0:
                        next_frontier.append((node.output[0], path + [node]))
            frontier = next_frontier


def declared_dims(value: onnx.ValueInfoProto) -> list[int | str | None]:
    """The declared dims of a graph input: sizes, symbol names, None where unknown."""
    dims = []
    for dim in value.type.tensor_type.shape.dim:
        # "?" is a Paddle export's unknown dim, not one name shared by every dim it marks
        dims.append(dim.dim_value if dim.dim_value > 0 else (dim.dim_param if dim.dim_param not in ("", "?") else None))
    return dims


def resolve_shape(dims: list, defaults: list[int], symbols: dict[str, int]) -> tuple[int, ...]:
    """Concrete shape: fixed dims kept, a symbol's first resolution reused, otherwise ``defaults``."""
    shape = []
    for dim, default in zip(dims, defaults):
        if isinstance(dim, int):
            shape.append(dim)
        elif isinstance(dim, str):
            shape.append(symbols.setdefault(dim, default))
        else:
            shape.append(default)
    return tuple(shape)

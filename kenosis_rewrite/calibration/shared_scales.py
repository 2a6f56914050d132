"""One range for every tensor a Concat joins, so the Concat runs on the quantized bytes.

quantize_static gives each Concat input its own range. Inputs on different scales make ONNX Runtime
run ``QLinearConcat``, which requantizes every input (measured on YOLOv8n, 18 Concats: 0.72 ms of
7.2 ms, one thread); inputs, output and their Q/DQ on one scale let fix() move the DequantizeLinear
after the Concat (``move-dq-forward``, exact), so the Concat copies uint8 bytes.

The group of a Concat is its float inputs and output, together with the tensors quantize_static
ties to them: the output of a data-movement op (Reshape, Transpose, Split, MaxPool, Resize, ...) is
quantized with its input's parameters, so their ranges must move together. Each group's range is
the union of its members' calibrated ranges (nothing that was representable becomes clipped); the
price is resolution on the narrower members. A group is left alone, with the reason, when the union
would widen a member's range by more than ``max_widening`` (the bits that member would lose), or
would reach past the clamp of a member computed by Relu/Clip: quantize_static deletes those
activations and lets the Q's range clamp in their place (``Concat(Relu(a), b)`` with a negative
``b`` would otherwise pass ``a``'s negative values: measured -0.03 cosine on a YOLOX detector).

Approximate, not exact: it changes calibrated ranges, so quantization error, before quantization.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import onnx

from kenosis_rewrite.calibration.collect import TensorRanges

# ops whose quantized output takes its input's parameters in quantize_static (QDQDirect8BitOp,
# QDQSplit, QDQMaxPool, QDQResize): joining one joins the other
SAME_SCALE_OPS = frozenset({
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Split", "MaxPool", "Resize",
    "AveragePool", "Gather", "TopK",
})
# a member may lose at most this factor of resolution (4x: two bits of uint8)
DEFAULT_MAX_WIDENING = 4.0


@dataclasses.dataclass(frozen=True)
class SharedRange:
    """A group of tensors given one range, or refused one (``applied`` False, with ``reason``)."""

    concat: str  # the first Concat of the group (for the report)
    tensors: tuple[str, ...]
    range: tuple[float, float]
    applied: bool
    reason: str


class _Groups:
    """Union-find over tensor names."""

    def __init__(self) -> None:
        self._parent: dict[str, str] = {}

    def find(self, name: str) -> str:
        parent = self._parent.setdefault(name, name)
        if parent != name:
            parent = self._parent[name] = self.find(parent)
        return parent

    def join(self, first: str, second: str) -> None:
        self._parent[self.find(first)] = self.find(second)

    def groups(self) -> list[list[str]]:
        by_root: dict[str, list[str]] = {}
        for name in list(self._parent):
            by_root.setdefault(self.find(name), []).append(name)
        return list(by_root.values())


def _clamp(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> tuple[float, float] | None:
    """The interval a Relu/Clip clamps to (None: not one of them). A Clip whose bound is computed at
    run time gets an empty interval, so its group is always refused. (The onnx-ir twin on the
    quantized graph is :func:`kenosis_rewrite.graph.value_range.activation_bounds`; this one reads the
    float proto quantize_static gets.)"""
    if node.op_type == "Relu":
        return 0.0, np.inf
    if node.op_type != "Clip":
        return None
    bounds = []
    for index, attribute, default in ((1, "min", -np.inf), (2, "max", np.inf)):
        if len(node.input) > index and node.input[index]:
            if node.input[index] not in constants:
                return np.inf, -np.inf  # empty: no range fits it
            bounds.append(float(constants[node.input[index]].reshape(-1)[0]))
        else:
            bounds.append(next((a.f for a in node.attribute if a.name == attribute), default))
    return bounds[0], bounds[1]


def _width(lo: float, hi: float) -> float:
    # quantize_static widens every range to include 0.0
    return max(hi, 0.0) - min(lo, 0.0)


def shared_concat_ranges(
    model: onnx.ModelProto,
    ranges: TensorRanges,
    *,
    excluded_nodes: Iterable[str] = (),
    max_widening: float = DEFAULT_MAX_WIDENING,
) -> tuple[TensorRanges, list[SharedRange]]:
    """``ranges`` with every Concat's group on one range, and what was done per group.

    Only tensors with a calibrated range take part (constants, shape tensors and the inputs of
    ``excluded_nodes``, which stay float, do not). ``model`` is the float model quantize_static gets.
    """
    excluded = set(excluded_nodes)
    constants = {init.name: onnx.numpy_helper.to_array(init) for init in model.graph.initializer
                 if np.prod(init.dims) <= 1}
    clamps = {out: clamp for node in model.graph.node for out in node.output[:1]
              if (clamp := _clamp(node, constants)) is not None}
    groups = _Groups()
    concats: dict[str, str] = {}  # group member -> a Concat naming the group
    for node in model.graph.node:
        if node.name in excluded:
            continue
        if node.op_type in SAME_SCALE_OPS and node.input and node.input[0] in ranges:
            for output in node.output:
                if output in ranges:
                    groups.join(output, node.input[0])
        elif node.op_type == "Concat":
            members = [name for name in [*node.input, *node.output] if name in ranges]
            if len(members) < 2 or node.output[0] not in ranges:
                continue
            for name in members:
                groups.join(name, node.output[0])
                concats.setdefault(name, node.name or node.output[0])
    updated = dict(ranges.ranges)
    decisions = []
    for members in groups.groups():
        named = next((concats[name] for name in members if name in concats), None)
        if named is None or len(members) < 2:
            continue
        lo = min(ranges[name][0] for name in members)
        hi = max(ranges[name][1] for name in members)
        narrowest = min(_width(*ranges[name]) for name in members)
        widening = _width(lo, hi) / narrowest if narrowest > 0 else float("inf")
        clamped = [name for name in members if name in clamps and not (clamps[name][0] <= lo and hi <= clamps[name][1])]
        if clamped:
            decisions.append(SharedRange(named, tuple(members), (lo, hi), False,
                                         f"one range [{lo:.3g}, {hi:.3g}] would reach past the clamp of {clamped[0]!r} "
                                         "(a Relu/Clip the Q's range stands for)"))
            continue
        if widening > max_widening:
            decisions.append(SharedRange(named, tuple(members), (lo, hi), False,
                                         f"one range would widen a member {widening:.1f}x (limit {max_widening:g}x)"))
            continue
        for name in members:
            updated[name] = (lo, hi)
        decisions.append(SharedRange(named, tuple(members), (lo, hi), True,
                                     f"{len(members)} tensors on one range (narrowest widened {widening:.2f}x)"))
    shared = dataclasses.replace(ranges, ranges=updated)
    return shared, decisions


__all__ = ["SharedRange", "shared_concat_ranges", "SAME_SCALE_OPS", "DEFAULT_MAX_WIDENING"]

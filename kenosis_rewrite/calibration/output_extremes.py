"""The tensors whose rare extremes are a model's answer: they are calibrated with their min/max.

A percentile range (or entropy/mse) clips a tensor's rarest values to spend the 8 bits on the bulk.
On the way into a graph output the rarest values are what the user reads: a detector's few
confident class scores among thousands of anchors, the text pixels of a text map, the winning logit.
Clipped, they are gone, and cosine does not see it when they are few: on nudenet's YOLOv8n the 99.99%
range of the class scores ended at 0.055, every box above nudenet's 0.25 threshold was lost
(box F1 against FP32: 0 on 100 held-out photos), and the output's cosine stayed 0.9995, as the box
coordinates concatenated beside the scores dominate it.

:func:`output_value_tensors` walks back from each graph output through ops that move values or
map them monotonically one by one (``ORDER_PRESERVING_OPS``, and Add/Sub/Mul/Div by a constant), taking
every tensor it meets, up to and including the output of the first op of another kind (the head's
Conv, Gemm or MatMul, whose output is the logits). quantize() calibrates those with their exact
min/max whatever the method (:func:`~kenosis_rewrite.calibration.collect.collect_ranges`'s
``extremes``): nothing seen in calibration becomes clipped; the bulk gets a coarser step, which no
threshold on these outputs reads. Where the producer bounds its output (Sigmoid, HardSigmoid,
Softmax: [0, 1]; Tanh: [-1, 1]) the tensor takes that whole range instead: calibration photos need
not contain what the model detects (nudenet's class scores reached 0.16 on 16 street scenes, 0.41 on
held-out photos), and a score the calibration never saw must not be clamped to the highest it did.
:func:`mixed_output_concats` names the output-path Concats that would requantize such values onto a
wider member's grid (boxes beside scores), to keep them float.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import onnx

from kenosis_rewrite.core.model_io import constant_names
from kenosis_rewrite.core.op_tables import ORDER_PRESERVING_OPS

__all__ = ["NATURAL_RANGES", "mixed_output_concats", "output_value_tensors"]

_AFFINE_OPS = frozenset({"Add", "Sub", "Mul", "Div"})
# the range every output of these ops lies in, whatever their input
NATURAL_RANGES = {"Sigmoid": (0.0, 1.0), "HardSigmoid": (0.0, 1.0), "Softmax": (0.0, 1.0), "Tanh": (-1.0, 1.0)}


def output_value_tensors(model: onnx.ModelProto) -> dict[str, tuple[float, float] | None]:
    """The tensors of ``model``'s main graph whose values reach a graph output through
    ``ORDER_PRESERVING_OPS`` and affine steps by constants (the graph outputs included), each -> its
    producer's range from ``NATURAL_RANGES``, or None (its calibrated min/max)."""
    graph = model.graph
    constants = constant_names(model)
    producers = {output: node for node in graph.node for output in node.output if output}
    found: dict[str, tuple[float, float] | None] = {}
    pending = [output.name for output in graph.output]
    while pending:
        name = pending.pop()
        if not name or name in found or name in constants:
            continue
        node = producers.get(name)
        standard = node is not None and node.domain in ("", "ai.onnx")
        found[name] = NATURAL_RANGES.get(node.op_type) if standard else None
        if standard:
            pending.extend(_carried(node, constants))
    return found


def _carried(node: onnx.NodeProto, constants: Collection[str]) -> list[str]:
    """The inputs whose values a standard ``node`` carries to its output (moved, or mapped one by one):
    none for any other op (a Conv's output is its own)."""
    if node.op_type in ORDER_PRESERVING_OPS:
        # the data input (Slice's starts, Reshape's shape, Clip's bounds are constants or shapes)
        return list(node.input[:1] if node.op_type != "Concat" else node.input)
    if node.op_type in _AFFINE_OPS:
        variable = [value for value in node.input if value not in constants]
        return variable if len(variable) == 1 else []
    return []


def mixed_output_concats(model: onnx.ModelProto, output_values: Collection[str],
                         ranges: Mapping[str, tuple[float, float]], max_spread: float = 4.0) -> dict[str, str]:
    """The nodes to keep float so that no output value is requantized onto a coarser member's grid:
    each Concat producing an output value whose inputs' ranges span more than ``max_spread`` times
    each other (a detector's box coordinates, 0 to 320, beside its scores, 0 to 1: one quantized
    output would give the scores a step of 1.25), and every node after it that carries its values on
    into an output value (the Reshape/Transpose glue up to the graph output, which quantize_static
    would quantize at the Concat's range again; not a MatMul reading them, whose output is its own,
    fuzz seed 20000416). Node name -> why."""
    graph = model.graph
    constants = constant_names(model)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    kept: dict[str, str] = {}
    for node in graph.node:
        if node.op_type != "Concat" or not node.output or node.output[0] not in output_values:
            continue
        spans = [ranges[name][1] - ranges[name][0] for name in node.input if name in ranges]
        spans = [span for span in spans if span > 0]
        if len(spans) < 2 or max(spans) <= max_spread * min(spans):
            continue
        joins = f"joins output values whose ranges span {min(spans):.3g} to {max(spans):.3g}"
        pending = [node]
        while pending:
            current = pending.pop()
            if current.name in kept:
                continue
            kept[current.name] = (f"{joins}: kept float" if current is node
                                  else f"on the output path after {node.name}, which {joins}: kept float")
            # the glue that carries the Concat's values on (not a MatMul reading them: its output is its own)
            pending.extend(reader for output in current.output for reader in consumers.get(output, ())
                           if reader.output and all(value in output_values for value in reader.output)
                           and reader.domain in ("", "ai.onnx") and output in _carried(reader, constants))
    return kept

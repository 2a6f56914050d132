"""Float islands of the graph ORT CPU runs: connected float nodes between DequantizeLinear and QuantizeLinear.

Nodes of the optimized graph are classified (Q/DQ, integer, layout-only, float), float and layout
nodes are grouped into connected components (union-find over the tensors linking them), and each
island is named with what it is made of and the kenosis rule that removes it, if any.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import onnx
import onnx_ir as ir

from kenosis_rewrite.diagnosis.float_reasons import (
    ABSORBABLE_ACTIVATIONS,
    NO_INTEGER_KERNEL_ACTIVATIONS,
    RULE_FOLD,
    RULE_PRELU,
    RULE_U8,
)
from kenosis_rewrite.diagnosis.fusion_report import FloatIsland, HeavyOp
from kenosis_rewrite.diagnosis.ort_graph import INTEGER_KERNELS, QDQ_OPS, TRIVIAL_OPS
from kenosis_rewrite.graph import qdq_params

# Quantized-output ops whose output stays an integer tensor.
_INTEGER_OUTPUT_OPS = frozenset({"DynamicQuantizeLinear", "NhwcMaxPool"})
_INTEGER_TYPES = frozenset(
    {
        onnx.TensorProto.UINT8, onnx.TensorProto.INT8, onnx.TensorProto.INT32, onnx.TensorProto.UINT16,
        onnx.TensorProto.INT16, onnx.TensorProto.INT4, onnx.TensorProto.UINT4,
    }
)
# Integer kernels whose output is float (they dequantize internally).
_FLOAT_OUTPUT_KERNELS = frozenset({"MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulNBits"})


def _is_integer_node(node: onnx.NodeProto, integer_tensors: set[str]) -> bool:
    """Integer kernels, QLinear* ops, and ops that pass quantized integers through (NhwcMaxPool, Flatten...)."""
    if node.op_type in QDQ_OPS:
        return False
    if node.op_type in INTEGER_KERNELS or node.op_type.startswith("QLinear") or node.op_type in _INTEGER_OUTPUT_OPS:
        return True
    return bool(node.input) and node.input[0] in integer_tensors and node.op_type != "Cast"


def _has_integer_output(node: onnx.NodeProto) -> bool:
    if node.op_type == "QGemm":
        return len(node.input) > 7  # with y_scale/y_zero_point it requantizes its output
    return node.op_type not in _FLOAT_OUTPUT_KERNELS


def _integer_tensors(graph: onnx.GraphProto) -> set[str]:
    """Tensors of the optimized graph that hold quantized integers (propagated in topological order)."""
    names = {t.name for t in graph.initializer if t.data_type in _INTEGER_TYPES}
    names |= {v.name for v in graph.input if v.type.tensor_type.elem_type in _INTEGER_TYPES}
    for node in graph.node:
        if node.op_type == "QuantizeLinear" or (_is_integer_node(node, names) and _has_integer_output(node)):
            names.update(node.output)
    return names


def _shape_tensors(graph: onnx.GraphProto) -> set[str]:
    """Tensors computed from tensor shapes only (Shape/Size and arithmetic on them and on constants):
    run-time shape bookkeeping (e.g. TF-style SAME pads), not float activations."""
    constants = {t.name for t in graph.initializer}
    names: set[str] = set()
    for node in graph.node:
        inputs = [name for name in node.input if name]
        computed = node.op_type in ("Shape", "Size") or (
            node.op_type not in QDQ_OPS and any(name in names for name in inputs)
            and all(name in names or name in constants for name in inputs))
        if computed:
            names.update(node.output)
    return names


def _node_kinds(graph: onnx.GraphProto) -> dict[int, str]:
    """index -> "qdq" | "shape" | "integer" | "trivial" | "float" for every optimized node."""
    integer = _integer_tensors(graph)
    shapes = _shape_tensors(graph)
    kinds = {}
    for index, node in enumerate(graph.node):
        if node.op_type in QDQ_OPS:
            kinds[index] = "qdq"
        elif node.output and all(name in shapes for name in node.output if name):
            kinds[index] = "shape"
        elif _is_integer_node(node, integer):
            kinds[index] = "integer"
        elif node.op_type in TRIVIAL_OPS:
            kinds[index] = "trivial"
        else:
            kinds[index] = "float"
    return kinds


def _components(graph: onnx.GraphProto, members: set[int]) -> list[list[int]]:
    """Connected components of ``members`` (node indices) linked by tensors."""
    parent = {i: i for i in members}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producer = {out: i for i in members for out in graph.node[i].output}
    for i in members:
        for name in graph.node[i].input:
            j = producer.get(name)
            if j is not None:
                parent[find(i)] = find(j)
    groups: dict[int, list[int]] = collections.defaultdict(list)
    for i in sorted(members):
        groups[find(i)].append(i)
    return list(groups.values())


def _float_islands(graph: onnx.GraphProto) -> list[list[int]]:
    """Node-index groups: float compute components, and DQ -> (layout ops) -> Q requantize chains."""
    kinds = _node_kinds(graph)
    floaty = {i for i, kind in kinds.items() if kind in ("float", "trivial")}
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    consumers: dict[str, list[int]] = collections.defaultdict(list)
    for i, node in enumerate(graph.node):
        for name in node.input:
            consumers[name].append(i)
    islands = []
    for group in _components(graph, floaty):
        if any(kinds[i] == "float" for i in group):
            islands.append(group)
            continue
        entering = {producer.get(name) for i in group for name in graph.node[i].input}
        leaving = {j for i in group for out in graph.node[i].output for j in consumers[out]}
        dqs = sorted(j for j in entering if j is not None and graph.node[j].op_type == "DequantizeLinear")
        qs = sorted(j for j in leaving if graph.node[j].op_type == "QuantizeLinear")
        if dqs and qs:
            islands.append(sorted({*dqs, *group, *qs}))
    for i, node in enumerate(graph.node):
        if node.op_type == "DequantizeLinear":
            for j in consumers[node.output[0]]:
                if graph.node[j].op_type == "QuantizeLinear":
                    islands.append([i, j])
    return islands


def _int8_boundary(graph: onnx.GraphProto, group: Sequence[int]) -> bool:
    """Whether a Q/DQ at the edge of the island still uses an int8 zero point after ORT's S8->U8 pass."""
    int8_zero_points = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.INT8}
    members = set(group)
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    edge = {producer.get(name) for i in members for name in graph.node[i].input} | members
    for index in edge:
        node = graph.node[index] if index is not None else None
        if node is not None and node.op_type in QDQ_OPS and len(node.input) > 2 and node.input[2] in int8_zero_points:
            return True
    for node in graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] in {o for m in members for o in graph.node[m].output}:
            if len(node.input) > 2 and node.input[2] in int8_zero_points:
                return True
    return False


def _between_dq_and_q(graph: onnx.GraphProto, group: Sequence[int]) -> bool:
    """Whether a DequantizeLinear feeds the island and a QuantizeLinear reads from it."""
    members = set(group)
    outputs = {o for i in members for o in graph.node[i].output}
    inputs = {name for i in members for name in graph.node[i].input}
    dq_in = any(n.op_type == "DequantizeLinear" and n.output[0] in inputs for n in graph.node)
    q_out = any(n.op_type == "QuantizeLinear" and n.input[0] in outputs for n in graph.node)
    return dq_in and q_out


def _island_reason(op_types: Sequence[str], names: Sequence[str], kind: str, input_nodes: dict[str, ir.Node],
                   heavy: Sequence[HeavyOp], int8_edge: bool, bounded: bool,
                   runtime_pads: bool = False) -> tuple[str | None, str | None]:
    """What a float island is made of and which rule removes it (None when it should stay).
    ``runtime_pads``: a Pad of the island reads pads computed at run time."""
    floats = [op for op in heavy if op.kernel == "float"]
    if floats:
        return f"float {floats[0].op_type}: {floats[0].reason}", floats[0].fixing_rule
    if not bounded and kind == "compute":
        return None, None  # float code outside the quantized region (graph input/output side)
    if int8_edge:
        return "int8 activations at its edge (a fan-out tensor ORT kept int8, no int8 kernels on x86)", RULE_U8
    for op_type in ABSORBABLE_ACTIVATIONS:
        if op_type in op_types:
            return (f"float {op_type} island between DQ and Q (ORT drops a {op_type} only when the next Q "
                    "makes it redundant, e.g. zero point = qmin)"), RULE_FOLD[op_type]
    if "PRelu" in op_types:
        return "float PRelu island (no QLinear PRelu on ORT CPU)", RULE_PRELU
    if "Pad" in op_types and runtime_pads:
        return ("float Pad between DQ and Q: its pads are computed at run time (e.g. TF-style SAME padding); "
                "ORT CPU keeps a QDQ Pad in int8 only with constant pads (measured)"), None
    if "Softmax" in op_types:
        return ("float Softmax: faster than ORT's QLinearSoftmax on x86 (softmax-float-input keeps it float; "
                "keep the island)"), None
    missing = sorted(set(op_types) & NO_INTEGER_KERNEL_ACTIVATIONS)
    if missing:
        return f"no integer kernel for {', '.join(missing)} on ORT CPU (keep the island)", None
    if kind == "requantize":
        for name in names:
            node = input_nodes.get(name)
            if qdq_params.is_dequantize(node):
                after = [use[0].op_type for use in node.outputs[0].uses()]
                for op_type in ABSORBABLE_ACTIVATIONS:
                    if op_type in after:
                        return f"requantize pair left after ORT removed a {op_type}", RULE_FOLD[op_type]
        return "DQ -> Q round trip (requantize or layout change between quantized ops)", None
    return None, None


def _runtime_pads(graph: onnx.GraphProto, group: Sequence[int]) -> bool:
    """Whether a Pad of the island reads its pads from a node (not from an initializer)."""
    produced = {out for node in graph.node for out in node.output}
    return any(graph.node[i].op_type == "Pad" and len(graph.node[i].input) > 1 and graph.node[i].input[1] in produced
               for i in group)


def build_islands(graph: onnx.GraphProto, ops: list[HeavyOp], matched: dict[str, str],
                  input_nodes: dict[str, ir.Node]) -> list[FloatIsland]:
    """Every float island of ORT's ``graph`` with its heavy ops (``matched``: heavy op -> optimized node name)
    and its reason, read from the input graph's ``input_nodes`` (by name)."""
    by_opt_name = collections.defaultdict(list)
    for op in ops:
        if op.name in matched:
            by_opt_name[matched[op.name]].append(op)
    islands, seen = [], set()
    for group in _float_islands(graph):
        if tuple(group) in seen:  # by index: ORT leaves some nodes unnamed, so names may repeat
            continue
        seen.add(tuple(group))
        nodes = tuple(graph.node[i].name for i in group)
        op_types = tuple(graph.node[i].op_type for i in group)
        kind = "compute" if set(op_types) - TRIVIAL_OPS - QDQ_OPS else "requantize"
        heavy = [op for name in nodes for op in by_opt_name.get(name, [])]
        reason, rule = _island_reason(op_types, nodes, kind, input_nodes, heavy, _int8_boundary(graph, group),
                                      kind == "requantize" or _between_dq_and_q(graph, group),
                                      _runtime_pads(graph, group))
        islands.append(FloatIsland(nodes, op_types, tuple(op.name for op in heavy), kind, reason, rule))
    return islands

"""``explain()``: which heavy ops ONNX Runtime CPU runs in integer kernels, and why the others stay float.

The "doctor" builds an ORT CPU session at ``ORT_ENABLE_ALL``, saves the optimized graph, and maps
every node of it back to the input graph's heavy ops (Conv, ConvTranspose, MatMul, Gemm). A heavy op
counts as *integer* when ORT turned it into one of :data:`INTEGER_KERNELS`; otherwise it is *float*
and the input graph around it is analysed for the reason ORT's QDQ selectors refused it, plus the
kenosis rule that fixes that reason (when one exists).

How ORT 1.31 names things (measured on quantize_static output, which is what the mapping relies on):

* a fused ``QLinearConv`` is named ``<conv name>_token_<n>`` (NhwcTransformer) and reads the
  quantized weight initializer of the original weight DequantizeLinear (``w_quantized``);
* ``QLinearMatMul``, ``QGemm``, ``QLinearLeakyRelu``... keep the original node name;
* a float Conv/MatMul/Gemm that was not fused keeps its name and its inputs (the weight still comes
  through the DequantizeLinear, which ORT does not constant-fold);
* in float models the NCHWc transformer names a Conv ``<output name>_nchwc`` and replaces its weight
  by a reordered initializer, but keeps the bias initializer's name;
* nodes duplicated by EnsureUniqueDQForNodeUnit get a ``/duplicated`` suffix.

So a heavy op is matched by (1) base node name, (2) the name of its weight or bias initializer
(before or after its DequantizeLinear), (3) its output name (also the output of a Relu/Clip fused
into it) -- the first rule that finds a candidate wins.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import tempfile
from collections.abc import Iterable, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite import _io, _qdq, value_range
from kenosis_rewrite.errors import RuntimeMeasurementError

__all__ = ["FusionReport", "HeavyOp", "FloatIsland", "explain", "INTEGER_KERNELS"]

# Optimized-graph op types that run the heavy op's arithmetic in integers.
INTEGER_KERNELS = frozenset(
    {
        "QLinearConv", "QLinearMatMul", "MatMulInteger", "MatMulIntegerToFloat", "ConvInteger",
        "QGemm", "DynamicQuantizeMatMul", "MatMulNBits",
    }
)
# Input-graph op types counted as heavy ops. Integer ones only occur in QOperator/dynamic models.
FLOAT_HEAVY_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
HEAVY_OPS = frozenset(FLOAT_HEAVY_OPS) | INTEGER_KERNELS
# Optimized-graph op types that may be the float form of a heavy op.
FLOAT_HEAVY_KERNELS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "FusedConv", "FusedGemm", "FusedMatMul"})
# Optimized-graph ops that move or relabel data without arithmetic worth calling an island.
TRIVIAL_OPS = frozenset(
    {
        "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "ReorderInput",
        "ReorderOutput", "Shape", "Constant", "Cast", "Gather", "Slice", "Concat", "Split", "Expand",
    }
)
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
# Quantized-output ops whose output stays an integer tensor.
_INTEGER_OUTPUT_OPS = frozenset({"DynamicQuantizeLinear", "NhwcMaxPool"})
# Float activations ORT CPU has no QLinear kernel for (they stay float islands in a QDQ graph).
NO_INTEGER_KERNEL_ACTIVATIONS = frozenset(
    {"HardSwish", "HardSigmoid", "PRelu", "Gelu", "Erf", "Div", "Tanh", "Elu", "Selu", "Softplus", "Mish"}
)
# Activations ORT absorbs into QLinearConv/QLinearMatMul/QGemm when the next Q makes them redundant.
ABSORBABLE_ACTIVATIONS = ("Relu", "Clip")
# Heavy ops ORT fuses without an output Q (MatMulIntegerToFloat, QGemm with float output).
FLOAT_OUTPUT_OK = frozenset({"MatMul", "Gemm"})
# Heavy ops ORT CPU never fuses from QDQ (measured: DQ -> ConvTranspose -> Q stays float).
NO_QDQ_FUSION_OPS = frozenset({"ConvTranspose"})
EIGHT_BIT_ONNX = (onnx.TensorProto.UINT8, onnx.TensorProto.INT8)
BIAS_RTOL = 1e-5

# Reasons (the text) and the fixing rules (kenosis rule names).
R_MISSING = "missing Q/DQ"
R_UNSUPPORTED_TYPE = "unsupported quantized type on ORT CPU"
R_FANOUT = "int8 fan-out"
R_INT8_NO_Q = "int8 activation without a single-consumer Q->DQ pair"
R_GRAPH_OUTPUT = "output not quantized (graph output)"
R_ZP_NOT_QMIN = "zero point not qmin after Relu/Clip"
R_ACTIVATION = "activation with no integer fusion between op and Q"
R_DTYPE = "dtype mismatch"
R_STALE_BIAS = "stale bias scale"
R_PER_AXIS_ACTIVATION = "per-axis activation quantization"
R_WEIGHT_ONLY = "weight-only MatMul not fused to MatMulNBits"
R_NO_KERNEL = "no QDQ fusion for this op type on ORT CPU"
R_UNKNOWN = "unknown (ORT did not fuse)"
R_ACTIVATION_PRODUCT = "product of two activations (attention), float by design"
RULE_U8 = "activation-int8-to-uint8"
RULE_STALE_BIAS = "requantize-stale-bias"
RULE_FOLD = {"Relu": "fold-relu-island", "Clip": "fold-clip-island"}
RULE_PRELU = "prelu-to-leakyrelu / prelu-to-relu-min"


@dataclasses.dataclass(frozen=True)
class HeavyOp:
    """One heavy op of the input graph and the kernel ORT CPU runs it in."""

    name: str
    op_type: str
    macs: int
    kernel: str  # "integer" | "float"
    optimized_op_type: str | None  # e.g. "com.microsoft.QLinearConv"; None when no node was matched
    reason: str | None = None  # why it is float (None for integer ops)
    fixing_rule: str | None = None  # kenosis rule that removes ``reason``, when one exists
    detail: str | None = None  # the evidence behind ``reason`` (tensor names, parameters)
    other_reasons: tuple[str, ...] = ()  # further reasons found after the first
    warning: str | None = None  # an integer op fused with a problem (e.g. a stale bias scale in QGemm)


@dataclasses.dataclass(frozen=True)
class FloatIsland:
    """A connected group of float nodes of the optimized graph, between DequantizeLinear and QuantizeLinear."""

    nodes: tuple[str, ...]  # optimized-graph node names
    op_types: tuple[str, ...]
    heavy_ops: tuple[str, ...]  # input-graph heavy ops running inside the island
    kind: str  # "compute" or "requantize" (only DQ->Q or layout ops between them)
    reason: str | None = None
    fixing_rule: str | None = None


@dataclasses.dataclass
class FusionReport:
    """Which heavy ops run in integer kernels on ORT CPU, weighted by multiply-accumulates."""

    ops: list[HeavyOp]
    float_islands: list[FloatIsland]
    optimized_op_counts: collections.Counter

    @property
    def total_macs(self) -> int:
        return sum(op.macs for op in self.ops)

    @property
    def integer_mac_fraction(self) -> float:
        """Share of heavy-op MACs that run in integer kernels (0.0 when there are no heavy ops)."""
        total = self.total_macs
        integer = sum(op.macs for op in self.ops if op.kernel == "integer")
        return integer / total if total else 0.0

    @property
    def float_ops(self) -> list[HeavyOp]:
        return [op for op in self.ops if op.kernel == "float"]

    def to_dict(self) -> dict:
        return {
            "integer_mac_fraction": self.integer_mac_fraction,
            "total_macs": self.total_macs,
            "ops": [dataclasses.asdict(op) for op in self.ops],
            "float_islands": [dataclasses.asdict(island) for island in self.float_islands],
            "optimized_op_counts": dict(sorted(self.optimized_op_counts.items())),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def summary(self) -> str:
        """Human-readable multi-line report: the integer share, then every float op with its fix."""
        integer = len(self.ops) - len(self.float_ops)
        lines = [
            f"Integer kernels: {100 * self.integer_mac_fraction:.1f}% of MACs "
            f"({integer}/{len(self.ops)} heavy ops, {_human(self.total_macs)} MACs)"
        ]
        for op in self.float_ops:
            share = 100 * op.macs / self.total_macs if self.total_macs else 0.0
            fix = f" -> fix: {op.fixing_rule}" if op.fixing_rule else " -> no kenosis rule"
            lines.append(f"  float {op.op_type} {op.name!r} ({share:.1f}% of MACs): {op.reason}{fix}")
            if op.detail:
                lines.append(f"        {op.detail}")
        for op in self.ops:
            if op.warning:
                lines.append(f"  warning {op.op_type} {op.name!r}: {op.warning}")
        if self.float_islands:
            lines.append(f"Float islands in the ORT graph: {len(self.float_islands)}")
            for island in self.float_islands:
                why = f": {island.reason}" if island.reason else ""
                fix = f" -> fix: {island.fixing_rule}" if island.fixing_rule else ""
                lines.append(f"  [{island.kind}] {' -> '.join(island.op_types)}{why}{fix}")
        return "\n".join(lines)


def _human(count: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


# --------------------------------------------------------------------------------------------
# ORT: build the session and read back the optimized graph
# --------------------------------------------------------------------------------------------


def _session_options(optimized_path: str, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # the NCHWc "hardware specific" warning is expected
    options.optimized_model_filepath = optimized_path
    # Keep weights out of the saved graph: only the structure is read back.
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", "optimized.data"
    )
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return options


def _write_model(model: ir.Model, directory: str) -> str:
    """Save ``model`` for ORT; large weights go to an external file next to it."""
    path = os.path.join(directory, "input.onnx")
    tensors = [v.const_value for v in model.graph.initializers.values() if v.const_value is not None]
    # external tensors are written out again: their files sit next to the caller's model, not here
    external = sum(t.nbytes for t in tensors) > 1 << 30 or any(isinstance(t, ir.ExternalTensor) for t in tensors)
    ir.save(model, path, external_data="input.data" if external else None)
    return path


def optimized_graph(model: ir.Model, directory: str, threads: int = 1, source: str | None = None) -> onnx.ModelProto:
    """The graph ORT CPU actually runs for ``model`` at ORT_ENABLE_ALL (weights not loaded).

    ``source``: a file holding ``model`` as it is (a lazily loaded path), given to ORT instead of a copy.
    """
    import onnxruntime as ort

    source = source or _write_model(model, directory)
    optimized = os.path.join(directory, "optimized.onnx")
    try:
        ort.InferenceSession(source, _session_options(optimized, threads), providers=["CPUExecutionProvider"])
    except Exception as error:  # noqa: BLE001 - ORT raises several unrelated exception types
        raise RuntimeMeasurementError(
            f"ONNX Runtime (CPU) could not build a session for the model: {error}"
        ) from None
    try:
        return onnx.load(optimized, load_external_data=False)
    except Exception as error:  # noqa: BLE001
        raise RuntimeMeasurementError(f"ONNX Runtime did not write a readable optimized model: {error}") from None


# --------------------------------------------------------------------------------------------
# Shapes and MACs
# --------------------------------------------------------------------------------------------


def _with_shapes(model: ir.Model) -> ir.Model:
    """A copy of ``model`` with ONNX shape inference applied (the model itself when that fails)."""
    try:  # inferred on the graph alone (any size), then given the model's own tensors back
        proto = _io.graph_only_proto(model)
        shaped = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto, data_prop=True))
        for name, value in shaped.graph.initializers.items():
            value.const_value = model.graph.initializers[name].const_value
        return shaped
    except Exception:  # noqa: BLE001 - shape inference is best effort; MACs fall back to 1 per dim
        return model


def _dims(value: ir.Value | None) -> list[int] | None:
    """Static dims of ``value`` with unknown dims as 1; None when the rank is unknown."""
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) and d > 0 else 1 for d in value.shape]


def _prod(values: Iterable[int]) -> int:
    return int(math.prod(values))


def _conv_output_spatial(node: ir.Node, x: list[int], w: list[int]) -> list[int]:
    """Output spatial dims of a Conv from its attributes (used when shape inference gave none)."""
    spatial = x[2:]
    n = len(spatial)
    strides = node.attributes.get_ints("strides", [1] * n)
    dilations = node.attributes.get_ints("dilations", [1] * n)
    pads = node.attributes.get_ints("pads", [0] * 2 * n)
    auto_pad = node.attributes.get_string("auto_pad", "NOTSET")
    out = []
    for i, size in enumerate(spatial):
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out.append(math.ceil(size / strides[i]))
            continue
        kernel = (w[2 + i] - 1) * dilations[i] + 1 if len(w) > 2 + i else 1
        extra = 0 if auto_pad == "VALID" else pads[i] + pads[i + n]
        out.append(max(1, (size + extra - kernel) // strides[i] + 1))
    return out


def _conv_macs(node: ir.Node, x_index: int, w_index: int) -> int:
    """N * Cout * prod(out spatial) * Cin/group * prod(kernel)."""
    x, w, y = _dims(_input(node, x_index)), _dims(_input(node, w_index)), _dims(node.outputs[0])
    if x is None or w is None or len(w) < 2:
        return 1
    if y is None or len(y) != len(x):
        y = [x[0], w[0], *_conv_output_spatial(node, x, w)]
    return _prod(y) * _prod(w[1:])  # w[1] = Cin/group


def _conv_transpose_macs(node: ir.Node) -> int:
    """N * prod(in spatial) * Cin * Cout/group * prod(kernel) (every input pixel scatters a kernel)."""
    x, w = _dims(_input(node, 0)), _dims(_input(node, 1))
    if x is None or w is None:
        return 1
    return x[0] * _prod(x[2:]) * _prod(w)


def _matmul_macs(a: list[int] | None, b: list[int] | None) -> int:
    """batch * M * K * N with numpy matmul broadcasting; 1-D operands count as vectors."""
    if a is None or b is None:
        return 1
    a2 = [1, *a] if len(a) == 1 else a
    b2 = [*b, 1] if len(b) == 1 else b
    batch = [max(x, y) for x, y in zip(_pad_left(a2[:-2], len(b2) - 2), _pad_left(b2[:-2], len(a2) - 2))]
    return _prod(batch) * a2[-2] * a2[-1] * b2[-1]


def _pad_left(dims: list[int], rank: int) -> list[int]:
    return [1] * (rank - len(dims)) + dims


def _gemm_macs(node: ir.Node, a_index: int, b_index: int) -> int:
    a, b = _dims(_input(node, a_index)), _dims(_input(node, b_index))
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return 1
    if node.attributes.get_int("transA", 0):
        a = a[::-1]
    if node.attributes.get_int("transB", 0):
        b = b[::-1]
    return a[0] * a[1] * b[1]


def _matmul_nbits_macs(node: ir.Node) -> int:
    a = _dims(_input(node, 0))
    k, n = node.attributes.get_int("K", 1), node.attributes.get_int("N", 1)
    rows = _prod(a[:-1]) if a else 1
    return rows * k * n


def heavy_op_macs(node: ir.Node) -> int:
    """Multiply-accumulates of one heavy op from the static shapes (unknown dims count as 1)."""
    op = node.op_type
    if op == "Conv":
        return _conv_macs(node, 0, 1)
    if op in ("QLinearConv",):
        return _conv_macs(node, 0, 3)
    if op == "ConvInteger":
        return _conv_macs(node, 0, 1)
    if op == "ConvTranspose":
        return _conv_transpose_macs(node)
    if op == "Gemm":
        return _gemm_macs(node, 0, 1)
    if op == "QGemm":
        return _gemm_macs(node, 0, 3)
    if op == "QLinearMatMul":
        return _matmul_macs(_dims(_input(node, 0)), _dims(_input(node, 3)))
    if op == "MatMulNBits":
        return _matmul_nbits_macs(node)
    return _matmul_macs(_dims(_input(node, 0)), _dims(_input(node, 1)))


# --------------------------------------------------------------------------------------------
# Mapping optimized nodes back to input heavy ops
# --------------------------------------------------------------------------------------------

_SUFFIXES = re.compile(r"(_token_\d+|/duplicated|_nchwc|/MatMulAddFusion)+$")


def base_name(name: str) -> str:
    """``Conv_4_token_1`` -> ``Conv_4``: the input node name ORT derived an optimized name from."""
    return _SUFFIXES.sub("", name)


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if index < len(node.inputs) else None


def _source_names(value: ir.Value | None) -> set[str]:
    """Names along the DQ/Transpose/Reshape/Cast chain behind a constant ``value``; empty for activations."""
    names: set[str] = set()
    for _ in range(4):
        if value is None:
            return set()
        if value.name:
            names.add(value.name)
        if value.is_initializer() or value.const_value is not None:
            return names
        producer = value.producer()
        if producer is None or producer.op_type not in ("DequantizeLinear", "Transpose", "Reshape", "Cast"):
            return set()
        value = _input(producer, 0)
    return set()


def _fused_consumer_output(node: ir.Node) -> ir.Value | None:
    """The output of the single non-heavy consumer of ``node`` (ORT may fuse it in: FusedConv, Conv+Add)."""
    uses = list(node.outputs[0].uses())
    if len(uses) == 1 and uses[0][0].op_type not in HEAVY_OPS and uses[0][0].outputs:
        return uses[0][0].outputs[0]
    return None


def _heavy_keys(node: ir.Node) -> tuple[set[str], set[str]]:
    """(constant parameter names, output names) that identify ``node`` in the optimized graph."""
    params: set[str] = set()
    for value in node.inputs[1:] if node.op_type != "MatMul" else node.inputs:
        params |= _source_names(value)
    outputs = {v.name for v in node.outputs if v.name}
    fused = _fused_consumer_output(node)
    if fused is not None and fused.name:
        outputs.add(fused.name)
    return params, outputs


def _is_compute_candidate(node: onnx.NodeProto) -> bool:
    return node.op_type in INTEGER_KERNELS or node.op_type in FLOAT_HEAVY_KERNELS


def _label(node: onnx.NodeProto) -> str:
    return f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def match_optimized(heavy: ir.Node, optimized: Sequence[onnx.NodeProto]) -> onnx.NodeProto | None:
    """The optimized node that runs ``heavy``: by base name, then parameter names, then outputs."""
    candidates = [n for n in optimized if _is_compute_candidate(n)]
    params, outputs = _heavy_keys(heavy)
    by_name = [n for n in candidates if heavy.name and base_name(n.name) == heavy.name]
    # ORT renames a MatMulNBits weight "<name>_T" (transposed for the kernel).
    by_param = [n for n in candidates if params & ({*n.input} | {i[:-2] for i in n.input if i.endswith("_T")})]
    by_output = [n for n in candidates if outputs & set(n.output)]
    for group in (by_name, by_param, by_output):
        if group:
            integer = [n for n in group if n.op_type in INTEGER_KERNELS]
            return (integer or group)[0]
    return None


# --------------------------------------------------------------------------------------------
# Float islands of the optimized graph
# --------------------------------------------------------------------------------------------


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


def _node_kinds(graph: onnx.GraphProto) -> dict[int, str]:
    """index -> "qdq" | "integer" | "trivial" | "float" for every optimized node."""
    integer = _integer_tensors(graph)
    kinds = {}
    for index, node in enumerate(graph.node):
        if node.op_type in QDQ_OPS:
            kinds[index] = "qdq"
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


# --------------------------------------------------------------------------------------------
# Input-graph analysis: why did ORT leave a heavy op in float?
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Reason:
    text: str
    rule: str | None
    detail: str


def _dq_of(value: ir.Value | None) -> ir.Node | None:
    """The DequantizeLinear producing ``value`` (looking through a Transpose/Reshape of a weight)."""
    producer = value.producer() if value is not None else None
    if producer is not None and producer.op_type in ("Transpose", "Reshape") and producer.domain in ("", "ai.onnx"):
        producer = _input(producer, 0).producer() if _input(producer, 0) is not None else None
    return producer if _qdq.is_dequantize(producer) else None


def _consumer_count(value: ir.Value) -> int:
    """Nodes that finally read the float tensor behind quantized ``value`` (through its DQs)."""
    count = 1 if value.is_graph_output() else 0
    for node, _ in value.uses():
        if _qdq.is_dequantize(node):
            out = node.outputs[0]
            count += len(list(out.uses())) + (1 if out.is_graph_output() else 0)
        else:
            count += 1
    return count


def _output_quantizer(node: ir.Node) -> tuple[ir.Node | None, ir.Node | None, list[ir.Node]]:
    """(activation between op and Q, the Q, every consumer of the op's output)."""
    output = node.outputs[0]
    users = [use[0] for use in output.uses()]
    if len(users) != 1:
        return None, None, users
    user = users[0]
    if _qdq.is_quantize(user):
        return None, user, users
    after = [use[0] for use in user.outputs[0].uses()] if user.outputs else []
    if len(after) == 1 and _qdq.is_quantize(after[0]) and not user.outputs[0].is_graph_output():
        return user, after[0], users
    return user, None, users


def _params(node: ir.Node | None) -> _qdq.QuantParams | None:
    return _qdq.quant_params(node) if node is not None else None


def _type_name(params: _qdq.QuantParams) -> str:
    return params.dtype.name.lower()


def _weight_and_input(node: ir.Node) -> tuple[int, int]:
    """(activation index, weight index): for MatMul the weight is the side with a constant behind its DQ."""
    if node.op_type == "MatMul":
        dq0 = _dq_of(_input(node, 0))
        if dq0 is not None and _input(dq0, 0) is not None and _input(dq0, 0).is_initializer():
            return 1, 0
    return 0, 1


def _effective_dtype(dq_or_q: ir.Node, quantized: ir.Value) -> tuple[ir.DataType, str | None]:
    """dtype ORT ends up with on x86 and, for int8, why QDQS8ToU8 could not convert it."""
    params = _qdq.quant_params(dq_or_q)
    if params is None:
        return ir.DataType.UNDEFINED, None
    if params.dtype != ir.DataType.INT8:
        return params.dtype, None
    producer = quantized.producer()
    fanout = _consumer_count(quantized)
    if fanout > 1:
        return ir.DataType.INT8, "fanout"
    if not _qdq.is_quantize(producer):
        return ir.DataType.INT8, "noq"
    return ir.DataType.UINT8, None


def _check_missing(node: ir.Node, x_dq, w_dq, activation, out_q, users) -> list[_Reason]:
    """Inputs without DequantizeLinear, and an output without QuantizeLinear where ORT needs one."""
    x_i, w_i = _weight_and_input(node)
    missing = []
    if x_dq is None:
        missing.append(f"input {_input(node, x_i).name!r} has no DequantizeLinear")
    if w_dq is None:
        missing.append(f"weight {_input(node, w_i).name!r} has no DequantizeLinear")
    w_p = _params(w_dq)
    if (x_dq is None and w_dq is None and node.op_type == "MatMul"
            and not any(_qdq.const_array(v) is not None for v in node.inputs[:2])):
        # attention scores/context: quantize()'s weighted plan leaves them float on purpose
        detail = ("both operands are computed tensors (attention scores or context); quantize() keeps them "
                  "float: int8 measured slower on ORT CPU (kenosis_rewrite.plan)")
        return [_Reason(R_ACTIVATION_PRODUCT, None, detail)]
    if x_dq is None and w_p is not None and w_p.dtype not in _qdq.EIGHT_BIT and node.op_type == "MatMul":
        missing = []  # weight-only quantization: a float input is expected
        detail = f"{w_p.describe()} weight with a float input was not fused into MatMulNBits"
        reasons = [_Reason(R_WEIGHT_ONLY, None, detail)]
    else:
        detail = "; ".join(missing) + " (not quantized by the quantizer)"
        reasons = [_Reason(R_MISSING, None, detail)] if missing else []
    output = node.outputs[0]
    if output.is_graph_output() and node.op_type not in FLOAT_OUTPUT_OK:
        detail = f"{output.name!r} is a graph output; ORT never fuses an op producing one"
        reasons.append(_Reason(R_GRAPH_OUTPUT, None, detail))
    elif out_q is None:
        reasons.extend(_output_without_q(node, activation, users))
    return reasons


def _output_without_q(node: ir.Node, activation: ir.Node | None, users: list[ir.Node]) -> list[_Reason]:
    """Why the op's output reaches no QuantizeLinear (MatMul/Gemm may legally end in float)."""
    output = node.outputs[0]
    if activation is not None and activation.outputs and activation.outputs[0].is_graph_output():
        detail = f"{activation.op_type} output {activation.outputs[0].name!r} is a graph output"
        return [_Reason(R_GRAPH_OUTPUT, None, detail)]
    if node.op_type in FLOAT_OUTPUT_OK:
        return []
    if len(users) > 1:
        names = ", ".join(sorted(u.op_type for u in users))
        detail = f"output {output.name!r} is read by {len(users)} ops ({names}) without a QuantizeLinear"
        return [_Reason(R_MISSING, None, detail)]
    if activation is not None and activation.op_type not in ABSORBABLE_ACTIVATIONS:
        return [_Reason(R_ACTIVATION, None,
                        f"{activation.op_type} follows the op with no QuantizeLinear in between; ORT only absorbs "
                        "Relu/Clip (quantize the op output: Q/DQ before the activation)")]
    return [_Reason(R_MISSING, None, f"output {output.name!r} has no QuantizeLinear")]


def _check_types(x_p, w_p, y_p) -> list[_Reason]:
    """Non-8-bit or blocked activation/weight Q/DQ: no ORT CPU kernel takes them."""
    bad = []
    for role, params in (("input", x_p), ("weight", w_p), ("output", y_p)):
        if params is not None and params.dtype not in _qdq.EIGHT_BIT:
            bad.append(f"{role} {_type_name(params)}")
        elif params is not None and params.block_size:
            bad.append(f"{role} blocked (block_size={params.block_size})")
    if not bad:
        return []
    return [_Reason(R_UNSUPPORTED_TYPE, None, ", ".join(bad) + " (ORT CPU fuses only 8-bit Q/DQ)")]


def _check_int8(x_dq, x_eff, out_q, y_eff) -> list[_Reason]:
    reasons = []
    for role, node, (dtype, why) in (("input", x_dq, x_eff), ("output", out_q, y_eff)):
        if node is None or dtype != ir.DataType.INT8:
            continue
        tensor = _input(node, 0) if role == "input" else node.outputs[0]
        if why == "fanout":
            reasons.append(_Reason(R_FANOUT, RULE_U8,
                                   f"int8 {role} {tensor.name!r} is read by {_consumer_count(tensor)} ops, so "
                                   "ORT's QDQS8ToU8 leaves it int8 and its producer and consumers run float"))
        else:
            reasons.append(_Reason(R_INT8_NO_Q, RULE_U8,
                                   f"int8 {role} {tensor.name!r} has no QuantizeLinear ORT could convert to uint8"))
    return reasons


def _check_activation(activation: ir.Node | None, out_q: ir.Node | None, y_p) -> list[_Reason]:
    """An op -> activation -> Q chain ORT cannot fuse (zp != qmin, Clip range too narrow, other activation)."""
    if activation is None or out_q is None:
        return []
    if activation.op_type not in ABSORBABLE_ACTIVATIONS:
        return [_Reason(R_ACTIVATION, None,
                        f"{activation.op_type} between the op and its QuantizeLinear: ORT only absorbs Relu/Clip "
                        "(keep a Q/DQ pair before the activation)")]
    if y_p is None or not y_p.is_per_tensor or y_p.dtype not in _qdq.EIGHT_BIT:
        return []
    zp, scale = y_p.scalar_zero_point, y_p.scalar_scale
    rule = RULE_FOLD[activation.op_type]
    if activation.op_type == "Relu":
        if zp != y_p.qmin:
            return [_Reason(R_ZP_NOT_QMIN, rule, f"Relu -> Q with zero point {zp}, ORT drops Relu only at {y_p.qmin}")]
        return []
    if value_range.absorbed_by_quantizer(activation, y_p):
        return []
    return [_Reason(R_ZP_NOT_QMIN, rule,
                    f"{activation.op_type}{value_range.activation_bounds(activation)} -> Q(s={scale:.6g}, zp={zp}) is not "
                    "redundant: ORT drops Clip only when the Q range lies inside the Clip bounds")]


def _check_dtype(x_eff, y_eff, x_p, y_p) -> list[_Reason]:
    x_dtype, y_dtype = x_eff[0], y_eff[0]
    if x_p is None or y_p is None or ir.DataType.INT8 in (x_dtype, y_dtype) or x_dtype == y_dtype:
        return []
    return [_Reason(R_DTYPE, None, f"input is {x_dtype.name.lower()} but output is {y_dtype.name.lower()}; "
                                   "ORT needs the same activation type on both sides")]


def _check_bias(node: ir.Node, x_p, w_p) -> list[_Reason]:
    bias = _input(node, 2) if node.op_type in ("Conv", "Gemm", "ConvTranspose") else None
    if bias is None or x_p is None or w_p is None:
        return []
    b_dq = _dq_of(bias)
    if b_dq is None:  # ORT's WeightBiasQuantization quantizes a float bias itself (measured)
        return []
    b_p = _qdq.quant_params(b_dq)
    if b_p is None or b_p.dtype != ir.DataType.INT32:
        return []
    expected = np.asarray(x_p.scale, np.float64).reshape(-1) * np.asarray(w_p.scale, np.float64).reshape(-1)
    actual = np.asarray(b_p.scale, np.float64).reshape(-1)
    if actual.size not in (1, expected.size) and expected.size != 1:
        return []
    if np.allclose(actual, expected, rtol=BIAS_RTOL, atol=0.0):
        return []
    return [_Reason(R_STALE_BIAS, RULE_STALE_BIAS,
                    f"bias scale {actual.reshape(-1)[0]:.6g} != input scale x weight scale "
                    f"{expected.reshape(-1)[0]:.6g}")]


def _check_per_axis(x_p, y_p) -> list[_Reason]:
    """Per-axis activation Q/DQ (measured: the Conv stays float); per-channel *weights* are fine."""
    reasons = []
    for role, params in (("input", x_p), ("output", y_p)):
        if params is not None and not params.is_per_tensor:
            detail = f"{role} is quantized per axis; ORT needs scalar activation parameters"
            reasons.append(_Reason(R_PER_AXIS_ACTIVATION, None, detail))
    return reasons


def explain_float_op(node: ir.Node) -> list[_Reason]:
    """Every reason found in the input graph why ORT CPU would run heavy ``node`` in float, most likely first."""
    x_i, w_i = _weight_and_input(node)
    x_dq, w_dq = _dq_of(_input(node, x_i)), _dq_of(_input(node, w_i))
    activation, out_q, users = _output_quantizer(node)
    reasons = _check_missing(node, x_dq, w_dq, activation, out_q, users)
    x_p, w_p, y_p = _params(x_dq), _params(w_dq), _params(out_q)
    reasons += _check_types(x_p, w_p, y_p)
    if any(r.text in (R_UNSUPPORTED_TYPE, R_WEIGHT_ONLY) for r in reasons):
        return _dedupe(reasons)
    x_eff = _effective_dtype(x_dq, _input(x_dq, 0)) if x_dq is not None else (ir.DataType.UNDEFINED, None)
    y_eff = _effective_dtype(out_q, out_q.outputs[0]) if out_q is not None else (ir.DataType.UNDEFINED, None)
    reasons += _check_int8(x_dq, x_eff, out_q, y_eff)
    reasons += _check_activation(activation, out_q, y_p)
    reasons += _check_dtype(x_eff, y_eff, x_p, y_p)
    reasons += _check_bias(node, x_p, w_p)
    reasons += _check_per_axis(x_p, y_p)
    if node.op_type in NO_QDQ_FUSION_OPS and x_dq is not None and w_dq is not None:
        reasons.append(_Reason(R_NO_KERNEL, None, f"ORT CPU has no QLinear{node.op_type} fusion; it runs float"))
    return _dedupe(reasons) or [_Reason(R_UNKNOWN, None, "no known blocker found in the input graph")]


def _dedupe(reasons: list[_Reason]) -> list[_Reason]:
    seen, unique = set(), []
    for reason in reasons:
        if (reason.text, reason.detail) not in seen:
            seen.add((reason.text, reason.detail))
            unique.append(reason)
    return unique


# --------------------------------------------------------------------------------------------
# Islands: reasons from the input graph
# --------------------------------------------------------------------------------------------


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
    for i, node in enumerate(graph.node):
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
                   heavy: Sequence[HeavyOp], int8_edge: bool, bounded: bool) -> tuple[str | None, str | None]:
    """What a float island is made of and which rule removes it (None when it should stay)."""
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
    missing = sorted(set(op_types) & NO_INTEGER_KERNEL_ACTIVATIONS)
    if missing:
        return f"no integer kernel for {', '.join(missing)} on ORT CPU (keep the island)", None
    if kind == "requantize":
        for name in names:
            node = input_nodes.get(name)
            if _qdq.is_dequantize(node):
                after = [use[0].op_type for use in node.outputs[0].uses()]
                for op_type in ABSORBABLE_ACTIVATIONS:
                    if op_type in after:
                        return f"requantize pair left after ORT removed a {op_type}", RULE_FOLD[op_type]
        return "DQ -> Q round trip (requantize or layout change between quantized ops)", None
    return None, None


def _build_islands(graph: onnx.GraphProto, ops: list[HeavyOp], matched: dict[str, str],
                   input_nodes: dict[str, ir.Node]) -> list[FloatIsland]:
    by_opt_name = collections.defaultdict(list)
    for op in ops:
        if op.name in matched:
            by_opt_name[matched[op.name]].append(op)
    islands, seen = [], set()
    for group in _float_islands(graph):
        nodes = tuple(graph.node[i].name for i in group)
        if nodes in seen:
            continue
        seen.add(nodes)
        op_types = tuple(graph.node[i].op_type for i in group)
        kind = "compute" if set(op_types) - TRIVIAL_OPS - QDQ_OPS else "requantize"
        heavy = [op for name in nodes for op in by_opt_name.get(name, [])]
        reason, rule = _island_reason(op_types, nodes, kind, input_nodes, heavy, _int8_boundary(graph, group),
                                      kind == "requantize" or _between_dq_and_q(graph, group))
        islands.append(FloatIsland(nodes, op_types, tuple(op.name for op in heavy), kind, reason, rule))
    return islands


# --------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------


def _heavy_nodes(model: ir.Model) -> list[ir.Node]:
    return [node for node in model.graph if node.op_type in HEAVY_OPS]


def _integer_warning(node: ir.Node) -> str | None:
    """A problem ORT fused anyway: a Gemm with a stale int32 bias scale runs with wrong numerics (measured)."""
    if node.op_type not in FLOAT_HEAVY_OPS:
        return None
    x_i, w_i = _weight_and_input(node)
    stale = _check_bias(node, _params(_dq_of(_input(node, x_i))), _params(_dq_of(_input(node, w_i))))
    if not stale:
        return None
    return f"{R_STALE_BIAS} (fused anyway, numerics off: {stale[0].detail}) -> fix: {RULE_STALE_BIAS}"


def _classify(node: ir.Node, optimized: Sequence[onnx.NodeProto]) -> tuple[HeavyOp, onnx.NodeProto | None]:
    match = match_optimized(node, optimized)
    name = node.name or (node.outputs[0].name or node.op_type)
    macs = heavy_op_macs(node)
    if node.op_type in INTEGER_KERNELS or (match is not None and match.op_type in INTEGER_KERNELS):
        label = _label(match) if match is not None else node.op_type
        return HeavyOp(name, node.op_type, macs, "integer", label, warning=_integer_warning(node)), match
    reasons = explain_float_op(node)
    first = reasons[0]
    return HeavyOp(
        name, node.op_type, macs, "float", _label(match) if match is not None else None,
        first.text, first.rule, first.detail, tuple(r.text for r in reasons[1:]),
    ), match


def explain(model: _io.ModelLike, *, threads: int = 1) -> FusionReport:
    """Report which heavy ops of ``model`` ORT CPU runs in integer kernels, and why the others are float.

    ``model`` is a path, an onnx.ModelProto or an onnx_ir.Model (QDQ, QOperator or float). Raises a
    ``KenosisError`` subclass for input that is not an ONNX model, and ``RuntimeMeasurementError``
    when ONNX Runtime cannot build a session for it.
    """
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    loaded = _io.load(model, require_qdq=False, lazy=True)
    with tempfile.TemporaryDirectory(prefix="kenosis_explain_") as directory:
        optimized = optimized_graph(loaded.model, directory, threads, source=loaded.path)
        shaped = _with_shapes(loaded.model)
        nodes = list(optimized.graph.node)
        ops, matched = [], {}
        for node in _heavy_nodes(shaped):
            op, match = _classify(node, nodes)
            ops.append(op)
            if match is not None:
                matched[op.name] = match.name
        input_nodes = {node.name: node for node in shaped.graph if node.name}
        islands = _build_islands(optimized.graph, ops, matched, input_nodes)
    counts = collections.Counter(_label(node) for node in nodes)
    return FusionReport(ops=ops, float_islands=islands, optimized_op_counts=counts)

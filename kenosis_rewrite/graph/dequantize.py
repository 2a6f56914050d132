"""Return parts of a QDQ model to float: the moves the latency placement chooses from.

Two transformations:

* **Dequantize constants** of a node: ``DQ(w_q; s, z) -> Op`` ==> ``w -> Op`` with
  ``w = (w_q - z) * s`` computed once, in float32, as the DequantizeLinear would at run time. ORT
  does not constant-fold a weight's DequantizeLinear, and without its DQ the op cannot be fused
  into an integer kernel: it runs float, on the very weight values the QDQ graph described.
* **Remove an activation Q/DQ pair**: ``x -> Q -> DQ -> consumers`` ==> ``x -> consumers``. The
  consumers read ``x`` instead of its rounded copy. When the zero point is qmin the Q's clamp at
  0 may be a Relu/Clip that quantize_static deleted, so ``Clip(x, 0, top of range)`` replaces it
  (a Clip that ORT fuses into a float Conv).

Removing quantization steps lowers the error on average, not for every input: the remaining
roundings move with it.

A heavy op returned to float (``to_float``) gets both: its weights dequantized, and the Q/DQ pairs
that connect it to neighbours with no integer kernel removed (a pair next to an integer kernel is
what that kernel needs, so it stays). ``DequantizeAllPass`` applies this to the whole graph,
giving the float model the QDQ model describes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.graph.pass_base import remove_unused_nodes

RULE_NAME = "return-to-float"

# Ops ORT CPU can run on quantized tensors (QDQ selectors, ort-cpu-facts.md §2): a Q/DQ pair that
# feeds one of them is kept, unless that op itself is being returned to float.
INTEGER_CAPABLE_OPS = frozenset(
    {
        "Conv", "ConvTranspose", "MatMul", "Gemm", "Add", "Mul", "Concat", "MaxPool", "AveragePool",
        "GlobalAveragePool", "GlobalMaxPool", "LeakyRelu", "Sigmoid", "Softmax", "Relu", "Clip",
        "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Gather", "Resize", "Split",
        "Pad", "Where", "ArgMax", "ReduceMax", "ReduceMin", "DepthToSpace", "SpaceToDepth", "Expand",
        "Tile", "Identity", "InstanceNormalization", "LayerNormalization",
    }
)


def _float_constant(graph: ir.Graph, value: ir.Value | None, cache: dict[int, ir.Value], names: qdq_params.NameAllocator,
                    default: str) -> ir.Value | None:
    """The float initializer equal to ``value`` when a DequantizeLinear of constants (not blocked: that
    is MatMulNBits territory) produces it, made once per value (``cache``); None otherwise."""
    producer = value.producer() if value is not None else None
    if not qdq_params.is_dequantize(producer) or qdq_params.const_array(producer.inputs[0]) is None:
        return None
    params = qdq_params.quant_params(producer)
    if params is None or params.block_size:
        return None
    if id(value) not in cache:
        array = qdq_params.dequantize_array(qdq_params.const_array(producer.inputs[0]), params).astype(params.scale.dtype)
        name = names.fresh(f"{value.name or default}_float")
        cache[id(value)] = qdq_params.add_initializer(graph, ir.tensor(array, name=name), name)
    return cache[id(value)]


def dequantize_constants(node: ir.Node, graph: ir.Graph, cache: dict[int, ir.Value] | None = None,
                         names: qdq_params.NameAllocator | None = None) -> int:
    """Replace ``node``'s inputs that are DequantizeLinear of constants by float initializers.

    ``cache`` and ``names`` let a caller that dequantizes many nodes share the initializers made and
    one scan of the graph for fresh names."""
    cache = {} if cache is None else cache
    names = names or qdq_params.NameAllocator(graph)
    count = 0
    for index, value in enumerate(node.inputs):
        constant = _float_constant(graph, value, cache, names, "weight")
        if constant is not None:
            node.replace_input_with(index, constant)
            count += 1
    return count


def _forward_graph_output(graph: ir.Graph, dq: ir.Node, source: ir.Value, names: qdq_params.NameAllocator,
                          keep_readers: bool = False) -> None:
    """Replace graph output ``dq.outputs[0]`` by ``Identity(source)`` under the same name; the DQ's
    other readers read ``source`` too, or, with ``keep_readers``, still the DQ (renamed)."""
    old = dq.outputs[0]
    name, value_type, shape = old.name, old.type, old.shape
    identity = ir.Node("", "Identity", [source], name=names.fresh(f"{dq.name or name}_float"))
    graph.insert_after(dq, identity)
    for index, output in enumerate(graph.outputs):
        if output is old:
            graph.outputs[index] = identity.outputs[0]
    if keep_readers:
        old.name = names.fresh(f"{name}_quantized")
    else:
        old.replace_all_uses_with(identity.outputs[0])
        old.name = None
    identity.outputs[0].name = name
    identity.outputs[0].type, identity.outputs[0].shape = value_type, shape


def _existing_clamp(value: ir.Value, lo: float | None, hi: float | None) -> ir.Value | None:
    for user, _ in value.uses():
        if user.op_type in ("Relu", "Clip") and user.domain in qdq_params.DEFAULT_DOMAINS and \
                value_range.activation_bounds(user) == (lo, hi):
            return user.outputs[0]
    return None


def _pass_through_chain(value: ir.Value) -> list[ir.Node]:
    """The pass-through ops from a DequantizeLinear down to ``value`` (top first); empty when ``value``
    is not reached from a DQ only through such ops."""
    chain: list[ir.Node] = []
    producer = value.producer()
    while value_range.is_pass_through(producer) and not producer.inputs[0].is_graph_input():
        chain.insert(0, producer)
        producer = producer.inputs[0].producer()
    return chain if chain and qdq_params.is_dequantize(producer) else []


CLIP_INPUTS_OPSET = 11  # Clip's bounds are inputs from opset 11, attributes before


def _new_clamp(graph: ir.Graph, value: ir.Value, lo: float | None, hi: float | None, dtype, base: str,
               names: qdq_params.NameAllocator) -> ir.Node:
    name = names.fresh(f"{base}_clamp")
    if lo == 0.0 and hi is None:
        clamp = ir.Node("", "Relu", [value], name=name)
    elif graph.opset_imports.get("", CLIP_INPUTS_OPSET) < CLIP_INPUTS_OPSET:  # Clip-6: bounds as float attributes
        bounds = {key: float(bound) for key, bound in (("min", lo), ("max", hi)) if bound is not None}
        clamp = ir.Node("", "Clip", [value], attributes=[ir.AttrFloat32(key, bound) for key, bound in bounds.items()],
                        name=name)
    else:
        bounds: list[ir.Value | None] = []
        for bound, suffix in ((lo, "clip_min"), (hi, "clip_max")):
            if bound is None:
                bounds.append(None)
                continue
            bound_name = names.fresh(f"{base}_{suffix}")
            # a bound beyond the type's range (the grid of a tensor holding the type's extremes, an
            # attention mask's float32 minimum) becomes an infinity: no bound, as the Q's own clamp was there
            with np.errstate(over="ignore"):
                tensor = ir.tensor(np.asarray(bound, dtype=dtype), name=bound_name)
            bounds.append(qdq_params.add_initializer(graph, tensor, bound_name))
        while bounds and bounds[-1] is None:
            bounds.pop()
        clamp = ir.Node("", "Clip", [value, *bounds], name=name)
    clamp.outputs[0].name = names.fresh(f"{base}_clamped")
    return clamp


def insert_clamp(graph: ir.Graph, value: ir.Value, lo: float | None, hi: float | None, dtype, base: str, reader: ir.Node,
                 names: qdq_params.NameAllocator | None = None) -> ir.Value:
    """Clamp ``value`` for ``reader``: ``Relu`` for ``(0, None)``, else ``Clip(lo, hi)``; returns the
    value ``reader`` must read instead of ``value``.

    When ``value`` comes from a DequantizeLinear through pass-through ops only, the clamp goes right
    after the DQ and the pass-through ops are repeated after it: a clamp commutes with ops that only
    move values, and ``DQ -> Reshape -> Clip`` is a form ORT x86 breaks (its QDQ propagation puts a
    Q/DQ pair after an int8 ``DQ -> Reshape`` that a float op reads, then retypes it to uint8
    inconsistently, and refuses the model: output_dtype INT8 vs a uint8 zero point). An identical
    clamp already reading the value is reused: dedicated Q/DQ pairs of one tensor share one clamp.
    ``names``: the caller's allocator of fresh names, when it names more in the same graph.
    """
    names = names or qdq_params.NameAllocator(graph)
    chain = _pass_through_chain(value)
    site = chain[0].inputs[0] if chain else value
    clamped = _existing_clamp(site, lo, hi)
    anchor = chain[0] if chain else reader
    if clamped is None:
        clamp = _new_clamp(graph, site, lo, hi, dtype, base, names)
        graph.insert_before(anchor, clamp)
        clamped = clamp.outputs[0]
    for op in chain:  # the same data movement, on the clamped values
        copy = ir.Node(op.domain, op.op_type, [clamped, *op.inputs[1:]], attributes=list(op.attributes.values()),
                       num_outputs=1, name=names.fresh(f"{op.name or op.op_type}_clamped"))
        copy.outputs[0].name = names.fresh(f"{op.outputs[0].name or base}_clamped")
        graph.insert_before(anchor, copy)
        clamped = copy.outputs[0]
    return clamped


IMPLIED = "implied"


def remove_qdq_pair(quantize: ir.Node, clamp: tuple[float | None, float | None] | str | None = IMPLIED,
                   names: qdq_params.NameAllocator | None = None, outputs_only: bool = False) -> bool:
    """Let the DQ consumers of ``quantize`` read its float input directly; False if not possible.

    The Q's clamp may stand for an activation quantize_static deleted; the float value then needs
    that clamp back. ``clamp`` says which: ``IMPLIED`` (default) takes what the graph proves
    (:func:`value_range.implied_clamp`: ``Clip(0, top of range)`` after a deleted Relu/Clip(0, M),
    or a bound that provably cuts reachable values), not when the Q's input cannot be negative
    (HardSigmoid, Softmax, a pooled Relu: the clamp at the calibrated maximum is then a quantization
    artifact the float model does not have); a ``(lo, hi)`` pair is a clamp the caller knows the Q
    stood for (e.g. from the float model); None restores nothing. A DQ whose output is a graph
    output becomes an Identity of the float input (names stay). Per-axis or non-constant
    activation parameters are left alone. ``names``: as for :func:`insert_clamp`. ``outputs_only``:
    only graph outputs take the float value; every other reader of the DQs still reads them (a
    protected output that a Conv/MatMul also reads must not make that op float).
    """
    output = quantize.outputs[0]
    dequantizers = qdq_params.dequantize_consumers(output)
    params = qdq_params.quant_params(quantize)
    if output.is_graph_output() or not dequantizers or params is None or not params.is_per_tensor:
        return False
    if clamp == IMPLIED:
        clamp = value_range.implied_clamp(quantize)
    source, graph = quantize.inputs[0], quantize.graph
    names = names or qdq_params.NameAllocator(graph)
    if clamp is not None:
        source = insert_clamp(graph, source, *clamp, params.scale.dtype, source.name or "activation", quantize, names)
    for dq in dequantizers:
        if dq.outputs[0].is_graph_output():
            _forward_graph_output(graph, dq, source, names, keep_readers=outputs_only)
        elif not outputs_only:
            dq.outputs[0].replace_all_uses_with(source)
    return True


def _feeds_only(dequantizers: Iterable[ir.Node], allowed) -> bool:
    return all(allowed(user) for dq in dequantizers for user, _ in dq.outputs[0].uses())


def _is_float_side(node: ir.Node | None, float_nodes: set[int]) -> bool:
    """True when ``node`` runs float anyway: returned to float, or no integer kernel for it.

    ``None`` (no producer: a graph input or a constant) is float by nature.
    """
    if node is None:
        return True
    return id(node) in float_nodes or node.op_type not in INTEGER_CAPABLE_OPS


def to_float(node: ir.Node, graph: ir.Graph, float_nodes: set[int], names: qdq_params.NameAllocator | None = None) -> int:
    """Return heavy op ``node`` to float; returns the number of Q/DQ pairs removed."""
    names = names or qdq_params.NameAllocator(graph)
    float_nodes.add(id(node))
    dequantize_constants(node, graph, names=names)
    removed = 0
    # Output side: node -> Q -> DQ -> consumers that run float anyway.
    for user, _ in list(node.outputs[0].uses()):
        if qdq_params.is_quantize(user):
            dequantizers = qdq_params.dequantize_consumers(user.outputs[0]) or []
            if _feeds_only(dequantizers, lambda c: _is_float_side(c, float_nodes)) and remove_qdq_pair(user, names=names):
                removed += 1
    # Input side: producer that runs float -> Q -> DQ -> node (and only float consumers).
    for value in list(node.inputs[:1]):
        dq = value.producer() if value is not None else None
        if not qdq_params.is_dequantize(dq) or not qdq_params.is_quantize(dq.inputs[0].producer()):
            continue
        quantize = dq.inputs[0].producer()
        source = quantize.inputs[0].producer()
        dequantizers = qdq_params.dequantize_consumers(quantize.outputs[0]) or []
        if _is_float_side(source, float_nodes) and _feeds_only(dequantizers, lambda c: _is_float_side(c, float_nodes)):
            removed += int(remove_qdq_pair(quantize, names=names))
    return removed


# ORT (WeightBiasQuantization, 1.20+) quantizes the float weight of these ops back to per-tensor
# int8 whenever their input comes from a per-tensor DequantizeLinear, and fuses them again.
_REQUANTIZED_BY_ORT = frozenset({"Conv", "ConvTranspose", "Gemm"})


def _reads_dequantized_input(node: ir.Node) -> ir.Node | None:
    """The per-tensor DQ that feeds ``node``'s data input, if any."""
    dq = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
    if not qdq_params.is_dequantize(dq):
        return None
    params = qdq_params.quant_params(dq)
    return dq if params is None or params.is_per_tensor else None


def _float_source_readable(quantize: ir.Node | None, float_nodes: set[int]) -> bool:
    """Can a float consumer read the Q's input directly without turning an integer heavy op float?"""
    if not qdq_params.is_quantize(quantize):
        return False
    source = quantize.inputs[0].producer()
    if qdq_params.is_dequantize(source):
        return False  # a requantization chain: no float value of its own to read
    # the float output of an integer Conv/MatMul does not exist in ORT's fused graph
    return _is_float_side(source, float_nodes) or source.op_type not in op_tables.WEIGHTED_OPS


def _keep_float_for_ort(node: ir.Node, original_inputs: list[ir.Value | None], float_nodes: set[int]) -> str:
    """Make sure ORT really runs ``node`` (weights now float) in float; returns "", or why it cannot.

    A Conv/Gemm whose input still comes from a DQ (kept for integer neighbours) would get its float
    weight requantized by ORT, per tensor, and fused again: instead it reads the float value before
    that Q/DQ pair when that value exists anyway; otherwise its quantized weights come back.
    """
    dq = _reads_dequantized_input(node)
    if node.op_type not in _REQUANTIZED_BY_ORT or dq is None:
        return ""
    quantize = dq.inputs[0].producer()
    if _float_source_readable(quantize, float_nodes):
        node.replace_input_with(0, quantize.inputs[0])
        return ""
    for index, value in enumerate(original_inputs):
        if node.inputs[index] is not value:
            node.replace_input_with(index, value)
    if not any(qdq_params.is_quantize(user) for user, _ in node.outputs[0].uses()):
        return ""  # DQ -> Conv with no Q after it: ORT runs it float, on the weights' DQ
    float_nodes.discard(id(node))
    return "its input is the quantized output of an integer layer, and ORT requantizes a float Conv fed by a DQ"


class FloatRegionsPass(ir.passes.InPlacePass):
    """Return the named heavy ops (and the Q/DQ pairs that only served them) to float."""

    def __init__(self, names: Iterable[str], report: FixReport | None = None, gains: dict[str, str] | None = None):
        super().__init__()
        self.names = list(names)
        self.report = report
        self.gains = gains or {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        wanted = set(self.names)
        chosen = [n for n in model.graph if n.name in wanted and n.op_type in op_tables.WEIGHTED_OPS]
        # all of them float from the start: a pair shared by two float layers goes, whatever their order
        float_nodes: set[int] = {id(node) for node in chosen}
        names = qdq_params.NameAllocator(model.graph)
        changed = False
        for node in chosen:
            original_inputs = list(node.inputs)
            removed = to_float(node, model.graph, float_nodes, names)
            refusal = _keep_float_for_ort(node, original_inputs, float_nodes)
            changed = True
            if self.report is None:
                continue
            if refusal:
                self.report.refused(RULE_NAME, node.name, f"stays integer: {refusal}")
                continue
            detail = f"runs float; {removed} Q/DQ pair(s) removed"
            if node.name in self.gains:
                detail += f"; {self.gains[node.name]}"
            self.report.changed(RULE_NAME, node.name, detail, exact=removed == 0)
        remove_unused_nodes(model, changed)
        return ir.passes.PassResult(model, modified=changed)


class DequantizeAllPass(ir.passes.InPlacePass):
    """Remove every activation Q/DQ pair and dequantize every constant: the QDQ model in float."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        cache: dict[int, ir.Value] = {}
        names = qdq_params.NameAllocator(graph)
        changed = False
        for node in list(graph):
            if not (qdq_params.is_quantize(node) or qdq_params.is_dequantize(node)):
                changed |= dequantize_constants(node, graph, cache, names) > 0
        for node in list(graph):
            if qdq_params.is_quantize(node):
                changed |= remove_qdq_pair(node, names=names)
        remove_unused_nodes(model, changed)
        return ir.passes.PassResult(model, modified=changed)


class DequantizeBiasPass(ir.passes.InPlacePass):
    """Biases of Conv/ConvTranspose/Gemm as float constants (TensorRT keeps biases in float).

    Exact: the float bias is the value the int32 bias's DequantizeLinear produced.
    """

    rule_name = "float-bias"

    def __init__(self, report: FixReport | None = None):
        super().__init__()
        self.report = report

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, cache, modified = model.graph, {}, False
        names = qdq_params.NameAllocator(graph)
        for node in list(graph):
            if node.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(node.inputs) < 3 or node.inputs[2] is None:
                continue
            constant = _float_constant(graph, node.inputs[2], cache, names, "bias")
            if constant is None:
                continue
            node.replace_input_with(2, constant)
            modified = True
            if self.report is not None:
                self.report.changed(self.rule_name, node.name or node.op_type, "int32 bias -> float", exact=True)
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified=modified)

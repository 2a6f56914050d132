"""``quantize_weights()``: weight-only block quantization of MatMul/Gemm weights for ONNX Runtime.

Transformers and LLMs are quantized weight-only: the activations stay float and each constant
weight ``W[K, N]`` of a MatMul becomes blocked integers behind a ``DequantizeLinear``::

    MatMul(A, W)  ==>  MatMul(A, DequantizeLinear(Wq[K, N], scale[ceil(K/bs), N] (, zp), axis=0, block_size=bs))

ONNX Runtime's CPU EP fuses that into ``com.microsoft.MatMulNBits`` (a 4/8-bit kernel that never
materialises the float weight) when its selector ``DQMatMulToMatMulNBits`` accepts it. Measured on
onnxruntime 1.31.1 (see :mod:`kenosis_rewrite.placement.rules.matmul_nbits` for the rules that repair models
that miss it), the DQ must: be blocked along axis 0 of a 2-D constant weight, with a power-of-two
``block_size`` from 16 to 256; be 4-bit (int4/uint4) or 8-bit (int8/uint8); have float or float16 scales of the
MatMul's type; feed exactly one MatMul, and its quantized weight must be read by that DQ only;
and the MatMul's output must not reach a Relu or Clip, directly or through one Add (ORT then leaves
it a float MatMul or FusedGemm). This module emits exactly that form, for 2-D and 3-D activations,
with or without a bias, whatever follows (but for a 2-D MatMul plus a residual without a bias: see
:mod:`kenosis_rewrite.weight_only.activation_form`):

* one DequantizeLinear and one private copy of the quantized initializers per MatMul (a weight read
  by several MatMuls is quantized once and copied);
* ``Gemm(A, B, C, alpha, beta, transB)`` with ``transA = 0`` becomes ``MatMul(A, DQ(alpha * B'))`` plus
  ``Add(beta * C)``;
* scales in the weight's own float type (float32 or float16);
* a Relu or Clip after a rewritten MatMul (directly or through an Add) becomes ``Max``/``Min``, the same
  values for every non-NaN input (:mod:`kenosis_rewrite.weight_only.activation_form`).

Quantization: round-to-nearest, ties to even (``np.rint``, as ONNX QuantizeLinear), per block of
``block_size`` rows of ``W``. Symmetric: int4 in [-8, 7] (int8 in [-128, 127]), zero point 0.
Asymmetric: uint4 (uint8) with a per-block zero point. The scale of each block is chosen by a small
grid search over clipping ratios that minimises the block's squared error (``scale_search=True``);
plain absmax RTN loses about 1.5 dB SQNR per layer more, which over a stack of layers drops the
output cosine below 0.99 (shared research, ort-cpu-facts.md, appendix). The numerics are in
:mod:`kenosis_rewrite.weight_only.blockwise`.

Memory: a path to a model over 256 MiB of external data is read lazily (onnx-ir, memory-mapped);
each weight is read, quantized and unmapped in turn, and the 4-bit output is held packed two
values per byte, so the peak is about the output plus one weight. A model over 2 GB never becomes
one protobuf (see ``Returns`` below).

Opsets: block quantization and int4 need DequantizeLinear-21. ``form`` picks the output:

* ``"qdq"``: standard ONNX. A model below opset 21 is converted to opset 21 with
  ``onnx.version_converter`` (so the other ops are upgraded correctly, not just relabelled), and
  the IR version raised to 10. This happens in the *output* only; a conversion failure raises.
* ``"matmul_nbits"``: ``com.microsoft.MatMulNBits`` directly, at the model's own opset, for runtimes
  without the fusion (ORT before 1.20 and the EPs that lack the selector).
* ``"auto"`` (default): ``"qdq"`` from opset 21 on, ``"matmul_nbits"`` below it, so no existing op
  changes meaning.

The input model is never modified; the output passes ``onnx.checker`` with ``full_check``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import common as common_passes

from kenosis_rewrite.core import model_io
from kenosis_rewrite.errors import KenosisError, ModelTooLargeError, RewriteError
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.weight_only import activation_form
from kenosis_rewrite.weight_only.blockwise import BlockQuantized, dequantize_blockwise, pack_matmul_nbits, quantize_blockwise

__all__ = [
    "BlockQuantized", "quantize_weights", "quantize_blockwise", "dequantize_blockwise",
    "pack_matmul_nbits", "toy_transformer", "FORMS",
]

FORMS = ("auto", "qdq", "matmul_nbits")
QDQ_MIN_OPSET = 21
QDQ_MIN_IR_VERSION = 10
MSFT_DOMAIN = "com.microsoft"
_FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


# --------------------------------------------------------------------------------------------
# Graph editing
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """One MatMul/Gemm to quantize: its node, the effective ``W[K, N]`` and what follows."""

    node: ir.Node
    weight: np.ndarray  # [K, N] in the model's float type (alpha and transB applied)
    bias: ir.Value | None  # Gemm's C
    beta: float


def _weight_key(node: ir.Node) -> str:
    return node.inputs[1].name or ""


def _excluded(node: ir.Node, exclude) -> bool:
    if callable(exclude):
        return bool(exclude(node))
    names = set(exclude)
    return node.name in names or _weight_key(node) in names


def _reads_dequantize(value: ir.Value | None) -> bool:
    return value is not None and qdq_params.is_dequantize(value.producer())


def _candidate_or_none(node: ir.Node, op_types, exclude, block_size: int) -> _Candidate | None:
    """The weight of an eligible MatMul/Gemm (constant, 2-D, float, K >= block_size), else None."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in op_types or len(node.inputs) < 2:
        return None
    if _excluded(node, exclude) or _reads_dequantize(node.inputs[0]):
        return None  # an activation-quantized (QDQ) MatMul: not weight-only
    weight = qdq_params.const_array(node.inputs[1])
    if weight is None or weight.ndim != 2 or weight.dtype not in (np.float32, np.float16):
        return None
    bias, beta = None, 1.0
    if node.op_type == "Gemm":
        if node.attributes.get_int("transA", 0):
            return None
        if node.attributes.get_int("transB", 0):
            weight = weight.T
        alpha = node.attributes.get_float("alpha", 1.0)
        if alpha != 1.0:
            weight = (weight.astype(np.float32) * alpha).astype(weight.dtype)
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        beta = node.attributes.get_float("beta", 1.0)
    if weight.shape[0] < block_size:
        return None
    return _Candidate(node, np.ascontiguousarray(weight), bias, beta)


def _packed_4bit(values: np.ndarray, dtype: ir.DataType, name: str) -> ir.PackedTensor:
    """4-bit ``values`` (already in range) held two per byte, low nibble first, as ONNX stores them."""
    lo, hi = qdq_params.INTEGER_RANGES[dtype]
    if values.size and (values.min() < lo or values.max() > hi):
        raise ValueError(f"values out of range for {dtype.name}")
    flat = values.reshape(-1).view(np.uint8) if values.dtype in (np.int8, np.uint8) else values.reshape(-1).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    packed = (flat[0::2] & 0x0F) | ((flat[1::2] & 0x0F) << 4)
    return ir.PackedTensor(packed, dtype, shape=values.shape, name=name)


class _Builder:
    """Creates initializers and nodes of one graph with fresh names."""

    def __init__(self, graph: ir.Graph):
        self.graph = graph
        self.names = qdq_params.NameAllocator(graph)

    def initializer(self, array: np.ndarray, base: str, dtype: ir.DataType | None = None) -> ir.Value:
        name = self.names.fresh(base)
        if dtype in (ir.DataType.INT4, ir.DataType.UINT4):
            tensor = _packed_4bit(array, dtype, name)
        elif dtype is not None and dtype in qdq_params.INTEGER_RANGES and dtype not in qdq_params.EIGHT_BIT:
            tensor = qdq_params.integer_tensor(array, dtype, name)
        else:
            tensor = ir.tensor(array if dtype is None else array.astype(dtype.numpy()), name=name)
        return qdq_params.add_initializer(self.graph, tensor, name)

    def node(self, op_type: str, inputs, attributes: dict, base: str, domain: str = "") -> ir.Node:
        output = ir.Value(name=self.names.fresh(f"{base}_output"))
        return ir.node(op_type, inputs, attributes, domain=domain, name=self.names.fresh(base), outputs=[output])


def _dequantize_nodes(builder: _Builder, quantized: BlockQuantized, base: str) -> list[ir.Node]:
    data = builder.initializer(quantized.data, f"{base}_q{quantized.bits}", quantized.dtype)
    scale = builder.initializer(quantized.scale, f"{base}_scale")
    inputs = [data, scale]
    if quantized.zero_point is not None:
        inputs.append(builder.initializer(quantized.zero_point, f"{base}_zero_point", quantized.dtype))
    attributes = {"axis": 0, "block_size": quantized.block_size}
    return [builder.node("DequantizeLinear", inputs, attributes, f"{base}_DequantizeLinear")]


def _matmul_nbits_node(builder: _Builder, a: ir.Value, quantized: BlockQuantized, base: str,
                       accuracy_level: int | None) -> ir.Node:
    packed, scales, zero_points = pack_matmul_nbits(quantized)
    inputs = [a, builder.initializer(packed, f"{base}_nbits_B"), builder.initializer(scales, f"{base}_nbits_scales")]
    if zero_points is not None:
        inputs.append(builder.initializer(zero_points, f"{base}_nbits_zero_points"))
    k, n = quantized.data.shape
    attributes = {"K": k, "N": n, "bits": quantized.bits, "block_size": quantized.block_size}
    if accuracy_level:
        attributes["accuracy_level"] = accuracy_level
    return builder.node("MatMulNBits", inputs, attributes, f"{base}_MatMulNBits", domain=MSFT_DOMAIN)


def _bias_nodes(builder: _Builder, candidate: _Candidate, product: ir.Value, base: str) -> list[ir.Node]:
    """``product + beta * C`` for a Gemm with a bias (nothing for MatMul or a Gemm without C)."""
    if candidate.bias is None or candidate.beta == 0.0:
        return []
    bias = candidate.bias
    constant = qdq_params.const_array(bias)
    nodes = []
    if candidate.beta != 1.0 and constant is not None:
        bias = builder.initializer((constant.astype(np.float32) * candidate.beta).astype(constant.dtype), f"{base}_bias")
    elif candidate.beta != 1.0:
        beta = builder.initializer(np.asarray(candidate.beta, dtype=candidate.weight.dtype), f"{base}_beta")
        nodes.append(builder.node("Mul", [bias, beta], {}, f"{base}_beta_Mul"))
        bias = nodes[-1].outputs[0]
    nodes.append(builder.node("Add", [product, bias], {}, f"{base}_bias_Add"))
    return nodes


def _rewrite(builder: _Builder, candidate: _Candidate, quantized: BlockQuantized, form: str,
             accuracy_level: int | None) -> ir.Node:
    """Replace the candidate's node by its quantized form; returns the new MatMul (or MatMulNBits)."""
    node = candidate.node
    base = node.name or (node.outputs[0].name or node.op_type)
    a = node.inputs[0]
    if form == "matmul_nbits":
        new_nodes = [_matmul_nbits_node(builder, a, quantized, base, accuracy_level)]
    else:
        new_nodes = _dequantize_nodes(builder, quantized, base)
        new_nodes.append(builder.node("MatMul", [a, new_nodes[-1].outputs[0]], {}, f"{base}_MatMul"))
    new_nodes += _bias_nodes(builder, candidate, new_nodes[-1].outputs[0], base)
    ir.convenience.replace_nodes_and_values(
        builder.graph, node, [node], new_nodes, [node.outputs[0]], [new_nodes[-1].outputs[0]]
    )
    return new_nodes[0] if form == "matmul_nbits" else new_nodes[1]


def _fusible_activations(builder: _Builder, matmuls: dict[ir.Node, np.dtype]) -> int:
    """Every Relu/Clip that would stop ORT fusing one of ``matmuls`` written as Max/Min; how many."""
    count = 0
    for node in list(builder.graph):
        matmul = activation_form.blocked_matmul(node, matmuls.__contains__)
        if matmul is not None:
            count += activation_form.rewrite_as_min_max(node, matmuls[matmul], builder.names)
    return count


def _resolve_form(form: str, opset: int) -> str:
    if form not in FORMS:
        raise KenosisError(f"form must be one of {FORMS}, got {form!r}")
    if form == "auto":
        return "qdq" if opset >= QDQ_MIN_OPSET else "matmul_nbits"
    return form


def _upgrade_opset(model: ir.Model) -> ir.Model:
    """``model`` converted to opset 21 by onnx.version_converter (IR version >= 10)."""
    if model_io.is_large(model):
        raise ModelTooLargeError(
            f"form='qdq' needs opset {QDQ_MIN_OPSET}, and a model over 2 GB cannot go through onnx.version_converter "
            f"(it holds the whole model in one protobuf). Use form='matmul_nbits' (works at any opset), or "
            f"convert the model to opset {QDQ_MIN_OPSET} first."
        )
    proto = ir.serde.serialize_model(model)
    try:
        converted = onnx.version_converter.convert_version(proto, QDQ_MIN_OPSET)
    except Exception as error:  # noqa: BLE001 - the converter raises several exception types
        raise KenosisError(
            f"form='qdq' needs opset {QDQ_MIN_OPSET}, and onnx.version_converter could not convert the model "
            f"from opset {qdq_params.default_opset(model)}: {error}. Use form='matmul_nbits' (works at any opset)."
        ) from None
    converted.ir_version = max(converted.ir_version, QDQ_MIN_IR_VERSION)
    return ir.serde.deserialize_model(converted)


def _release(value: ir.Value) -> None:
    """Unmap a weight read from an external file (it is read again only if something asks for it)."""
    if isinstance(value.const_value, ir.ExternalTensor):
        try:
            value.const_value.release()
        except BufferError:  # something still views the mapping: it is unmapped when that goes
            pass


def _quantize_graph(model: ir.Model, *, bits, block_size, symmetric, op_types, exclude, form,
                    scale_search, accuracy_level) -> int:
    """Quantize and rewrite the eligible MatMul/Gemm nodes of ``model`` one weight at a time.

    Only one float weight is held in memory at a time (external weights are unmapped after use); a
    weight read by several MatMuls is quantized once and kept until its last reader is rewritten.
    """
    graph = model.graph
    builder = _Builder(graph)
    cache: dict[tuple, BlockQuantized] = {}
    readers = collections.Counter(_weight_key(node) for node in graph if len(node.inputs) > 1)
    written: dict[ir.Node, np.dtype] = {}
    count = 0
    for node in list(graph):
        candidate = _candidate_or_none(node, op_types, exclude, block_size)
        if candidate is None:
            continue
        key = (_weight_key(node), node.op_type, node.attributes.get_int("transB", 0),
               node.attributes.get_float("alpha", 1.0))
        quantized = cache.get(key) if key[0] else None
        if quantized is None:
            quantized = quantize_blockwise(
                candidate.weight, bits=bits, block_size=block_size, symmetric=symmetric, scale_search=scale_search
            )
            if key[0] and readers[key[0]] > 1:
                cache[key] = quantized
        weight_value = node.inputs[1]
        written[_rewrite(builder, candidate, quantized, form, accuracy_level)] = candidate.weight.dtype
        del candidate
        _release(weight_value)
        readers[key[0]] -= 1
        if not readers[key[0]]:
            cache.pop(key, None)
        count += 1
    if form == "matmul_nbits" and count:
        model.opset_imports.setdefault(MSFT_DOMAIN, 1)
    elif count:
        _fusible_activations(builder, written)
    common_passes.RemoveUnusedNodesPass()(model)
    return count


def _check_arguments(bits: int, block_size: int) -> None:
    if bits not in (4, 8):
        raise KenosisError(f"bits must be 4 or 8, got {bits!r}")
    if not 16 <= block_size <= 256 or block_size & (block_size - 1):
        raise KenosisError(
            f"block_size must be a power of two from 16 to 256 (what ORT fuses into MatMulNBits), got {block_size!r}"
        )


def quantize_weights(
    model: model_io.ModelLike,
    *,
    bits: int = 4,
    block_size: int = 32,
    symmetric: bool = True,
    op_types: Iterable[str] = ("MatMul", "Gemm"),
    exclude: Iterable[str] | Callable[[ir.Node], bool] = (),
    form: str = "auto",
    scale_search: bool = True,
    accuracy_level: int | None = None,
):
    """Block-quantize the constant weights of MatMul/Gemm nodes (weight-only), ORT-fusable form.

    Args:
        model: float model (float32 or float16 weights): ModelProto, onnx_ir.Model or a path.
            Never modified.
        bits: 4 (int4/uint4) or 8 (int8/uint8).
        block_size: rows of ``W[K, N]`` per scale; a power of two from 16 to 256.
        symmetric: signed values with zero point 0; else unsigned values with a zero point per block.
        op_types: which ops to quantize (``"MatMul"``, ``"Gemm"``).
        exclude: node names or weight initializer names to leave float, or a predicate on the node.
        form: ``"auto"``, ``"qdq"`` or ``"matmul_nbits"`` (see the module docstring; ``"qdq"`` below
            opset 21 converts the output model to opset 21).
        scale_search: choose each block's clipping ratio by least squared error (else absmax).
        accuracy_level: MatMulNBits ``accuracy_level`` attribute (form ``"matmul_nbits"`` only).

    Returns:
        The quantized model, of the kind given (a path gives a ModelProto), or an onnx_ir.Model when
        the output is over 2 GB (save it with :func:`kenosis_rewrite.save`). A path whose external
        data exceeds 256 MiB is read one weight at a time and never held whole in memory.

    Raises:
        KenosisError: bad arguments, or a model that cannot be converted to opset 21 for ``"qdq"``.
    """
    return model_io.to_output(quantize_weights_loaded(
        model, bits=bits, block_size=block_size, symmetric=symmetric, op_types=op_types, exclude=exclude,
        form=form, scale_search=scale_search, accuracy_level=accuracy_level,
    ))


def quantize_weights_loaded(model: model_io.ModelLike, *, bits: int = 4, block_size: int = 32, symmetric: bool = True,
                            op_types: Iterable[str] = ("MatMul", "Gemm"), exclude=(), form: str = "auto",
                            scale_search: bool = True, accuracy_level: int | None = None) -> model_io.LoadedModel:
    """:func:`quantize_weights` without the conversion of the result (the CLI saves the onnx-ir model as it is)."""
    _check_arguments(bits, block_size)
    loaded = model_io.load(model, require_qdq=False, lazy=True)
    resolved = _resolve_form(form, qdq_params.default_opset(loaded.model))
    if resolved == "qdq" and qdq_params.default_opset(loaded.model) < QDQ_MIN_OPSET:
        loaded = model_io.LoadedModel(_upgrade_opset(loaded.model), loaded.returns)
    elif resolved == "qdq":
        loaded.model.ir_version = max(loaded.model.ir_version, QDQ_MIN_IR_VERSION)
    _quantize_graph(
        loaded.model, bits=bits, block_size=block_size, symmetric=symmetric, op_types=tuple(op_types),
        exclude=exclude, form=resolved, scale_search=scale_search, accuracy_level=accuracy_level,
    )
    try:  # the graph without its tensor data: the check reads no data, and the model may be any size
        model_io.check_model(model_io.graph_only_proto(loaded.model), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise RewriteError(f"internal error: the weight-quantized model fails the ONNX checker ({error})") from None
    return loaded


# --------------------------------------------------------------------------------------------
# A transformer-style toy (tests and benchmarks)
# --------------------------------------------------------------------------------------------


def _linear(nodes, inits, rng, x: str, k: int, n: int, name: str, np_dtype) -> str:
    weight = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np_dtype)
    bias = (0.02 * rng.standard_normal(n)).astype(np_dtype)
    inits += [onnx.numpy_helper.from_array(weight, f"{name}.weight"), onnx.numpy_helper.from_array(bias, f"{name}.bias")]
    nodes.append(onnx.helper.make_node("MatMul", [x, f"{name}.weight"], [f"{name}_mm"], name=f"{name}/MatMul"))
    nodes.append(onnx.helper.make_node("Add", [f"{name}_mm", f"{name}.bias"], [f"{name}_out"], name=f"{name}/Add"))
    return f"{name}_out"


def _layer_norm(nodes, inits, x: str, hidden: int, name: str, np_dtype) -> str:
    inits += [onnx.numpy_helper.from_array(np.ones(hidden, np_dtype), f"{name}.gamma"),
              onnx.numpy_helper.from_array(np.zeros(hidden, np_dtype), f"{name}.beta")]
    nodes.append(onnx.helper.make_node(
        "LayerNormalization", [x, f"{name}.gamma", f"{name}.beta"], [f"{name}_out"], name=name, axis=-1))
    return f"{name}_out"


def _attention(nodes, inits, rng, x: str, hidden: int, heads: int, name: str, np_dtype) -> str:
    make = onnx.helper.make_node
    head_dim = hidden // heads
    q, k, v = (_linear(nodes, inits, rng, x, hidden, hidden, f"{name}.{p}", np_dtype) for p in "qkv")
    split = f"{name}.split_shape"
    inits += [onnx.numpy_helper.from_array(np.array([0, 0, heads, head_dim], np.int64), split),
              onnx.numpy_helper.from_array(np.array([0, 0, hidden], np.int64), f"{name}.merge_shape"),
              onnx.numpy_helper.from_array(np.array(1 / np.sqrt(head_dim), np_dtype), f"{name}.scale")]
    for t, perm in ((q, [0, 2, 1, 3]), (k, [0, 2, 3, 1]), (v, [0, 2, 1, 3])):
        nodes += [make("Reshape", [t, split], [f"{t}_4d"]), make("Transpose", [f"{t}_4d"], [f"{t}_t"], perm=perm)]
    nodes += [
        make("MatMul", [f"{q}_t", f"{k}_t"], [f"{name}_scores"], name=f"{name}/QK"),
        make("Mul", [f"{name}_scores", f"{name}.scale"], [f"{name}_scaled"]),
        make("Softmax", [f"{name}_scaled"], [f"{name}_probs"], axis=-1),
        make("MatMul", [f"{name}_probs", f"{v}_t"], [f"{name}_ctx"], name=f"{name}/PV"),
        make("Transpose", [f"{name}_ctx"], [f"{name}_ctx_t"], perm=[0, 2, 1, 3]),
        make("Reshape", [f"{name}_ctx_t", f"{name}.merge_shape"], [f"{name}_merged"]),
    ]
    return _linear(nodes, inits, rng, f"{name}_merged", hidden, hidden, f"{name}.o", np_dtype)


def toy_transformer(*, hidden: int = 256, layers: int = 2, heads: int = 4, seq: int = 8,
                    float16: bool = False, seed: int = 0) -> onnx.ModelProto:
    """A pre-LayerNorm transformer encoder (opset 21): per layer 4 attention MatMuls + 2 MLP MatMuls.

    Input ``x[1, seq, hidden]``, output ``y[1, seq, hidden]``. The same ``seed`` gives the same
    weights for float32 and float16 (the float16 model holds the float32 weights rounded).
    """
    np_dtype = np.float16 if float16 else np.float32
    elem = onnx.TensorProto.FLOAT16 if float16 else onnx.TensorProto.FLOAT
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        normed = _layer_norm(nodes, inits, x, hidden, f"layer{i}.ln1", np_dtype)
        attended = _attention(nodes, inits, rng, normed, hidden, heads, f"layer{i}.attn", np_dtype)
        nodes.append(onnx.helper.make_node("Add", [x, attended], [f"layer{i}_res1"]))
        normed = _layer_norm(nodes, inits, f"layer{i}_res1", hidden, f"layer{i}.ln2", np_dtype)
        up = _linear(nodes, inits, rng, normed, hidden, 4 * hidden, f"layer{i}.mlp.up", np_dtype)
        nodes.append(onnx.helper.make_node("Gelu", [up], [f"layer{i}_gelu"]))
        down = _linear(nodes, inits, rng, f"layer{i}_gelu", 4 * hidden, hidden, f"layer{i}.mlp.down", np_dtype)
        nodes.append(onnx.helper.make_node("Add", [f"layer{i}_res1", down], [f"layer{i}_out"]))
        x = f"layer{i}_out"
    y = _layer_norm(nodes, inits, x, hidden, "final_ln", np_dtype)
    nodes.append(onnx.helper.make_node("Identity", [y], ["y"]))
    graph = onnx.helper.make_graph(
        nodes, "toy_transformer", [onnx.helper.make_tensor_value_info("x", elem, [1, seq, hidden])],
        [onnx.helper.make_tensor_value_info("y", elem, [1, seq, hidden])], inits,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    model.ir_version = QDQ_MIN_IR_VERSION
    return model


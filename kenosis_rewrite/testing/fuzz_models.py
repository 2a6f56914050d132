"""Random small FP32 ONNX models for the property fuzz (:mod:`kenosis_rewrite.testing.fuzz`).

:func:`random_float_model` draws, from one ``np.random.Generator``, a CNN (rank-4) or MLP
(rank-2/3) graph of weighted layers, activations, residuals, pooling, resizing and layout ops,
with calibration feeds; the same generator state gives the same model. With ``dynamic_batch``
the model is then written as an exporter with a dynamic batch writes it (:func:`as_dynamic_export`):
the shape arithmetic runs in the graph.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from kenosis_rewrite.testing.fuzz_builder import Builder, Tensor, activation, batchnorm, maybe_activation, relu_or_clip
from kenosis_rewrite.testing.fuzz_dense_layers import build_transformer, gemm, matmul_block, mlp_layer
from kenosis_rewrite.testing.fuzz_dynamic_export import as_dynamic_export

N_CALIBRATION = 4
N_FEEDS = 6
# Op types quantize_static quantizes as weighted layers (a config's op_types_to_quantize draws from them).
QUANTIZABLE_WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")

_MAX_CHANNELS = 16
_MAX_SPATIAL = 24


def _conv(b: Builder, x: Tensor, c_out: int | None = None, same: bool = False) -> Tensor:
    """Conv: kernel 1 or 3, random pads/stride, groups (incl. depthwise), with or without bias."""
    _, c_in, h, w = x.shape
    k = b.pick([1, 3, 3])
    pad = 1 if k == 3 and (same or min(h, w) < 5 or b.chance(0.75)) else 0
    stride = 2 if not same and min(h, w) >= 8 and b.chance(0.15) else 1
    group, c_out = _conv_groups(b, c_in, c_out, same)
    weight = b.he((c_out, c_in // group, k, k), c_in // group * k * k)
    inputs = [x.name, b.const(weight, "w")]
    if b.chance(0.7):
        inputs.append(b.f32(b.rng.normal(0, 0.1, c_out), "b"))
    out_h, out_w = ((d + 2 * pad - k) // stride + 1 for d in (h, w))
    attrs = {"kernel_shape": [k, k], "group": group}
    if pad or b.chance(0.5):
        attrs["pads"] = [pad] * 4
    if stride != 1 or b.chance(0.3):
        attrs["strides"] = [stride, stride]
    return b.node("Conv", inputs, (1, c_out, out_h, out_w), **attrs)


def _conv_groups(b: Builder, c_in: int, c_out: int | None, same: bool) -> tuple[int, int]:
    """(group, c_out): dense, depthwise (multiplier 1 or 2) or grouped."""
    roll = b.rng.random()
    if roll < 0.25 and (c_out is None or c_out == c_in):
        multiplier = 1 if same or c_in * 2 > _MAX_CHANNELS or b.chance(0.6) else 2
        return c_in, c_in * multiplier
    divisors = [g for g in range(2, c_in) if c_in % g == 0 and (c_out is None or c_out % g == 0)]
    if roll < 0.4 and divisors:
        group = b.pick(divisors)
        if c_out is None:
            c_out = group * int(b.rng.integers(1, max(2, _MAX_CHANNELS // group) + 1))
            c_out = min(c_out, _MAX_CHANNELS - _MAX_CHANNELS % group)
        return group, c_out
    return 1, c_out if c_out is not None else int(b.rng.integers(3, 9))


def _conv_block(b: Builder, x: Tensor) -> Tensor:
    """Conv [-> BN] [-> activation [-> BN]]."""
    y = _conv(b, x)
    if b.chance(0.3):
        y = batchnorm(b, y)
    if b.chance(0.75):
        y = activation(b, y)
        if b.chance(0.12):
            y = batchnorm(b, y)
    return y


def _conv_transpose(b: Builder, x: Tensor) -> Tensor:
    """ConvTranspose, kernel 2 stride 2 (upsampling) or kernel 3 pad 1 stride 1, optional bias."""
    _, c_in, h, w = x.shape
    c_out = int(b.rng.integers(3, 9))
    up = max(h, w) * 2 <= _MAX_SPATIAL and b.chance(0.6)
    k, stride, pad = (2, 2, 0) if up else (3, 1, 1)
    weight = b.he((c_in, c_out, k, k), c_in * k * k // (stride * stride))
    inputs = [x.name, b.const(weight, "wt")]
    if b.chance(0.6):
        inputs.append(b.f32(b.rng.normal(0, 0.1, c_out), "bt"))
    out_h, out_w = ((d - 1) * stride - 2 * pad + k for d in (h, w))
    y = b.node("ConvTranspose", inputs, (1, c_out, out_h, out_w), kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4)
    return maybe_activation(b, y, 0.6)


def _residual(b: Builder, x: Tensor) -> Tensor:
    """Fan-out: x feeds a Conv branch and an identity or 1x1 branch, joined by Add or channel Concat."""
    left = maybe_activation(b, _conv(b, x, c_out=x.shape[1], same=True), 0.7)
    right = x if b.chance(0.5) else maybe_activation(b, _conv(b, x, c_out=x.shape[1], same=True), 0.5)
    if x.shape[1] * 2 <= _MAX_CHANNELS and b.chance(0.4):
        shape = (1, x.shape[1] * 2) + x.shape[2:]
        return b.node("Concat", [left.name, right.name], shape, axis=1)
    joined = b.node("Add", [left.name, right.name], x.shape)
    return maybe_activation(b, joined, 0.5)


def _pool(b: Builder, x: Tensor) -> Tensor:
    """MaxPool/AveragePool (2x2 stride 2, or 3x3 pad 1 stride 1), sometimes an activation after."""
    _, c, h, w = x.shape
    op = b.pick(["MaxPool", "MaxPool", "AveragePool"])
    if min(h, w) >= 4 and b.chance(0.6):
        y = b.node(op, [x.name], (1, c, h // 2, w // 2), kernel_shape=[2, 2], strides=[2, 2])
    else:
        y = b.node(op, [x.name], x.shape, kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
    return relu_or_clip(b, y) if b.chance(0.3) else y


def _resize(b: Builder, x: Tensor) -> Tensor:
    """Resize by 2 in H and W, nearest or linear."""
    _, c, h, w = x.shape
    mode = b.pick(["nearest", "linear"])
    scales = b.f32([1.0, 1.0, 2.0, 2.0], "scales")
    return b.node("Resize", [x.name, "", scales], (1, c, 2 * h, 2 * w), mode=mode)


def _shape_op_4d(b: Builder, x: Tensor) -> Tensor:
    """A rank-preserving data-movement detour: Transpose, Reshape there and back, Unsqueeze/Squeeze."""
    _, c, h, w = x.shape
    choice = b.pick(["transpose", "reshape", "unsqueeze", "squeeze"])
    if choice == "transpose":
        y = b.node("Transpose", [x.name], (1, c, w, h), perm=[0, 1, 3, 2])
        return maybe_activation(b, y, 0.3)
    if choice == "reshape":
        y = b.node("Reshape", [x.name, b.i64([1, c, h * w])], (1, c, h * w))
        y = maybe_activation(b, y, 0.4)
        return b.node("Reshape", [y.name, b.i64([1, c, h, w])], x.shape)
    if choice == "unsqueeze":
        y = b.node("Unsqueeze", [x.name, b.i64([2], "axes")], (1, c, 1, h, w))
        y = maybe_activation(b, y, 0.4)
        return b.node("Squeeze", [y.name, b.i64([2], "axes")], x.shape)
    y = b.node("Squeeze", [x.name, b.i64([0], "axes")], (c, h, w))
    y = maybe_activation(b, y, 0.3) if b.chance(0.5) else y
    return b.node("Unsqueeze", [y.name, b.i64([0], "axes")], x.shape)


def _conv_passthrough_activation(b: Builder, x: Tensor) -> Tensor:
    """Conv -> pass-through op -> activation (Conv->MaxPool->Relu, Conv->Reshape->Relu, ...)."""
    y = _conv(b, x)
    _, c, h, w = y.shape
    choice = b.pick(["maxpool", "reshape", "transpose", "flatten"])
    if choice == "maxpool" and min(h, w) >= 4:
        y = b.node("MaxPool", [y.name], (1, c, h // 2, w // 2), kernel_shape=[2, 2], strides=[2, 2])
    elif choice == "flatten" and c * h * w <= 512:
        y = b.node("Flatten", [y.name], (1, c * h * w), axis=1)
    elif choice == "reshape":
        y = b.node("Reshape", [y.name, b.i64([1, c, w, h])], (1, c, w, h))
    else:
        y = b.node("Transpose", [y.name], (1, c, w, h), perm=[0, 1, 3, 2])
    return relu_or_clip(b, y) if b.chance(0.7) else activation(b, y)


def _activation_then_bn(b: Builder, x: Tensor) -> Tensor:
    """Relu -> BN or Conv -> Relu -> BN."""
    if b.chance(0.5):
        x = _conv(b, x)
    return batchnorm(b, b.node("Relu", [x.name], x.shape))


def _to_vector(b: Builder, x: Tensor) -> Tensor:
    """Leave the CNN body: GlobalAveragePool [-> Flatten/Reshape] or Flatten/Reshape of the map."""
    _, c, h, w = x.shape
    if c * h * w > 512 or b.chance(0.6):
        x = b.node("GlobalAveragePool", [x.name], (1, c, 1, 1))
        x = maybe_activation(b, x, 0.2)
        h = w = 1
    if b.chance(0.5):
        return b.node("Flatten", [x.name], (1, c * h * w), axis=1)
    return b.node("Reshape", [x.name, b.i64([1, c * h * w])], (1, c * h * w))


def _cnn_layer(b: Builder, x: Tensor) -> Tensor:
    _, c, h, w = x.shape
    menu = [
        (0.30, _conv_block), (0.05, _conv_transpose), (0.07, lambda b, x: activation(b, x)),
        (0.13, _residual), (0.10, _pool), (0.06, _resize), (0.08, _shape_op_4d),
        (0.12, _conv_passthrough_activation), (0.05, _activation_then_bn), (0.04, _to_vector),
    ]
    allowed = [
        (p, f) for p, f in menu
        if not (f is _resize and max(h, w) * 2 > _MAX_SPATIAL) and not (f is _conv_transpose and c > 12)
    ]
    weights = np.array([p for p, _ in allowed])
    return allowed[int(b.rng.choice(len(allowed), p=weights / weights.sum()))][1](b, x)


# ---- MLP layers (rank 2 [1, F] or rank 3 [1, S, F]) ----------------------------------------

def _ir_version(opset: int) -> int:
    return 8 if opset <= 17 else (9 if opset <= 19 else 10)


def _build_body(b: Builder) -> tuple[Tensor, Tensor]:
    """(graph input, last tensor) of a CNN body (with a dense head sometimes) or an MLP body."""
    if b.chance(0.65):
        x = Tensor("input", (1, int(b.rng.integers(3, 9)), int(b.rng.integers(6, 13)), int(b.rng.integers(6, 13))))
    elif b.chance(0.6):
        x = Tensor("input", (1, int(b.rng.integers(4, 17))))
    else:
        x = Tensor("input", (1, int(b.rng.integers(2, 7)), int(b.rng.integers(4, 17))))
    y = x
    for index in range(int(b.rng.integers(2, 8))):
        if index == 0 and b.chance(0.85):  # a weighted stem, as in real models
            y = _weighted_layer(b, y)
        else:
            y = _cnn_layer(b, y) if y.rank == 4 else mlp_layer(b, y)
    if not any(node.op_type in QUANTIZABLE_WEIGHTED for node in b.nodes):
        y = _weighted_layer(b, y)  # without one, quantize_static often emits no Q/DQ at all
    return x, y


def _weighted_layer(b: Builder, x: Tensor) -> Tensor:
    """A layer with a weighted op: conv block (rank 4), Gemm (rank 2) or MatMul."""
    if x.rank == 4:
        return _conv_block(b, x) if b.chance(0.7) else _conv_passthrough_activation(b, x)
    if x.rank == 2 and b.chance(0.5):
        return gemm(b, x)
    return matmul_block(b, x)


def _choose_outputs(b: Builder, last: Tensor) -> list[Tensor]:
    """The last tensor (after a final Relu/Clip sometimes), plus an intermediate one sometimes."""
    if b.chance(0.2):
        last = relu_or_clip(b, last)
    outputs = [last]
    candidates = [t for t in b.produced[:-1] if t.name != last.name]
    if candidates and b.chance(0.2):
        outputs.append(b.pick(candidates))
    return outputs


def _softmax_head(b: Builder, last: Tensor) -> Tensor:
    """A Softmax over the last tensor: a detector's DFL head on a map (``Reshape [1,4,c/4,hw] ->
    Transpose(0,2,1,3) -> Softmax(axis=1)``) or a Softmax over its channels; over the features of a vector."""
    if last.rank != 4:
        return b.node("Softmax", [last.name], last.shape, axis=-1)
    _, c, h, w = last.shape
    if c % 4 == 0 and c >= 8 and b.chance(0.7):
        boxes = b.node("Reshape", [last.name, b.i64([1, 4, c // 4, h * w])], (1, 4, c // 4, h * w))
        last = b.node("Transpose", [boxes.name], (1, c // 4, 4, h * w), perm=[0, 2, 1, 3])
    return b.node("Softmax", [last.name], last.shape, axis=1)


def _with_softmax_head(b: Builder, outputs: list[Tensor], rng: np.random.Generator) -> list[Tensor]:
    """A Softmax head on the first output, drawn from a stream jumped ahead of ``rng``: ``rng`` does
    not advance, so the body, the feeds and the other draws are those of the same generator without a head."""
    body_rng, b.rng = b.rng, np.random.Generator(rng.bit_generator.jumped())
    try:
        return [_softmax_head(b, outputs[0]), *outputs[1:]]
    finally:
        b.rng = body_rng


def _assemble(b: Builder, x: Tensor, outputs: list[Tensor]) -> onnx.ModelProto:
    graph = helper.make_graph(
        b.nodes, "fuzz",
        [helper.make_tensor_value_info(x.name, TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.shape)) for t in outputs],
        b.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", b.opset)], producer_name="kenosis-fuzz")
    model.ir_version = _ir_version(b.opset)
    return model


def _check_shapes(model: onnx.ModelProto) -> None:
    """The tracked output shapes must be what ONNX shape inference computes (a generator self-check)."""
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    known = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for value in model.graph.output:
        dims = [d.dim_value for d in known[value.name].type.tensor_type.shape.dim]
        declared = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if dims != declared:
            raise AssertionError(f"generator shape bug: {value.name} inferred {dims}, tracked {declared}")


def random_float_model(rng: np.random.Generator, softmax_head: bool = False, dynamic_batch: bool = False,
                       transformer: bool = False) -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """A small random valid FP32 model and 6 feeds (first 4: calibration, last 2: evaluation).

    Opset 13..21; one model in eight has about half its constants as Constant nodes. CNN bodies
    (Conv/ConvTranspose/BN/activations/residuals/pools/Resize/shape ops)
    or MLP bodies (Gemm/MatMul/Add/activations/reshapes); one or two graph outputs with static shapes;
    ``softmax_head``: the first output is a Softmax head (:func:`_with_softmax_head`).
    ``dynamic_batch``: the batch dim is symbolic and the shapes are computed in the graph
    (:func:`as_dynamic_export`, drawn from its own stream: the body and feeds are the static model's).
    ``transformer``: a small encoder instead (:func:`build_transformer`: attention with heads,
    feed-forward blocks, LayerNormalization or its decomposition). The feeds have batch 1.
    """
    opset = int(rng.integers(13, 22))
    b = Builder(rng, opset, constant_nodes=bool(rng.random() < 0.12))
    x, last = build_transformer(b) if transformer else _build_body(b)
    outputs = _choose_outputs(b, last)
    model = _assemble(b, x, _with_softmax_head(b, outputs, rng) if softmax_head else outputs)
    _check_shapes(model)
    if dynamic_batch:
        model = as_dynamic_export(model, np.random.Generator(rng.bit_generator.jumped(2)))
    onnx.checker.check_model(model, full_check=True)
    feeds = [{x.name: rng.standard_normal(x.shape).astype(np.float32)} for _ in range(N_FEEDS)]
    return model, feeds


# ---- as exported with a dynamic batch ------------------------------------------------------


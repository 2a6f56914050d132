"""Random small FP32 ONNX models for the property fuzz (:mod:`kenosis_rewrite.testing.fuzz`).

:func:`random_float_model` draws, from one ``np.random.Generator``, a CNN (rank-4) or MLP
(rank-2/3) graph of weighted layers, activations, residuals, pooling, resizing and layout ops,
with calibration feeds; the same generator state gives the same model. With ``dynamic_batch``
the model is then written as an exporter with a dynamic batch writes it (:func:`as_dynamic_export`):
the shape arithmetic runs in the graph.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


N_CALIBRATION = 4
N_FEEDS = 6
# Op types quantize_static quantizes as weighted layers (a config's op_types_to_quantize draws from them).
QUANTIZABLE_WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """A tensor of the graph under construction with its (static) shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


class _Builder:
    """Appends uniquely named nodes and initializers to an FP32 graph under construction."""

    def __init__(self, rng: np.random.Generator, opset: int, constant_nodes: bool = False):
        self.rng = rng
        self.opset = opset
        self.constant_nodes = constant_nodes  # emit about half the constants as Constant nodes
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.produced: list[_Tensor] = []
        self._count = 0

    def name(self, base: str) -> str:
        self._count += 1
        return f"{base}_{self._count}"

    def const(self, array, base: str = "c") -> str:
        """An initializer, or (in constant-node mode, half the time) a Constant node's output."""
        name = self.name(base)
        tensor = numpy_helper.from_array(np.asarray(array), name)
        if self.constant_nodes and self.chance(0.5):
            self.nodes.append(helper.make_node("Constant", [], [name], name=self.name("n_Constant"), value=tensor))
        else:
            self.initializers.append(tensor)
        return name

    def f32(self, values, base: str = "c") -> str:
        return self.const(np.asarray(values, np.float32), base)

    def i64(self, values, base: str = "shape") -> str:
        return self.const(np.asarray(values, np.int64), base)

    def node(self, op: str, inputs: list[str], shape, **attrs) -> _Tensor:
        out = _Tensor(self.name(op.lower()), tuple(int(d) for d in shape))
        self.nodes.append(helper.make_node(op, inputs, [out.name], name=self.name(f"n_{op}"), **attrs))
        self.produced.append(out)
        return out

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def pick(self, options):
        return options[int(self.rng.integers(len(options)))]

    def he(self, shape, fan_in: int) -> np.ndarray:
        return self.rng.normal(0.0, np.sqrt(2.0 / max(fan_in, 1)), shape).astype(np.float32)


# ---- activations ---------------------------------------------------------------------------


def _clip(b: _Builder, x: _Tensor, kind: str | None = None) -> _Tensor:
    """Clip with bounds as inputs: (0,6), (-1,1), (0,M), min only or max only."""
    kind = kind or b.pick(["relu6", "relu6", "sym1", "zero_m", "min_only", "max_only"])
    bound = float(np.round(b.rng.uniform(1.0, 8.0), 2))
    lo, hi = {
        "relu6": (0.0, 6.0), "sym1": (-1.0, 1.0), "zero_m": (0.0, bound),
        "min_only": (b.pick([0.0, -1.0]), None), "max_only": (None, bound),
    }[kind]
    inputs = [x.name, "" if lo is None else b.f32(lo, "clip_min")]
    if hi is not None:
        inputs.append(b.f32(hi, "clip_max"))
    return b.node("Clip", inputs, x.shape)


def _prelu(b: _Builder, x: _Tensor) -> _Tensor:
    """PRelu with a single slope or one slope per channel (axis 1, or the last axis below rank 4)."""
    if b.chance(0.5):
        slope = b.rng.uniform(0.05, 0.3, (1,))
    elif x.rank == 4:
        slope = b.rng.uniform(-0.1, 0.4, (x.shape[1], 1, 1))
    else:
        slope = b.rng.uniform(-0.1, 0.4, (x.shape[-1],))
    return b.node("PRelu", [x.name, b.f32(slope, "slope")], x.shape)


def _silu(b: _Builder, x: _Tensor) -> _Tensor:
    sig = b.node("Sigmoid", [x.name], x.shape)
    return b.node("Mul", [x.name, sig.name], x.shape)


def _gelu(b: _Builder, x: _Tensor) -> _Tensor:
    """Gelu (opset >= 20) or its Erf form x * 0.5 * (1 + erf(x / sqrt(2)))."""
    if b.opset >= 20 and b.chance(0.7):
        return b.node("Gelu", [x.name], x.shape, approximate=b.pick(["none", "tanh"]))
    scaled = b.node("Div", [x.name, b.f32(np.sqrt(2.0), "sqrt2")], x.shape)
    erf = b.node("Erf", [scaled.name], x.shape)
    plus = b.node("Add", [erf.name, b.f32(1.0, "one")], x.shape)
    prod = b.node("Mul", [x.name, plus.name], x.shape)
    return b.node("Mul", [prod.name, b.f32(0.5, "half")], x.shape)


def _activation_kinds(opset: int) -> list[str]:
    kinds = ["Relu", "Relu", "Relu", "Clip", "Clip", "LeakyRelu", "PRelu", "Sigmoid", "HardSigmoid", "SiLU", "Gelu", "Tanh"]
    if opset >= 14:
        kinds += ["HardSwish", "HardSwish"]
    return kinds


def _activation(b: _Builder, x: _Tensor, kind: str | None = None) -> _Tensor:
    """One activation of a random kind allowed by the opset (several nodes for SiLU and Erf-Gelu)."""
    kind = kind or b.pick(_activation_kinds(b.opset))
    if kind == "Clip":
        return _clip(b, x)
    if kind == "PRelu":
        return _prelu(b, x)
    if kind == "SiLU":
        return _silu(b, x)
    if kind == "Gelu":
        return _gelu(b, x)
    if kind == "LeakyRelu":
        return b.node("LeakyRelu", [x.name], x.shape, alpha=float(np.round(b.rng.uniform(0.01, 0.3), 3)))
    if kind == "HardSigmoid" and b.chance(0.5):
        return b.node("HardSigmoid", [x.name], x.shape, alpha=float(np.round(b.rng.uniform(0.1, 0.3), 3)))
    return b.node(kind, [x.name], x.shape)


def _maybe_activation(b: _Builder, x: _Tensor, p: float = 0.7) -> _Tensor:
    return _activation(b, x) if b.chance(p) else x


def _relu_or_clip(b: _Builder, x: _Tensor) -> _Tensor:
    return b.node("Relu", [x.name], x.shape) if b.chance(0.6) else _clip(b, x)


def _batchnorm(b: _Builder, x: _Tensor) -> _Tensor:
    """Unfolded BatchNormalization on axis 1, gamma of mixed sign one time in three."""
    c = x.shape[1]
    gamma = b.rng.uniform(0.5, 1.5, c)
    if b.chance(1 / 3):
        gamma *= np.where(b.rng.random(c) < 0.4, -1.0, 1.0)
    inputs = [
        x.name, b.f32(gamma, "bn_scale"), b.f32(b.rng.normal(0, 0.2, c), "bn_bias"),
        b.f32(b.rng.normal(0, 0.2, c), "bn_mean"), b.f32(b.rng.uniform(0.5, 2.0, c), "bn_var"),
    ]
    return b.node("BatchNormalization", inputs, x.shape, epsilon=1e-5)


# ---- CNN layers (rank 4, [1, C, H, W]) -----------------------------------------------------

_MAX_CHANNELS = 16
_MAX_SPATIAL = 24


def _conv(b: _Builder, x: _Tensor, c_out: int | None = None, same: bool = False) -> _Tensor:
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


def _conv_groups(b: _Builder, c_in: int, c_out: int | None, same: bool) -> tuple[int, int]:
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


def _conv_block(b: _Builder, x: _Tensor) -> _Tensor:
    """Conv [-> BN] [-> activation [-> BN]]."""
    y = _conv(b, x)
    if b.chance(0.3):
        y = _batchnorm(b, y)
    if b.chance(0.75):
        y = _activation(b, y)
        if b.chance(0.12):
            y = _batchnorm(b, y)
    return y


def _conv_transpose(b: _Builder, x: _Tensor) -> _Tensor:
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
    return _maybe_activation(b, y, 0.6)


def _residual(b: _Builder, x: _Tensor) -> _Tensor:
    """Fan-out: x feeds a Conv branch and an identity or 1x1 branch, joined by Add or channel Concat."""
    left = _maybe_activation(b, _conv(b, x, c_out=x.shape[1], same=True), 0.7)
    right = x if b.chance(0.5) else _maybe_activation(b, _conv(b, x, c_out=x.shape[1], same=True), 0.5)
    if x.shape[1] * 2 <= _MAX_CHANNELS and b.chance(0.4):
        shape = (1, x.shape[1] * 2) + x.shape[2:]
        return b.node("Concat", [left.name, right.name], shape, axis=1)
    joined = b.node("Add", [left.name, right.name], x.shape)
    return _maybe_activation(b, joined, 0.5)


def _pool(b: _Builder, x: _Tensor) -> _Tensor:
    """MaxPool/AveragePool (2x2 stride 2, or 3x3 pad 1 stride 1), sometimes an activation after."""
    _, c, h, w = x.shape
    op = b.pick(["MaxPool", "MaxPool", "AveragePool"])
    if min(h, w) >= 4 and b.chance(0.6):
        y = b.node(op, [x.name], (1, c, h // 2, w // 2), kernel_shape=[2, 2], strides=[2, 2])
    else:
        y = b.node(op, [x.name], x.shape, kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
    return _relu_or_clip(b, y) if b.chance(0.3) else y


def _resize(b: _Builder, x: _Tensor) -> _Tensor:
    """Resize by 2 in H and W, nearest or linear."""
    _, c, h, w = x.shape
    mode = b.pick(["nearest", "linear"])
    scales = b.f32([1.0, 1.0, 2.0, 2.0], "scales")
    return b.node("Resize", [x.name, "", scales], (1, c, 2 * h, 2 * w), mode=mode)


def _shape_op_4d(b: _Builder, x: _Tensor) -> _Tensor:
    """A rank-preserving data-movement detour: Transpose, Reshape there and back, Unsqueeze/Squeeze."""
    _, c, h, w = x.shape
    choice = b.pick(["transpose", "reshape", "unsqueeze", "squeeze"])
    if choice == "transpose":
        y = b.node("Transpose", [x.name], (1, c, w, h), perm=[0, 1, 3, 2])
        return _maybe_activation(b, y, 0.3)
    if choice == "reshape":
        y = b.node("Reshape", [x.name, b.i64([1, c, h * w])], (1, c, h * w))
        y = _maybe_activation(b, y, 0.4)
        return b.node("Reshape", [y.name, b.i64([1, c, h, w])], x.shape)
    if choice == "unsqueeze":
        y = b.node("Unsqueeze", [x.name, b.i64([2], "axes")], (1, c, 1, h, w))
        y = _maybe_activation(b, y, 0.4)
        return b.node("Squeeze", [y.name, b.i64([2], "axes")], x.shape)
    y = b.node("Squeeze", [x.name, b.i64([0], "axes")], (c, h, w))
    y = _maybe_activation(b, y, 0.3) if b.chance(0.5) else y
    return b.node("Unsqueeze", [y.name, b.i64([0], "axes")], x.shape)


def _conv_passthrough_activation(b: _Builder, x: _Tensor) -> _Tensor:
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
    return _relu_or_clip(b, y) if b.chance(0.7) else _activation(b, y)


def _activation_then_bn(b: _Builder, x: _Tensor) -> _Tensor:
    """Relu -> BN or Conv -> Relu -> BN."""
    if b.chance(0.5):
        x = _conv(b, x)
    return _batchnorm(b, b.node("Relu", [x.name], x.shape))


def _to_vector(b: _Builder, x: _Tensor) -> _Tensor:
    """Leave the CNN body: GlobalAveragePool [-> Flatten/Reshape] or Flatten/Reshape of the map."""
    _, c, h, w = x.shape
    if c * h * w > 512 or b.chance(0.6):
        x = b.node("GlobalAveragePool", [x.name], (1, c, 1, 1))
        x = _maybe_activation(b, x, 0.2)
        h = w = 1
    if b.chance(0.5):
        return b.node("Flatten", [x.name], (1, c * h * w), axis=1)
    return b.node("Reshape", [x.name, b.i64([1, c * h * w])], (1, c * h * w))


def _cnn_layer(b: _Builder, x: _Tensor) -> _Tensor:
    _, c, h, w = x.shape
    menu = [
        (0.30, _conv_block), (0.05, _conv_transpose), (0.07, lambda b, x: _activation(b, x)),
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

_MAX_FEATURES = 32


def _gemm(b: _Builder, x: _Tensor) -> _Tensor:
    """Gemm with transB 0/1 and with or without C ([N] or [1, N]), then maybe an activation."""
    k = x.shape[1]
    n = int(b.rng.integers(4, 17))
    trans_b = int(b.chance(0.5))
    weight = b.he((n, k) if trans_b else (k, n), k)
    inputs = [x.name, b.const(weight, "gw")]
    if b.chance(0.7):
        # C of shape [1, N] makes per-channel quantize_static raise (ORT bug): keep it rare.
        inputs.append(b.f32(b.rng.normal(0, 0.1, (n,) if b.chance(0.92) else (1, n)), "gc"))
    y = b.node("Gemm", inputs, (1, n), **({"transB": 1} if trans_b else {}))
    if b.chance(0.1):
        y = _batchnorm(b, y)
    return _maybe_activation(b, y, 0.7)


def _matmul(b: _Builder, x: _Tensor, n: int | None = None) -> _Tensor:
    """MatMul by a constant weight, then maybe Add of a constant bias."""
    k = x.shape[-1]
    n = n if n is not None else int(b.rng.integers(4, 17))
    y = b.node("MatMul", [x.name, b.const(b.he((k, n), k), "mw")], x.shape[:-1] + (n,))
    if b.chance(0.6):
        y = b.node("Add", [y.name, b.f32(b.rng.normal(0, 0.1, n), "mb")], y.shape)
    return y


def _matmul_block(b: _Builder, x: _Tensor) -> _Tensor:
    return _maybe_activation(b, _matmul(b, x), 0.7)


def _mlp_residual(b: _Builder, x: _Tensor) -> _Tensor:
    """Fan-out: x feeds a MatMul branch, joined with x by Add or by Concat on the last axis."""
    branch = _maybe_activation(b, _matmul(b, x, n=x.shape[-1]), 0.7)
    if x.shape[-1] * 2 <= _MAX_FEATURES and b.chance(0.4):
        return b.node("Concat", [x.name, branch.name], x.shape[:-1] + (x.shape[-1] * 2,), axis=-1)
    return _maybe_activation(b, b.node("Add", [x.name, branch.name], x.shape), 0.4)


def _mlp_shape_op(b: _Builder, x: _Tensor) -> _Tensor:
    """Reshape/Flatten/Transpose/Unsqueeze between the dense layers, sometimes an activation after."""
    if x.rank == 3:
        _, s, f = x.shape
        choice = b.pick(["flatten", "reshape", "transpose"])
        if choice == "flatten":
            y = b.node("Flatten", [x.name], (1, s * f), axis=1)
        elif choice == "reshape":
            y = b.node("Reshape", [x.name, b.i64([1, s * f])], (1, s * f))
        else:
            y = b.node("Transpose", [x.name], (1, f, s), perm=[0, 2, 1])
    else:
        f = x.shape[1]
        split = next((d for d in (2, 3, 4) if f % d == 0), None)
        if split is not None and b.chance(0.6):
            y = b.node("Reshape", [x.name, b.i64([1, split, f // split])], (1, split, f // split))
        else:
            y = b.node("Unsqueeze", [x.name, b.i64([1], "axes")], (1, 1, f))
            y = _maybe_activation(b, y, 0.4)
            y = b.node("Squeeze", [y.name, b.i64([1], "axes")], (1, f))
    return _relu_or_clip(b, y) if b.chance(0.3) else y


def _mlp_layer(b: _Builder, x: _Tensor) -> _Tensor:
    menu = [(0.25, _gemm), (0.25, _matmul_block), (0.1, lambda b, x: _activation(b, x)), (0.2, _mlp_residual), (0.2, _mlp_shape_op)]
    if x.rank != 2:
        menu = [(p, f) for p, f in menu if f is not _gemm]
    if x.shape[-1] > _MAX_FEATURES:  # shrink wide vectors first
        return _gemm(b, x) if x.rank == 2 else _matmul_block(b, x)
    weights = np.array([p for p, _ in menu])
    return menu[int(b.rng.choice(len(menu), p=weights / weights.sum()))][1](b, x)


# ---- transformer blocks (rank 3 [1, S, F]) -------------------------------------------------


def _layer_norm(b: _Builder, x: _Tensor) -> _Tensor:
    """LayerNormalization over the features: the op (opset >= 17, half the time) or as exporters
    decompose it (ReduceMean -> Sub -> Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul -> Add)."""
    f = x.shape[-1]
    gamma, beta = b.f32(b.rng.uniform(0.5, 1.5, f), "ln_scale"), b.f32(b.rng.normal(0, 0.1, f), "ln_bias")
    if b.opset >= 17 and b.chance(0.5):
        return b.node("LayerNormalization", [x.name, gamma, beta], x.shape, axis=-1, epsilon=1e-5)
    reduced = x.shape[:-1] + (1,)

    def mean(t: _Tensor) -> _Tensor:
        if b.opset >= 18:
            return b.node("ReduceMean", [t.name, b.i64([-1], "axes")], reduced, keepdims=1)
        return b.node("ReduceMean", [t.name], reduced, axes=[-1], keepdims=1)

    centred = b.node("Sub", [x.name, mean(x).name], x.shape)
    variance = mean(b.node("Pow", [centred.name, b.f32(2.0, "two")], x.shape))
    deviation = b.node("Sqrt", [b.node("Add", [variance.name, b.f32(1e-5, "eps")], reduced).name], reduced)
    normalized = b.node("Div", [centred.name, deviation.name], x.shape)
    return b.node("Add", [b.node("Mul", [normalized.name, gamma], x.shape).name, beta], x.shape)


def _attention(b: _Builder, x: _Tensor) -> _Tensor:
    """Self-attention: Q/K/V projections, heads split by Reshape/Transpose (or one head), scores
    scaled by Div or Mul, Softmax, the context merged back and projected, a residual Add."""
    _, s, f = x.shape
    heads = b.pick([h for h in (1, 2, 4) if f % h == 0])
    d = f // heads
    q, k, v = (_matmul(b, x, n=f) for _ in range(3))
    if heads > 1:
        def split(t: _Tensor, perm: list[int]) -> _Tensor:
            y = b.node("Reshape", [t.name, b.i64([1, s, heads, d])], (1, s, heads, d))
            return b.node("Transpose", [y.name], tuple((1, s, heads, d)[i] for i in perm), perm=perm)
        q, k, v = split(q, [0, 2, 1, 3]), split(k, [0, 2, 3, 1]), split(v, [0, 2, 1, 3])
        scores_shape = (1, heads, s, s)
    else:
        k = b.node("Transpose", [k.name], (1, f, s), perm=[0, 2, 1])
        scores_shape = (1, s, s)
    scores = b.node("MatMul", [q.name, k.name], scores_shape)
    if b.chance(0.5):
        scaled = b.node("Div", [scores.name, b.f32(np.sqrt(d), "sqrt_d")], scores_shape)
    else:
        scaled = b.node("Mul", [scores.name, b.f32(1 / np.sqrt(d), "inv_sqrt_d")], scores_shape)
    probs = b.node("Softmax", [scaled.name], scores_shape, axis=-1)
    context = b.node("MatMul", [probs.name, v.name], scores_shape[:-1] + (d,))
    if heads > 1:
        context = b.node("Transpose", [context.name], (1, s, heads, d), perm=[0, 2, 1, 3])
        context = b.node("Reshape", [context.name, b.i64([1, s, f])], (1, s, f))
    projected = _matmul(b, context, n=f)
    return b.node("Add", [x.name, projected.name], x.shape)


def _feed_forward(b: _Builder, x: _Tensor) -> _Tensor:
    """MatMul -> Gelu/Relu -> MatMul, added to its input."""
    hidden = _matmul(b, x, n=int(b.rng.integers(x.shape[-1], 2 * x.shape[-1] + 1)))
    hidden = _gelu(b, hidden) if b.chance(0.6) else b.node("Relu", [hidden.name], hidden.shape)
    return b.node("Add", [x.name, _matmul(b, hidden, n=x.shape[-1]).name], x.shape)


def _transformer_layer(b: _Builder, x: _Tensor) -> _Tensor:
    """A pre- or post-norm encoder layer: attention and feed-forward blocks with layer norms."""
    pre_norm = b.chance(0.5)
    for block in (_attention, _feed_forward):
        x = block(b, _layer_norm(b, x)) if pre_norm else _layer_norm(b, block(b, x))
    return x


def _build_transformer(b: _Builder) -> tuple[_Tensor, _Tensor]:
    """(graph input, last tensor) of a small encoder: an embedding MatMul, 1-2 layers, a head."""
    x = _Tensor("input", (1, int(b.rng.integers(3, 9)), int(b.rng.integers(4, 17))))
    features = int(b.pick([8, 12, 16]))
    y = _matmul(b, x, n=features)
    for _ in range(int(b.rng.integers(1, 3))):
        y = _transformer_layer(b, y)
    if b.chance(0.5):
        y = _layer_norm(b, y)
    return x, _matmul(b, y, n=int(b.rng.integers(2, 9)))


# ---- whole model ---------------------------------------------------------------------------


def _ir_version(opset: int) -> int:
    return 8 if opset <= 17 else (9 if opset <= 19 else 10)


def _build_body(b: _Builder) -> tuple[_Tensor, _Tensor]:
    """(graph input, last tensor) of a CNN body (with a dense head sometimes) or an MLP body."""
    if b.chance(0.65):
        x = _Tensor("input", (1, int(b.rng.integers(3, 9)), int(b.rng.integers(6, 13)), int(b.rng.integers(6, 13))))
    elif b.chance(0.6):
        x = _Tensor("input", (1, int(b.rng.integers(4, 17))))
    else:
        x = _Tensor("input", (1, int(b.rng.integers(2, 7)), int(b.rng.integers(4, 17))))
    y = x
    for index in range(int(b.rng.integers(2, 8))):
        if index == 0 and b.chance(0.85):  # a weighted stem, as in real models
            y = _weighted_layer(b, y)
        else:
            y = _cnn_layer(b, y) if y.rank == 4 else _mlp_layer(b, y)
    if not any(node.op_type in QUANTIZABLE_WEIGHTED for node in b.nodes):
        y = _weighted_layer(b, y)  # without one, quantize_static often emits no Q/DQ at all
    return x, y


def _weighted_layer(b: _Builder, x: _Tensor) -> _Tensor:
    """A layer with a weighted op: conv block (rank 4), Gemm (rank 2) or MatMul."""
    if x.rank == 4:
        return _conv_block(b, x) if b.chance(0.7) else _conv_passthrough_activation(b, x)
    if x.rank == 2 and b.chance(0.5):
        return _gemm(b, x)
    return _matmul_block(b, x)


def _choose_outputs(b: _Builder, last: _Tensor) -> list[_Tensor]:
    """The last tensor (after a final Relu/Clip sometimes), plus an intermediate one sometimes."""
    if b.chance(0.2):
        last = _relu_or_clip(b, last)
    outputs = [last]
    candidates = [t for t in b.produced[:-1] if t.name != last.name]
    if candidates and b.chance(0.2):
        outputs.append(b.pick(candidates))
    return outputs


def _softmax_head(b: _Builder, last: _Tensor) -> _Tensor:
    """A Softmax over the last tensor: a detector's DFL head on a map (``Reshape [1,4,c/4,hw] ->
    Transpose(0,2,1,3) -> Softmax(axis=1)``) or a Softmax over its channels; over the features of a vector."""
    if last.rank != 4:
        return b.node("Softmax", [last.name], last.shape, axis=-1)
    _, c, h, w = last.shape
    if c % 4 == 0 and c >= 8 and b.chance(0.7):
        boxes = b.node("Reshape", [last.name, b.i64([1, 4, c // 4, h * w])], (1, 4, c // 4, h * w))
        last = b.node("Transpose", [boxes.name], (1, c // 4, 4, h * w), perm=[0, 2, 1, 3])
    return b.node("Softmax", [last.name], last.shape, axis=1)


def _with_softmax_head(b: _Builder, outputs: list[_Tensor], rng: np.random.Generator) -> list[_Tensor]:
    """A Softmax head on the first output, drawn from a stream jumped ahead of ``rng``: ``rng`` does
    not advance, so the body, the feeds and the other draws are those of the same generator without a head."""
    body_rng, b.rng = b.rng, np.random.Generator(rng.bit_generator.jumped())
    try:
        return [_softmax_head(b, outputs[0]), *outputs[1:]]
    finally:
        b.rng = body_rng


def _assemble(b: _Builder, x: _Tensor, outputs: list[_Tensor]) -> onnx.ModelProto:
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

    Opset 13..21; one model in eight has about half its constants as Constant nodes. CNN bodies (Conv/ConvTranspose/BN/activations/residuals/pools/Resize/shape ops)
    or MLP bodies (Gemm/MatMul/Add/activations/reshapes); one or two graph outputs with static shapes;
    ``softmax_head``: the first output is a Softmax head (:func:`_with_softmax_head`).
    ``dynamic_batch``: the batch dim is symbolic and the shapes are computed in the graph
    (:func:`as_dynamic_export`, drawn from its own stream: the body and feeds are the static model's).
    ``transformer``: a small encoder instead (:func:`_build_transformer`: attention with heads,
    feed-forward blocks, LayerNormalization or its decomposition). The feeds have batch 1.
    """
    opset = int(rng.integers(13, 22))
    b = _Builder(rng, opset, constant_nodes=bool(rng.random() < 0.12))
    x, last = _build_transformer(b) if transformer else _build_body(b)
    outputs = _choose_outputs(b, last)
    model = _assemble(b, x, _with_softmax_head(b, outputs, rng) if softmax_head else outputs)
    _check_shapes(model)
    if dynamic_batch:
        model = as_dynamic_export(model, np.random.Generator(rng.bit_generator.jumped(2)))
    onnx.checker.check_model(model, full_check=True)
    feeds = [{x.name: rng.standard_normal(x.shape).astype(np.float32)} for _ in range(N_FEEDS)]
    return model, feeds


# ---- as exported with a dynamic batch ------------------------------------------------------

BATCH = "batch"


class _ShapeArithmetic:
    """Appends the nodes an exporter writes to compute shapes at run time (``Shape -> Slice/Gather
    -> Concat``), uniquely named."""

    def __init__(self, taken: set[str]):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._taken = taken
        self._count = 0

    def name(self, base: str) -> str:
        while True:
            self._count += 1
            name = f"dyn_{base}_{self._count}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    def i64(self, values) -> str:
        name = self.name("i64")
        self.initializers.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name

    def node(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.name(f"n_{op}"), **attrs))
        return out

    def dims(self, tensor: str, start: int, end: int) -> str:
        """``tensor.shape[start:end]`` at run time."""
        return self.node("Slice", [self.node("Shape", [tensor]), self.i64([start]), self.i64([end])])

    def batch_then(self, tensor: str, rest, rng: np.random.Generator) -> str:
        """``[tensor.shape[0], *rest]``: ``x.view(x.size(0), ...)``, Sliced or Gathered and Unsqueezed."""
        if rng.random() < 0.5:
            batch = self.dims(tensor, 0, 1)
        else:
            scalar = self.node("Gather", [self.node("Shape", [tensor]), self.i64(0)], axis=0)
            batch = self.node("Unsqueeze", [scalar, self.i64([0])])
        return self.node("Concat", [batch, self.i64(rest)], axis=0)


def _constant_arrays(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    arrays = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            arrays[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return arrays


def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    values = [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
    return {v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim) for v in values
            if v.type.tensor_type.elem_type == TensorProto.FLOAT}


def as_dynamic_export(model: onnx.ModelProto, rng: np.random.Generator) -> onnx.ModelProto:
    """``model`` (static, batch 1) as an exporter with a dynamic batch writes it, computing the same:

    * the inputs' and outputs' first dim is the symbol ``batch``, and in one model in two the input's
      spatial dims (``height``, ``width``) or sequence length (``sequence``) are symbolic too;
    * a Reshape to a constant shape ``[1, ...]`` reads its shape from its data at run time
      (``x.view(x.size(0), ...)``: ``Shape -> Slice`` or ``Shape -> Gather -> Unsqueeze``, then
      ``Concat``), or from an earlier tensor of the target shape (``y.view(x.shape)``), or keeps the
      batch with a 0 (``[0, ...]``);
    * a Resize by 2 resizes to a computed size (``interpolate(size=(2 * h, 2 * w))``);
    * a 3x3 Conv's padding is, sometimes, a Pad computed from the input's shape (TF "same" padding);
    * zeros made from a tensor's run-time shape (``ConstantOfShape(Shape(y))``, a recurrent net's
      initial state) are added to one tensor, and a constant bias is Expanded to a tensor's shape and
      added to another (the float data the graph computes from shapes).
    """
    shapes = _static_shapes(model)
    constants = _constant_arrays(model)
    taken = {name for node in model.graph.node for name in [*node.input, *node.output, node.name]}
    taken.update(init.name for init in model.graph.initializer)
    taken.update(value.name for value in [*model.graph.input, *model.graph.output])
    arithmetic = _ShapeArithmetic(taken)
    outputs = {value.name for value in model.graph.output}
    produced: list[str] = [value.name for value in model.graph.input]
    nodes: list[onnx.NodeProto] = []
    padding_rng = np.random.Generator(rng.bit_generator.jumped())  # rng's own draws stay those of before
    for original in model.graph.node:
        node = onnx.NodeProto()
        node.CopyFrom(original)
        _dynamic_parameters(node, arithmetic, constants, shapes, produced, rng)
        _same_padding(node, arithmetic, padding_rng)
        nodes.extend(arithmetic.nodes)
        arithmetic.nodes.clear()
        nodes.append(node)
        produced.extend(name for name in node.output if name in shapes)
    inner = [name for name in produced[1:] if name not in outputs and shapes[name]]  # not scalars
    for kind in ("zeros", "expand"):
        if inner and rng.random() < 0.3:
            nodes = _add_from_shape(nodes, inner[int(rng.integers(len(inner)))], kind, arithmetic, shapes, rng)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input}
    kept = [init for init in result.graph.initializer if init.name in read]  # constant shapes replaced go
    del result.graph.initializer[:]
    result.graph.initializer.extend([*kept, *arithmetic.initializers])
    for value in [*result.graph.input, *result.graph.output]:
        value.type.tensor_type.shape.dim[0].dim_param = BATCH
    if rng.random() < 0.5:  # the image's or sequence's size too (the Reshapes' other dims stay constant)
        dims = result.graph.input[0].type.tensor_type.shape.dim
        symbolic = {4: {2: "height", 3: "width"}, 3: {1: "sequence"}}.get(len(dims), {})
        for index, name in symbolic.items():
            dims[index].dim_param = name
        if symbolic:  # the outputs' dims then follow them: declared unknown (a static one would
            for value in result.graph.output:  # tell ORT to fold shapes for that size alone)
                for dim in value.type.tensor_type.shape.dim[1:]:
                    dim.Clear()
    return result


def _dynamic_parameters(node: onnx.NodeProto, arithmetic: _ShapeArithmetic, constants, shapes, produced: list[str],
                        rng: np.random.Generator) -> None:
    """A constant Reshape target or Resize scale replaced by its run-time computation (sometimes)."""
    if node.op_type == "Reshape" and node.input[1] in constants and rng.random() < 0.85:
        target = [int(d) for d in constants[node.input[1]]]
        if not target or target[0] != 1:
            return
        like = [name for name in produced if shapes.get(name) == tuple(target)]
        choice = rng.random()
        if like and choice < 0.3:
            node.input[1] = arithmetic.node("Shape", [like[-1]])
        elif choice < 0.45:
            node.input[1] = arithmetic.i64([0, *target[1:]])
        else:
            node.input[1] = arithmetic.batch_then(node.input[0], target[1:], rng)
    elif (node.op_type == "Resize" and len(node.input) == 3 and node.input[2] in constants
          and rng.random() < 0.6):
        scales = constants[node.input[2]]
        if scales.shape != (4,) or not np.array_equal(scales[:2], [1, 1]) or not np.all(scales[2:] == np.round(scales[2:])):
            return
        spatial = arithmetic.node("Mul", [arithmetic.dims(node.input[0], 2, 4), arithmetic.i64(scales[2:].astype(np.int64))])
        sizes = arithmetic.node("Concat", [arithmetic.dims(node.input[0], 0, 2), spatial], axis=0)
        node.input[2] = ""
        node.input.append(sizes)


def _same_padding(node: onnx.NodeProto, arithmetic: _ShapeArithmetic, rng: np.random.Generator) -> None:
    """A Conv's symmetric padding (stride 1), sometimes, as a TF export computes "same" padding at run
    time: ``total = (ceil(hw / s) - 1) * s + k - hw``, ``before = total // 2``, then ``Pad``."""
    if node.op_type != "Conv" or rng.random() >= 0.3:
        return
    attributes = {a.name: a for a in node.attribute}
    kernel = list(attributes["kernel_shape"].ints) if "kernel_shape" in attributes else []
    pads = list(attributes["pads"].ints) if "pads" in attributes else []
    strides = list(attributes["strides"].ints) if "strides" in attributes else [1, 1]
    if kernel != [3, 3] or pads != [1, 1, 1, 1] or strides != [1, 1] or "dilations" in attributes:
        return
    shape = arithmetic.node("Shape", [node.input[0]])
    if rng.random() < 0.5:
        hw = arithmetic.node("Slice", [shape, arithmetic.i64([2]), arithmetic.i64([4])])
    else:  # read one dim at a time
        dims = [arithmetic.node("Unsqueeze", [arithmetic.node("Gather", [shape, arithmetic.i64(i)], axis=0), arithmetic.i64([0])])
                for i in (2, 3)]
        hw = arithmetic.node("Concat", dims, axis=0)
    cells = arithmetic.node("Div", [arithmetic.node("Add", [hw, arithmetic.i64([0, 0])]), arithmetic.i64([1, 1])])
    total = arithmetic.node("Sub", [arithmetic.node("Add", [arithmetic.node("Sub", [cells, arithmetic.i64([1, 1])]),
                                                             arithmetic.i64([3, 3])]), hw])
    total = arithmetic.node("Max", [total, arithmetic.i64([0, 0])])
    before = arithmetic.node("Div", [total, arithmetic.i64([2, 2])])
    after = arithmetic.node("Sub", [total, before])
    zeros = arithmetic.i64([0, 0])
    padded = arithmetic.node("Pad", [node.input[0], arithmetic.node("Concat", [zeros, before, zeros, after], axis=0)])
    node.input[0] = padded
    kept = [a for a in node.attribute if a.name != "pads"]
    del node.attribute[:]
    node.attribute.extend(kept)


def _add_from_shape(nodes: list[onnx.NodeProto], tensor: str, kind: str, arithmetic: _ShapeArithmetic, shapes,
                    rng: np.random.Generator) -> list[onnx.NodeProto]:
    """``nodes`` with ``tensor``'s readers reading ``tensor + zeros(tensor.shape)`` (``kind`` "zeros":
    ConstantOfShape) or ``tensor + expand(bias, tensor.shape)`` ("expand": a per-channel bias)."""
    shape_of = arithmetic.node("Shape", [tensor])
    if kind == "zeros":
        addend = arithmetic.node("ConstantOfShape", [shape_of], value=numpy_helper.from_array(np.zeros(1, np.float32)))
    else:
        channels = shapes[tensor][1] if len(shapes[tensor]) > 1 else shapes[tensor][-1]
        bias_shape = (channels,) + (1,) * (len(shapes[tensor]) - 2) if len(shapes[tensor]) > 1 else (channels,)
        bias = arithmetic.name("bias")
        arithmetic.initializers.append(numpy_helper.from_array(rng.normal(0, 0.1, bias_shape).astype(np.float32), bias))
        addend = arithmetic.node("Expand", [bias, shape_of])
    total = arithmetic.node("Add", [tensor, addend])
    added = list(arithmetic.nodes)
    arithmetic.nodes.clear()
    result = []
    for node in nodes:
        if tensor in node.input:
            node.input[:] = [total if name == tensor else name for name in node.input]
        result.append(node)
        if tensor in node.output:
            result.extend(added)
    return result

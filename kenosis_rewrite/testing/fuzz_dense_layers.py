"""MLP and transformer layers of the fuzz's random models (rank-2/3 graphs)."""

from __future__ import annotations

import numpy as np

from kenosis_rewrite.testing.fuzz_builder import Builder, Tensor, activation, batchnorm, gelu, maybe_activation, relu_or_clip

_MAX_FEATURES = 32


def gemm(b: Builder, x: Tensor) -> Tensor:
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
        y = batchnorm(b, y)
    return maybe_activation(b, y, 0.7)


def _matmul(b: Builder, x: Tensor, n: int | None = None) -> Tensor:
    """MatMul by a constant weight, then maybe Add of a constant bias."""
    k = x.shape[-1]
    n = n if n is not None else int(b.rng.integers(4, 17))
    y = b.node("MatMul", [x.name, b.const(b.he((k, n), k), "mw")], x.shape[:-1] + (n,))
    if b.chance(0.6):
        y = b.node("Add", [y.name, b.f32(b.rng.normal(0, 0.1, n), "mb")], y.shape)
    return y


def matmul_block(b: Builder, x: Tensor) -> Tensor:
    return maybe_activation(b, _matmul(b, x), 0.7)


def _mlp_residual(b: Builder, x: Tensor) -> Tensor:
    """Fan-out: x feeds a MatMul branch, joined with x by Add or by Concat on the last axis."""
    branch = maybe_activation(b, _matmul(b, x, n=x.shape[-1]), 0.7)
    if x.shape[-1] * 2 <= _MAX_FEATURES and b.chance(0.4):
        return b.node("Concat", [x.name, branch.name], x.shape[:-1] + (x.shape[-1] * 2,), axis=-1)
    return maybe_activation(b, b.node("Add", [x.name, branch.name], x.shape), 0.4)


def _mlp_shape_op(b: Builder, x: Tensor) -> Tensor:
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
            y = maybe_activation(b, y, 0.4)
            y = b.node("Squeeze", [y.name, b.i64([1], "axes")], (1, f))
    return relu_or_clip(b, y) if b.chance(0.3) else y


def mlp_layer(b: Builder, x: Tensor) -> Tensor:
    menu = [(0.25, gemm), (0.25, matmul_block), (0.1, lambda b, x: activation(b, x)), (0.2, _mlp_residual), (0.2, _mlp_shape_op)]
    if x.rank != 2:
        menu = [(p, f) for p, f in menu if f is not gemm]
    if x.shape[-1] > _MAX_FEATURES:  # shrink wide vectors first
        return gemm(b, x) if x.rank == 2 else matmul_block(b, x)
    weights = np.array([p for p, _ in menu])
    return menu[int(b.rng.choice(len(menu), p=weights / weights.sum()))][1](b, x)


# ---- transformer blocks (rank 3 [1, S, F]) -------------------------------------------------


def _layer_norm(b: Builder, x: Tensor) -> Tensor:
    """LayerNormalization over the features: the op (opset >= 17, half the time) or as exporters
    decompose it (ReduceMean -> Sub -> Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul -> Add)."""
    f = x.shape[-1]
    gamma, beta = b.f32(b.rng.uniform(0.5, 1.5, f), "ln_scale"), b.f32(b.rng.normal(0, 0.1, f), "ln_bias")
    if b.opset >= 17 and b.chance(0.5):
        return b.node("LayerNormalization", [x.name, gamma, beta], x.shape, axis=-1, epsilon=1e-5)
    reduced = x.shape[:-1] + (1,)

    def mean(t: Tensor) -> Tensor:
        if b.opset >= 18:
            return b.node("ReduceMean", [t.name, b.i64([-1], "axes")], reduced, keepdims=1)
        return b.node("ReduceMean", [t.name], reduced, axes=[-1], keepdims=1)

    centred = b.node("Sub", [x.name, mean(x).name], x.shape)
    variance = mean(b.node("Pow", [centred.name, b.f32(2.0, "two")], x.shape))
    deviation = b.node("Sqrt", [b.node("Add", [variance.name, b.f32(1e-5, "eps")], reduced).name], reduced)
    normalized = b.node("Div", [centred.name, deviation.name], x.shape)
    return b.node("Add", [b.node("Mul", [normalized.name, gamma], x.shape).name, beta], x.shape)


def _attention(b: Builder, x: Tensor) -> Tensor:
    """Self-attention: Q/K/V projections, heads split by Reshape/Transpose (or one head), scores
    scaled by Div or Mul, Softmax, the context merged back and projected, a residual Add."""
    _, s, f = x.shape
    heads = b.pick([h for h in (1, 2, 4) if f % h == 0])
    d = f // heads
    q, k, v = (_matmul(b, x, n=f) for _ in range(3))
    if heads > 1:
        def split(t: Tensor, perm: list[int]) -> Tensor:
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


def _feed_forward(b: Builder, x: Tensor) -> Tensor:
    """MatMul -> Gelu/Relu -> MatMul, added to its input."""
    hidden = _matmul(b, x, n=int(b.rng.integers(x.shape[-1], 2 * x.shape[-1] + 1)))
    hidden = gelu(b, hidden) if b.chance(0.6) else b.node("Relu", [hidden.name], hidden.shape)
    return b.node("Add", [x.name, _matmul(b, hidden, n=x.shape[-1]).name], x.shape)


def _transformer_layer(b: Builder, x: Tensor) -> Tensor:
    """A pre- or post-norm encoder layer: attention and feed-forward blocks with layer norms."""
    pre_norm = b.chance(0.5)
    for block in (_attention, _feed_forward):
        x = block(b, _layer_norm(b, x)) if pre_norm else _layer_norm(b, block(b, x))
    return x


def build_transformer(b: Builder) -> tuple[Tensor, Tensor]:
    """(graph input, last tensor) of a small encoder: an embedding MatMul, 1-2 layers, a head."""
    x = Tensor("input", (1, int(b.rng.integers(3, 9)), int(b.rng.integers(4, 17))))
    features = int(b.pick([8, 12, 16]))
    y = _matmul(b, x, n=features)
    for _ in range(int(b.rng.integers(1, 3))):
        y = _transformer_layer(b, y)
    if b.chance(0.5):
        y = _layer_norm(b, y)
    return x, _matmul(b, y, n=int(b.rng.integers(2, 9)))


# ---- whole model ---------------------------------------------------------------------------

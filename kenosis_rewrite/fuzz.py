"""Property fuzzing of ``fix()`` and ``quantize()`` on random small FP32 graphs.

Every case is a pure function of one integer seed: ``np.random.default_rng(seed)`` draws a small
FP32 ONNX model (:func:`random_float_model`), then an ``onnxruntime.quantization.quantize_static``
configuration (:func:`random_quant_config`). :func:`check_fix_case` quantizes the model with that
configuration and checks the properties ``fix()`` promises, for every target:

* no exception other than a :class:`~kenosis_rewrite.KenosisError` subclass;
* the caller's model is not mutated;
* the output loads and runs in ONNX Runtime CPU at ``ORT_ENABLE_ALL`` and ``ORT_DISABLE_ALL`` with
  the input's output names and shapes, and keeps its interface (inputs, outputs, opsets);
* idempotence (``fix(fix(m)) == fix(m)``) and determinism (two calls, identical bytes);
* exactness: when every change in the report says ``exact=True``, the outputs equal the input's
  bit for bit (``ORT_DISABLE_ALL``);
* fidelity: the cosine against FP32 drops by at most :data:`FIDELITY_TOLERANCE`; where the
  symmetric int8 conversion that TensorRT/NPU require ran, by at most its stated bound
  (:func:`kenosis_rewrite.guard.cosine_floor`).

:func:`check_quantize_case` compares ``kenosis_rewrite.quantize()`` with plain ``quantize_static``
(uint8 activations, int8 per-channel weights). Command line::

    python -m kenosis_rewrite.fuzz --seed-start 0 --cases 300 --quantize-cases 50 --jobs 2 --out r.json
    python -m kenosis_rewrite.fuzz --replay 1234 [--target tensorrt] [--dump DIR]
    python -m kenosis_rewrite.fuzz --replay-quantize 1234
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.guard import cosine_floor
from kenosis_rewrite.ort_quantize import quiet_logger

__all__ = [
    "CATEGORIES", "CATEGORY_TITLES", "FIDELITY_TOLERANCE", "CaseResult", "Failure", "TargetResult",
    "random_float_model", "random_quant_config", "plain_quant_config", "quantize_with_config",
    "check_fix_case", "check_quantize_case", "run_cases", "summarize", "format_summary", "main",
]

FIDELITY_TOLERANCE = 0.01
N_CALIBRATION = 4
N_FEEDS = 6

# Failure categories, in the order the summary prints them, with their titles.
CATEGORY_TITLES = (
    ("uncaught", "uncaught exception (not a KenosisError)"),
    ("input_mutated", "input mutated"),
    ("ort_enable_all", "ORT refuses ORT_ENABLE_ALL"),
    ("ort_disable_all", "ORT refuses ORT_DISABLE_ALL"),
    ("shape_change", "output names/shapes changed"),
    ("interface_change", "interface change"),
    ("non_idempotent", "non-idempotent"),
    ("non_deterministic", "non-deterministic"),
    ("exactness_break", "exactness break (all changes exact=True)"),
    ("fidelity_drop", f"fidelity drop > {FIDELITY_TOLERANCE}"),
    ("quantize_below_plain", f"quantize() below plain > {FIDELITY_TOLERANCE}"),
    ("timeout", "case timed out (hang in fix()/quantize()?)"),
    ("harness", "harness error (bug in the fuzzer itself)"),
)
CATEGORIES = tuple(key for key, _ in CATEGORY_TITLES)


# --------------------------------------------------------------------------------------------
# Graph generator
# --------------------------------------------------------------------------------------------


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
    if not any(node.op_type in _QUANTIZABLE_WEIGHTED for node in b.nodes):
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


def random_float_model(rng: np.random.Generator) -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """A small random valid FP32 model and 6 feeds (first 4: calibration, last 2: evaluation).

    Opset 13..21; one model in eight has about half its constants as Constant nodes. CNN bodies (Conv/ConvTranspose/BN/activations/residuals/pools/Resize/shape ops)
    or MLP bodies (Gemm/MatMul/Add/activations/reshapes); one or two graph outputs with static shapes.
    """
    opset = int(rng.integers(13, 22))
    b = _Builder(rng, opset, constant_nodes=bool(rng.random() < 0.12))
    x, last = _build_body(b)
    model = _assemble(b, x, _choose_outputs(b, last))
    _check_shapes(model)
    onnx.checker.check_model(model, full_check=True)
    feeds = [{x.name: rng.standard_normal(x.shape).astype(np.float32)} for _ in range(N_FEEDS)]
    return model, feeds


# --------------------------------------------------------------------------------------------
# Quantizer configurations
# --------------------------------------------------------------------------------------------

_EXTRA_OPTION_KEYS = (
    "ActivationSymmetric", "WeightSymmetric", "AddQDQPairToWeight", "DedicatedQDQPair",
    "QDQKeepRemovableActivations", "ForceQuantizeNoInputCheck",
)
_QUANTIZABLE_WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def plain_quant_config() -> dict:
    """The reference configuration of :func:`check_quantize_case`: u8 activations, s8 per-channel weights."""
    return {"activation_type": "QUInt8", "weight_type": "QInt8", "per_channel": True}


def _op_types_subset(rng: np.random.Generator, op_types: list[str]) -> list[str]:
    """A random non-empty subset of ``op_types``, usually with one weighted op in it."""
    chosen = [op for op in op_types if rng.random() < 0.5]
    weighted = [op for op in op_types if op in _QUANTIZABLE_WEIGHTED]
    if weighted and rng.random() < 0.8:
        chosen.append(weighted[int(rng.integers(len(weighted)))])
    if not chosen:
        chosen.append(op_types[int(rng.integers(len(op_types)))])
    return sorted(set(chosen))


def random_quant_config(rng: np.random.Generator, op_types: list[str] | None = None) -> dict:
    """A random, JSON-able ``quantize_static`` configuration (see :func:`quantize_with_config`).

    ``op_types``: the op types of the model; when given, one config in five restricts
    ``op_types_to_quantize`` to a random subset of them.
    """
    sixteen = rng.random() < 0.12
    if sixteen:
        activation = "QUInt16" if rng.random() < 0.5 else "QInt16"
        weight = ["QInt8", "QUInt8", "QInt16"][int(rng.integers(3))]
    else:
        activation = "QUInt8" if rng.random() < 0.5 else "QInt8"
        # quantize_static refuses int8 activations with uint8 weights: never draw that pair.
        weight = "QUInt8" if activation == "QUInt8" and rng.random() < 0.3 else "QInt8"
    roll = rng.random()
    config = {
        "activation_type": activation,
        "weight_type": weight,
        "per_channel": bool(rng.random() < 0.5),
        "reduce_range": bool(rng.random() < 0.2),
        "calibrate_method": "MinMax" if roll < 0.92 else ("Percentile" if roll < 0.96 else "Entropy"),
        "extra_options": {key: True for key in _EXTRA_OPTION_KEYS if rng.random() < 0.2},
        "use_contrib_ops": bool(rng.random() < 0.05),
        # Post-processing, not a quantize_static option: Q/DQ scales and zero points as Constant
        # nodes instead of initializers, as torch.onnx exports of QAT models have them.
        "qparams_as_constant_nodes": bool(rng.random() < 0.08),
    }
    if op_types and rng.random() < 0.2:
        config["op_types_to_quantize"] = _op_types_subset(rng, sorted(set(op_types)))
    return config


def _static_kwargs(config: dict) -> dict:
    """quantize_static keyword arguments of a JSON config."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType  # noqa: PLC0415

    extra = dict(config.get("extra_options", {}))
    if config.get("use_contrib_ops"):
        extra["UseQDQContribOps"] = True
    kwargs = {
        "quant_format": QuantFormat.QDQ,
        "activation_type": QuantType[config.get("activation_type", "QUInt8")],
        "weight_type": QuantType[config.get("weight_type", "QInt8")],
        "per_channel": bool(config.get("per_channel", False)),
        "reduce_range": bool(config.get("reduce_range", False)),
        "calibrate_method": CalibrationMethod[config.get("calibrate_method", "MinMax")],
        "extra_options": extra,
    }
    if config.get("op_types_to_quantize"):
        kwargs["op_types_to_quantize"] = list(config["op_types_to_quantize"])
    return kwargs


@contextlib.contextmanager
def _silenced():
    """quantize_static logs warnings and its histogram calibrators print: keep the fuzz output readable."""
    with quiet_logger(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _quantize(fp32: onnx.ModelProto, config: dict, feeds) -> tuple[onnx.ModelProto | None, str | None]:
    """(QDQ model, None), or (None, why it was skipped): quantize_static raised, or ORT cannot load
    its output or run it on the first feed (at either optimization level)."""
    from kenosis_rewrite.ort_quantize import FeedsReader  # noqa: PLC0415
    from onnxruntime.quantization import quantize_static  # noqa: PLC0415

    try:
        with tempfile.TemporaryDirectory() as tmp, _silenced():
            source, target = os.path.join(tmp, "float.onnx"), os.path.join(tmp, "qdq.onnx")
            onnx.save(fp32, source)
            quantize_static(source, target, FeedsReader(feeds), **_static_kwargs(config))
            model = onnx.load(target)
        if config.get("qparams_as_constant_nodes"):
            model = _qparams_to_constant_nodes(model)
    except Exception as error:  # noqa: BLE001 - the quantizer raises many unrelated types
        return None, f"quantize_static raised {type(error).__name__}: {_first_line(error)}"
    for level in ("disable_all", "enable_all"):
        try:
            _run(model.SerializeToString(), feeds[:1], level)
        except Exception as error:  # noqa: BLE001
            return None, f"ORT cannot load or run the quantize_static output at {level}: {_first_line(error)}"
    return model, None


def _qparams_to_constant_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The Q/DQ scale and zero-point initializers of ``model`` moved into Constant nodes (same names)."""
    qdq_ops = ("QuantizeLinear", "DequantizeLinear")
    names = {name for node in model.graph.node if node.op_type in qdq_ops for name in node.input[1:] if name}
    initializers = {t.name: t for t in model.graph.initializer if t.name in names}
    constants = [
        helper.make_node("Constant", [], [name], name=f"{name}_constant", value=tensor)
        for name, tensor in sorted(initializers.items())
    ]
    kept = [t for t in model.graph.initializer if t.name not in initializers]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    nodes = constants + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def quantize_with_config(fp32: onnx.ModelProto, config: dict, calibration_feeds) -> onnx.ModelProto | None:
    """``quantize_static`` (QDQ) of ``fp32`` in ``config``; None when it raises or ORT cannot load the result."""
    return _quantize(fp32, config, calibration_feeds)[0]


# --------------------------------------------------------------------------------------------
# Running and comparing
# --------------------------------------------------------------------------------------------

_LEVELS = {
    "enable_all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "disable_all": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}


def _session(model_bytes: bytes, level: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 4
    options.graph_optimization_level = _LEVELS[level]
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def _run(model_bytes: bytes, feeds, level: str) -> tuple[list[str], list[list[np.ndarray]]]:
    """(output names, outputs per feed) at one optimization level; raises what ORT raises."""
    session = _session(model_bytes, level)
    return [o.name for o in session.get_outputs()], [session.run(None, feed) for feed in feeds]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    if a.shape != b.shape:
        return float("nan")
    denominator = np.linalg.norm(a) * np.linalg.norm(b)
    if denominator == 0:
        return 1.0 if np.array_equal(a, b) else 0.0
    return float(np.dot(a, b) / denominator)


def _min_cosine(reference: list[list[np.ndarray]], candidate: list[list[np.ndarray]]) -> float:
    """Per output: cosine over all feeds concatenated; the minimum over outputs."""
    scores = []
    for index in range(len(reference[0])):
        ref = np.concatenate([np.ravel(outputs[index]) for outputs in reference])
        out = np.concatenate([np.ravel(outputs[index]) for outputs in candidate])
        scores.append(_cosine(ref, out))
    return float(min(scores))


def _max_abs_diff(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> float:
    diffs = [
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0))
        for xs, ys in zip(a, b) for x, y in zip(xs, ys) if np.shape(x) == np.shape(y)
    ]
    return max(diffs, default=float("nan"))


def _all_equal(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> bool:
    return all(np.array_equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def _first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else "")[:limit]


def _short_traceback(error: BaseException, frames: int = 4) -> str:
    lines = traceback.format_exception(type(error), error, error.__traceback__)
    tail = lines[-(frames + 1):]
    return "".join(tail)[-1500:]


def _interface(model: onnx.ModelProto) -> tuple:
    return (
        [(v.name, v.type.SerializeToString()) for v in model.graph.input],
        [(v.name, v.type.tensor_type.elem_type) for v in model.graph.output],
        sorted((o.domain, o.version) for o in model.opset_import),
    )


def _attribute_key(attribute: onnx.AttributeProto) -> tuple:
    return (attribute.name, attribute.SerializeToString(deterministic=True))


def _node_key(node: onnx.NodeProto) -> tuple:
    return (node.domain, node.op_type, tuple(node.input), tuple(node.output), tuple(sorted(_attribute_key(a) for a in node.attribute)))


def _node_text(key: tuple) -> str:
    return f"{key[1]}({', '.join(key[2])}) -> {', '.join(key[3])}"


def _structure(model: onnx.ModelProto) -> tuple[list[tuple], dict[str, tuple]]:
    nodes = [_node_key(node) for node in model.graph.node]
    initializers = {}
    for tensor in model.graph.initializer:
        array = numpy_helper.to_array(tensor)
        initializers[tensor.name] = (str(array.dtype), array.shape, array.tobytes())
    return nodes, initializers


def _structural_diff(first: onnx.ModelProto, second: onnx.ModelProto) -> str | None:
    """None when both graphs have the same nodes (any order, names ignored) and initializer values."""
    nodes_a, inits_a = _structure(first)
    nodes_b, inits_b = _structure(second)
    problems = []
    if collections.Counter(nodes_a) != collections.Counter(nodes_b):
        ops_a = collections.Counter(n[1] for n in nodes_a)
        ops_b = collections.Counter(n[1] for n in nodes_b)
        gone, new = ops_a - ops_b, ops_b - ops_a
        problems.append(f"nodes {len(nodes_a)} -> {len(nodes_b)}; op types removed {dict(gone)} added {dict(new)}")
        set_a, set_b = set(nodes_a), set(nodes_b)
        only_a = [_node_text(n) for n in nodes_a if n not in set_b]
        only_b = [_node_text(n) for n in nodes_b if n not in set_a]
        problems.append(f"{len(only_a)} node(s) only before, e.g. {only_a[:3]}; {len(only_b)} only after, e.g. {only_b[:3]}")
    removed, added = sorted(set(inits_a) - set(inits_b)), sorted(set(inits_b) - set(inits_a))
    changed = sorted(k for k in set(inits_a) & set(inits_b) if inits_a[k] != inits_b[k])
    if removed or added or changed:
        problems.append(f"initializers removed {removed[:4]} added {added[:4]} changed {changed[:4]}")
    if first.graph.output != second.graph.output or first.graph.input != second.graph.input:
        problems.append("graph input/output declarations differ")
    return "; ".join(problems) or None


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Failure:
    """One violated property, with what it takes to replay it."""

    category: str
    seed: int
    target: str | None
    message: str
    config: dict | None = None
    rules: list[str] = dataclasses.field(default_factory=list)
    value: float | None = None  # the size of the violation (drop, max abs diff), for ranking

    @property
    def replay(self) -> str:
        if self.target == "quantize()":
            return f"python -m kenosis_rewrite.fuzz --replay-quantize {self.seed}"
        target = f" --target {self.target}" if self.target else ""
        return f"python -m kenosis_rewrite.fuzz --replay {self.seed}{target}"

    def describe(self) -> str:
        value = "" if self.value is None else f" [{self.value:.4g}]"
        rules = f" rules={','.join(self.rules)}" if self.rules else ""
        return f"seed={self.seed} target={self.target}{value}{rules}: {self.message}\n    config={json.dumps(self.config)}\n    replay: {self.replay}"


@dataclasses.dataclass
class TargetResult:
    """What one ``fix(target=...)`` call did on one case."""

    target: str
    seconds: float = 0.0
    typed_error: str | None = None  # "ClassName: message" of an allowed KenosisError
    changes: dict[str, int] = dataclasses.field(default_factory=dict)
    all_exact: bool | None = None
    cos_fixed: float | None = None
    drop: float | None = None
    max_abs_diff: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CaseResult:
    """Everything one seed produced: skip reason, per-target results, failures, timing."""

    seed: int
    kind: str = "fix"  # "fix" or "quantize"
    config: dict | None = None
    skipped: bool = False
    skip_reason: str | None = None
    model: str = ""  # opset and op-type counts of the FP32 model
    cos_qdq: float | None = None
    cos_plain: float | None = None
    cos_quantize: float | None = None
    targets: list[TargetResult] = dataclasses.field(default_factory=list)
    failures: list[Failure] = dataclasses.field(default_factory=list)
    fix_calls: int = 0
    quantize_calls: int = 0
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.failures)

    def fail(self, category: str, target: str | None, message: str, rules=(), value: float | None = None) -> None:
        self.failures.append(Failure(category, self.seed, target, message, self.config, list(rules), value))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _describe_model(model: onnx.ModelProto) -> str:
    counts = collections.Counter(node.op_type for node in model.graph.node)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    inputs = [list(d.dim_value for d in v.type.tensor_type.shape.dim) for v in model.graph.input]
    return f"opset {opset}, input {inputs}, outputs {len(model.graph.output)}, " + ", ".join(f"{k}x{v}" for k, v in sorted(counts.items()))


# --------------------------------------------------------------------------------------------
# Property checks
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Reference:
    """What every target's output is compared with: the input QDQ model and the FP32 outputs."""

    qdq: onnx.ModelProto
    qdq_bytes: bytes
    names: list[str]
    qdq_outputs: list[list[np.ndarray]]  # ORT_DISABLE_ALL
    fp32_outputs: list[list[np.ndarray]]  # ORT_DISABLE_ALL
    cos_qdq: float
    eval_feeds: list[dict]
    verify: bool = True  # fix()'s run-time guard on; off tests the rules' own promises


def _call_fix(model, target: str, verify: bool = True):
    import kenosis_rewrite  # noqa: PLC0415

    return kenosis_rewrite.fix(model, target=target, return_report=True, verify=verify)


def _check_outputs(case: CaseResult, ref: _Reference, fixed_bytes: bytes, target: str, rules) -> dict:
    """Run the fixed model at both levels; record refusals and name/shape changes. Returns level -> outputs."""
    results = {}
    for level in ("enable_all", "disable_all"):
        try:
            names, outputs = _run(fixed_bytes, ref.eval_feeds, level)
        except Exception as error:  # noqa: BLE001
            case.fail(f"ort_{level}", target, f"{type(error).__name__}: {_first_line(error, 400)}", rules)
            continue
        shapes = [tuple(np.shape(o)) for o in outputs[0]]
        expected = [tuple(np.shape(o)) for o in ref.qdq_outputs[0]]
        if names != ref.names or shapes != expected:
            case.fail("shape_change", target, f"{level}: outputs {list(zip(names, shapes))}, input QDQ {list(zip(ref.names, expected))}", rules)
            continue
        results[level] = outputs
    return results


def _check_numbers(case: CaseResult, ref: _Reference, result: TargetResult, outputs, report) -> None:
    """Exactness (all changes exact => bit-equal at ORT_DISABLE_ALL) and fidelity against FP32."""
    rules = sorted(result.changes)
    result.all_exact = all(change.exact for change in report.changes)
    result.max_abs_diff = _max_abs_diff(ref.qdq_outputs, outputs)
    if result.all_exact and not _all_equal(ref.qdq_outputs, outputs):
        exact_rules = sorted({c.rule for c in report.changes})
        case.fail("exactness_break", result.target, f"every change says exact=True but max abs diff {result.max_abs_diff:.4g}", exact_rules, result.max_abs_diff)
    result.cos_fixed = _min_cosine(ref.fp32_outputs, outputs)
    result.drop = ref.cos_qdq - result.cos_fixed
    floor = cosine_floor(ref.cos_qdq, set(result.changes), FIDELITY_TOLERANCE)
    if not result.cos_fixed >= floor:  # NaN counts as a drop
        message = f"cosine vs FP32 {ref.cos_qdq:.5f} (input QDQ) -> {result.cos_fixed:.5f} (fixed; floor {floor:.5f})"
        case.fail("fidelity_drop", result.target, message, rules, result.drop)


def _check_repeat(case: CaseResult, ref: _Reference, fixed: onnx.ModelProto, fixed_bytes: bytes, target: str, rules) -> None:
    """Determinism (fix twice on the input) and idempotence (fix on the output)."""
    checks = (("non_deterministic", ref.qdq, "fix(input) again"), ("non_idempotent", fixed, "fix(fixed)"))
    for category, source, what in checks:
        case.fix_calls += 1
        try:
            again, _ = _call_fix(source, target, ref.verify)
        except Exception as error:  # noqa: BLE001
            import kenosis_rewrite  # noqa: PLC0415

            typed = isinstance(error, kenosis_rewrite.KenosisError)
            kind = category if typed else "uncaught"
            detail = "" if typed else "\n" + _short_traceback(error)
            case.fail(kind, target, f"{what} raised {type(error).__name__}: {_first_line(error)}{detail}", rules)
            continue
        if again.SerializeToString() == fixed_bytes:
            continue
        diff = _structural_diff(fixed, again)
        if category == "non_deterministic":
            case.fail(category, target, f"{what} gave different bytes; {diff or 'structurally equal (names/order/metadata differ)'}", rules)
        elif diff is not None:
            case.fail(category, target, f"{what} differs: {diff}", rules)
        else:
            note = "fix(fixed) byte-different but structurally equal"
            next(r for r in case.targets if r.target == target).notes.append(note)


def _check_target(case: CaseResult, ref: _Reference, target: str) -> None:
    """All properties of ``fix(qdq, target=target)``."""
    import kenosis_rewrite  # noqa: PLC0415

    result = TargetResult(target)
    case.targets.append(result)
    start = time.perf_counter()
    case.fix_calls += 1
    try:
        fixed, report = _call_fix(ref.qdq, target, ref.verify)
    except kenosis_rewrite.KenosisError as error:
        result.typed_error = f"{type(error).__name__}: {_first_line(error)}"
    except Exception as error:  # noqa: BLE001
        case.fail("uncaught", target, f"{type(error).__name__}: {_first_line(error)}\n{_short_traceback(error)}")
    if ref.qdq.SerializeToString() != ref.qdq_bytes:
        case.fail("input_mutated", target, "fix() modified the caller's ModelProto")
        ref.qdq.ParseFromString(ref.qdq_bytes)  # the next target must see the original
    if result.typed_error is not None or any(f.target == target and f.category == "uncaught" for f in case.failures):
        result.seconds = time.perf_counter() - start
        return
    result.changes = report.change_counts()
    result.notes.extend(f"{target}: {note}" for note in report.notes if note.startswith("run-time guard"))
    rules = sorted(result.changes)
    if _interface(fixed) != _interface(ref.qdq):
        case.fail("interface_change", target, "graph inputs, outputs or opset imports differ from the input", rules)
    fixed_bytes = fixed.SerializeToString()
    outputs = _check_outputs(case, ref, fixed_bytes, target, rules)
    if "disable_all" in outputs:
        _check_numbers(case, ref, result, outputs["disable_all"], report)
    _check_repeat(case, ref, fixed, fixed_bytes, target, rules)
    result.seconds = time.perf_counter() - start


def _model_and_config(seed: int) -> tuple[onnx.ModelProto, list[dict], dict]:
    rng = np.random.default_rng(seed)
    fp32, feeds = random_float_model(rng)
    config = random_quant_config(rng, [node.op_type for node in fp32.graph.node])
    return fp32, feeds, config


def check_fix_case(seed: int, targets: tuple[str, ...] | None = None, verify: bool = True) -> CaseResult:
    """Generate, quantize and ``fix()`` case ``seed`` for every target; check every property.

    ``verify=False`` turns fix()'s run-time guard off, so that the rules themselves are held to
    their promises (the guard would undo a rule that breaks them).

    Failures are recorded in ``CaseResult.failures`` (never raised); a configuration that
    ``quantize_static`` (or ORT, on its output) refuses marks the case skipped.
    """
    import kenosis_rewrite  # noqa: PLC0415

    start = time.perf_counter()
    fp32, feeds, config = _model_and_config(seed)
    case = CaseResult(seed=seed, kind="fix", config=config, model=_describe_model(fp32))
    case.quantize_calls += 1
    qdq, reason = _quantize(fp32, config, feeds[:N_CALIBRATION])
    if qdq is None:
        case.skipped, case.skip_reason = True, reason
        case.seconds = time.perf_counter() - start
        return case
    eval_feeds = feeds[N_CALIBRATION:]
    qdq_bytes = qdq.SerializeToString()
    try:
        names, qdq_outputs = _run(qdq_bytes, eval_feeds, "disable_all")
    except Exception as error:  # noqa: BLE001 - the input, not fix(), is broken
        case.skipped, case.skip_reason = True, f"the quantize_static output fails on the evaluation feeds: {_first_line(error)}"
        case.seconds = time.perf_counter() - start
        return case
    _, fp32_outputs = _run(fp32.SerializeToString(), eval_feeds, "disable_all")
    case.cos_qdq = _min_cosine(fp32_outputs, qdq_outputs)
    ref = _Reference(qdq, qdq_bytes, names, qdq_outputs, fp32_outputs, case.cos_qdq, eval_feeds, verify)
    for target in targets or kenosis_rewrite.TARGETS:
        _check_target(case, ref, target)
    case.seconds = time.perf_counter() - start
    return case


def check_quantize_case(seed: int) -> CaseResult:
    """``kenosis_rewrite.quantize()`` against plain ``quantize_static`` (u8/s8 per-channel) on case ``seed``.

    Failures: quantize() raises a non-KenosisError, its output does not run (or changes output
    names/shapes), or its cosine against FP32 is more than :data:`FIDELITY_TOLERANCE` below plain's.
    """
    import kenosis_rewrite  # noqa: PLC0415

    start = time.perf_counter()
    fp32, feeds = random_float_model(np.random.default_rng(seed))
    case = CaseResult(seed=seed, kind="quantize", config=plain_quant_config(), model=_describe_model(fp32))
    calibration, eval_feeds = feeds[:N_CALIBRATION], feeds[N_CALIBRATION:]
    case.quantize_calls += 1
    plain, reason = _quantize(fp32, case.config, calibration)
    if plain is None:
        case.skipped, case.skip_reason = True, f"plain: {reason}"
        case.seconds = time.perf_counter() - start
        return case
    names, fp32_outputs = _run(fp32.SerializeToString(), eval_feeds, "disable_all")
    case.cos_plain = _min_cosine(fp32_outputs, _run(plain.SerializeToString(), eval_feeds, "disable_all")[1])
    result = TargetResult("quantize()")
    case.targets.append(result)
    t0 = time.perf_counter()
    try:
        with _silenced():
            model, report = kenosis_rewrite.quantize(fp32, calibration=calibration, return_report=True)
    except kenosis_rewrite.KenosisError as error:
        result.typed_error = f"{type(error).__name__}: {_first_line(error)}"
        result.seconds = time.perf_counter() - t0
        case.seconds = time.perf_counter() - start
        return case
    except Exception as error:  # noqa: BLE001
        case.fail("uncaught", "quantize()", f"{type(error).__name__}: {_first_line(error)}\n{_short_traceback(error)}")
        case.seconds = time.perf_counter() - start
        return case
    result.seconds = time.perf_counter() - t0
    result.changes = report.change_counts()
    ref = _Reference(fp32, b"", names, fp32_outputs, fp32_outputs, 1.0, eval_feeds)
    outputs = _check_outputs(case, ref, model.SerializeToString(), "quantize()", sorted(result.changes))
    if "disable_all" in outputs:
        case.cos_quantize = _min_cosine(fp32_outputs, outputs["disable_all"])
        result.cos_fixed = case.cos_quantize
        result.drop = case.cos_plain - case.cos_quantize
        if not result.drop <= FIDELITY_TOLERANCE:
            message = f"cosine vs FP32: quantize() {case.cos_quantize:.5f}, plain quantize_static {case.cos_plain:.5f}"
            case.fail("quantize_below_plain", "quantize()", message, sorted(result.changes), result.drop)
    case.seconds = time.perf_counter() - start
    return case


# --------------------------------------------------------------------------------------------
# Running many cases and summarizing
# --------------------------------------------------------------------------------------------


class _CaseTimeout(Exception):
    """Raised by SIGALRM when one case runs longer than its time limit."""


def _on_alarm(signum, frame):
    raise _CaseTimeout()


@contextlib.contextmanager
def _time_limit(seconds: int):
    """SIGALRM-based limit (POSIX main thread only; no limit elsewhere or when ``seconds`` is 0)."""
    usable = seconds > 0 and hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, _on_alarm) if usable else None
    if usable:
        signal.alarm(seconds)
    try:
        yield
    finally:
        if usable:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def _run_one(job: tuple[str, int, int, bool]) -> CaseResult:
    """Worker entry point: one case, every exception recorded (category ``harness`` or ``timeout``)."""
    kind, seed, limit, verify = job
    start = time.perf_counter()
    try:
        with _time_limit(limit):
            return check_fix_case(seed, verify=verify) if kind == "fix" else check_quantize_case(seed)
    except _CaseTimeout:
        case = CaseResult(seed=seed, kind=kind, config=_config_or_none(seed, kind))
        case.fail("timeout", "quantize()" if kind == "quantize" else None, f"the case ran longer than {limit} s")
    except Exception as error:  # noqa: BLE001 - a generator or harness bug must not stop the run
        case = CaseResult(seed=seed, kind=kind, config=_config_or_none(seed, kind))
        case.fail("harness", "quantize()" if kind == "quantize" else None, f"{type(error).__name__}: {_first_line(error)}\n{_short_traceback(error)}")
    case.seconds = time.perf_counter() - start
    return case


def _config_or_none(seed: int, kind: str) -> dict | None:
    """The configuration of case ``seed`` for a harness-error report, if it can still be drawn."""
    if kind != "fix":
        return plain_quant_config()
    try:
        return _model_and_config(seed)[2]
    except Exception:  # noqa: BLE001
        return None


def _worker_init() -> None:
    ort.set_default_logger_severity(4)
    warnings.simplefilter("ignore")


def run_cases(
    seed_start: int = 0, cases: int = 100, quantize_cases: int = 0, jobs: int = 1, progress_every: int = 50,
    stream=None, case_timeout: int = 300, verify: bool = True,
) -> list[CaseResult]:
    """Run ``cases`` fix cases and ``quantize_cases`` quantize cases from ``seed_start``; results by seed.

    Each case runs in a worker process (``jobs`` > 1) under a ``case_timeout`` second limit.
    """
    stream = stream if stream is not None else sys.stdout
    work = [("fix", seed_start + i, case_timeout, verify) for i in range(cases)]
    work += [("quantize", seed_start + i, case_timeout, verify) for i in range(quantize_cases)]
    results = []
    start = time.perf_counter()

    def progress(done: int) -> None:
        if progress_every and (done % progress_every == 0 or done == len(work)):
            failed = sum(r.failed for r in results)
            skipped = sum(r.skipped for r in results)
            print(f"  {done}/{len(work)} cases, {failed} with failures, {skipped} skipped, {time.perf_counter() - start:.1f} s", file=stream, flush=True)

    if jobs <= 1:
        _worker_init()
        for job in work:
            results.append(_run_one(job))
            progress(len(results))
    else:
        context = multiprocessing.get_context("spawn" if sys.platform == "darwin" else "fork")
        with context.Pool(jobs, initializer=_worker_init, maxtasksperchild=100) as pool:
            for result in pool.imap_unordered(_run_one, work, chunksize=1):
                results.append(result)
                progress(len(results))
    return sorted(results, key=lambda r: (r.kind, r.seed))


def _worst(failures: list[Failure], n: int) -> list[Failure]:
    """Biggest violations first (value), then one example per distinct rule set / message start."""
    ranked = sorted(failures, key=lambda f: (-(f.value if f.value is not None and f.value == f.value else float("inf")), f.seed))
    picked, seen = [], set()
    for failure in ranked:
        key = (failure.target, tuple(failure.rules), failure.message[:40])
        if key not in seen:
            seen.add(key)
            picked.append(failure)
        if len(picked) == n:
            break
    return picked


def summarize(results: list[CaseResult], examples: int = 4) -> dict:
    """Counts per failure category, skip rate, call counts, time per case and the worst examples."""
    fix_cases = [r for r in results if r.kind == "fix"]
    quantize_cases = [r for r in results if r.kind == "quantize"]
    by_category = {c: [f for r in results for f in r.failures if f.category == c] for c in CATEGORIES}
    typed = collections.Counter(
        t.typed_error.split(":")[0] for r in results for t in r.targets if t.typed_error
    )
    run_fix = [r for r in fix_cases if not r.skipped]

    def mean(values) -> float | None:
        values = list(values)
        return float(np.mean(values)) if values else None

    return {
        "cases": len(results),
        "fix_cases": len(fix_cases),
        "quantize_cases": len(quantize_cases),
        "skipped": sum(r.skipped for r in results),
        "skip_rate_fix": (sum(r.skipped for r in fix_cases) / len(fix_cases)) if fix_cases else 0.0,
        "skip_reasons": dict(collections.Counter(_skip_key(r.skip_reason) for r in results if r.skipped).most_common(8)),
        "fix_calls": sum(r.fix_calls for r in results),
        "quantize_calls": sum(r.quantize_calls for r in results),
        "seconds_per_fix_case": mean(r.seconds for r in run_fix),
        "seconds_per_quantize_case": mean(r.seconds for r in quantize_cases if not r.skipped),
        "cases_with_failures": sum(r.failed for r in results),
        # not failures: fix() caught a rule breaking its bound and undid it (what and why, per call)
        "guard_undos": [f"seed {r.seed} {note}" for r in results for t in r.targets for note in t.notes
                        if "run-time guard" in note],
        "typed_errors": dict(typed),
        "failures": {c: len(fs) for c, fs in by_category.items()},
        "failing_seeds": {c: len({(f.seed, f.target == "quantize()") for f in fs}) for c, fs in by_category.items()},
        "worst": {c: [dataclasses.asdict(f) | {"replay": f.replay} for f in _worst(fs, examples)] for c, fs in by_category.items() if fs},
    }


def _skip_key(reason: str | None) -> str:
    return (reason or "")[:110]


def format_summary(summary: dict) -> str:
    """The summary table and the worst examples of each category, as text."""
    lines = [
        "",
        f"cases: {summary['cases']} ({summary['fix_cases']} fix, {summary['quantize_cases']} quantize); "
        f"fix() calls {summary['fix_calls']}, quantize calls {summary['quantize_calls']}, "
        f"skipped {summary['skipped']} ({summary['skip_rate_fix']:.1%} of fix cases)",
    ]
    if summary["seconds_per_fix_case"] is not None:
        lines.append(f"time per fix case (4 targets, not skipped): {summary['seconds_per_fix_case']:.3f} s")
    if summary["seconds_per_quantize_case"] is not None:
        lines.append(f"time per quantize case: {summary['seconds_per_quantize_case']:.3f} s")
    for reason, count in summary["skip_reasons"].items():
        lines.append(f"  skipped {count}x: {reason}")
    if summary["typed_errors"]:
        lines.append("typed KenosisErrors (allowed): " + ", ".join(f"{k} x{v}" for k, v in summary["typed_errors"].items()))
    guard_undos = summary.get("guard_undos", [])
    lines.append(f"run-time guard undid a rule in {len(guard_undos)} fix() call(s) (not a failure: caught, undone, reported)")
    lines.extend(f"  {note[:240]}" for note in guard_undos[:8])
    lines += ["", f"{'failure category':48s} {'failures':>8s} {'cases':>6s}", "-" * 64]
    for key, title in CATEGORY_TITLES:
        lines.append(f"{title:48s} {summary['failures'][key]:8d} {summary['failing_seeds'][key]:6d}")
    for key, title in CATEGORY_TITLES:
        examples = summary["worst"].get(key)
        if not examples:
            continue
        lines += ["", f"== {title}: worst examples"]
        for f in examples:
            value = "" if f["value"] is None else f" [{f['value']:.4g}]"
            rules = f" rules={','.join(f['rules'])}" if f["rules"] else ""
            message = f["message"].splitlines()[0][:300]
            lines.append(f"  seed={f['seed']} target={f['target']}{value}{rules}: {message}")
            lines.append(f"      config={json.dumps(f['config'])}")
            lines.append(f"      replay: {f['replay']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _dump_case(seed: int, directory: str) -> None:
    """Write fp32.onnx, qdq.onnx (when not skipped), config.json and feeds.npz of case ``seed``."""
    os.makedirs(directory, exist_ok=True)
    fp32, feeds, config = _model_and_config(seed)
    onnx.save(fp32, os.path.join(directory, "fp32.onnx"))
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
    np.savez(os.path.join(directory, "feeds.npz"), **{f"{i}_{k}": v for i, f in enumerate(feeds) for k, v in f.items()})
    qdq, reason = _quantize(fp32, config, feeds[:N_CALIBRATION])
    if qdq is not None:
        onnx.save(qdq, os.path.join(directory, "qdq.onnx"))
    print(f"case {seed} written to {directory}" + (f" (quantize skipped: {reason})" if reason else ""))


def _replay(args) -> int:
    if args.dump:
        _dump_case(args.replay, args.dump)
    targets = (args.target,) if args.target else None
    case = check_quantize_case(args.replay_quantize) if args.replay_quantize is not None else check_fix_case(args.replay, targets)
    print(json.dumps(case.to_dict(), indent=2, default=str))
    for failure in case.failures:
        print("\nFAILURE", failure.category, "-", failure.describe())
    return 1 if case.failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kenosis_rewrite.fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--seed-start", type=int, default=0)
    parser.add_argument("--cases", type=int, default=100, help="fix() cases (each runs every target)")
    parser.add_argument("--quantize-cases", type=int, default=0, help="quantize() vs plain quantize_static cases")
    parser.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    parser.add_argument("--out", help="write every case result and the summary as JSON here")
    parser.add_argument("--examples", type=int, default=4, help="worst examples printed per category")
    parser.add_argument("--case-timeout", type=int, default=300, help="seconds one case may run (0: no limit)")
    parser.add_argument("--replay", type=int, help="run one fix case and print everything about it")
    parser.add_argument("--replay-quantize", type=int, help="run one quantize case and print everything about it")
    parser.add_argument("--target", help="with --replay: only this target")
    parser.add_argument("--no-guard", action="store_true", help="fix(verify=False): hold the rules themselves to their promises")
    parser.add_argument("--dump", help="with --replay: write the case's models, config and feeds to this folder")
    args = parser.parse_args(argv)
    if args.replay is not None or args.replay_quantize is not None:
        return _replay(args)
    start = time.perf_counter()
    guard = "off" if args.no_guard else "on"
    print(f"fuzzing seeds {args.seed_start}..{args.seed_start + args.cases - 1} ({args.cases} fix cases, {args.quantize_cases} quantize cases, {args.jobs} jobs, fix() guard {guard})")
    results = run_cases(args.seed_start, args.cases, args.quantize_cases, args.jobs, case_timeout=args.case_timeout,
                        verify=not args.no_guard)
    summary = summarize(results, args.examples)
    summary["wall_seconds"] = time.perf_counter() - start
    print(format_summary(summary))
    print(f"\nwall time {summary['wall_seconds']:.1f} s")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"summary": summary, "results": [r.to_dict() for r in results]}, handle, indent=1, default=str)
        print(f"results written to {args.out}")
    return 1 if summary["cases_with_failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

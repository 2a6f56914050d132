"""The fuzz's graph builder: tensors with known shapes, and the activations every layer kind draws from."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import helper, numpy_helper


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor of the graph under construction with its (static) shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


class Builder:
    """Appends uniquely named nodes and initializers to an FP32 graph under construction."""

    def __init__(self, rng: np.random.Generator, opset: int, constant_nodes: bool = False):
        self.rng = rng
        self.opset = opset
        self.constant_nodes = constant_nodes  # emit about half the constants as Constant nodes
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.produced: list[Tensor] = []
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

    def node(self, op: str, inputs: list[str], shape, **attrs) -> Tensor:
        out = Tensor(self.name(op.lower()), tuple(int(d) for d in shape))
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


def clip(b: Builder, x: Tensor, kind: str | None = None) -> Tensor:
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


def prelu(b: Builder, x: Tensor) -> Tensor:
    """PRelu with a single slope or one slope per channel (axis 1, or the last axis below rank 4)."""
    if b.chance(0.5):
        slope = b.rng.uniform(0.05, 0.3, (1,))
    elif x.rank == 4:
        slope = b.rng.uniform(-0.1, 0.4, (x.shape[1], 1, 1))
    else:
        slope = b.rng.uniform(-0.1, 0.4, (x.shape[-1],))
    return b.node("PRelu", [x.name, b.f32(slope, "slope")], x.shape)


def silu(b: Builder, x: Tensor) -> Tensor:
    sig = b.node("Sigmoid", [x.name], x.shape)
    return b.node("Mul", [x.name, sig.name], x.shape)


def gelu(b: Builder, x: Tensor) -> Tensor:
    """Gelu (opset >= 20) or its Erf form x * 0.5 * (1 + erf(x / sqrt(2)))."""
    if b.opset >= 20 and b.chance(0.7):
        return b.node("Gelu", [x.name], x.shape, approximate=b.pick(["none", "tanh"]))
    scaled = b.node("Div", [x.name, b.f32(np.sqrt(2.0), "sqrt2")], x.shape)
    erf = b.node("Erf", [scaled.name], x.shape)
    plus = b.node("Add", [erf.name, b.f32(1.0, "one")], x.shape)
    prod = b.node("Mul", [x.name, plus.name], x.shape)
    return b.node("Mul", [prod.name, b.f32(0.5, "half")], x.shape)


def activation_kinds(opset: int) -> list[str]:
    kinds = ["Relu", "Relu", "Relu", "Clip", "Clip", "LeakyRelu", "PRelu", "Sigmoid", "HardSigmoid", "SiLU", "Gelu", "Tanh"]
    if opset >= 14:
        kinds += ["HardSwish", "HardSwish"]
    return kinds


def activation(b: Builder, x: Tensor, kind: str | None = None) -> Tensor:
    """One activation of a random kind allowed by the opset (several nodes for SiLU and Erf-Gelu)."""
    kind = kind or b.pick(activation_kinds(b.opset))
    if kind == "Clip":
        return clip(b, x)
    if kind == "PRelu":
        return prelu(b, x)
    if kind == "SiLU":
        return silu(b, x)
    if kind == "Gelu":
        return gelu(b, x)
    if kind == "LeakyRelu":
        return b.node("LeakyRelu", [x.name], x.shape, alpha=float(np.round(b.rng.uniform(0.01, 0.3), 3)))
    if kind == "HardSigmoid" and b.chance(0.5):
        return b.node("HardSigmoid", [x.name], x.shape, alpha=float(np.round(b.rng.uniform(0.1, 0.3), 3)))
    return b.node(kind, [x.name], x.shape)


def maybe_activation(b: Builder, x: Tensor, p: float = 0.7) -> Tensor:
    return activation(b, x) if b.chance(p) else x


def relu_or_clip(b: Builder, x: Tensor) -> Tensor:
    return b.node("Relu", [x.name], x.shape) if b.chance(0.6) else clip(b, x)


def batchnorm(b: Builder, x: Tensor) -> Tensor:
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

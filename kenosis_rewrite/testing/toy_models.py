"""Small FP32 networks that reproduce the patterns real CNNs and transformers are made of.

Used by the tests (each rule is checked on the pattern it targets) and by the micro-benchmarks.
Weights are He-initialised from a fixed seed, so every build is identical.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["ToyBuilder", "TOY_MODELS", "EXPORT_TOYS", "build", "build_export", "random_feeds"]


class ToyBuilder:
    """Appends nodes and He-initialised weights to an FP32 graph under construction."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def name(self, base: str) -> str:
        self._count += 1
        return f"{base}_{self._count}"

    def const(self, array: np.ndarray, base: str = "c") -> str:
        name = self.name(base)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], n_out: int = 1, **attrs) -> str:
        outputs = [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=self.name(op), **attrs))
        return outputs[0]

    def conv(self, x: str, c_in: int, c_out: int, k: int = 3, group: int = 1, stride: int = 1) -> str:
        fan_in = c_in // group * k * k
        w = self.rng.normal(0, np.sqrt(2.0 / fan_in), (c_out, c_in // group, k, k)).astype(np.float32)
        b = self.rng.normal(0, 0.1, (c_out,)).astype(np.float32)
        pad = k // 2
        return self.node(
            "Conv", [x, self.const(w, "w"), self.const(b, "b")],
            kernel_shape=[k, k], pads=[pad] * 4, group=group, strides=[stride, stride],
        )

    def matmul(self, x: str, k: int, n: int) -> str:
        w = self.rng.normal(0, np.sqrt(2.0 / k), (k, n)).astype(np.float32)
        return self.node("MatMul", [x, self.const(w, "w")])

    def gemm(self, x: str, k: int, n: int) -> str:
        w = self.rng.normal(0, np.sqrt(2.0 / k), (n, k)).astype(np.float32)
        b = self.rng.normal(0, 0.1, (n,)).astype(np.float32)
        return self.node("Gemm", [x, self.const(w, "w"), self.const(b, "b")], transB=1)

    def clip(self, x: str, lo: float, hi: float) -> str:
        return self.node("Clip", [x, self.const(np.float32(lo), "lo"), self.const(np.float32(hi), "hi")])

    def model(self, inputs: dict[str, list[int]], output: str, opset: int = 17) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "toy",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
            [],
            self.initializers,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        inferred = onnx.shape_inference.infer_shapes(model)
        output_info = next(v for v in inferred.graph.value_info if v.name == output)
        model.graph.output.append(output_info)
        onnx.checker.check_model(model, full_check=True)
        return model


C, H = 16, 16
IMAGE = {"x": [1, C, H, H]}


def _wrap(b: ToyBuilder, body) -> onnx.ModelProto:
    """x -> Conv -> [pattern] -> Conv1x1 -> y, so the pattern sits between two quantized ops."""
    h = b.conv("x", C, C)
    h = body(b, h)
    return b.model(IMAGE, b.conv(h, C, C, k=1))


def _batchnorm(b: ToyBuilder, h: str, channels: int) -> str:
    """An unfolded inference BatchNormalization with some negative gammas (as Paddle exports keep)."""
    gamma = b.rng.uniform(-1.5, 1.5, channels).astype(np.float32)
    beta = b.rng.normal(0, 0.5, channels).astype(np.float32)
    mean = b.rng.normal(0, 0.5, channels).astype(np.float32)
    var = b.rng.uniform(0.5, 2.0, channels).astype(np.float32)
    return b.node("BatchNormalization", [h] + [b.const(a, n) for a, n in
                                            ((gamma, "gamma"), (beta, "beta"), (mean, "mean"), (var, "var"))])


def conv_bn(b):
    """Conv -> BN -> Relu -> depthwise Conv -> BN -> HardSwish -> Conv (PP-LCNet-like, BN unfolded)."""
    h = b.node("Relu", [_batchnorm(b, b.conv("x", C, C), C)])
    h = b.node("HardSwish", [_batchnorm(b, b.conv(h, C, C, group=C), C)])
    return b.model(IMAGE, b.conv(h, C, C, k=1))


def conv_relu(b):
    return _wrap(b, lambda b, h: b.node("Relu", [h]))


def conv_clip(b):
    return _wrap(b, lambda b, h: b.clip(h, 0.0, 6.0))


def conv_leakyrelu(b):
    return _wrap(b, lambda b, h: b.node("LeakyRelu", [h], alpha=0.1))


def conv_sigmoid(b):
    return _wrap(b, lambda b, h: b.node("Sigmoid", [h]))


def conv_hardswish(b):
    return _wrap(b, lambda b, h: b.node("HardSwish", [h]))


def conv_silu(b):
    return _wrap(b, lambda b, h: b.node("Mul", [h, b.node("Sigmoid", [h])]))


def conv_prelu(b):
    slope = b.rng.uniform(0.05, 0.3, (C, 1, 1)).astype(np.float32)
    return _wrap(b, lambda b, h: b.node("PRelu", [h, b.const(slope, "slope")]))


def conv_prelu_uniform(b):
    slope = np.full((C, 1, 1), 0.25, np.float32)
    return _wrap(b, lambda b, h: b.node("PRelu", [h, b.const(slope, "slope")]))


def conv_relu_maxpool(b):
    def body(b, h):
        h = b.node("Relu", [h])
        return b.node("MaxPool", [h], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    return _wrap(b, body)


def conv_clip_maxpool(b):
    def body(b, h):
        h = b.clip(h, 0.0, 6.0)
        return b.node("MaxPool", [h], kernel_shape=[2, 2], strides=[2, 2])
    return _wrap(b, body)


def conv_add_relu(b):
    """A residual block: x feeds both the Conv branch and the Add (fan-out)."""
    h = b.node("Relu", [b.conv("x", C, C)])
    h = b.conv(h, C, C)
    h = b.node("Relu", [b.node("Add", [h, "x"])])
    return b.model(IMAGE, b.conv(h, C, C, k=1))


def concat(b):
    """x fans out to two Conv+Relu branches joined by Concat."""
    left = b.node("Relu", [b.conv("x", C, C)])
    right = b.node("Relu", [b.conv("x", C, C)])
    h = b.node("Concat", [left, right], axis=1)
    return b.model(IMAGE, b.conv(h, 2 * C, C, k=1))


def avgpool(b):
    def body(b, h):
        h = b.node("Relu", [h])
        return b.node("AveragePool", [h], kernel_shape=[2, 2], strides=[2, 2])
    return _wrap(b, body)


def gap_head(b):
    h = b.node("Relu", [b.conv("x", C, 4 * C)])
    h = b.node("Flatten", [b.node("GlobalAveragePool", [h])])
    return b.model(IMAGE, b.gemm(h, 4 * C, 10))


def matmul_relu(b):
    h = b.node("Relu", [b.matmul("t", 64, 64)])
    return b.model({"t": [1, 32, 64]}, b.matmul(h, 64, 64))


def gemm_relu(b):
    h = b.node("Relu", [b.gemm("t", 64, 64)])
    return b.model({"t": [8, 64]}, b.gemm(h, 64, 10))


def resnetish(b, blocks: int = 3, width: int = C):
    """Stem Conv+Relu+MaxPool, residual basic blocks, GAP and a Gemm head."""
    h = b.node("Relu", [b.conv("x", C, width)])
    h = b.node("MaxPool", [h], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    for _ in range(blocks):
        r = b.node("Relu", [b.conv(h, width, width)])
        r = b.conv(r, width, width)
        h = b.node("Relu", [b.node("Add", [r, h])])
    h = b.node("Flatten", [b.node("GlobalAveragePool", [h])])
    return b.model(IMAGE, b.gemm(h, width, 10))


TOY_MODELS = {
    f.__name__: f
    for f in (
        conv_relu, conv_clip, conv_leakyrelu, conv_sigmoid, conv_hardswish, conv_silu, conv_prelu,
        conv_prelu_uniform, conv_relu_maxpool, conv_clip_maxpool, conv_add_relu, concat, avgpool,
        gap_head, matmul_relu, gemm_relu, resnetish, conv_bn,
    )
}


def build(name: str, seed: int = 0) -> onnx.ModelProto:
    """The FP32 toy model ``name`` (one of ``TOY_MODELS``)."""
    return TOY_MODELS[name](ToyBuilder(seed))


def random_feeds(model: onnx.ModelProto, n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` N(0,1) feeds for the float inputs of a toy model (static shapes)."""
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(n):
        feed = {}
        for value in model.graph.input:
            shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
            feed[value.name] = rng.standard_normal(shape).astype(np.float32)
        feeds.append(feed)
    return feeds


# --- FP32 graphs as exporters write them (for prepare(): each trait of a real export) ----------


def _same_padding(b: ToyBuilder, x: str, kernel: int, stride: int) -> str:
    """TF "same" padding computed at run time (tf2onnx): pad = max((ceil(H/s)-1)*s + k - H, 0)."""
    size = b.node("Cast", [b.node("Slice", [b.node("Shape", [x]), b.const(np.array([2], np.int64)),
                                            b.const(np.array([4], np.int64))])], to=TensorProto.FLOAT)
    steps = b.node("Ceil", [b.node("Div", [size, b.const(np.float32(stride))])])
    total = b.node("Sub", [b.node("Add", [b.node("Mul", [b.node("Sub", [steps, b.const(np.float32(1))]),
                                                       b.const(np.float32(stride))]), b.const(np.float32(kernel))]), size])
    total = b.node("Max", [total, b.const(np.float32(0))])
    before = b.node("Floor", [b.node("Div", [total, b.const(np.float32(2))])])
    after = b.node("Sub", [total, before])
    zeros = b.const(np.zeros(2, np.int64))
    pads = b.node("Concat", [zeros, b.node("Cast", [before], to=TensorProto.INT64), zeros,
                             b.node("Cast", [after], to=TensorProto.INT64)], axis=0)
    return b.node("Pad", [x, pads], mode="constant")


def _unpadded_conv(b: ToyBuilder, x: str, c_in: int, c_out: int, k: int, stride: int = 1, group: int = 1) -> str:
    w = b.rng.normal(0, np.sqrt(2.0 / (c_in // group * k * k)), (c_out, c_in // group, k, k)).astype(np.float32)
    return b.node("Conv", [x, b.const(w, "w"), b.const(b.rng.normal(0, 0.1, (c_out,)).astype(np.float32), "b")],
                  kernel_shape=[k, k], strides=[stride, stride], group=group)


def _decomposed_bn(b: ToyBuilder, h: str, shape: tuple[int, ...]) -> str:
    """BatchNorm as exporters of frozen BN write it: Sub(mean) -> Mul(gamma/std) -> Add(beta)."""
    h = b.node("Sub", [h, b.const(b.rng.normal(0, 0.5, shape).astype(np.float32), "mean")])
    h = b.node("Mul", [h, b.const((b.rng.uniform(0.5, 1.5, shape) * b.rng.choice([-1, 1], shape, p=[0.1, 0.9])).astype(np.float32),
                                  "gamma")])
    return b.node("Add", [h, b.const(b.rng.normal(0, 0.3, shape).astype(np.float32), "beta")])


def _decomposed_hardswish(b: ToyBuilder, h: str) -> str:
    """x * clip(x + 3, 0, 6) / 6 (Paddle exports)."""
    gate = b.clip(b.node("Add", [h, b.const(np.float32(3))]), 0.0, 6.0)
    return b.node("Div", [b.node("Mul", [h, gate]), b.const(np.float32(6))])


def tf_same_padding(b: ToyBuilder, symbolic: bool = True) -> onnx.ModelProto:
    """tf2onnx-style: run-time "same" Pad before a stride-2 Conv and a depthwise Conv, BN decomposed,
    HardSwish decomposed; input dims symbolic (batch, height, width) like a Keras export."""
    h = _unpadded_conv(b, _same_padding(b, "x", 3, 2), C, 16, 3, stride=2)
    h = b.node("Relu", [_decomposed_bn(b, h, (1, 16, 1, 1))])
    h = _unpadded_conv(b, _same_padding(b, h, 3, 1), 16, 16, 3, group=16)
    h = _decomposed_hardswish(b, _decomposed_bn(b, h, (1, 16, 1, 1)))
    h = _unpadded_conv(b, h, 16, 8, 1)
    shape = ["N", C, "H", "W"] if symbolic else IMAGE["x"]
    model = b.model({"x": shape}, h)
    model.graph.output[0].type.tensor_type.shape.Clear()
    for dim in (("N", 8, "h", "w") if symbolic else (1, 8, (IMAGE["x"][2] + 1) // 2, (IMAGE["x"][3] + 1) // 2)):
        model.graph.output[0].type.tensor_type.shape.dim.add().CopyFrom(
            onnx.TensorShapeProto.Dimension(dim_param=dim) if isinstance(dim, str) else onnx.TensorShapeProto.Dimension(dim_value=dim))
    return model


def nhwc_export(b: ToyBuilder) -> onnx.ModelProto:
    """NHWC input, a Transpose on each side of every Conv, bias/BN/activation in NHWC between them."""
    to_nchw, to_nhwc = [0, 3, 1, 2], [0, 2, 3, 1]
    h = "x"
    channels = C
    for width in (16, 16):
        h = b.node("Transpose", [h], perm=to_nchw)
        h = b.node("Transpose", [b.conv(h, channels, width)], perm=to_nhwc)
        h = b.node("Relu", [_decomposed_bn(b, h, (width,))])  # per-channel constants on the last axis
        channels = width
    n, c, height, width_ = IMAGE["x"]
    return b.model({"x": [n, height, width_, c]}, h)


def paddle_head(b: ToyBuilder) -> onnx.ModelProto:
    """Paddle-style classifier head whose output is declared rank 0 while the tensor is rank 2."""
    h = _decomposed_hardswish(b, b.conv("x", C, 16))
    h = b.node("Flatten", [b.node("GlobalAveragePool", [h])])
    h = b.node("Softmax", [b.gemm(h, 16, 4)], axis=-1)
    model = b.model(IMAGE, h)
    model.graph.output[0].type.tensor_type.shape.Clear()  # declared as a scalar shape: []
    return model


def grid_detector(b: ToyBuilder) -> onnx.ModelProto:
    """YOLO-style decode: a grid of cell centres built at run time from the feature map's width
    (Shape -> float -> cells = ceil(W / 2) -> Range -> pixels -> Resize back to W), added to the
    predicted offsets. Input height and width symbolic."""
    features = b.node("Relu", [b.conv("x", C, 8)])
    offsets = b.conv(features, 8, 2, k=1)
    width = b.node("Gather", [b.node("Shape", [offsets]), b.const(np.int64(3))])
    cells = b.node("Mul", [b.node("Cast", [width], to=TensorProto.FLOAT), b.const(np.float32(0.5))])
    count = b.node("Cast", [b.node("Ceil", [cells])], to=TensorProto.INT64)
    grid = b.node("Cast", [b.node("Range", [b.const(np.int64(0)), count, b.const(np.int64(1))])], to=TensorProto.FLOAT)
    grid = b.node("Mul", [grid, b.const(np.float32(2.0))])
    grid = b.node("Resize", [grid, b.const(np.array([], np.float32)), b.const(np.array([2.0], np.float32))], mode="nearest")
    model = b.model({"x": [1, C, "H", "W"]}, b.node("Add", [offsets, grid]))
    return model


def crnn_sequence(b: ToyBuilder) -> onnx.ModelProto:
    """CRNN-style sequence head: the feature map reshaped to [N, C*H, W] by a shape computed from its
    own Shape (the batch dim read at run time), time-major, and each time step gathered by a constant
    index into a Gemm (an unrolled recurrent layer's input projections). Batch and width symbolic."""
    h = b.node("Relu", [b.conv("x", C, 8, stride=2)])  # [N, 8, 4, W/2]
    batch = b.node("Gather", [b.node("Shape", [h]), b.const(np.array([0], np.int64))])
    shape = b.node("Concat", [batch, b.const(np.array([32], np.int64)), b.const(np.array([-1], np.int64))], axis=0)
    sequence = b.node("Transpose", [b.node("Reshape", [h, shape])], perm=[2, 0, 1])  # [W/2, N, 32]
    steps = [b.gemm(b.node("Gather", [sequence, b.const(np.int64(t))], axis=0), 32, 16) for t in range(3)]
    return b.model({"x": ["N", C, 8, "W"]}, b.node("Add", [b.node("Add", steps[:2]), steps[2]]))


def text_line_recognizer(b: ToyBuilder) -> onnx.ModelProto:
    """A recognizer as Paddle exports one: ``[1, 3, "?", "?"]``, its height pooled by 32 and squeezed,
    so it runs only at heights 32-63 (any width); a MatMul reads each column."""
    h = b.node("Relu", [b.conv("x", 3, 8)])
    h = b.node("MaxPool", [h], kernel_shape=[32, 1], strides=[32, 1])
    h = b.node("Squeeze", [h, b.const(np.array([2], np.int64))])  # [1, 8, W]: one row left
    h = b.matmul(b.node("Transpose", [h], perm=[0, 2, 1]), 8, 5)
    graph = helper.make_graph(b.nodes, "rec", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "?", "?"])],
                              [helper.make_tensor_value_info(h, TensorProto.FLOAT, [1, None, 5])], b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


EXPORT_TOYS = {f.__name__: f for f in (tf_same_padding, nhwc_export, paddle_head, grid_detector, crnn_sequence,
                                       text_line_recognizer)}


def build_export(name: str, seed: int = 0) -> onnx.ModelProto:
    """The FP32 export-style toy ``name`` (one of ``EXPORT_TOYS``)."""
    return EXPORT_TOYS[name](ToyBuilder(seed))

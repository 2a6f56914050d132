"""Activation equalization into depthwise convolutions (cross-layer scaling, Nagel et al. 2019).

An activation tensor is quantized with one range for all its channels, so a channel that spans a
tenth of the tensor's range is quantized with a tenth of the levels. Where

    T = act(Conv_A(x))   and every reader of T is a depthwise Conv_B (T as its input),

channel ``c`` of ``T`` can be scaled by ``k_c > 0`` (``Conv_A``'s output channel ``c``: weights
and bias times ``k_c``) and undone in the depthwise reader (its channel ``c`` weights divided by
``k_c``). Both scalings are along output channels, which per-channel int8 weights absorb in their
scales, so the weights quantize as well as before; the activation gets ``k_c`` times more levels on
channel ``c``. ``k_c = min(R / max_c, MAX_SCALE, M / (HEADROOM max_c))`` (at least 1), with
``max_c`` the channel's largest magnitude over the calibration feeds and ``R`` the largest of them:
narrow channels are stretched towards the widest one, at most ``MAX_SCALE`` times.

Exactness: ``act`` is Relu, identity, or Clip(0, M) (ReLU6). Relu and identity are positively
homogeneous, so the FP32 model computes the same function (up to float rounding). Clip(0, M) is
homogeneous only below its bound: ``Clip(k x) = k Clip(x)`` wherever ``k x <= M``. Since
``k_c <= M / (HEADROOM max_c)``, that holds for every value up to ``HEADROOM`` times the channel's
calibrated maximum: the FP32 function is unchanged on the calibration feeds and on new inputs
within that margin (the tests check both with ONNX Runtime); beyond it, a stretched channel is
clipped at ``M / k_c >= HEADROOM max_c`` instead of ``M``. Channels never active on the feeds,
tensors with fewer than ``MIN_VALUES`` values per channel over the feeds (their maximum is no
guide to new data), and tensors with other readers (a residual Add, a dense Conv, a graph output)
are left alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from kenosis_rewrite.core import ort_sessions
from kenosis_rewrite.core.report import FixReport

RULE_NAME = "equalize-activation"
# No channel is stretched more than 2x: a channel's reach on new data differs from the calibration
# feeds' (deep, class-specific channels most), and a stretched channel uses up the range's headroom.
# Measured (MobileNetV2, 16 scenes calibrate, 100 objects score, weight rounding on): cap 16: 0.99067,
# cap 4: 0.99526, cap 2: 0.99575, none: 0.99454.
MAX_SCALE = 2.0
HEADROOM = 2.0  # below a Clip bound M, a channel may reach HEADROOM x its calibrated maximum exactly
# A channel's maximum over few values (a 7x7 map on 16 feeds: 784) says little about new data: such
# tensors stay as they are. Measured on EfficientNet-Lite0 (its 7x7 expand outputs): 0.99654 with
# them, 0.99762 without; MobileNetV2's 7x7 ones made it worse too.
MIN_VALUES = 2048


@dataclasses.dataclass(frozen=True)
class _Chain:
    producer: onnx.NodeProto  # Conv_A
    tensor: str  # T
    bound: float | None  # Clip's upper bound M, None for Relu / identity
    readers: tuple[onnx.NodeProto, ...]  # the depthwise Convs reading T


def _attribute(node: onnx.NodeProto, name: str, default):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _constant(name: str, initializers: Mapping[str, onnx.TensorProto]) -> np.ndarray | None:
    return numpy_helper.to_array(initializers[name]) if name in initializers else None


def _activation(node: onnx.NodeProto, initializers) -> tuple[bool, float | None]:
    """(positively homogeneous below a bound, that bound) for Relu and Clip(0, M)."""
    if node.op_type == "Relu":
        return True, None
    if node.op_type != "Clip" or len(node.input) < 3 or not node.input[1] or not node.input[2]:
        return False, None
    low, high = _constant(node.input[1], initializers), _constant(node.input[2], initializers)
    if low is None or high is None or low.size != 1 or high.size != 1 or float(low) != 0.0 or float(high) <= 0:
        return False, None
    return True, float(high)


def _is_depthwise_reader(node: onnx.NodeProto, tensor: str, channels: int, initializers) -> bool:
    if node.op_type != "Conv" or not node.input or node.input[0] != tensor or len(node.input) < 2:
        return False
    weights = _constant(node.input[1], initializers)
    return (weights is not None and weights.ndim == 4 and weights.shape[:2] == (channels, 1)
            and _attribute(node, "group", 1) == channels)


def find_chains(model: onnx.ModelProto) -> list[_Chain]:
    """Conv -> (Relu | Clip(0, M) | nothing) -> depthwise Conv readers only (see the module docstring)."""
    initializers = {init.name: init for init in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in set(node.input):
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in model.graph.output}
    uses = {name: len(nodes) for name, nodes in readers.items()}
    chains = []
    for node in model.graph.node:
        if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in initializers or uses.get(node.input[1]) != 1:
            continue
        if len(node.input) > 2 and node.input[2] and (node.input[2] not in initializers or uses.get(node.input[2]) != 1):
            continue
        channels = initializers[node.input[1]].dims[0]
        tensor, bound = node.output[0], None
        following = readers.get(tensor, [])
        if len(following) == 1 and tensor not in outputs:
            homogeneous, bound = _activation(following[0], initializers)
            if homogeneous:
                tensor = following[0].output[0]
        if tensor == node.output[0]:
            bound = None
        targets = readers.get(tensor, [])
        if tensor in outputs or not targets or not all(_is_depthwise_reader(r, tensor, channels, initializers) and
                                                       uses.get(r.input[1]) == 1 for r in targets):
            continue
        chains.append(_Chain(node, tensor, bound, tuple(targets)))
    return chains


def _reach(value: np.ndarray) -> np.ndarray:
    """Each channel's (axis 1) largest magnitude in ``value``."""
    return np.abs(value).max(axis=tuple(a for a in range(value.ndim) if a != 1))


class ChannelMaxima:
    """Each channel's largest magnitude of the chain tensors of a model, gathered from runs made
    for something else (quantize() passes it to prepare(), whose verification runs the prepared
    model on the calibration feeds): :meth:`tensors` names what to expose, :meth:`observe` takes
    each run's values. :func:`equalize` uses them where they cover its chains."""

    def __init__(self, tensors: Sequence[str] = ()) -> None:
        self._names = list(tensors)
        self._maxima: dict[str, np.ndarray] = {}
        self._counts: dict[str, int] = {}
        self.runs = 0

    def tensors(self, model: onnx.ModelProto) -> list[str]:
        """The tensors of ``model``'s chains (what to show :meth:`observe`); forgets earlier runs."""
        self._names = [chain.tensor for chain in find_chains(model)]
        self.discard()
        return list(self._names)

    def observe(self, values: Mapping[str, np.ndarray]) -> None:
        """Add one run's tensors (by name)."""
        for name in self._names:
            reach = _reach(values[name])
            self._maxima[name] = np.maximum(self._maxima[name], reach) if name in self._maxima else reach
            self._counts[name] = self._counts.get(name, 0) + values[name].size // max(values[name].shape[1], 1)
        self.runs += 1

    def discard(self) -> None:
        """Forget the runs (they were of a model that is not the one kept)."""
        self._maxima, self._counts, self.runs = {}, {}, 0

    def of(self, tensors: Sequence[str], runs: int) -> tuple[list[np.ndarray], list[int]] | None:
        """(maxima, values per channel) of ``tensors`` over ``runs`` runs; None unless all were seen that often."""
        if self.runs != runs or any(name not in self._maxima for name in tensors):
            return None
        return [self._maxima[name] for name in tensors], [self._counts[name] for name in tensors]


def _channel_maxima(model: onnx.ModelProto, tensors: Sequence[str], feeds) -> tuple[list[np.ndarray], list[int]]:
    """Per tensor, each channel's largest magnitude over ``feeds``, and how many values per channel that saw."""
    session = ort_sessions.session(ort_sessions.computing_only(model, tensors), ort_sessions.options(None, level="basic", spinning=False))
    observed = ChannelMaxima(tensors)
    for feed in feeds:
        observed.observe(dict(zip(tensors, session.run(list(tensors), dict(feed)))))
    return observed.of(tensors, len(feeds))


def channel_scales(maxima: np.ndarray, bound: float | None = None) -> np.ndarray:
    """``k_c = min(R / max_c, MAX_SCALE, M / (HEADROOM max_c))``, at least 1, and 1 for channels never
    active (see the module docstring)."""
    widest = float(maxima.max()) if maxima.size else 0.0
    active = maxima > 0
    reach = np.where(active, maxima, 1.0)
    scales = np.minimum(widest / reach, MAX_SCALE)
    if bound is not None:
        scales = np.minimum(scales, bound / (HEADROOM * reach))
    return np.where(active, np.maximum(scales, 1.0), 1.0)


def _scaled(initializer: onnx.TensorProto, factors: np.ndarray) -> onnx.TensorProto:
    values = numpy_helper.to_array(initializer).astype(np.float64)
    shape = (-1,) + (1,) * (values.ndim - 1)
    return numpy_helper.from_array((values * factors.reshape(shape)).astype(numpy_helper.to_array(initializer).dtype),
                                   initializer.name)


def equalize(model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]],
             report: FixReport | None = None, observed: ChannelMaxima | None = None) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with every activation of :func:`find_chains` equalized over ``feeds``, and
    how many were (see the module docstring). ``model`` itself is not changed; the copy of a model
    onnx_ir serialised is one it would serialise the same (only initializers are replaced, by
    tensors encoded as it encodes them: name, dims, data type, raw data). ``observed``: the
    maxima of this model's chain tensors on ``feeds``, already gathered; the model runs only when
    they do not cover every chain."""
    chains = find_chains(model)
    if not chains or not feeds:
        return model, 0
    tensors = [c.tensor for c in chains]
    gathered = observed.of(tensors, len(feeds)) if observed is not None else None
    try:
        maxima, counts = gathered if gathered is not None else _channel_maxima(model, tensors, feeds)
    except Exception as error:  # noqa: BLE001 - ORT raises many types; the model stays as it is
        if report is not None:
            report.note(f"activation equalization skipped: ONNX Runtime could not run the model ({error})")
        return model, 0
    result = onnx.ModelProto()
    result.CopyFrom(model)
    initializers = {init.name: init for init in result.graph.initializer}
    count = 0
    for chain, reach, values in zip(chains, maxima, counts):
        factors = channel_scales(reach, chain.bound)
        if values < MIN_VALUES or np.all(factors == 1.0):
            continue
        names = [name for name in chain.producer.input[1:3] if name]
        for name in names:
            initializers[name].CopyFrom(_scaled(initializers[name], factors))
        for reader in chain.readers:
            initializers[reader.input[1]].CopyFrom(_scaled(initializers[reader.input[1]], 1.0 / factors))
        count += 1
        if report is not None:
            report.changed(RULE_NAME, chain.producer.name or chain.producer.output[0],
                           f"{chain.tensor!r}: channels stretched by x{np.median(factors):.2g} median "
                           f"(up to x{factors.max():.2g}) into {len(chain.readers)} depthwise reader(s)", exact=chain.bound is None)
    return result, count

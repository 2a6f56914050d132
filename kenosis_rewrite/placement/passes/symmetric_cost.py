"""What converting each activation to symmetric int8 costs, measured on calibration feeds.

``SymmetricActivationsPass`` (:mod:`.symmetric_int8`) converts every asymmetric activation quantizer to
zero point 0, as TensorRT and NPU compilers require. For a one-sided tensor the step doubles, and
on some tensors that costs far more than it does on average: on a generated attention block with
197 keys (``tests/unit/placement/passes/test_symmetric_cost.py``) quantize_static's model is at
cosine 0.9935 against FP32 on held-out feeds, 0.9802 with every activation converted (TensorRT and
NPU targets alike), and 0.9976 with the attention probabilities left float and every other
activation converted (above the input, which rounded the probabilities on its own grid). Such a
tensor is better left float: the target runs the ops around it in FP16.

The measure: the model as the pass finds it (the *baseline*) and a *variant* with some of its
quantizers converted (by the pass itself, restricted to them) run on the same feeds with ONNX
Runtime, graph as written (``ORT_DISABLE_ALL``); the cost of the variant is ``1 - cosine`` between
their outputs (mean over feeds, the worst float output). The conversion's rounding error is nearly
independent of the baseline's own error, so to first order this is what the conversion takes off
the model's cosine against FP32 (noise powers add). Where the two roundings are correlated it errs
high, towards leaving float: on that block it read 0.025 for the probabilities alone, where
converting everything took 0.013 off the cosine against FP32; the tests check it against FP32.

Kept cheap: one baseline run that also captures every candidate's input, one run with every
candidate converted (when that costs at most :data:`MAX_COST`, nothing stays float: the common case),
and otherwise single-tensor variants for at most :data:`MAX_MEASURED` candidates, ranked by the
noise their conversion adds to their own tensor (computed from the captured values, no run). A
tensor whose conversion alone costs more than ``MAX_COST`` stays float; then the rest are measured
together, and while they still cost more than ``MAX_COST`` the costliest measured one stays float
too (at most :data:`MAX_CONFIRM` rounds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.core import fidelity
from kenosis_rewrite.graph import qdq_params

__all__ = ["COST_FEEDS", "MAX_CONFIRM", "MAX_COST", "MAX_MEASURED", "costly_conversions"]

# the most output cosine one tensor's conversion may cost before it stays float
MAX_COST = 0.005
COST_FEEDS = 8  # of the calibration feeds
MAX_MEASURED = 16
MAX_CONFIRM = 6


def _candidates(model: ir.Model, convert) -> dict[int, ir.Node]:
    """The quantizers the pass would convert, by their position in graph order."""
    return {index: node for index, node in enumerate(model.graph)
            if qdq_params.is_quantize(node) and isinstance(convert.candidate(node), list)}


def _cost(reference: list[list[np.ndarray]], outputs: list[list[np.ndarray]]) -> float:
    """``1 - cosine`` of ``outputs`` against ``reference``: mean over feeds, worst float output."""
    return max([0.0, *(1.0 - mean if np.isfinite(mean) else 2.0 for mean in fidelity.mean_cosines(reference, outputs)
                       if mean is not None)])


def _baseline(proto: onnx.ModelProto, feeds: list, candidates: Mapping[int, ir.Node]) -> tuple[list, dict[int, list]]:
    """The baseline's outputs on ``feeds``, and each candidate quantizer's input values (one run)."""
    captured = onnx.ModelProto()
    captured.CopyFrom(proto)
    outputs = {o.name for o in proto.graph.output}
    wanted: dict[str, int] = {}
    for index, node in candidates.items():
        value = node.inputs[0]
        if value is not None and value.name and value.name not in outputs and value.dtype is not None:
            wanted.setdefault(value.name, index)
            captured.graph.output.append(onnx.helper.make_tensor_value_info(value.name, int(value.dtype), None))
    runs = fidelity.run(captured.SerializeToString(), feeds, optimized=False)
    count = len(proto.graph.output)
    names = list(wanted)
    values = {wanted[name]: [run[count + k] for run in runs] for k, name in enumerate(names)}
    return [run[:count] for run in runs], values


def _local_noise(convert, node: ir.Node, values: list[np.ndarray] | None) -> float:
    """The noise converting ``node`` adds to its own tensor, relative to the tensor (inf: unknown)."""
    if not values:
        return float("inf")
    params = qdq_params.quant_params(node)
    x = np.concatenate([np.asarray(v, np.float32).ravel() for v in values])
    before = qdq_params.dequantize_array(qdq_params.quantize_array(x, params), params).astype(np.float64)
    scale = float(convert.symmetric_scale(params).reshape(-1)[0])
    lo, hi = (params.qmin - params.scalar_zero_point) * params.scalar_scale, (params.qmax - params.scalar_zero_point) * params.scalar_scale
    after = np.clip(np.rint(np.clip(x, lo, hi) / np.float32(scale)), -127, 127) * scale
    signal = float(np.sum(before * before))
    return float(np.sum((after - before) ** 2)) / signal if signal > 0 else 0.0


class _Variants:
    """Runs of the baseline with some of its candidate quantizers converted."""

    def __init__(self, proto: onnx.ModelProto, feeds: list, reference: list, convert):
        self.proto, self.feeds, self.reference = proto, feeds, reference
        self.convert = convert
        self.measured: dict[frozenset, float] = {}

    def cost(self, converted: frozenset[int]) -> float:
        if converted not in self.measured:
            variant = ir.serde.deserialize_model(self.proto)
            # the pass itself, restricted to these quantizers, without a report
            type(self.convert)(None, tuple(self.convert.fused_activations), only=converted)(variant)
            outputs = fidelity.run(ir.serde.serialize_model(variant).SerializeToString(), self.feeds, optimized=False)
            self.measured[converted] = _cost(self.reference, outputs)
        return self.measured[converted]


def costly_conversions(model: ir.Model, convert, feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[int, str]:
    """The quantizers of ``model`` (by position in graph order) whose conversion costs more than
    :data:`MAX_COST` of the output cosine on ``feeds``, each with what was measured; see the module
    docstring. ``convert``: the :class:`~.symmetric_int8.SymmetricActivationsPass` about to run
    (its ``candidate``, ``symmetric_scale``, ``fused_activations`` and ``report``). Nothing when
    the model cannot be run on the feeds (a note in the pass's report)."""
    candidates = _candidates(model, convert)
    if not candidates or not feeds:
        return {}
    feeds = list(feeds)[:COST_FEEDS]
    proto = ir.serde.serialize_model(model)
    try:
        reference, captured = _baseline(proto, feeds, candidates)
        variants = _Variants(proto, feeds, reference, convert)
        everything = frozenset(candidates)
        if variants.cost(everything) <= MAX_COST:
            return {}
        ranked = sorted(candidates, key=lambda i: -_local_noise(convert, candidates[i], captured.get(i)))[:MAX_MEASURED]
        alone = {i: variants.cost(frozenset({i})) for i in ranked}
        kept = {i: f"converting it alone cost {cost:.4f} of the output cosine on the calibration feeds (more than "
                   f"{MAX_COST})" for i, cost in alone.items() if cost > MAX_COST}
        for _ in range(MAX_CONFIRM):
            rest = everything - frozenset(kept)
            together = variants.cost(rest) if rest else 0.0
            spare = [i for i in alone if i not in kept]
            if together <= MAX_COST or not spare:
                break
            costliest = max(spare, key=alone.get)
            kept[costliest] = (f"converting it alone cost {alone[costliest]:.4f}, but the conversions left together "
                               f"still cost {together:.4f} of the output cosine (more than {MAX_COST})")
    except Exception as error:  # noqa: BLE001 - ORT refuses the model or a feed: nothing is measured
        if convert.report is not None:
            convert.report.note(f"{convert.rule_name}: the conversions' cost could not be measured on the "
                                f"calibration feeds ({str(error).splitlines()[0][:200]}); every tensor was converted")
        return {}
    return kept

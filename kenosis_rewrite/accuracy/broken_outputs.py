"""No output left broken: the layer that breaks one output returns to FP32, found by measuring.

A model's fidelity pooled over its outputs is the large outputs' fidelity: MediaPipe's pose model
quantized by quantize() scored 0.99 pooled on its calibration feeds while its 117 world-landmark
values were at cosine 0.31 against FP32 (0.23 on held-out photos; plain quantize_static and INC the
same). The SNR ranking (:mod:`kenosis_rewrite.accuracy.sensitivity`) blamed the landmark head, whose
return to FP32 changed nothing: the error entered one Conv earlier, whose 288 output channels share
one grid over [-104, 23] (a step of 0.5) while the channels the head reads span a few units.

So, per float output of at least ``fidelity.FEW_VALUES`` values whose mean cosine against FP32 on the
calibration feeds is below :data:`BROKEN_COSINE`: each of the :data:`CANDIDATES` weighted layers
nearest upstream of it is returned to FP32 on its own (quantizers on its input and output removed,
its dequantized weights kept) and the output measured; the best is kept where it lifts the output by
at least :data:`MIN_GAIN` and by more than the output's rounding noise on those feeds
(:mod:`kenosis_rewrite.accuracy.rounding_noise`: how far its cosine moves when a few roundings flip),
and the search repeats, up to :data:`MAX_LAYERS` layers per output. Each
layer kept is a change of rule ``keep-fp32-for-broken-output`` with the cosines before and after;
what it costs in speed is one layer's integer kernel (the report says which).

A gain within the rounding noise is not a repair: PP-OCRv3's text detector on four street scenes,
whose probability map is near zero where they have no text, scored 0.67 and 0.73 with its last
ConvTranspose in FP32, a move its roundings make alone (noise 0.147); that layer is 27% of the
model's MACs (0.69 of them integer instead of 0.96, 1.71x -> 1.35x FP32) and on 100 held-out photos
it changed nothing (cosine 0.7795 -> 0.7793). MediaPipe's pose world landmarks: 0.29 -> 0.97 against
a noise of 0.088, kept.

Approximate by nature: a layer in FP32 removes roundings; the other outputs are measured too, and a
layer that lowers any of them by more than 0.002 is not kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.accuracy.rounding_noise import rounding_noise
from kenosis_rewrite.accuracy.sensitivity import keep_fp32, with_layers_in_fp32
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params

__all__ = ["BROKEN_COSINE", "RULE_NAME", "mend_broken_outputs", "per_output_cosines"]

RULE_NAME = "keep-fp32-for-broken-output"
BROKEN_COSINE = 0.9
CANDIDATES = 24
MIN_GAIN = 0.05
MAX_LAYERS = 3
_OTHERS_TOLERANCE = 0.002
_FEEDS = 4


def per_output_cosines(reference: list, runs: list) -> list[float | None]:
    """Each output's mean cosine over the feeds (None for outputs that are not float or have fewer
    than ``fidelity.FEW_VALUES`` values: scores and flags, too few values for a per-feed cosine)."""
    return [None if np.asarray(value).size < fidelity.FEW_VALUES else cosine
            for value, cosine in zip(reference[0], fidelity.mean_cosines(reference, runs))]


def _upstream_layers(model: ir.Model, output: ir.Value, limit: int) -> list[str]:
    """The names of the ``limit`` weighted ops nearest upstream of ``output`` (breadth first)."""
    found, seen, frontier = [], {id(output)}, [output]
    while frontier and len(found) < limit:
        following = []
        for value in frontier:
            node = value.producer()
            if node is None:
                continue
            if node.op_type in qdq_params.WEIGHTED_OPS and node.name and node.name not in found:
                found.append(node.name)
            for source in node.inputs:
                if source is not None and id(source) not in seen and source.const_value is None:
                    seen.add(id(source))
                    following.append(source)
        frontier = following
    return found[:limit]


class _Measure:
    """Outputs of candidate models against the float model's, on a few calibration feeds."""

    def __init__(self, float_model: onnx.ModelProto, feeds: Sequence[dict]):
        self.feeds = list(feeds)[:_FEEDS]
        self.reference = fidelity.run(float_model, self.feeds)

    def run(self, proto: onnx.ModelProto) -> list[list[np.ndarray]]:
        return fidelity.run(proto, self.feeds)

    def cosines(self, proto: onnx.ModelProto, runs: list[list[np.ndarray]] | None = None) -> list[float | None]:
        """Per output, its mean cosine against FP32; ``runs``: ``proto``'s outputs when already run."""
        return per_output_cosines(self.reference, runs if runs is not None else self.run(proto))

    def noise(self, proto: onnx.ModelProto, runs: list[list[np.ndarray]]) -> list[float]:
        """Per output, how far a feed's cosine moves when a few of ``proto``'s roundings flip (``runs``:
        its own outputs on the feeds)."""
        return rounding_noise(proto, self.reference, runs, self.run)


def _acceptable(now: list, before: list, index: int) -> bool:
    """No other output falls by more than the tolerance."""
    return all(b is None or n is None or i == index or n >= b - _OTHERS_TOLERANCE
               for i, (n, b) in enumerate(zip(now, before)))


def _best_layer(model: ir.Model, kept: list[str], candidates: list[str], measure: _Measure, index: int,
                before: list) -> tuple[str, list] | None:
    """The candidate whose return to FP32 (with ``kept``) lifts output ``index`` most, and the cosines then."""
    best = None
    for name in candidates:
        if name in kept:
            continue
        cosines = measure.cosines(with_layers_in_fp32(model, [*kept, name]))
        if cosines[index] is None or not _acceptable(cosines, before, index):
            continue
        if best is None or cosines[index] > best[1][index]:
            best = (name, cosines)
    return best


def mend_broken_outputs(model: ir.Model, float_model: onnx.ModelProto, feeds: Sequence[dict],
                        report: FixReport) -> int:
    """Return to FP32 the fewest layers (measured, see the module docstring) that lift each broken
    output of ``model`` (quantized ``float_model``); ``model`` is changed in place. Returns how many."""
    measure = _Measure(float_model, feeds)
    proto = ir.serde.serialize_model(model)
    runs = measure.run(proto)  # for the cosines, and for the rounding noise where an output is broken
    before = measure.cosines(proto, runs)
    outputs = list(model.graph.outputs)
    kept: list[str] = []
    reasons: dict[str, str] = {}
    noise = None
    for index, cosine in enumerate(before):
        if cosine is None or cosine >= BROKEN_COSINE:
            continue
        noise = noise if noise is not None else measure.noise(proto, runs)
        min_gain = max(MIN_GAIN, noise[index]) if not np.isnan(noise[index]) else MIN_GAIN
        candidates = _upstream_layers(model, outputs[index], CANDIDATES)
        current = before
        for _ in range(MAX_LAYERS):
            if current[index] >= BROKEN_COSINE:
                break
            best = _best_layer(model, kept, candidates, measure, index, current)
            if best is None or best[1][index] <= current[index] + min_gain:
                break
            kept.append(best[0])
            reasons[best[0]] = (f"output {outputs[index].name!r} at cosine {current[index]:.4f} against FP32 on "
                                f"{len(measure.feeds)} calibration feeds, {best[1][index]:.4f} with this layer in FP32")
            current = best[1]
        before = current if kept else before
    if kept:
        keep_fp32(model, kept, report, reasons, rule=RULE_NAME)
    return len(kept)

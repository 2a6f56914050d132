"""The input model's own rounding noise: how far its answer moves when a few of its roundings flip.

A quantized model rounds every activation to its grid. Moving every activation scale by a relative
``1e-5`` is an invisible change: a value ``k`` steps from zero moves ``k * 1e-5`` of a step, so at
most about one rounding in eight hundred (those nearest a tie) flips by one step, and nothing else
changes. A model whose outputs are smooth in its roundings barely moves; one that is not
(saturating quantizers in front of squeeze-and-excitation gates or score heads) moves a lot. On 8
photos, against FP32: MediaPipe's face detector by Quark moves its worst photo's score cosine by up
to 0.032, MediaPipe's selfie segmenter by NNCF 0.024; waifu2x's UpResNet10 and MediaPipe's iris
landmarks less than 0.001.

That movement is a floor under what any change of roundings can be judged by on a few feeds: a
rewrite that changes roundings at all (a finer grid, a folded scale computed in another order, ORT's
own fused kernels) moves the worst feed by about as much, in either direction, so a fall smaller
than the floor says nothing about accuracy on data the guard has not seen. ``fix()`` reports it
next to the fidelity it measured (:meth:`kenosis_rewrite.placement.guard.Guard.fidelity_summary`);
it does not relax the guard's budget.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.core import fidelity
from kenosis_rewrite.graph import qdq_params

__all__ = ["JITTER", "jittered_scales", "rounding_noise"]

# relative change of every activation scale: flips the roundings of values within 1e-5 of a step's
# width from a tie per unit of code (at most 0.00127 of a step at an 8-bit grid's top)
JITTER = 1e-5


def jittered_scales(model: onnx.ModelProto, relative: float) -> onnx.ModelProto:
    """A copy of ``model`` whose activation Q/DQ scales (those of a Q or DQ that reads a tensor
    computed at run time) are multiplied by ``1 + relative``; weights and their scales untouched.
    Q and DQ of a pair read the same scale value, or equal ones: both move alike."""
    copy = ir.serde.deserialize_model(model)
    names = qdq_params.NameAllocator(copy.graph)
    for node in ir.traversal.RecursiveGraphIterator(copy.graph):
        if not (qdq_params.is_quantize(node) or qdq_params.is_dequantize(node)) or len(node.inputs) < 2:
            continue
        scale = qdq_params.const_array(node.inputs[1])
        if scale is None or qdq_params.const_array(node.inputs[0]) is not None:
            continue
        moved = ir.tensor(np.asarray(scale * (1.0 + relative), dtype=scale.dtype))
        node.replace_input_with(1, qdq_params.add_initializer(copy.graph, moved, names.fresh("jittered_scale")))
    return ir.serde.serialize_model(copy)


def rounding_noise(model: onnx.ModelProto, reference: list[list[np.ndarray]], runs: list[list[np.ndarray]],
                   run: Callable[[onnx.ModelProto], list[list[np.ndarray]]]) -> list[float]:
    """Per float output, the largest move of any feed's cosine against ``reference`` when the model's
    activation scales are jittered by ``+-JITTER``: ``runs`` are the model's own outputs on those
    feeds, ``run`` runs a model on them. An output of one value per feed (a score, whose per-feed
    cosine is its sign) by its cosine pooled over the feeds (:func:`fidelity.feed_cosines`)."""
    before = fidelity.feed_cosines(reference, runs)
    moved = []
    for relative in (JITTER, -JITTER):
        after = fidelity.feed_cosines(reference, run(jittered_scales(model, relative)))
        moved.append([_largest_move(was, now) for was, now in zip(before, after)])
    return [max(up, down) for up, down in zip(*moved)]


def _largest_move(before: list[float], after: list[float]) -> float:
    """The largest change of one feed's cosine (NaN where every feed's is NaN)."""
    moves = [abs(now - was) for was, now in zip(before, after)]
    return float("nan") if all(np.isnan(moves)) else float(np.nanmax(moves))

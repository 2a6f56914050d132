"""The run-time guard of ``fix()``: the rewritten model must run, keep its output shapes and its accuracy.

Every rule states its exactness; the guard checks the whole result against the input model on a
few feeds (the caller's calibration feeds, random ones otherwise), with ONNX Runtime:

* **runs**: the output builds and runs at ``ORT_ENABLE_ALL`` and ``ORT_DISABLE_ALL`` wherever the
  input ran, and every output has the input's shape;
* **exact**: when every change claims exactness, the outputs equal the input's bit for bit
  (``ORT_DISABLE_ALL``: the graph's own semantics, no kernel substitution);
* **faithful**: the cosine of every output against a reference drops by at most ``tolerance``
  compared with the input's (:func:`cosine_floor`; the symmetric int8 conversion that TensorRT/NPU
  require is held to its own stated bound instead). The reference is the FP32 model when the caller gives it, otherwise
  the input model without its activation roundings, every clamp kept (:func:`_unrounded_reference`).

``fix()`` undoes the rules a failed check points at (see :func:`candidate_undos`) and reports why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import common as common_passes

from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.graph.dequantize import remove_qdq_pair
from kenosis_rewrite.placement.passes.contrib_qdq import ContribQDQToStandardPass

__all__ = ["BLIND_COSINE", "DEFAULT_TOLERANCE", "Guard", "candidate_undos", "cosine_floor"]

DEFAULT_TOLERANCE = 0.005
# below this cosine of the input against its own reference on made-up feeds, those feeds do not
# drive the model the way data does (a text detector's probability map on noise is ~0 everywhere:
# 0.003-0.05 on PP-OCR's DB detectors), and a cosine measured there says nothing about accuracy
BLIND_COSINE = 0.9
# symmetric-int8-activations gives TensorRT/NPU the format they require; its stated bound: each
# activation's step grows at most 255/127 (a one-sided tensor loses one bit), so quantization noise
# power, and ``1 - cosine`` with it, grows at most by the square.
SYMMETRIC_RULE = "symmetric-int8-activations"
SYMMETRIC_NOISE_GROWTH = (255 / 127) ** 2


def cosine_floor(input_cosine: float, rules: set[str] | frozenset[str], tolerance: float) -> float:
    """The lowest cosine (against the reference) the rewritten model may have, given the input's and
    the rules that changed it: the input's minus ``tolerance``; with the symmetric conversion, the
    input's noise grown by that rule's bound, minus ``tolerance``."""
    noise = 1.0 - input_cosine
    if SYMMETRIC_RULE in rules:
        noise *= SYMMETRIC_NOISE_GROWTH
    return 1.0 - noise - tolerance
_FEEDS = 4


def _outputs(model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]], optimized: bool) -> list[list[np.ndarray]]:
    at_once = fidelity.concurrent_runs(len(feeds))
    return fidelity.each_run(fidelity.session(model, optimized, at_once), feeds, at_once)


def _per_output_cosines(reference: list[list[np.ndarray]], outputs: list[list[np.ndarray]]) -> list[float]:
    """Cosine of each float output against the reference, over all feeds together."""
    cosines = []
    for index in range(len(reference[0])):
        ref = [np.asarray(r[index]) for r in reference]
        if not np.issubdtype(ref[0].dtype, np.floating):
            continue
        out = [np.asarray(o[index], np.float64).reshape(-1) for o in outputs]
        cosines.append(fidelity.cosine(np.concatenate([r.reshape(-1) for r in ref]), np.concatenate(out)))
    return cosines


def _unrounded_reference(model: onnx.ModelProto) -> onnx.ModelProto:
    """The input without its activation roundings: each per-tensor activation Q/DQ pair becomes a
    clamp to the range it represented. Every clamp stays, whether it stands for a deleted
    activation or a calibrated bound, since the graph cannot tell them apart: a rewrite that drops a
    deleted Clip then shows as a systematic difference, one that drops a calibrated bound only on
    the few values beyond it. com.microsoft Q/DQ are read as the standard ones they compute (else a
    contrib-domain input would be its own reference, and the same model in the default domain not)."""
    copy = ir.serde.deserialize_model(model)
    ContribQDQToStandardPass()(copy)
    names = qdq_params.NameAllocator(copy.graph)
    for node in list(copy.graph):
        params = qdq_params.quant_params(node) if qdq_params.is_quantize(node) else None
        if params is None or not params.is_per_tensor or qdq_params.const_array(node.inputs[0]) is not None:
            continue
        limits = value_range.quantizer_range(params)
        remove_qdq_pair(node, (limits.lo, limits.hi), names)
    common_passes.RemoveUnusedNodesPass()(copy)
    return ir.serde.serialize_model(copy)


@dataclasses.dataclass
class Guard:
    """The input model's behaviour on a few feeds, to hold rewritten models against."""

    model: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]
    float_model: onnx.ModelProto | None = None
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        given = [dict(feed) for feed in self.feeds][:_FEEDS]
        self.given = bool(given)
        # made-up feeds: the dynamic dims at another size where the default size does not run
        sizes = [None] if given or not fidelity.has_dynamic_dims(self.model) else [None, *fidelity.OTHER_DYNAMIC_SIZES]
        self.unavailable = ""
        self.levels_note = ""
        for size in sizes:
            self.feeds = given or fidelity.random_feeds(self.model, _FEEDS, size=size)
            failure = self._run_input()
            if failure is None:
                self.unavailable = ""
                runs = self.input_optimized if self.input_optimized is not None else self.input_plain
                self.input_cosines = _per_output_cosines(self.reference, runs)
                return
            if not self.unavailable:  # the first failure says most (the default sizes)
                self.unavailable = f"the run-time guard could not run the input model ({failure})"

    def _run_input(self) -> str | None:
        """The input's outputs at both optimization levels, or at the one where it runs, and the
        reference's; why it runs at neither, or None."""
        runs, failures = {}, []
        for optimized in (True, False):
            try:
                runs[optimized] = _outputs(self.model, self.feeds, optimized=optimized)
            except Exception as error:  # noqa: BLE001 - any ORT failure: that level is not checked
                failures.append(str(error).splitlines()[0][:200])
        if not runs:
            return failures[0]
        self.input_optimized, self.input_plain = runs.get(True), runs.get(False)
        if failures:
            level = "ORT_DISABLE_ALL" if self.input_plain is None else "ORT_ENABLE_ALL"
            self.levels_note = (f"the run-time guard checked the model at one optimization level only: the input does not "
                                f"run at {level} ({failures[0]})")
        try:
            reference_model = self.float_model if self.float_model is not None else _unrounded_reference(self.model)
            self.reference = _outputs(reference_model, self.feeds, optimized=True)
        except Exception as error:  # noqa: BLE001 - no reference: nothing to hold the rewrite to
            return str(error).splitlines()[0][:200]
        return None

    def blindness(self) -> str | None:
        """Why the guard's cosines say nothing about accuracy on data, or None: the feeds are made up
        (no calibration given) and on them the input itself is far from its reference."""
        if self.unavailable or self.given:
            return None
        lowest = min(self.input_cosines, key=lambda c: -1.0 if np.isnan(c) else c, default=1.0)
        if np.isnan(lowest) or lowest < BLIND_COSINE:
            return (f"on made-up feeds the input model's own cosine against its reference is {lowest:.3f} "
                    f"(< {BLIND_COSINE}): those feeds do not drive it the way data does")
        return None

    def violation(self, model: onnx.ModelProto, report: FixReport) -> str | None:
        """Why ``model`` (the rewrite of the input, described by ``report``) is not acceptable, or None.
        Checked at each optimization level the input runs at."""
        if self.unavailable:
            return None
        runs = {}
        for optimized, expected in ((True, self.input_optimized), (False, self.input_plain)):
            if expected is None:
                continue
            try:
                runs[optimized] = _outputs(model, self.feeds, optimized=optimized)
            except Exception as error:  # noqa: BLE001 - any ORT failure is the finding
                return f"the rewritten model does not run in ONNX Runtime ({str(error).splitlines()[0][:300]})"
        optimized, plain = runs.get(True), runs.get(False)
        for before, after in zip(self.input_plain if plain is not None else self.input_optimized,
                                 plain if plain is not None else optimized):
            for index, (a, b) in enumerate(zip(before, after)):
                if np.shape(a) != np.shape(b):
                    return f"output {index} changed shape: {np.shape(a)} -> {np.shape(b)}"
        if plain is not None and report.changes and all(change.exact for change in report.changes):
            for before, after in zip(self.input_plain, plain):
                for a, b in zip(before, after):
                    if not np.array_equal(a, b, equal_nan=True):
                        return "every change claims exactness, yet the outputs differ from the input's"
        cosines = _per_output_cosines(self.reference, optimized if optimized is not None else plain)
        rules = {change.rule for change in report.changes}
        for index, (before, after) in enumerate(zip(self.input_cosines, cosines)):
            floor = cosine_floor(before, rules, self.tolerance)
            if after < floor:
                return (f"output {index}: cosine against the reference fell from {before:.5f} to {after:.5f} "
                        f"(floor {floor:.5f})")
        return None


def candidate_undos(report: FixReport) -> list[frozenset[str]]:
    """Sets of rules to disable, in the order to try them: each rule that changed something, the
    approximate ones first and the latest first, then all approximate rules, then every rule."""
    changed: list[str] = []
    for change in reversed(report.changes):
        if change.rule not in changed:
            changed.append(change.rule)
    approximate = [rule for rule in changed if any(not c.exact for c in report.changes if c.rule == rule)]
    exact = [rule for rule in changed if rule not in approximate]
    candidates = [frozenset({rule}) for rule in approximate + exact]
    if len(approximate) > 1:
        candidates.append(frozenset(approximate))
    if len(changed) > 1:
        candidates.append(frozenset(changed))
    return candidates

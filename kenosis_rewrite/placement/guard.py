"""The run-time guard of ``fix()``: the rewritten model must run, keep its output shapes and its accuracy.

Every rule states its exactness; the guard checks the whole result against the input model on a
few feeds (the caller's calibration feeds, synthetic ones shaped like data otherwise), with ONNX Runtime:

* **runs**: the output builds and runs at ``ORT_ENABLE_ALL`` and ``ORT_DISABLE_ALL`` wherever the
  input ran, and every output has the input's shape;
* **exact**: when every change claims exactness, the outputs equal the input's bit for bit
  (``ORT_DISABLE_ALL``: the graph's own semantics, no kernel substitution);
* **faithful**: for every float output, the mean over feeds of its cosine against a yardstick, and
  its worst feed's cosine, each drop by at most ``tolerance`` (0.002), or 5% of the input's own
  error ``1 - cosine`` where that is larger, compared with the input's
  (:func:`cosine_floor`; the symmetric int8 conversion that TensorRT/NPU require is held to its own
  stated bound instead). The yardstick is the FP32 model when the caller gives it, otherwise the
  input model with its activation Q/DQ removed and its weights as they are, keeping only the clamps
  that stand for an activation the quantizer deleted (:func:`_unrounded_reference`): a rewrite that
  adds roundings the input did not have (an output quantizer, a merged grid, per-tensor steps) is
  held to the input's distance from FP32, not to the input's distance from its own unrounded self.

``fix()`` undoes the rules a failed check points at (see :func:`candidate_undos`) and reports why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import common as common_passes

from kenosis_rewrite.accuracy import rounding_noise
from kenosis_rewrite.calibration import inputs
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.graph.dequantize import remove_qdq_pair
from kenosis_rewrite.placement.passes import bias_rescale
from kenosis_rewrite.placement.passes.contrib_qdq import ContribQDQToStandardPass

# Rules whose only rounding is onto the integer kernel's accumulator grid (a bias re-rounded by at most
# half of s_x * s_w), far below any activation step: suspected after the rules that change activation
# grids. They are also what lets ORT fuse the ops whose input steps other rules changed, so undoing
# one of them first passes the guard by running those ops in float: PP-OCR's mobile v2 classifier by
# Quark, fix() with no data, 100% -> 0% integer MACs where undoing the finer grids after its Clips at
# the sites that cost the budget keeps them all.
ACCUMULATOR_ROUNDINGS = frozenset({bias_rescale.RULE_NAME})

__all__ = ["BLIND_COSINE", "DEFAULT_TOLERANCE", "Guard", "OutputFidelity", "candidate_undos", "cosine_floor"]

# the most any output's mean or worst-feed cosine may fall: "fix() never lowers fidelity" measured
# against FP32 (NNCF outputs given their missing output quantizers lost up to 0.029 under 0.005
# against the input's unrounded self, issue 55)
DEFAULT_TOLERANCE = 0.002
# where the input is far from the yardstick, 0.002 is far below what a few feeds can tell apart: the
# budget is then this share of the input's own error (1 - cosine), i.e. its noise may grow by 5%
# (PicoDet by NNCF, 0.862 against its yardstick on the guard's feeds: 0.002 kept 1 of 57 BatchNorm
# folds, 1.21x -> 0.89x FP32, where the folds had moved 40 held-out photos 0.0125 closer to FP32)
RELATIVE_NOISE_GROWTH = 0.05
# the mean's budget where made-up feeds do not drive the model (Guard.blindness)
BLIND_TOLERANCE = 0.005
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
# the share of the tolerance a site-by-site search may spend: choosing which of many sites to keep
# on the guard's few feeds fits them (PP-LCNet by NNCF, fix(calibration=16 photos): 25 of 27 folds kept
# within 0.002 on the guard's feeds cost 0.008 on 40 photos it had not seen)
SELECTION_MARGIN = 0.5
# on made-up feeds, a quarter: they stand for data less well than the caller's feeds (MediaPipe's face
# detector by Quark: 12 of 17 sites kept within half the budget on 4 synthetic images lost 0.010 on photos)
MADE_UP_SELECTION_MARGIN = 0.25
_MADE_UP_FEEDS = 4
_GIVEN_FEEDS = 8  # of the caller's calibration feeds: the worst-feed check needs more than a few


@dataclasses.dataclass(frozen=True)
class OutputFidelity:
    """One float output's cosines against the yardstick: the mean over feeds and the worst feed's."""

    mean: float
    worst: float

    def as_dict(self) -> dict[str, float]:
        return {"mean_cosine": self.mean, "worst_feed_cosine": self.worst}


def _outputs(model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]], optimized: bool) -> list[list[np.ndarray]]:
    at_once = fidelity.concurrent_runs(len(feeds))
    return fidelity.each_run(fidelity.session(model, optimized, at_once), feeds, at_once)


def _fidelities(reference: list[list[np.ndarray]], outputs: list[list[np.ndarray]]) -> list[OutputFidelity]:
    """Each float output's cosines against the reference, feed by feed (:func:`fidelity.feed_cosines`:
    an output of one value per feed over all feeds at once): their mean and the worst (NaN where an
    output is not finite: it fails every floor)."""
    found = []
    for per_feed in fidelity.feed_cosines(reference, outputs):
        worst = float("nan") if any(np.isnan(c) for c in per_feed) else min(per_feed)
        found.append(OutputFidelity(float(np.mean(per_feed)), worst))
    return found


# a deleted Relu6 leaves a quantizer whose range tops out here
_RELU6_TOP = 6.0


def _deleted_activation_clamp(quantize: ir.Node) -> tuple[float | None, float | None] | None:
    """The clamp of an activation Q that stands for an activation the quantizer deleted
    (:func:`value_range.implied_clamp`), without the top of a deleted Relu's range unless it is a
    Relu6's: that top is a calibrated bound, which FP32 does not have."""
    clamp = value_range.implied_clamp(quantize)
    params = qdq_params.quant_params(quantize)
    if clamp is None or params.scalar_zero_point != params.qmin:
        return clamp
    top = clamp[1]
    keep_top = top is not None and abs(top - _RELU6_TOP) <= float(np.max(params.scale))
    return clamp[0], (_RELU6_TOP if keep_top else None)


def _shape_readers_to_float(quantize: ir.Node) -> None:
    """Let the Shape and Size nodes that read ``quantize``'s codes read its float input (the same
    shape), so that its pair can be removed: ``softmax-float-input`` reads the shape of the codes it
    dequantizes. Left there, that one rounding stayed in the rewritten model's yardstick and not in
    its input's, and a second fix() applied a rule the first had undone (fuzz seed 8700076)."""
    for user, index in list(quantize.outputs[0].uses()):
        if user.op_type in ("Shape", "Size") and user.domain in ("", "ai.onnx"):
            user.replace_input_with(index, quantize.inputs[0])


def _unrounded_reference(model: onnx.ModelProto) -> onnx.ModelProto:
    """The yardstick without a float model: the input with its per-tensor activation Q/DQ pairs
    removed and its weights as they are. A pair that stands for an activation the quantizer deleted
    leaves that activation's clamp (:func:`_deleted_activation_clamp`); a calibrated bound leaves
    nothing, so the input's own clipping counts against it as it does against FP32.
    com.microsoft Q/DQ are read as the standard ones they compute (else a contrib-domain input would
    be its own reference, and the same model in the default domain not)."""
    copy = ir.serde.deserialize_model(model)
    ContribQDQToStandardPass()(copy)
    names = qdq_params.NameAllocator(copy.graph)
    for node in list(copy.graph):
        params = qdq_params.quant_params(node) if qdq_params.is_quantize(node) else None
        if params is None or not params.is_per_tensor or qdq_params.const_array(node.inputs[0]) is not None:
            continue
        _shape_readers_to_float(node)
        try:
            clamp = _deleted_activation_clamp(node)
        except ValueError:  # parameters it cannot read: the quantizer's whole range, as before
            limits = value_range.quantizer_range(params)
            clamp = (limits.lo, limits.hi)
        remove_qdq_pair(node, clamp, names)
    common_passes.RemoveUnusedNodesPass()(copy)
    return ir.serde.serialize_model(copy)


def _made_up_feeds(model: onnx.ModelProto) -> Iterator[list[dict[str, np.ndarray]]]:
    """Feeds to try in turn where the caller gave none: synthetic feeds shaped like data (natural
    images in the range the input's own quantizer measured, valid token ids; see
    :func:`kenosis_rewrite.calibration.synthetic_feeds`), then N(0, 1) noise, then noise with the
    dynamic dims at other sizes. On noise a photo model's outputs move in ways photos never see
    (MediaPipe pose landmarks by NNCF: a rewrite 0.02 closer to the input's unrounded self on noise
    was 0.021 farther from FP32 on photos; natural images in [0, 1] showed the fall)."""
    try:
        yield inputs.synthetic_feeds(model, _MADE_UP_FEEDS)
    except Exception:  # noqa: BLE001 - inputs it cannot make up: noise below
        pass
    sizes = [None, *fidelity.OTHER_DYNAMIC_SIZES] if fidelity.has_dynamic_dims(model) else [None]
    for size in sizes:
        yield fidelity.random_feeds(model, _MADE_UP_FEEDS, size=size)


@dataclasses.dataclass
class Guard:
    """The input model's behaviour on a few feeds, to hold rewritten models against."""

    model: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]
    float_model: onnx.ModelProto | None = None
    tolerance: float = DEFAULT_TOLERANCE
    # with the caller's feeds, also hold the rewrite on made-up ones (see :meth:`violation`)
    also_made_up: bool = True

    def __post_init__(self) -> None:
        given = [dict(feed) for feed in self.feeds][:_GIVEN_FEEDS]
        self.given = bool(given)
        self.unavailable = ""
        self.levels_note = ""
        self._last_measured: tuple[onnx.ModelProto, list[OutputFidelity]] | None = None
        self.made_up: Guard | None = None
        for feeds in ([given] if given else _made_up_feeds(self.model)):
            self.feeds = feeds
            failure = self._run_input()
            if failure is None:
                self.unavailable = ""
                runs = self.input_optimized if self.input_optimized is not None else self.input_plain
                self.input_fidelity = _fidelities(self.reference, runs)
                if given and self.also_made_up:  # only once the caller's feeds run: else nothing is checked
                    companion = Guard(self.model, [], self.float_model, self.tolerance)
                    self.made_up = None if companion.unavailable else companion
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

    @property
    def yardstick(self) -> str:
        """What the cosines are measured against, in words."""
        if self.float_model is not None:
            return "the FP32 model (float_model=)"
        return "the input with its activation Q/DQ removed, weights as they are (pass float_model= for FP32)"

    @property
    def input_cosines(self) -> list[float]:
        """Each float output's mean cosine against the yardstick, for the input model."""
        return [output.mean for output in self.input_fidelity]

    def fidelity_of(self, model: onnx.ModelProto) -> list[OutputFidelity] | None:
        """``model``'s per-output cosines against the yardstick on the guard's feeds (None where it
        cannot run, or the guard has no input to compare with)."""
        if self.unavailable:
            return None
        measured = self._last_measured
        if measured is not None and measured[0] is model:  # violation() measured this very model
            return measured[1]
        try:
            return _fidelities(self.reference, _outputs(model, self.feeds, optimized=self.input_optimized is not None))
        except Exception:  # noqa: BLE001 - any ORT failure: nothing to report
            return None

    def fidelity_summary(self, model: onnx.ModelProto) -> dict | None:
        """What the report says of fidelity: the yardstick, the feeds, and each float output's mean and
        worst-feed cosine for the input and for ``model`` (None where the guard did not measure)."""
        after = self.fidelity_of(model)
        if after is None:
            return None
        names = [output.name for output in self.model.graph.output]
        floats = [name for name, value in zip(names, self.reference[0]) if np.issubdtype(np.asarray(value).dtype, np.floating)]
        feeds = f"{len(self.feeds)} {'calibration' if self.given else 'made-up'} feeds"
        noise = self._input_rounding_noise() or [None] * len(floats)
        outputs = [{"output": name, "input": before.as_dict(), "fixed": now.as_dict(), "input_rounding_noise": moved}
                   for name, before, now, moved in zip(floats, self.input_fidelity, after, noise)]
        return {"yardstick": self.yardstick, "feeds": feeds, "outputs": outputs}

    def _input_rounding_noise(self) -> list[float] | None:
        """Per float output, how far the input's own cosine moves on these feeds when a few of its
        roundings flip (:mod:`kenosis_rewrite.accuracy.rounding_noise`); None where it cannot run."""
        optimized = self.input_optimized is not None
        runs = self.input_optimized if optimized else self.input_plain
        try:
            return rounding_noise.rounding_noise(self.model, self.reference, runs,
                                                 lambda model: _outputs(model, self.feeds, optimized=optimized))
        except Exception:  # noqa: BLE001 - a model the jitter cannot rewrite or run: not reported
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

    @property
    def _selection_margin(self) -> float:
        return SELECTION_MARGIN if self.given else MADE_UP_SELECTION_MARGIN

    def violation(self, model: onnx.ModelProto, report: FixReport, selecting: bool = False) -> str | None:
        """Why ``model`` (the rewrite of the input, described by ``report``) is not acceptable, or None:
        on the caller's feeds and, where they were given, on made-up ones too (:attr:`made_up`; where
        the input is blind on those, their mean only): the caller's feeds may not be what the model
        meets. PicoDet's layout detector by quantize_static, calibrated on 16 street scenes: BatchNorm
        folds kept at 29 of 94 sites within budget on the scenes moved one output 0.027 farther from
        FP32 on 24 photos of objects; held on synthetic images too, 4 sites, +0.0007. PP-LCNet by NNCF:
        0.0055 -> 0.0035 below the input on 40 photos (integer MACs 79% -> 67%)."""
        problem = self._violation(model, report, selecting)
        if problem is None and self.made_up is not None:
            problem = self.made_up._violation(model, report, selecting)
            if problem is not None:
                problem = f"on {len(self.made_up.feeds)} made-up feeds beside the caller's: {problem}"
        return problem

    def _violation(self, model: onnx.ModelProto, report: FixReport, selecting: bool = False) -> str | None:
        """:meth:`violation` on this guard's own feeds.
        Checked at each optimization level the input runs at. ``selecting``: the check chooses among
        many candidates (which sites to keep), so it fits the guard's feeds; half the tolerance then
        leaves room for the feeds it did not see; and it runs the optimized level only (where the
        cosines are measured; a selection's result is checked whole after, :meth:`violation`)."""
        if self.unavailable:
            return None
        runs = {}
        for optimized, expected in ((True, self.input_optimized), (False, self.input_plain)):
            if expected is None or (selecting and not optimized and self.input_optimized is not None):
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
        fidelities = _fidelities(self.reference, optimized if optimized is not None else plain)
        self._last_measured = (model, fidelities)  # the model fix() returns is the last one it accepted
        return self._fidelity_violation(fidelities, {change.rule for change in report.changes},
                                        self.tolerance * (self._selection_margin if selecting else 1.0))

    def _fidelity_violation(self, fidelities: list[OutputFidelity], rules: set[str], tolerance: float) -> str | None:
        """Where an output's mean or worst-feed cosine fell below its floor, or None."""
        # on feeds that do not drive the model (blindness) one feed's cosine is noise: the mean only,
        # held to the budget the guard had before it judged worst feeds
        blind = self.blindness() is not None
        judged, tolerance = (1, max(tolerance, BLIND_TOLERANCE)) if blind else (2, tolerance)
        for index, (before, after) in enumerate(zip(self.input_fidelity, fidelities)):
            for what, was, now in (("mean", before.mean, after.mean), ("worst-feed", before.worst, after.worst))[:judged]:
                if np.isnan(was):  # the input's own output is not finite there: no fidelity to keep
                    continue
                floor = cosine_floor(was, rules, max(tolerance, RELATIVE_NOISE_GROWTH * (1.0 - was)))
                if not now >= floor:  # NaN fails
                    return (f"output {index}: {what} cosine against {self.yardstick} fell from {was:.5f} to {now:.5f} "
                            f"(floor {floor:.5f})")
        return None


def candidate_undos(report: FixReport) -> list[frozenset[str]]:
    """Sets of rules to disable, in the order to try them: each rule that changed something, the
    approximate ones first and the latest first (those of :data:`ACCUMULATOR_ROUNDINGS` after the
    other approximate ones), then all approximate rules, then every rule."""
    changed: list[str] = []
    for change in reversed(report.changes):
        if change.rule not in changed:
            changed.append(change.rule)
    approximate = [rule for rule in changed if any(not c.exact for c in report.changes if c.rule == rule)]
    approximate.sort(key=lambda rule: rule in ACCUMULATOR_ROUNDINGS)  # stable: latest first within each group
    exact = [rule for rule in changed if rule not in approximate]
    candidates = [frozenset({rule}) for rule in approximate + exact]
    if len(approximate) > 1:
        candidates.append(frozenset(approximate))
    if len(changed) > 1:
        candidates.append(frozenset(changed))
    return candidates

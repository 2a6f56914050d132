"""The whole ``fix()`` transformation of one target as an onnx-ir pass, and the rule set of a target.

:class:`FixPass` runs a target's passes before the rules, its rewrite rules to a fixed point with its
passes after them, then clean-up (unused nodes, order, stale ``output_dtype``, the rewriter's
bookkeeping metadata); usable in any ``onnx_ir.passes.PassManager``. :func:`rules` gives a target's
rewrite rules as an onnxscript ``RewriteRuleSet``, for any onnxscript pipeline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import common as common_passes
from onnxscript.rewriter import RewritePass, RewriteRuleSet

from kenosis_rewrite.core import model_io
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_filter import op_filtered
from kenosis_rewrite.placement.passes.output_quantizers import QuantizeWeightedOutputsPass
from kenosis_rewrite.placement.passes.per_tensor_activations import PerTensorActivationsPass
from kenosis_rewrite.placement.targets import TARGETS as _TARGETS
from kenosis_rewrite.placement.targets import get_target

__all__ = ["TARGETS", "CallerData", "CleanupPass", "FixPass", "apply_rules", "rules"]

TARGETS = tuple(_TARGETS)


_MAX_REWRITE_ROUNDS = 8


_REWRITER_METADATA_PREFIX = "pkg.onnxscript"


def _check_target(target: str) -> None:
    get_target(target)


def rules(target: str = "ort-cpu", report: FixReport | None = None) -> RewriteRuleSet:
    """The onnxscript rewrite rules of ``target``, usable in any onnxscript/onnx-ir pipeline.

    Graph-wide steps (dtype retyping, parameter propagation, bias requantization) are onnx-ir
    passes, not rules: run :class:`FixPass` for the whole transformation.
    """
    return RewriteRuleSet(get_target(target).rules(report))


def _rewrite_until_done(rule_set: RewriteRuleSet) -> ir.passes.PassManager:
    """onnxscript's ``RewritePass`` of ``rule_set``, repeated until nothing more matches (at most
    ``_MAX_REWRITE_ROUNDS`` rounds): a rewrite can create the next one's match."""
    return ir.passes.PassManager([RewritePass(rule_set)], steps=_MAX_REWRITE_ROUNDS, early_stop=True)


class CleanupPass(ir.passes.InPlacePass):
    """Drop what the rewrite left unused and the rewriter's bookkeeping; name new nodes."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        common_passes.RemoveUnusedNodesPass()(model)
        model.graph.sort()  # inserted nodes may read values a reused node defines further down
        for node in model.graph:
            # The zero point fixes a Q's type; a redundant output_dtype goes stale when ORT's own
            # int8 -> uint8 transformer retypes the zero point (ORT then refuses the model).
            if qdq_params.is_quantize(node) and "output_dtype" in node.attributes and len(node.inputs) > 2 \
                    and node.inputs[2] is not None:
                del node.attributes["output_dtype"]
        taken = {node.name for node in model.graph if node.name}
        for index, node in enumerate(model.graph):
            for key in [k for k in node.metadata_props if k.startswith(_REWRITER_METADATA_PREFIX)]:
                del node.metadata_props[key]
            if not node.name:
                name, suffix = f"{node.op_type}_kenosis_{index}", 0
                while name in taken:
                    suffix += 1
                    name = f"{node.op_type}_kenosis_{index}_{suffix}"
                node.name = name
                taken.add(name)
        common_passes.NameFixPass()(model)
        return ir.passes.PassResult(model, modified=True)


@dataclasses.dataclass(frozen=True)
class CallerData:
    """What the caller's calibration feeds give ``fix()`` before it rewrites: the measured output
    ranges of weighted ops that have no quantizer (:mod:`.passes.output_quantizers`) and the feeds
    themselves (the symmetric targets measure each conversion's cost on them, :mod:`.passes.symmetric_cost`).
    The guard's retries hand it on as it is."""

    output_ranges: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    feeds: Sequence[Mapping[str, np.ndarray]] = ()


class FixPass(ir.passes.InPlacePass):
    """The whole ``fix()`` transformation of one target as an onnx-ir pass.

    Usable in ``onnx_ir.passes.PassManager`` and after ``onnxscript.optimizer.optimize``.
    """

    def __init__(
        self, target: str = "ort-cpu", report: FixReport | None = None, disabled: Iterable[str] = (),
        output_ranges: Mapping[str, tuple[float, float]] | None = None,
        calibration: Sequence[Mapping[str, np.ndarray]] | None = None,
    ):
        super().__init__()
        _check_target(target)
        self.target = target
        self.report = report if report is not None else FixReport(target=target)
        self.disabled = frozenset(disabled)
        # measured ranges of weighted-op outputs that have no quantizer (see passes.output_quantizers)
        self.output_ranges = dict(output_ranges or {})
        # the caller's feeds, for the passes that measure on data (passes.symmetric_cost)
        self.calibration = list(calibration or [])

    def _enabled(self, steps: list) -> list:
        return [step for step in steps if getattr(step, "rule_name", getattr(step, "name", None)) not in self.disabled]

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        target = get_target(self.target)
        # weighted outputs with no quantizer get one from measured ranges or, without them, from the
        # bounds a saturating activation's quantizer puts on them (passes.output_quantizers)
        first = ([QuantizeWeightedOutputsPass(self.output_ranges, self.report)]
                 if self.output_ranges or target.facts.quantize_weighted_outputs else [])
        first = self._enabled(first)
        pre_passes = target.pre_passes(self.report, self.calibration)
        # after the per-axis activation quantizers became per-tensor (NNCF's at depthwise inputs): a
        # saturating activation's quantizer bounds the output before it only as one grid
        at = max((i + 1 for i, step in enumerate(pre_passes) if isinstance(step, PerTensorActivationsPass)), default=0)
        pre_passes[at:at] = first
        steps = ir.passes.Sequential(
            *self._enabled(pre_passes),
            common_passes.RemoveUnusedNodesPass(),  # rules count consumers: dead readers must go first
            # post passes move Q/DQ and change parameters, which can make a rule match again (a Clip
            # moved in front of a Reshape now follows the Conv's Q/DQ): rules and post passes are
            # repeated together until nothing changes, so a second fix() finds nothing left to do
            ir.passes.PassManager([
                _rewrite_until_done(op_filtered(self._enabled(target.rules(self.report)))),
                ir.passes.PassManager(self._enabled(target.post_passes(self.report)), steps=_MAX_REWRITE_ROUNDS),
            ], steps=_MAX_REWRITE_ROUNDS, early_stop=True),
        )
        result = steps(model)
        # the output quantizers put after a chain the folds then left: no integer kernel, one rounding more
        undone = sum(step.undo_unfolded_chains(model) for step in first)
        CleanupPass()(model)
        return ir.passes.PassResult(model, modified=result.modified or bool(undone))


def apply_rules(model: ir.Model, target: str, names: Iterable[str], report: FixReport | None = None) -> bool:
    """Apply only the rules and post passes of ``target`` named in ``names``; True when any rewrote
    ``model``. For a pipeline that ran :class:`FixPass` with them disabled and applies them last
    (quantize() lowers the integer MatMuls' bias Adds, and concatenates codes, after bias correction,
    which reads the QDQ form)."""
    wanted = frozenset(names)
    target_ = get_target(target)
    rules = [rule for rule in target_.rules(report) if rule.name in wanted]
    modified = bool(rules) and _rewrite_until_done(op_filtered(rules))(model).modified
    for step in target_.post_passes(report):
        if getattr(step, "rule_name", None) in wanted:
            modified = step(model).modified or modified
    return modified


def _fix_once(
    model: model_io.ModelLike | model_io.LoadedModel, target: str, disabled: frozenset[str], data: CallerData | None = None,
    held_sites: frozenset = frozenset(),
) -> tuple[model_io.LoadedModel, FixReport]:
    """FixPass on a fresh private copy of ``model`` (or on ``model`` itself when it is one already);
    ``data``: what the caller's feeds gave; ``held_sites``: (rule, site) pairs the rules leave alone."""
    loaded = model if isinstance(model, model_io.LoadedModel) else model_io.load(model, lazy=True)
    report = FixReport(target=target, held_sites=held_sites)
    for note in loaded.notes:
        report.note(note)
    data = data or CallerData()
    FixPass(target, report, disabled, data.output_ranges, data.feeds)(loaded.model)
    return loaded, report

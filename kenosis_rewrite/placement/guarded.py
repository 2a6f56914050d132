"""What ``fix()`` does with the run-time guard's verdict (:mod:`kenosis_rewrite.placement.guard`).

A rewrite the guard rejects is undone and rebuilt: candidate sets of rules are disabled in turn until
the result passes, then, where one rule was at fault, it is undone only at the sites that cost the
fidelity (released half by half under the guard); where no single rule's undo passes, output
quantizers that sit on the model's answer are held first. Where the guard is blind (made-up feeds that do not
drive the model), rules whose cost only data shows stay out; where it cannot run the input at all,
only the rewrites proven exact are applied. A closing round applies the pipeline once more to what
passed, held to the same guard, and the sites where the guard undid rules are marked in the output's
node metadata, so that a second ``fix()`` finds nothing left to do.
"""

from __future__ import annotations

import dataclasses

import onnx
import onnx_ir as ir

from kenosis_rewrite.core import interleaved_timing, model_io
from kenosis_rewrite.core.report import GUARD_UNDO_REASON, FixReport, Refusal
from kenosis_rewrite.diagnosis.explain import kernel_facts
from kenosis_rewrite.errors import KenosisError
from kenosis_rewrite.graph.rule_base import GUARD_HELD_KEY, guard_marks
from kenosis_rewrite.placement import speed_check
from kenosis_rewrite.placement.fix_pass import CallerData, _fix_once
from kenosis_rewrite.placement.guard import Guard, candidate_undos
from kenosis_rewrite.placement.passes import output_quantizers, per_tensor_activations
from kenosis_rewrite.placement.passes.float_kernel_inputs import FloatKernelInputsPass
from kenosis_rewrite.placement.passes.float_kernel_weights import FloatKernelWeightsPass

# Rules that add a rounding step on a grid set from the graph alone, whose cost compounds over
# layers: kept only where the guard can measure them. On PP-OCRv5's DB text detector quantized by
# NNCF, 34 HardSwish inputs given their saturation grids took the cosine against FP32 from 0.851 to
# 0.780, which random feeds could not show (there the input's own cosine is 0.045). With
# calibration= feeds the guard measures them on data.
# Per-tensor steps in place of per-channel ones likewise: NNCF's MediaPipe selfie segmenter, whose
# input is at 0.66 of its unrounded self on made-up feeds, lost 0.037 against FP32 on photos.
UNVERIFIABLE_BLIND = frozenset({output_quantizers.RULE_NAME, per_tensor_activations.RULE_NAME})


def _guarded_fix(
    model: model_io.ModelLike, first: model_io.LoadedModel, target: str, guard: Guard | None, data: CallerData | None = None,
) -> tuple[model_io.LoadedModel, FixReport, onnx.ModelProto | None]:
    """:func:`_faithful_fix`, then :func:`_not_slower`: what the guard accepts, never slower than the input."""
    result = _faithful_fix(model, first, target, guard, data)
    return _with_held_sites_marked(*_not_slower(model, result, target, guard, data))


def _faithful_fix(
    model: model_io.ModelLike, first: model_io.LoadedModel, target: str, guard: Guard | None, data: CallerData | None = None,
) -> tuple[model_io.LoadedModel, FixReport, onnx.ModelProto | None]:
    """FixPass on ``first`` (the caller's ``model``, loaded), then the run-time guard; rules the guard
    rejects are undone (the model is loaded again from the caller's input and rebuilt without them)
    and the report says why. Where the guard is blind (:meth:`Guard.blindness`), the rules of
    :data:`UNVERIFIABLE_BLIND` that changed the model are undone first, and stay undone."""
    loaded, report = _fix_once(first, target, frozenset(), data)
    if guard is None:
        return loaded, report, None
    after = model_io.in_memory_proto(loaded.model)
    if after is None:
        return loaded, report, after
    if guard.levels_note:
        report.note(guard.levels_note)
    if guard.unavailable:
        return _exact_only(model, loaded, report, after, target, guard, data)
    blind = guard.blindness()
    kept_out = frozenset(c.rule for c in report.changes if c.rule in UNVERIFIABLE_BLIND) if blind else frozenset()
    if kept_out:
        problem = (f"{blind}; {', '.join(sorted(kept_out))} adds roundings whose cost only data shows (pass "
                   "calibration= feeds to apply it, measured on them)")
        candidates = [frozenset(), *candidate_undos(report)]
    else:
        problem = guard.violation(after, report)
        if problem is None:
            return loaded, report, after
        candidates = candidate_undos(report)
    for disabled, answer in [*_with_answer_held(candidates, report), (None, frozenset())]:
        if disabled is None:  # nothing short of no rewrite at all passes: return the input as it was
            loaded = model_io.load(model, lazy=True)
            retry_report, retry_after = FixReport(target=target), model_io.in_memory_proto(loaded.model)
            undone = "every rewrite"
        else:
            disabled = disabled | kept_out
            loaded, retry_report = _fix_once(model, target, disabled, data, answer)
            retry_after = model_io.in_memory_proto(loaded.model)
            if guard.violation(retry_after, retry_report) is not None:
                continue
            undone = ", ".join([*sorted(disabled), *([_on_the_answer(answer)] if answer else [])])
        held: frozenset = answer
        at_sites = _undone_at_sites(model, target, disabled, kept_out, report, guard, data, answer)
        undone_whole: frozenset[str] = frozenset()
        if at_sites is not None:
            (loaded, retry_report, retry_after), held, undone = at_sites
        else:
            undone_whole = (disabled or frozenset()) - kept_out
            # the rules undone whole (every rule that changed the model where nothing passed), and the summary says so
            undone_rules = disabled if disabled is not None else {change.rule for change in report.changes}
            retry_report.refusals[:0] = [
                Refusal(rule, "whole model", f"{GUARD_UNDO_REASON}: {problem}") for rule in sorted(undone_rules)
            ]
        if held:
            retry_report.refusals[:0] = _held_site_refusals(report, held, problem)
        retry_report.note(f"run-time guard: {problem}; undone: {undone}")
        if disabled is not None and retry_after is not None:
            loaded, retry_report, retry_after = _closing_round(loaded, retry_report, retry_after, target, guard,
                                                               data, kept_out, held)
            # every site where the guard undid a rule, whole or there alone (kept-out rules are not its verdict)
            retry_report.held_sites = held | frozenset(
                (rule, site) for rule in undone_whole for site in _sites_of(report, rule) if site is not None)
        if target.startswith("ort-cpu") and interleaved_timing.u8s8_saturates():
            retry_report.note(
                "this host is x86 without VNNI: ORT's uint8 x int8 kernels saturate int16 pair sums here, so "
                "integer kernels lose accuracy that the same graph keeps on a VNNI host (measure there before deploying)"
            )
        return loaded, retry_report, retry_after
    raise AssertionError("unreachable")


def _not_slower(
    model: model_io.ModelLike, result: tuple[model_io.LoadedModel, FixReport, onnx.ModelProto | None], target: str,
    guard: Guard | None, data: CallerData | None,
) -> tuple[model_io.LoadedModel, FixReport, onnx.ModelProto | None]:
    """``result``, unless it runs slower than the input (:mod:`.speed_check`): then the rules that changed
    it are undone one at a time, latest first, until the result is neither slower nor rejected by the
    guard; the input as it was where none passes."""
    loaded, report, after = result
    if guard is None or guard.unavailable or after is None or not report.changes:
        return result
    feed = guard.feeds[0]
    if not speed_check.worth_timing(speed_check.input_latency_ms(guard.model, feed)):
        return result
    problem = speed_check.slower(guard.model, after, feed)
    if problem is None:
        return result
    disabled = {r.rule for r in report.refusals if r.where == "whole model" and r.reason.startswith(GUARD_UNDO_REASON)}
    for rule in dict.fromkeys(change.rule for change in reversed(report.changes)):
        disabled.add(rule)
        trial, trial_report = _fix_once(model, target, frozenset(disabled), data, report.held_sites)
        trial_after = model_io.in_memory_proto(trial.model)
        if (trial_after is not None and guard.violation(trial_after, trial_report) is None
                and speed_check.slower(guard.model, trial_after, feed) is None):
            trial_report.refusals[:0] = [Refusal(name, "whole model", f"undone: {problem}") for name in sorted(disabled)]
            trial_report.note(f"speed check: {problem}; undone: {', '.join(sorted(disabled))}")
            return trial, trial_report, trial_after
    unchanged = model_io.load(model, lazy=True)
    kept = FixReport(target=target)
    kept.note(f"speed check: {problem}, and undoing its rules one by one did not make it faster: the input is "
              "returned unchanged")
    return unchanged, kept, model_io.in_memory_proto(unchanged.model)


def _with_held_sites_marked(
    loaded: model_io.LoadedModel, report: FixReport, after: onnx.ModelProto | None,
) -> tuple[model_io.LoadedModel, FixReport, onnx.ModelProto | None]:
    """The model with each node at a site where the guard undid rules marked with their names
    (:data:`~kenosis_rewrite.graph.rule_base.GUARD_HELD_KEY`), so that fix() of it holds them too. A
    site is a node's name (a rule's match root) or a value's (a pass's: its producer is marked)."""
    rules_at: dict[str, set[str]] = {}
    for rule, site in report.held_sites:
        rules_at.setdefault(site, set()).add(rule)
    marked = False
    for node in ir.traversal.RecursiveGraphIterator(loaded.model.graph):
        rules = set(rules_at.get(node.name, ()))
        for value in node.outputs:
            rules |= rules_at.get(value.name, set())
        if rules:
            node.metadata_props[GUARD_HELD_KEY] = ",".join(sorted(guard_marks(node) | rules))
            marked = True
    if marked and after is not None:
        after = model_io.in_memory_proto(loaded.model)
    return loaded, report, after


MAX_SITE_TRIALS = 48  # fix() runs the per-site search may spend, each held to the guard


def _sites_of(report: FixReport, rule: str) -> list:
    """The sites (match roots) of ``rule``'s changes in ``report``, in order; None among them where a
    change's site is unknown (a pass's change, an unnamed root node)."""
    return list(dict.fromkeys(report.sites.get((rule, change.where)) for change in report.changes if change.rule == rule))


def _undone_at_sites(
    model: model_io.ModelLike, target: str, disabled: frozenset[str] | None, kept_out: frozenset[str], report: FixReport,
    guard: Guard, data: CallerData | None, answer: frozenset = frozenset(),
) -> tuple[tuple[model_io.LoadedModel, FixReport, onnx.ModelProto], frozenset, str] | None:
    """Where the guard passed with one rule undone, that rule undone only at the sites that cost the
    fidelity: the sites are released half by half (each try a fix() held to the guard) and those whose
    release fails stay held. ``answer``: ``(rule, site)`` pairs held throughout (:func:`_with_answer_held`).
    Returns the result, the held pairs (``answer`` among them) and what was undone; None where the
    rule's sites are unknown, or holding fewer of them does not pass."""
    rules = (disabled or frozenset()) - kept_out
    if len(rules) != 1:
        return None
    rule = next(iter(rules))
    sites = _sites_of(report, rule)
    if len(sites) < 2 or None in sites:
        return None
    held, best, trials = set(sites), None, 0

    def release(chunk: list) -> None:
        nonlocal best, trials
        if trials >= MAX_SITE_TRIALS:
            return
        trials += 1
        pairs = frozenset((rule, site) for site in held - set(chunk)) | answer
        loaded, trial_report = _fix_once(model, target, kept_out, data, pairs)
        after = model_io.in_memory_proto(loaded.model)
        if after is not None and guard.violation(after, trial_report, selecting=True) is None:
            held.difference_update(chunk)
            best = (loaded, trial_report, after)
        elif len(chunk) > 1:
            release(chunk[:len(chunk) // 2])
            release(chunk[len(chunk) // 2:])

    release(sites[:len(sites) // 2])  # releasing them all is what failed
    release(sites[len(sites) // 2:])
    if best is None or len(held) == len(sites):
        return None
    if guard.violation(best[2], best[1]) is not None:  # the choice was checked at one level: now at both
        return None
    pairs = frozenset((rule, site) for site in held) | answer
    also = f", {_on_the_answer(answer)}" if answer else ""
    return best, pairs, f"{rule} at {len(held)} of its {len(sites)} sites (kept at the others){also}"


def _on_the_answer(answer: frozenset) -> str:
    """What holding ``answer`` (:func:`_with_answer_held`) undid, in words."""
    return f"{output_quantizers.RULE_NAME} at its {len(answer)} site(s) on the model's answer"


def _with_answer_held(candidates: list[frozenset[str]], report: FixReport) -> list[tuple[frozenset[str], frozenset]]:
    """``(rules to undo, (rule, site) pairs to hold)`` to try in turn: each candidate as it is; where
    output quantizers were put on the model's answer (a graph output with no quantizer between, which
    they cost directly), after the single-rule candidates: those sites held alone, then with each single
    rule. MediaPipe's selfie segmenter by NNCF, fix(calibration=): its mask head's quantizer (steps of
    4.1 over ``[-894, 150]``) and per-tensor-activations together cost the guard's budget, and no single
    rule's undo passed: three rules were undone whole, 48% of MACs integer (0.45x FP32); with the head
    held and per-tensor-activations undone, 80% (0.58x)."""
    rule = output_quantizers.RULE_NAME
    answer = frozenset((rule, report.sites.get((rule, change.where))) for change in report.changes
                       if change.rule == rule and output_quantizers.ON_THE_ANSWER in change.detail)
    plain = [(candidate, frozenset()) for candidate in candidates]
    if not answer or any(site is None for _, site in answer):
        return plain
    singles = [candidate for candidate in candidates if len(candidate) == 1]
    held = [(frozenset(), answer), *((candidate, answer) for candidate in singles if candidate != {rule})]
    return [*plain[:len(singles)], *held, *plain[len(singles):]]


def _held_site_refusals(report: FixReport, held: frozenset, problem: str) -> list[Refusal]:
    """A refusal for each change of ``report`` made at a held site: where the guard undid its rule."""
    return [Refusal(change.rule, change.where, f"{GUARD_UNDO_REASON} at this site: {problem}")
            for change in report.changes if (change.rule, report.sites.get((change.rule, change.where))) in held]


UNCHECKED_HINT = ("pass calibration= feeds the model runs on (or input_shapes= that pin its symbolic dims) so "
                  "the guard can run it and check them")


def _exact_only(
    model: model_io.ModelLike, loaded: model_io.LoadedModel, report: FixReport, after: onnx.ModelProto, target: str,
    guard: Guard, data: CallerData | None,
) -> tuple[model_io.LoadedModel, FixReport, onnx.ModelProto | None]:
    """Where the guard cannot run the input, only rewrites proven bit-exact are applied: the rules
    that made an approximate change are held back, and the report says which and how to lift that."""
    held_back = frozenset(change.rule for change in report.changes if not change.exact)
    if not held_back:
        report.note(f"{guard.unavailable}; every change is exact, so none was held back")
        return loaded, report, after
    loaded, exact_report = _fix_once(model, target, held_back, data)
    exact_report.refusals[:0] = [
        Refusal(rule, "whole model", f"held back: not exact, and {guard.unavailable}") for rule in sorted(held_back)
    ]
    exact_report.note(f"{guard.unavailable}: only exact rewrites were applied; held back: {', '.join(sorted(held_back))} "
                      f"({UNCHECKED_HINT})")
    return loaded, exact_report, model_io.in_memory_proto(loaded.model)


def _closing_round(
    loaded: model_io.LoadedModel, report: FixReport, after: onnx.ModelProto, target: str, guard: Guard,
    data: CallerData | None, kept_out: frozenset[str], held_sites: frozenset = frozenset(),
) -> tuple[model_io.LoadedModel, FixReport, onnx.ModelProto]:
    """The pipeline once more on the model the guard let through with rules undone, held to the same
    guard (the caller's input). A rule undone on the input graph can pass on the rewritten one:
    applied after the other rules moved and merged the Q/DQ, the symmetric int8 conversion no longer
    widens pairs they remove (fuzz seed 30000103). Without this round a second fix() made that
    rewrite, held only to its own input: fix() was not idempotent. The round's model is taken when
    it changed and passes; otherwise the model as it was. ``kept_out``: rules it leaves out too;
    ``held_sites``: the sites where the guard undid a rule, left alone too."""
    again, again_report = _fix_once(after, target, kept_out, data, held_sites)
    if not again_report.changes:
        return loaded, report, after
    merged = FixReport(target=target, changes=[*report.changes, *again_report.changes],
                       refusals=list(report.refusals), notes=list(report.notes), fidelity=report.fidelity)
    again_after = model_io.in_memory_proto(again.model)
    if again_after is None or guard.violation(again_after, merged) is not None:
        return loaded, report, after
    applied = {change.rule for change in again_report.changes}
    merged.refusals = [refusal for refusal in merged.refusals if refusal.rule not in applied]
    merged.note(f"run-time guard: applied to the rewritten model, {', '.join(sorted(applied))} passes it")
    again.returns = loaded.returns
    return again, merged, again_after


def with_float_kernel_steps(
    loaded: model_io.LoadedModel, report: FixReport, after: onnx.ModelProto | None, guard: Guard | None,
) -> onnx.ModelProto | None:
    """The accepted rewrite with the ops ORT runs in float given float weights
    (:mod:`.passes.float_kernel_weights`), then reading float inputs where their quantizer serves
    nothing else (:mod:`.passes.float_kernel_inputs`), each step kept where the guard accepts it too.
    ``loaded`` and ``report`` are updated in place, and the output proto is returned. Asking ORT which
    ops run in float costs a session, so this runs on what the guard accepted, not in each of its
    retries; ORT is asked again before the second step, because float weights change what it runs: a
    BatchNormalization between a Conv and its quantizer folds into float weights, and ORT then
    quantizes them itself into a QLinearConv (PP-OCRv3's text detector by NNCF: 10 Convs)."""
    if after is None or (guard is not None and guard.unavailable):
        return after
    steps = (lambda facts, report: FloatKernelWeightsPass(facts.float_heavy, report),
             lambda facts, report: FloatKernelInputsPass(facts.float_heavy, report, kept_quantizers=facts.kept_quantizers))
    for step in steps:
        try:
            facts = kernel_facts(loaded.model)
        except KenosisError:  # ORT cannot optimize the model: nothing known about its kernels
            return after
        if not facts.float_heavy:
            return after
        trial_report = dataclasses.replace(report, changes=list(report.changes), refusals=list(report.refusals),
                                           notes=list(report.notes))
        trial, trial_pass = ir.serde.deserialize_model(after), step(facts, trial_report)
        if not trial_pass(trial).modified:
            continue
        problem = guard.violation(ir.serde.serialize_model(trial), trial_report) if guard is not None else None
        if problem is not None:
            report.note(f"{trial_pass.rule_name}: not applied, the run-time guard found that {problem}")
            continue
        step(facts, report)(loaded.model)
        after = model_io.in_memory_proto(loaded.model)
    return after

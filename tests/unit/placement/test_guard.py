"""The run-time guard: what fix() applies when the guard cannot run the input, or runs it at one level only."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import pytest

import kenosis_rewrite
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.diagnosis.explain import KernelFacts
from kenosis_rewrite.graph.rule_base import GUARD_HELD_KEY
from kenosis_rewrite.placement import guard, guarded
from kenosis_rewrite.testing.model_checks import outputs

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "fixtures"


def _nncf_model() -> onnx.ModelProto:
    """NNCF 3.4's output of a PP-LCNet-like block: fix() makes exact and approximate changes on it."""
    return onnx.load(FIXTURES / "lcnetish_nncf3.4.onnx")


def _approximate_rules(report) -> set[str]:
    return {change.rule for change in report.changes if not change.exact}


def test_when_the_guard_cannot_run_the_input_only_exact_rewrites_are_applied():
    qdq = _nncf_model()
    _, guarded = kenosis_rewrite.fix(qdq, return_report=True)
    approximate = _approximate_rules(guarded)
    assert approximate  # the guarded run keeps approximate rewrites it measured
    wrong_size = [{"x": np.zeros((1, 3, 17, 17), np.float32)}]  # the model takes 16 x 16: nothing runs
    fixed, report = kenosis_rewrite.fix(qdq, calibration=wrong_size, return_report=True)

    assert report.changes and all(change.exact for change in report.changes)
    held = {r.rule for r in report.refusals if r.reason.startswith("held back: not exact")}
    assert held and held <= approximate | {"quantize-weighted-outputs"}
    assert any("only exact rewrites were applied" in note and "calibration=" in note for note in report.notes)
    # exact: bit for bit the input's outputs on feeds it runs on, graph semantics (no ORT fusions)
    feeds = fidelity.random_feeds(qdq, 2)
    for feed in feeds:
        for a, b in zip(outputs(qdq, feed, optimized=False), outputs(fixed, feed, optimized=False)):
            np.testing.assert_array_equal(a, b)


def test_a_guard_that_runs_the_input_at_one_level_checks_at_that_level(monkeypatch):
    qdq = _nncf_model()
    qdq.graph.doc_string = "runs optimized only"  # kept by fix(): the rewrite needs the optimizer too
    real = guard._outputs

    def no_plain_runs_of_the_input(model, feeds, optimized):
        if not optimized and model.graph.doc_string == "runs optimized only":
            raise RuntimeError("this kernel needs the optimizer")
        return real(model, feeds, optimized)

    monkeypatch.setattr(guard, "_outputs", no_plain_runs_of_the_input)
    check = guard.Guard(qdq, [])
    assert check.unavailable == "" and check.input_plain is None and check.input_optimized is not None
    assert "ORT_DISABLE_ALL" in check.levels_note and "this kernel needs the optimizer" in check.levels_note
    fixed, report = kenosis_rewrite.fix(qdq, return_report=True)
    assert any("one optimization level only" in note for note in report.notes)
    assert _approximate_rules(report)  # still measured, so still applied
    # and it still refuses what breaks the model at the level it checks
    broken = onnx.ModelProto()
    broken.CopyFrom(fixed)
    broken.graph.output[0].name = broken.graph.node[-1].input[0]
    assert check.violation(broken, report) is not None


def _reject_sites(monkeypatch, rule: str, bad: set[str]) -> None:
    """Make the guard reject any rewrite in which ``rule`` changed one of the ``bad`` places."""
    real = guard.Guard.violation

    def rejects_chosen_sites(self, model, report, selecting=False):
        if any(c.rule == rule and c.where in bad for c in report.changes):
            return "the output's cosine fell at a chosen site"
        return real(self, model, report, selecting)

    monkeypatch.setattr(guard.Guard, "violation", rejects_chosen_sites)


def test_the_guard_undoes_a_rule_only_at_the_sites_that_cost_fidelity(monkeypatch):
    """A rule the guard rejects is searched site by site: the sites whose change breaks the check stay
    undone, the rule keeps its other sites (the guard here rejects two chosen sites of 15)."""
    qdq = _nncf_model()
    rule = "fold-affine-into-conv"
    _, unguarded = kenosis_rewrite.fix(qdq, return_report=True, verify=False)
    wheres = [c.where for c in unguarded.changes if c.rule == rule]
    assert len(wheres) >= 8
    bad = {wheres[2], wheres[-1]}
    _reject_sites(monkeypatch, rule, bad)
    # on made-up feeds and on the caller's alike (made-up ones hold each choice to a quarter of the budget)
    _, made_up = kenosis_rewrite.fix(qdq, return_report=True)
    assert {c.where for c in made_up.changes if c.rule == rule} == set(wheres) - bad
    given = [{"x": np.random.default_rng(i).uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)} for i in range(4)]
    fixed, report = kenosis_rewrite.fix(qdq, calibration=given, return_report=True)

    kept = {c.where for c in report.changes if c.rule == rule}
    assert kept == set(wheres) - bad
    undone = {r.where for r in report.refusals if r.rule == rule and "undone by the run-time guard at this site" in r.reason}
    assert undone == bad
    assert any(f"undone: {rule} at 2 of its {len(wheres)} sites" in note for note in report.notes)
    onnx.checker.check_model(fixed, full_check=True)
    feeds = fidelity.random_feeds(qdq, 2)
    reference, ours = fidelity.run(qdq, feeds), fidelity.run(fixed, feeds)
    assert [o.shape for o in ours[0]] == [o.shape for o in reference[0]]
    assert fidelity.scores(reference, ours)["cosine"] > 0.99


def test_the_sites_the_guard_undid_are_marked_and_a_later_fix_holds_them(monkeypatch):
    """fix() marks the nodes where its guard undid a rule (node metadata, not the model's), and fix()
    of its output leaves those sites alone even with no guard: judged against that output, the rule
    could pass where it failed against the first input, and fix() would not be idempotent."""
    qdq = _nncf_model()
    rule = "fold-affine-into-conv"
    # float weights for the Convs left float would keep them float in any later fix(), marks or not
    monkeypatch.setattr(guarded, "kernel_facts", lambda model: KernelFacts(frozenset(), frozenset()))
    _, unguarded = kenosis_rewrite.fix(qdq, return_report=True, verify=False)
    wheres = [c.where for c in unguarded.changes if c.rule == rule]
    bad = {wheres[1], wheres[-2]}
    _reject_sites(monkeypatch, rule, bad)
    fixed = kenosis_rewrite.fix(qdq)
    monkeypatch.undo()
    monkeypatch.setattr(guarded, "kernel_facts", lambda model: KernelFacts(frozenset(), frozenset()))
    marks = {n.name: p.value for n in fixed.graph.node for p in n.metadata_props if p.key == GUARD_HELD_KEY}
    assert len(marks) == 2 and set(marks.values()) == {rule}
    assert not any(p.key == GUARD_HELD_KEY for n in qdq.graph.node for p in n.metadata_props)  # input untouched
    again, report = kenosis_rewrite.fix(fixed, return_report=True, verify=False)
    assert rule not in {c.rule for c in report.changes}
    held = [r for r in report.refusals if r.rule == rule and "of the fix() that wrote this model" in r.reason]
    assert len(held) == 2
    _, unmarked = kenosis_rewrite.fix(_without_marks(fixed), return_report=True, verify=False)
    assert bad <= {c.where for c in unmarked.changes if c.rule == rule}  # the marks are what held them


def _without_marks(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        kept = [p for p in node.metadata_props if p.key != GUARD_HELD_KEY]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)
    return copy


def _two_branch_model(seed: int, costly: str) -> onnx.ModelProto:
    """Two inputs, each ``Q/DQ -> Conv (int8 per-channel weights) -> Tanh -> Q/DQ -> 1x1 Conv -> output``,
    no quantizer right after the first Conv (NNCF's placement). Its channels are small (about +-0.1)
    and the 1x1 Conv reads mostly them; in the ``costly`` branch channel 0 is far larger and saturates
    the Tanh: a per-tensor output quantizer over its range (to the Tanh's saturation bound, about 3)
    rounds the small channels to a few steps, which costs that output far more than the guard's
    budget; the other branch's quantizer spans the small channels alone and costs nothing measurable."""
    rng = np.random.default_rng(seed)
    channels = int(rng.integers(3, 6))
    nodes, inits = [], []

    def const(name, array):
        inits.append(onnx.numpy_helper.from_array(np.asarray(array), name))

    const("sx", np.float32(8 / 255))
    const("zx", np.uint8(128))
    const("st", np.float32(2 / 255))
    for branch in ("a", "b"):
        weights = rng.integers(-127, 128, (channels, 2, 3, 3)).astype(np.int8)
        steps = np.full(channels, 0.0003, np.float32)
        if branch == costly:
            steps[0] = 0.05  # channel 0 dwarfs the others
        const(f"w{branch}", weights)
        const(f"s{branch}", steps)
        const(f"z{branch}", np.zeros(channels, np.int8))
        const(f"v{branch}", np.array([[[[1]], *[[[127]]] * (channels - 1)]], np.int8))
        const(f"vs{branch}", np.float32(0.01))
        const(f"vz{branch}", np.int8(0))
        nodes += [
            onnx.helper.make_node("QuantizeLinear", [f"x{branch}", "sx", "zx"], [f"q{branch}"]),
            onnx.helper.make_node("DequantizeLinear", [f"q{branch}", "sx", "zx"], [f"d{branch}"]),
            onnx.helper.make_node("DequantizeLinear", [f"w{branch}", f"s{branch}", f"z{branch}"], [f"dw{branch}"], axis=0),
            onnx.helper.make_node("Conv", [f"d{branch}", f"dw{branch}"], [f"c{branch}"], name=f"conv_{branch}", pads=[1] * 4),
            onnx.helper.make_node("Tanh", [f"c{branch}"], [f"t{branch}"]),
            onnx.helper.make_node("QuantizeLinear", [f"t{branch}", "st", "zx"], [f"qt{branch}"]),
            onnx.helper.make_node("DequantizeLinear", [f"qt{branch}", "st", "zx"], [f"dt{branch}"]),
            onnx.helper.make_node("DequantizeLinear", [f"v{branch}", f"vs{branch}", f"vz{branch}"], [f"dv{branch}"]),
            onnx.helper.make_node("Conv", [f"dt{branch}", f"dv{branch}"], [f"y{branch}"], name=f"head_{branch}"),
        ]
    graph = onnx.helper.make_graph(
        nodes, "two_branches",
        [onnx.helper.make_tensor_value_info(f"x{b}", onnx.TensorProto.FLOAT, [1, 2, 8, 8]) for b in "ab"],
        [onnx.helper.make_tensor_value_info(f"y{b}", onnx.TensorProto.FLOAT, [1, 1, 8, 8]) for b in "ab"],
        inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


@pytest.mark.parametrize("seed", range(4))
def test_an_added_quantizer_that_costs_one_output_more_than_the_budget_is_undone_at_that_site_only(seed, monkeypatch):
    # the steps after the guard (float weights and inputs for the float heads) are tested on their own
    monkeypatch.setattr(guarded, "kernel_facts", lambda model: KernelFacts(frozenset(), frozenset()))
    costly = "ab"[seed % 2]
    cheap = "ba"[seed % 2]
    qdq = _two_branch_model(seed, costly)
    rng = np.random.default_rng(100 + seed)
    feeds = [{f"x{b}": rng.uniform(-2, 2, (1, 2, 8, 8)).astype(np.float32) for b in "ab"} for _ in range(8)]
    _, unguarded = kenosis_rewrite.fix(qdq, calibration=feeds, return_report=True, verify=False)
    assert {c.where for c in unguarded.changes if c.rule == "quantize-weighted-outputs"} == {"conv_a", "conv_b"}

    fixed, report = kenosis_rewrite.fix(qdq, calibration=feeds, return_report=True)

    added = [c for c in report.changes if c.rule == "quantize-weighted-outputs"]
    assert [c.where for c in added] == [f"conv_{cheap}"]
    undone = [r for r in report.refusals if r.rule == "quantize-weighted-outputs" and "at this site" in r.reason]
    assert [r.where for r in undone] == [f"conv_{costly}"]
    assert "worst-feed cosine" in undone[0].reason or "mean cosine" in undone[0].reason
    # node by node: one quantizer more than the input, reading the cheap branch's Conv
    quantizers = [n for n in fixed.graph.node if n.op_type == "QuantizeLinear"]
    assert len(quantizers) == 5 and {n.input[0] for n in quantizers} == {"xa", "xb", "ta", "tb", f"c{cheap}"}
    # numbers: the costly branch is the input's, bit for bit; the cheap one within the budget on every
    # feed against FP32 (the yardstick here: the input without its activation roundings)
    names = [o.name for o in qdq.graph.output]
    index_costly, index_cheap = names.index(f"y{costly}"), names.index(f"y{cheap}")
    float_model = guard._unrounded_reference(qdq)
    for feed in feeds:
        before, after = outputs(qdq, feed, optimized=False), outputs(fixed, feed, optimized=False)
        np.testing.assert_array_equal(before[index_costly], after[index_costly])
        reference = outputs(float_model, feed, optimized=False)[index_cheap]
        assert fidelity.cosine(reference, after[index_cheap]) >= fidelity.cosine(reference, before[index_cheap]) - 0.002
    assert report.guard_fidelity is not None and len(report.guard_fidelity["outputs"]) == 2
    onnx.checker.check_model(fixed, full_check=True)
    # the pass reads the mark on the costly Conv: a later fix(), even unguarded, adds no quantizer there
    marked = [n.name for n in fixed.graph.node for p in n.metadata_props if p.key == GUARD_HELD_KEY]
    assert marked == [f"conv_{costly}"]
    _, again = kenosis_rewrite.fix(fixed, calibration=feeds, return_report=True, verify=False)
    assert "quantize-weighted-outputs" not in again.change_counts()


def test_the_report_says_which_yardstick_held_the_rewrite_and_the_fidelity_before_and_after():
    qdq = _two_branch_model(0, "a")
    rng = np.random.default_rng(7)
    feeds = [{f"x{b}": rng.uniform(-2, 2, (1, 2, 8, 8)).astype(np.float32) for b in "ab"} for _ in range(4)]
    float_model = guard._unrounded_reference(qdq)  # what the QDQ model computes in float: its FP32 here
    for given, yardstick in ((None, "the input with its activation Q/DQ removed"), (float_model, "the FP32 model")):
        _, report = kenosis_rewrite.fix(qdq, calibration=feeds, float_model=given, return_report=True)
        summary = report.guard_fidelity
        assert summary["yardstick"].startswith(yardstick) and summary["feeds"] == "4 calibration feeds"
        assert [o["output"] for o in summary["outputs"]] == ["ya", "yb"]
        for output in summary["outputs"]:
            for key in ("input", "fixed"):
                assert 0.9 < output[key]["worst_feed_cosine"] <= output[key]["mean_cosine"] <= 1.0 + 1e-9
            assert output["fixed"]["mean_cosine"] >= output["input"]["mean_cosine"] - guard.DEFAULT_TOLERANCE
            # the input's own rounding noise on these feeds: a number, small for this smooth model
            assert 0.0 <= output["input_rounding_noise"] < guard.DEFAULT_TOLERANCE
        text = str(report)
        assert f"fidelity against {summary['yardstick']}, on 4 calibration feeds:" in text
        assert "ya: mean cosine" in text and "worst feed" in text and "(input's rounding noise 0.0" in text
        assert report.to_dict()["guard_fidelity"] == summary


def _bare_guard(means: list[float], worsts: list[float], blind: bool = False) -> guard.Guard:
    check = object.__new__(guard.Guard)
    check.tolerance, check.float_model = guard.DEFAULT_TOLERANCE, None
    check.input_fidelity = [guard.OutputFidelity(m, w) for m, w in zip(means, worsts)]
    check.blindness = lambda: "made-up feeds" if blind else None
    return check


@pytest.mark.parametrize("was, allowed", [(0.9995, 0.002), (0.99, 0.002), (0.86, 0.05 * 0.14), (0.5, 0.025)])
def test_the_budget_is_0002_or_5_percent_of_the_inputs_own_error_whichever_is_larger(was, allowed):
    check = _bare_guard([was], [was])
    assert check._fidelity_violation([guard.OutputFidelity(was - allowed + 1e-6, was)], set(), check.tolerance) is None
    assert "mean cosine" in check._fidelity_violation([guard.OutputFidelity(was - allowed - 1e-4, was)], set(),
                                                      check.tolerance)
    assert "worst-feed cosine" in check._fidelity_violation([guard.OutputFidelity(was, was - allowed - 1e-4)], set(),
                                                            check.tolerance)


def test_choosing_sites_on_made_up_feeds_spends_a_quarter_of_the_budget():
    made_up, given = _bare_guard([0.999], [0.999]), _bare_guard([0.999], [0.999])
    made_up.given, given.given = False, True
    assert made_up._selection_margin == guard.MADE_UP_SELECTION_MARGIN < given._selection_margin == guard.SELECTION_MARGIN


def test_a_blind_guard_judges_the_mean_only_at_its_own_budget():
    check = _bare_guard([0.999], [0.99], blind=True)
    assert check._fidelity_violation([guard.OutputFidelity(0.999 - 0.004, 0.5)], set(), check.tolerance) is None
    assert check._fidelity_violation([guard.OutputFidelity(0.999 - 0.006, 0.99)], set(), check.tolerance) is not None


def test_an_output_of_few_values_is_compared_over_all_feeds_not_by_its_sign_per_feed():
    rng = np.random.default_rng(3)
    reference = [[np.array([[v]], np.float32), rng.normal(size=(1, 64)).astype(np.float32)] for v in (0.02, -0.01, 3.0, -2.5)]
    # the one-value output keeps its large values and moves its near-zero ones across 0
    rewritten = [[np.array([[v]], np.float32), r[1] * 1.0] for v, r in zip((-0.01, 0.02, 3.0, -2.5), reference)]
    few, many = guard._fidelities(reference, rewritten)
    stacked = fidelity.cosine(np.array([0.02, -0.01, 3.0, -2.5]), np.array([-0.01, 0.02, 3.0, -2.5]))
    assert few.mean == few.worst == pytest.approx(stacked) and few.worst > 0.99  # per feed: -1 twice
    assert many.mean == pytest.approx(1.0) and many.worst == pytest.approx(1.0)


def test_a_class_score_vector_is_judged_feed_by_feed_not_pooled():
    """Four class probabilities per feed: one feed's near-tie flips while the confident feeds, which
    dominate a pooled cosine, stay: the worst feed shows the flip, the pooled cosine would not."""
    confident = [np.array([[0.97, 0.01, 0.01, 0.01]], np.float32), np.array([[0.01, 0.97, 0.01, 0.01]], np.float32)] * 3
    reference = [[p] for p in [*confident, np.array([[0.2, 0.05, 0.45, 0.3]], np.float32)]]
    rewritten = [[r[0].copy()] for r in reference[:-1]] + [[np.array([[0.15, 0.05, 0.33, 0.47]], np.float32)]]
    [scores] = guard._fidelities(reference, rewritten)
    flipped = fidelity.cosine(reference[-1][0], rewritten[-1][0])
    pooled = fidelity.cosine(np.concatenate([r[0].ravel() for r in reference]), np.concatenate([o[0].ravel() for o in rewritten]))
    assert scores.worst == pytest.approx(flipped) and flipped < 0.95 < pooled
    # and the guard refuses it: far beyond the budget on that feed
    check = _bare_guard([1.0], [1.0])
    assert check._fidelity_violation([scores], set(), check.tolerance) is not None


def test_when_nothing_short_of_no_rewrite_passes_the_summary_says_the_guard_undid_every_rule(monkeypatch):
    qdq = _nncf_model()
    _, unguarded = kenosis_rewrite.fix(qdq, verify=False, return_report=True)
    changed = {change.rule for change in unguarded.changes}
    assert changed
    monkeypatch.setattr(guard.Guard, "violation", lambda self, model, report, selecting=False: "forced by the test")
    fixed, report = kenosis_rewrite.fix(qdq, return_report=True)

    assert not report.changes
    assert [node.op_type for node in fixed.graph.node] == [node.op_type for node in qdq.graph.node]
    first = report.summary().splitlines()[1]
    assert first.startswith("  no changes kept: the run-time guard undid ")
    assert set(first.split("undid ")[1].split(" (why")[0].split(", ")) == changed
    assert any("undone: every rewrite" in note for note in report.notes)


def test_with_the_callers_feeds_the_rewrite_is_held_on_made_up_feeds_too(monkeypatch):
    """Calibration feeds that cover a sliver of the input's range give output quantizers too tight for
    data the model meets: within budget on those feeds, the guard's made-up images (over the input
    quantizer's whole range) see the clipping and the sites that cost it are undone."""
    qdq = _nncf_model()
    narrow = [{"x": np.random.default_rng(i).uniform(0, 0.05, (1, 3, 16, 16)).astype(np.float32)} for i in range(6)]
    wide = [{"x": np.random.default_rng(100 + i).uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)} for i in range(6)]
    reference = fidelity.run(guard._unrounded_reference(qdq), wide)

    def cosine(model):
        return fidelity.scores(reference, fidelity.run(model, wide))["cosine"]

    fixed, report = kenosis_rewrite.fix(qdq, calibration=narrow, return_report=True)
    assert any("made-up feeds beside the caller's" in note for note in report.notes)
    # undone where it clips (the quantizers after the Convs whose affine chains no longer fold go with
    # them), kept elsewhere
    held = [r for r in report.refusals if "undone by the run-time guard at this site" in r.reason]
    kept = [c for c in report.changes if c.rule == "quantize-weighted-outputs"]
    assert held and kept, report.summary()
    assert cosine(fixed) >= cosine(qdq) - guard.DEFAULT_TOLERANCE

    real = guard.Guard.__post_init__

    def callers_feeds_only(self):
        self.also_made_up = False
        real(self)

    monkeypatch.setattr(guard.Guard, "__post_init__", callers_feeds_only)
    unheld = kenosis_rewrite.fix(qdq, calibration=narrow)
    assert cosine(unheld) < cosine(qdq) - guard.DEFAULT_TOLERANCE  # what the caller's feeds alone let through


def test_quantizers_on_the_answer_are_held_after_single_rule_undos_fail():
    """Where no single rule's undo passes, the output quantizers put on the model's answer are held
    alone, then with each single rule undone, before several rules are undone whole (the selfie
    segmenter by NNCF: its mask head's quantizer and per-tensor-activations together cost the budget)."""
    from kenosis_rewrite.core.report import FixReport
    from kenosis_rewrite.placement import guarded
    from kenosis_rewrite.placement.passes import output_quantizers

    rule = output_quantizers.RULE_NAME
    report = FixReport()
    report.changed(rule, "conv_inner", "output quantizer over [-3, 3], the measured range", exact=False)
    report.changed(rule, "conv_head", f"output quantizer over [-894, 150], the measured range, {output_quantizers.ON_THE_ANSWER} ('y')",
                   exact=False)
    report.changed("per-tensor-activations", "q1", "per-tensor steps", exact=False)
    report.sites.update({(rule, "conv_inner"): "inner", (rule, "conv_head"): "head", ("per-tensor-activations", "q1"): "q1"})
    candidates = guard.candidate_undos(report)
    ordered = guarded._with_answer_held(candidates, report)
    head = frozenset({(rule, "head")})
    singles = [c for c in candidates if len(c) == 1]
    assert [pair for pair in ordered[:len(singles)]] == [(c, frozenset()) for c in singles]
    assert ordered[len(singles)] == (frozenset(), head)
    assert ordered[len(singles) + 1] == (frozenset({"per-tensor-activations"}), head)
    assert [held for _, held in ordered[len(singles) + 2:]] == [frozenset()] * (len(candidates) - len(singles))
    # without a quantizer on the answer, the candidates as they were
    report.changes = [c for c in report.changes if output_quantizers.ON_THE_ANSWER not in c.detail]
    assert guarded._with_answer_held(guard.candidate_undos(report), report) == [(c, frozenset()) for c in guard.candidate_undos(report)]


SOFTMAX_AFTER_DATA_MOVEMENT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,6] x) => (float[1,4,6] y)
<float s = {0.05}, uint8 z = {128}, float so = {0.00392157}, uint8 zo = {0}, int64[1] axes = {0}>
{
  qx = QuantizeLinear(x, s, z)
  dx = DequantizeLinear(qx, s, z)
  u = Unsqueeze(dx, axes)
  qu = QuantizeLinear(u, s, z)
  du = DequantizeLinear(qu, s, z)
  v = Squeeze(du, axes)
  qv = QuantizeLinear(v, s, z)
  dv = DequantizeLinear(qv, s, z)
  p = Softmax<axis = -1>(dv)
  qp = QuantizeLinear(p, so, zo)
  y = DequantizeLinear(qp, so, zo)
}
"""


def test_the_yardstick_of_fixs_output_is_its_inputs_when_a_rewrite_reads_the_shape_of_codes():
    """softmax-float-input reads the shape of the codes it dequantizes: that Q's pair must still be
    removed from the yardstick, or a second fix() judges against a model with one rounding more
    (fuzz seed 8700076 applied a rule the first fix() had undone)."""
    qdq = onnx.parser.parse_model(SOFTMAX_AFTER_DATA_MOVEMENT)
    fixed, report = kenosis_rewrite.fix(qdq, target="ort-cpu", return_report=True)
    assert "softmax-float-input" in {change.rule for change in report.changes}
    shape_reads = {node.input[0] for node in fixed.graph.node if node.op_type == "Shape"}
    assert shape_reads & {node.output[0] for node in fixed.graph.node if node.op_type == "QuantizeLinear"}
    before, after = guard._unrounded_reference(qdq), guard._unrounded_reference(fixed)
    assert not [node for node in after.graph.node if node.op_type in ("QuantizeLinear", "DequantizeLinear")]
    for seed in range(3):
        feed = {"x": np.random.default_rng(seed).standard_normal((1, 4, 6)).astype(np.float32) * 3}
        np.testing.assert_array_equal(outputs(before, feed)[0], outputs(after, feed)[0])


def test_a_bias_requantization_is_suspected_after_the_rules_that_change_activation_grids():
    """requantize-stale-bias rounds only onto the accumulator grid, and it is what lets ORT fuse the ops
    whose input steps other rules changed: undoing it first would pass the guard by running them in
    float (PP-OCR's mobile v2 classifier by Quark: 100% -> 0% integer MACs)."""
    from kenosis_rewrite.core.report import FixReport

    report = FixReport()
    report.changed("clip-zero-point-to-qmin", "clip_1", "finer grid", exact=False)
    report.changed("activation-int8-to-uint8", "q_1", "uint8", exact=True)
    report.changed("requantize-stale-bias", "conv_1", "bias at s_x * s_w", exact=False)
    report.changed("fold-batchnorm-into-conv", "bn_1", "folded", exact=False)
    singles = [next(iter(c)) for c in guard.candidate_undos(report) if len(c) == 1]
    assert singles == ["fold-batchnorm-into-conv", "clip-zero-point-to-qmin", "requantize-stale-bias",
                       "activation-int8-to-uint8"]
    assert guard.candidate_undos(report)[len(singles)] == frozenset(
        {"fold-batchnorm-into-conv", "clip-zero-point-to-qmin", "requantize-stale-bias"})

"""What ``fix()`` changed, where, and why it left other candidates alone."""

from __future__ import annotations

import collections
import dataclasses
import json

GUARD_UNDO_REASON = "undone by the run-time guard"  # how a refusal says the guard took a rule's changes back


@dataclasses.dataclass(frozen=True)
class Change:
    """One applied rewrite: ``rule`` changed the graph at ``where``."""

    rule: str
    where: str
    detail: str
    exact: bool


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One candidate a rule matched structurally but left alone, with the reason."""

    rule: str
    where: str
    reason: str


@dataclasses.dataclass
class FixReport:
    """Changes and refusals of one ``fix()`` run, in the order they happened.

    Rules and passes append to it through :meth:`changed` and :meth:`refused`; a refusal is
    recorded once per (rule, place, reason) even when the rewriter asks twice.
    """

    target: str = "ort-cpu"
    changes: list[Change] = dataclasses.field(default_factory=list)
    refusals: list[Refusal] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    # {"input": {"cosine": ..., "max_abs": ...}, "fixed": {...}} when fix() was given the float model.
    fidelity: dict | None = None
    # the run-time guard's measure: {"yardstick": ..., "feeds": ..., "outputs": [{"output", "input", "fixed"}]}
    guard_fidelity: dict | None = None
    # quantize() beside plain quantize_static: {"held_back_feeds", "quantized_cosine", "quantize_static_cosine"}
    baseline: dict | None = None
    # (rule, site) pairs the rules must leave alone: the sites where the run-time guard undid a rule
    held_sites: frozenset = dataclasses.field(default=frozenset(), compare=False, repr=False)
    # (rule, where) of each change -> the site it was made at (the root node of the rule's match), for
    # undoing one change at a time; not part of the report's content
    sites: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def changed(self, rule: str, where: str, detail: str, *, exact: bool) -> None:
        self.changes.append(Change(rule, where, detail, exact))

    def refused(self, rule: str, where: str, reason: str) -> None:
        refusal = Refusal(rule, where, reason)
        if refusal not in self.refusals:
            self.refusals.append(refusal)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def forget_refusals_at(self, rule: str, where: str) -> None:
        """Drop refusals of ``rule`` at ``where`` after the rule did apply there in a later round."""
        self.refusals = [r for r in self.refusals if not (r.rule == rule and r.where == where)]

    def change_counts(self) -> dict[str, int]:
        return dict(collections.Counter(change.rule for change in self.changes))

    def refusal_counts(self) -> dict[str, int]:
        return dict(collections.Counter(refusal.rule for refusal in self.refusals))

    @property
    def changed_anything(self) -> bool:
        return bool(self.changes)

    def summary(self) -> str:
        lines = [f"kenosis_rewrite fix (target {self.target})"]
        if not self.changes:
            lines.append(f"  {self._no_changes_line()}")
        for rule, count in self.change_counts().items():
            lines.append(f"  {rule}: {count} change(s)")
        for rule, count in self.refusal_counts().items():
            lines.append(f"  {rule}: {count} candidate(s) left alone")
        for refusal in self.refusals:
            lines.append(f"    - {refusal.where}: {refusal.reason}")
        for name, scores in (self.fidelity or {}).items():
            lines.append(f"  fidelity vs FP32, {name}: cosine {scores['cosine']:.6f}, SQNR {scores['sqnr_db']:.1f} dB, "
                         f"max abs {scores['max_abs']:.4g}")
        if self.baseline:
            lines.append(f"  beside plain quantize_static, on {self.baseline['held_back_feeds']} held-back feeds: cosine "
                         f"{self.baseline['quantized_cosine']:.6f} (quantize_static {self.baseline['quantize_static_cosine']:.6f})")
        lines.extend(self._guard_fidelity_lines())
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)

    def _guard_fidelity_lines(self) -> list[str]:
        if not self.guard_fidelity:
            return []
        lines = [f"  fidelity against {self.guard_fidelity['yardstick']}, on {self.guard_fidelity['feeds']}:"]
        for output in self.guard_fidelity["outputs"]:
            before, after = output["input"], output["fixed"]
            noise = output.get("input_rounding_noise")
            lines.append(f"    {output['output']}: mean cosine {before['mean_cosine']:.5f} -> {after['mean_cosine']:.5f}, "
                         f"worst feed {before['worst_feed_cosine']:.5f} -> {after['worst_feed_cosine']:.5f}"
                         + (f" (input's rounding noise {noise:.5f})" if noise is not None else ""))
        if any(output.get("input_rounding_noise") is not None for output in self.guard_fidelity["outputs"]):
            lines.append("    rounding noise: the most a feed's cosine of the input moves when at most about 1 in 800 of its "
                         "roundings flip (activation scales x(1 +- 1e-5)); a change smaller than it is not decidable "
                         "on these feeds")
        return lines

    def _no_changes_line(self) -> str:
        """Why nothing changed, consistent with the lines below it: the guard's undo, candidates left
        alone, or nothing to do at all."""
        undone = sorted({r.rule for r in self.refusals if r.reason.startswith(GUARD_UNDO_REASON)})
        if undone:
            return f"no changes kept: the run-time guard undid {', '.join(undone)} (why below)"
        if self.refusals:
            return f"no changes: {len(self.refusals)} candidate(s) left alone (why below)"
        return "no changes: the model already matches every rule of this target"

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "changes": [dataclasses.asdict(change) for change in self.changes],
            "refusals": [dataclasses.asdict(refusal) for refusal in self.refusals],
            "change_counts": self.change_counts(),
            "refusal_counts": self.refusal_counts(),
            "notes": list(self.notes),
            "fidelity": self.fidelity,
            "guard_fidelity": self.guard_fidelity,
            "baseline": self.baseline,
        }

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

"""What :func:`kenosis_rewrite.diagnosis.explain.explain` returns: heavy ops, float islands, and how to print them."""

from __future__ import annotations

import collections
import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class HeavyOp:
    """One heavy op of the input graph and the kernel ORT CPU runs it in."""

    name: str
    op_type: str
    macs: int
    kernel: str  # "integer" | "float"
    optimized_op_type: str | None  # e.g. "com.microsoft.QLinearConv"; None when no node was matched
    reason: str | None = None  # why it is float (None for integer ops)
    fixing_rule: str | None = None  # kenosis rule that removes ``reason``, when one exists
    detail: str | None = None  # the evidence behind ``reason`` (tensor names, parameters)
    other_reasons: tuple[str, ...] = ()  # further reasons found after the first
    warning: str | None = None  # an integer op fused with a problem (e.g. a stale bias scale in QGemm)


@dataclasses.dataclass(frozen=True)
class FloatIsland:
    """A connected group of float nodes of the optimized graph, between DequantizeLinear and QuantizeLinear."""

    nodes: tuple[str, ...]  # optimized-graph node names
    op_types: tuple[str, ...]
    heavy_ops: tuple[str, ...]  # input-graph heavy ops running inside the island
    kind: str  # "compute" or "requantize" (only DQ->Q or layout ops between them)
    reason: str | None = None
    fixing_rule: str | None = None


@dataclasses.dataclass
class FusionReport:
    """Which heavy ops run in integer kernels on ORT CPU, weighted by multiply-accumulates."""

    ops: list[HeavyOp]
    float_islands: list[FloatIsland]
    optimized_op_counts: collections.Counter
    # what could not be determined, with its cause (e.g. shapes ONNX shape inference left unknown)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def total_macs(self) -> int:
        return sum(op.macs for op in self.ops)

    @property
    def integer_mac_fraction(self) -> float:
        """Share of heavy-op MACs that run in integer kernels (0.0 when there are no heavy ops)."""
        total = self.total_macs
        integer = sum(op.macs for op in self.ops if op.kernel == "integer")
        return integer / total if total else 0.0

    @property
    def float_ops(self) -> list[HeavyOp]:
        return [op for op in self.ops if op.kernel == "float"]

    def to_dict(self) -> dict:
        return {
            "integer_mac_fraction": self.integer_mac_fraction,
            "total_macs": self.total_macs,
            "ops": [dataclasses.asdict(op) for op in self.ops],
            "float_islands": [dataclasses.asdict(island) for island in self.float_islands],
            "optimized_op_counts": dict(sorted(self.optimized_op_counts.items())),
            "notes": list(self.notes),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def summary(self) -> str:
        """Human-readable multi-line report: the integer share, then every float op with its fix."""
        integer = len(self.ops) - len(self.float_ops)
        lines = [
            f"Integer kernels: {100 * self.integer_mac_fraction:.1f}% of MACs "
            f"({integer}/{len(self.ops)} heavy ops, {_human(self.total_macs)} MACs)"
        ]
        for op in self.float_ops:
            share = 100 * op.macs / self.total_macs if self.total_macs else 0.0
            fix = f" -> fix: {op.fixing_rule}" if op.fixing_rule else " -> no kenosis rule"
            lines.append(f"  float {op.op_type} {op.name!r} ({share:.1f}% of MACs): {op.reason}{fix}")
            if op.detail:
                lines.append(f"        {op.detail}")
        for op in self.ops:
            if op.warning:
                lines.append(f"  warning {op.op_type} {op.name!r}: {op.warning}")
        if self.float_islands:
            lines.append(f"Float islands in the ORT graph: {len(self.float_islands)}")
            for island in self.float_islands:
                why = f": {island.reason}" if island.reason else ""
                fix = f" -> fix: {island.fixing_rule}" if island.fixing_rule else ""
                lines.append(f"  [{island.kind}] {' -> '.join(island.op_types)}{why}{fix}")
        lines += [f"Note: {note}" for note in self.notes]
        return "\n".join(lines)


def _human(count: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)

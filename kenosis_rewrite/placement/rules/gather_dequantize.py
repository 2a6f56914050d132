"""Gather the quantized codes, then dequantize the rows gathered: not the whole table every run.

Transformation (``gather-before-dequantize``), for a quantized table read only by Gathers::

    Gather(DQ(table_q; s, z, axis=a), ids; axis=g)   ==>   DQ(Gather(table_q, ids; axis=g); s, z, axis=a')

with ``a' = a`` when ``a < g``, ``a + rank(ids) - 1`` when ``a > g`` (the gathered axis is replaced by
the index dims), for per-tensor parameters or per-axis ones on an axis other than the gathered one.
Per-row parameters of a table gathered along its rows (``a = g = 0``: NNCF quantizes embeddings per
row) are gathered with the codes, and the DequantizeLinear is written out as what it computes::

    Gather(DQ(table_q; s, z, axis=0), ids)  ==>  (Cast(Gather(table_q, ids)) - Cast(Gather(z, ids))[..., None]) * Gather(s, ids)[..., None]

(the Sub only where some zero point is not 0; ``None``: Unsqueeze over the table's other axes).

Why: NNCF (and other quantizers that quantize embeddings) leave a transformer's word-embedding table
as ``DQ(int8 table) -> Gather``; ORT does not constant-fold a DequantizeLinear, so every run
dequantizes the whole table (30522 x 384 floats for a MiniLM) to read a few rows: 3.9 of the
6.3 ms that NNCF's MiniLM-L3 took on one thread (ORT's profiler), slower than FP32. Gathered first,
the DQ touches ``len(ids)`` rows.

Exactness: exact, bit for bit: DequantizeLinear is elementwise with parameters fixed per element's
position on axis ``a``, and Gather only selects elements (out-of-range indices fail the same way in
both orders). The written-out form computes ``(x - z) * s`` as DequantizeLinear defines it: the
8-bit difference is exact in float, the product is the one rounding.

Left alone: blocked (``block_size``) parameters, per-axis parameters on a gathered axis other than 0, a DQ
that anything else reads too (onnxscript's matcher declines: its full dequantization would stay),
index tensors of unknown rank where the axis would move.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleSet

from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.rule_base import ReportingRule, acceptance, refusal

__all__ = ["GatherBeforeDequantize", "gather_dequantize_rules", "RULE_NAME"]

RULE_NAME = "gather-before-dequantize"
_ROWS = -1  # per-row parameters gathered with the rows (written-out DequantizeLinear)


def _normalized(axis: int, rank: int | None) -> int | None:
    if axis >= 0:
        return axis
    return None if rank is None else axis + rank


class GatherBeforeDequantize(ReportingRule):
    """``Gather(DQ(t), ids)`` ==> ``DQ(Gather(t, ids))`` (per-row: written out). Exact."""

    def __init__(self, report: FixReport | None = None):
        super().__init__(RULE_NAME, report)

    def pattern(self, op, table, ids):
        dequantized = op.DequantizeLinear(table, _allow_other_inputs=True, _outputs=["dq"])
        return op.Gather(dequantized, ids, _outputs=["gathered"])

    def _new_axis(self, dq_node: ir.Node, gather: ir.Node, table: ir.Value, ids: ir.Value) -> int | str | None:
        """The DQ's axis after the Gather (None: per-tensor, attributes as they are), or why the two
        cannot swap."""
        params = qdq_params.quant_params(dq_node)
        if params is None:
            return "the table's scale or zero point is not a constant"
        if params.block_size:
            return "blocked quantization parameters"
        rank = table.shape.rank() if table.shape is not None else None
        gather_axis = _normalized(gather.attributes.get_int("axis", 0), rank)
        if params.is_per_tensor:
            return None
        dq_axis = _normalized(params.axis, rank)
        if gather_axis is None or dq_axis is None:
            return "the table's rank is unknown"
        if dq_axis == gather_axis and dq_node.attributes.get_int("output_dtype", 0):
            return "an output_dtype attribute on per-row parameters"
        if dq_axis == gather_axis:
            return _ROWS if gather_axis == 0 and rank is not None else "per-axis parameters along a gathered axis other than 0"
        if dq_axis < gather_axis:
            return dq_axis
        if ids.shape is None:
            return "the index tensor's rank is unknown"
        return dq_axis + ids.shape.rank() - 1

    def check(self, context, table, ids, dq, gathered, **_) -> MatchResult:
        del context
        dq_node, gather = dq.producer(), gathered.producer()
        if dq_node.domain not in qdq_params.DEFAULT_DOMAINS or gather.domain not in qdq_params.DEFAULT_DOMAINS:
            return MatchResult().fail("not default-domain DequantizeLinear and Gather")
        axis = self._new_axis(dq_node, gather, table, ids)
        where = gather.name or str(gathered.name)
        return refusal(where, axis) if isinstance(axis, str) else acceptance(where)

    def rewrite(self, op, table, ids, dq, gathered, **_):
        dq_node, gather = dq.producer(), gathered.producer()
        axis = self._new_axis(dq_node, gather, table, ids)
        codes = op.Gather(table, ids, axis=gather.attributes.get_int("axis", 0))
        if axis == _ROWS:
            return self._per_row(op, dq_node, codes, ids, gather, gathered, table.shape.rank())
        attributes = {name: attr.value for name, attr in dq_node.attributes.items()}
        if axis is not None:
            attributes["axis"] = axis
        self.record(gather.name or str(gathered.name), "gathers the quantized codes, dequantizes only the rows read", exact=True)
        return op.DequantizeLinear(codes, *dq_node.inputs[1:], **attributes)


    def _per_row(self, op, dq_node, codes, ids, gather, gathered, rank: int):
        params = qdq_params.quant_params(dq_node)
        float_type = params.scale.dtype
        trailing = op.Constant(value=ir.tensor(list(range(-rank + 1, 0)), dtype=ir.DataType.INT64))

        def rows(value):  # per-row parameter -> broadcast over the table's other axes
            return op.Unsqueeze(op.Gather(value, ids, axis=0), trailing)

        to_float = ir.DataType.from_numpy(float_type)
        values = op.Cast(codes, to=to_float)
        if len(dq_node.inputs) > 2 and dq_node.inputs[2] is not None and params.zero_point.any():
            values = op.Sub(values, op.Cast(rows(dq_node.inputs[2]), to=to_float))
        self.record(gather.name or str(gathered.name),
                    "gathers the quantized rows and their per-row scales, dequantizes only those", exact=True)
        return op.Mul(values, rows(dq_node.inputs[1]))


def gather_dequantize_rules(report: FixReport | None = None) -> RewriteRuleSet:
    return RewriteRuleSet([GatherBeforeDequantize.rule(report)])

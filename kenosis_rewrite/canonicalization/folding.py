"""onnxscript's optimizer as canonicalization runs it: constant folding and onnxscript's default
rewrites, the same passes in the same order as ``onnxscript.optimizer.optimize_ir``, faster.

Two things differ from onnxscript's own, neither in the graphs made (the tests compare them):
its default rewrite rules are :func:`~kenosis_rewrite.graph.rule_filter.op_filtered` (tried only
where their pattern can match), and its constant folding skips ONNX shape inference on nodes where
it would change nothing (:class:`FoldConstantsKnownShapesPass`). What this takes from onnxscript's
internals comes through :mod:`kenosis_rewrite._upstream.onnxscript_folding`.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import common as common_passes
from onnxscript.rewriter import RewritePass

from kenosis_rewrite._upstream import onnxscript_folding
from kenosis_rewrite._upstream.lift_constants import LiftAllConstantsPass
from kenosis_rewrite.canonicalization.rules.materialized_reshape import (
    MATERIALIZE_RESHAPE_RULE_NAME,
    materialized_reshape_rules,
)
from kenosis_rewrite.graph.rule_filter import op_filtered

__all__ = ["FoldConstantsKnownShapesPass", "fold_small_constant_of_shape", "inference_reads", "optimize_ir",
           "rewrite_rules", "same_inference_reads"]

_SMALL_CONSTANT_ELEMENTS = 1 << 16


def fold_small_constant_of_shape(node: ir.Node) -> bool | None:
    """onnxscript keeps every ConstantOfShape (model size); a small one computing padding or grids
    must fold for the arithmetic after it to fold."""
    if node.op_type != "ConstantOfShape" or node.inputs[0] is None or node.inputs[0].const_value is None:
        return None
    return int(np.prod(node.inputs[0].const_value.numpy())) <= _SMALL_CONSTANT_ELEMENTS or None


class FoldConstantsKnownShapesPass(onnxscript_folding.FoldConstantsPass):
    """onnxscript's FoldConstantsPass, without running ONNX shape inference again on a node whose
    outputs all have a type and a static shape: inference merges its shape into theirs keeping
    their static dims, and its type is theirs (in a graph whose types are consistent, which ONNX
    Runtime checks anyway). That inference, made on every node at every step of every fold, was
    about half of the constant folding's time on the shape-pinned PaddleOCR exports.

    Nor on a node whose inference would read what it read last time (``inferred``, shared by the
    folds of one canonicalization): the same input names, types, shapes and constants, the same
    attributes, and its outputs as that inference left them. Inference is a function of those,
    and merging its result again into the outputs it made changes nothing (PP-OCR cls: 393 of 840
    inferences, with a symbolic batch dim)."""

    def __init__(self, *args, inferred: dict[ir.Node, tuple] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._inferred = {} if inferred is None else inferred

    def run_shape_inference(self, node: ir.Node) -> None:
        if all(output.type is not None and output.shape is not None
               and all(isinstance(dim, int) for dim in output.shape) for output in node.outputs):
            return
        last = self._inferred.get(node)
        if last is not None and same_inference_reads(last, inference_reads(node)):
            return
        super().run_shape_inference(node)
        self._inferred[node] = inference_reads(node)


def inference_reads(node: ir.Node) -> tuple:
    """What ONNX shape inference of ``node`` reads, and its outputs' types and shapes."""
    def shape(value: ir.Value) -> tuple | None:
        return None if value.shape is None else tuple(value.shape)

    inputs = tuple(None if value is None else (value.name, value.type, shape(value), value.const_value)
                   for value in node.inputs)
    return (inputs, tuple(node.attributes.values()), tuple((value.type, shape(value)) for value in node.outputs))


def same_inference_reads(last: tuple, now: tuple) -> bool:
    """Equal names, types and shapes; the very same constant tensors and attribute objects (a
    constant or attribute replaced is a new object, and held here, so never one that reuses a
    freed one's identity)."""
    (last_inputs, last_attributes, last_outputs), (inputs, attributes, outputs) = last, now
    if last_outputs != outputs or len(last_inputs) != len(inputs) or len(last_attributes) != len(attributes):
        return False
    if any(a is not b for a, b in zip(last_attributes, attributes)):
        return False
    for before, after in zip(last_inputs, inputs):
        if (before is None) != (after is None):
            return False
        if before is not None and (before[:3] != after[:3] or before[3] is not after[3]):
            return False
    return True


def rewrite_rules() -> tuple:
    """onnxscript's default rewrite rules, its MaterializeReshapeShape replaced by ours (valid before
    opset 14: :mod:`kenosis_rewrite.canonicalization.rules.materialized_reshape`)."""
    ours = materialized_reshape_rules().rules
    return tuple(replacement for rule in onnxscript_folding.default_rewrite_rules()
                 for replacement in (ours if rule.name == MATERIALIZE_RESHAPE_RULE_NAME else [rule]))


def optimize_ir(model: ir.Model, num_iterations: int, should_fold=lambda node: None,
                inferred: dict[ir.Node, tuple] | None = None) -> None:
    """``onnxscript.optimizer.optimize_ir(model, num_iterations)`` (onnxscript 0.7: the same passes,
    defaults and order), its default rewrite rules :func:`~kenosis_rewrite.graph.rule_filter.op_filtered`
    (the same rewrites without matching every rule at every node) and its constant folding
    :class:`FoldConstantsKnownShapesPass` (no shape inference on nodes whose outputs have static
    shapes), which folds what ``should_fold`` asks for besides onnxscript's own choices."""
    passes = [
        common_passes.InlinePass(),
        ir.passes.PassManager(
            [
                FoldConstantsKnownShapesPass(shape_inference=True,
                                             input_size_limit=onnxscript_folding.FOLD_INPUT_SIZE_LIMIT,
                                             output_size_limit=onnxscript_folding.FOLD_OUTPUT_SIZE_LIMIT,
                                             should_fold=should_fold, inferred=inferred),
                RewritePass(op_filtered(rewrite_rules())),
                common_passes.RemoveUnusedNodesPass(),
                common_passes.RemoveUnusedFunctionsPass(),
                common_passes.RemoveUnusedOpsetsPass(),
            ],
            steps=num_iterations,
            early_stop=True,
        ),
        common_passes.RemoveUnusedNodesPass(),
        LiftAllConstantsPass(),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    ]
    ir.passes.Sequential(*passes)(model)

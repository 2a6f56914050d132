"""What canonicalization's constant folding takes from onnxscript's optimizer internals.

``onnxscript.optimizer.optimize_ir`` is public, but its parts are not: its constant folding pass
(``onnxscript.optimizer._constant_folding.FoldConstantsPass``), that pass's size limits, its
per-node ONNX shape inference (``FoldConstantsPass._do_inference``) and its default rewrite rules
(``onnxscript.rewriter._DEFAULT_REWRITE_RULES``). canonicalization rebuilds ``optimize_ir`` from
them (:mod:`kenosis_rewrite.canonicalization.folding`) to skip inferences that change nothing.
``tests/unit/_upstream/test_internals.py`` fails when one of them moves.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import rewriter as _rewriter
from onnxscript.optimizer import _constant_folding
from onnxscript.rewriter import RewriteRule

__all__ = ["FOLD_INPUT_SIZE_LIMIT", "FOLD_OUTPUT_SIZE_LIMIT", "FoldConstantsPass", "default_rewrite_rules"]

# Internal: onnxscript.optimizer._constant_folding.DEFAULT_CONSTANT_FOLD_{INPUT,OUTPUT}_SIZE_LIMIT
# (seen in onnxscript 0.5 - 0.7: 8192 and 512 * 512). Public replacement: none public today (the
# defaults of onnxscript.optimizer.optimize()'s arguments).
FOLD_INPUT_SIZE_LIMIT: int = _constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
FOLD_OUTPUT_SIZE_LIMIT: int = _constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT


def default_rewrite_rules() -> tuple[RewriteRule, ...]:
    """The rules ``onnxscript.optimizer.optimize_ir`` rewrites with, in its order.

    Internal: ``onnxscript.rewriter._DEFAULT_REWRITE_RULES`` (seen in onnxscript 0.5 - 0.7).
    Public replacement: none public today (``onnxscript.rewriter.rewrite()`` applies them, it does
    not return them)."""
    return _rewriter._DEFAULT_REWRITE_RULES


class FoldConstantsPass(_constant_folding.FoldConstantsPass):
    """onnxscript's constant folding pass, its per-node ONNX shape inference behind a public hook:
    a subclass overrides :meth:`run_shape_inference` to decide when to infer (and calls it on
    this class to infer as onnxscript does).

    Internal: ``onnxscript.optimizer._constant_folding.FoldConstantsPass`` and its private method
    ``_do_inference(node)``, called once per node it visits (seen in onnxscript 0.5 - 0.7). Public
    replacement: none public today (``onnxscript.optimizer.fold_constants`` runs the pass whole)."""

    def _do_inference(self, node: ir.Node) -> None:
        self.run_shape_inference(node)

    def run_shape_inference(self, node: ir.Node) -> None:
        """onnxscript's shape inference of ``node``, merged into its outputs' types and shapes."""
        super()._do_inference(node)

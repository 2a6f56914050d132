"""Canonicalize an FP32 graph as exported into the graph a quantizer should see.

``prepare(model, feeds)`` runs, in order:

1. **Input shapes** (``pin-input-shapes``): when a Pad computes its parameters from the shape of a
   tensor (TF-style "same" padding), or a Resize of a table computed from constants does (a ViT's
   position embeddings resized to its patch grid), and an input has symbolic dims, the dims are
   pinned to the shapes in use (``input_shapes``, or the feeds' shapes where every feed agrees) so
   the shape arithmetic folds: first the static dims it reads from a partly static shape are read
   as the constants they are (``Gather(Shape(x), 2)``:
   :func:`~kenosis_rewrite.canonicalization.rules.shape_slices.static_dim_rules`), then the spatial dims are pinned,
   the batch only if such a Pad/Resize remains. A Resize of data to a computed size pins nothing
   (:func:`computed_layout_parameters`). The prepared model then accepts only those shapes; the
   report says which dims were pinned. Shape arithmetic anywhere else (a recurrent state's batch size, an
   attention mask's length, a detector's anchors) pins nothing: the model keeps accepting every
   shape, and quantize() keeps that arithmetic float (``float-shape-arithmetic``).
2. **Constant folding and onnxscript's default rules** (``onnxscript.optimizer``): shape
   arithmetic, run-time "same" padding (``Shape -> Slice -> ... -> Pad`` folds to a constant Pad,
   which ``fuse_pad_into_conv`` moves into the Conv), BatchNormalization into Conv/Gemm, Cast/
   Identity/Transpose-pair and other no-op removal.
3. **Our FP32 rules**: decomposed HardSwish/HardSigmoid fused (onnxscript's rules), Transposes sunk
   past elementwise ops so NHWC Transpose pairs cancel (:mod:`rules.transpose_sinking`), per-channel
   affine arithmetic folded into Conv/Gemm weights and bias (:mod:`rules.channel_affine`), residual
   Adds read by a layer norm written as Sum, so ORT does not fuse them into its slow
   SkipLayerNormalization (:mod:`rules.residual_sum`), a Gemm's computed addend (a residual that
   ORT's MatMulAddFusion put there) moved back into an Add, so the Gemm stays quantizable
   (:mod:`rules.gemm_addend`).
   Before them, onnxruntime's basic-level optimizer (standard ops only): its transpose optimizer cancels
   the NHWC Transposes around residual Adds, which local rules cannot (the Add's inputs fan out).
   Step 2 runs before that optimizer only where step 1 or a function or subgraph needs it
   (:func:`_folds_before_the_optimizer`); after it, always.
4. **Declared output shapes** (``repair-declared-output-shapes``): a graph output declared with a
   shape the model does not produce (Paddle exports declare rank 0 for rank-2 outputs) gets the
   shape it really has, so shape inference and the checker accept the graph.
5. **Verification**: the prepared model runs on the feeds and must equal the original within float
   rounding: first both as onnxruntime runs them (every optimization on), max error <=
   ``PREPARE_TOLERANCE`` x the output's largest magnitude, on the first ``VERIFY_FEEDS`` feeds (the
   rewrites are identities whatever the data: a wrong one shows on any real input; every feed for a
   graph with control flow or value-dependent sizes); failing that, both graphs as written
   (optimizations off), within ``PREPARE_TOLERANCE`` or, where the model amplifies rounding,
   ``NOISE_FACTOR`` x what onnxruntime's own graph optimizations change on the same inputs;
   otherwise the original is kept and the report says why. The first check proves the equality of
   what runs (ORT's rewrites of both graphs included), the second that of the graphs as written.

Exactness: every step is exact in real arithmetic; float32 results differ by rounding only, which
step 5 measures on the caller's inputs.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import RewriteRuleSet
from onnxscript.rewriter.rules.common import fuse_hardswish_rules, no_op_transpose_rule, transpose_transpose_rule

from kenosis_rewrite._upstream.lift_constants import LiftAllConstantsPass
from kenosis_rewrite.canonicalization.folding import fold_small_constant_of_shape
from kenosis_rewrite.canonicalization.folding import optimize_ir as _optimize_ir  # tests compare it with onnxscript's
from kenosis_rewrite.canonicalization.ort_optimizer import ort_basic_optimized
from kenosis_rewrite.canonicalization.rules.channel_affine import channel_affine_rules
from kenosis_rewrite.canonicalization.rules.gemm_addend import gemm_addend_rules
from kenosis_rewrite.canonicalization.rules.residual_sum import residual_sum_rules
from kenosis_rewrite.canonicalization.rules.shape_slices import shape_slice_rules, static_dim_rules
from kenosis_rewrite.canonicalization.rules.transpose_sinking import transpose_sinking_rules
from kenosis_rewrite.canonicalization.shapes import (
    computed_layout_parameters,
    negative_dims_as_symbolic,
    pin_input_shapes,
    propagated_dims,
    reads_shapes,
    shapes_in_use,
    symbolic_inputs,
)
from kenosis_rewrite.canonicalization.verify import TensorObserver, verified
from kenosis_rewrite.core import fidelity, model_io
from kenosis_rewrite.core.ort_quantize import quiet_logger
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import KenosisError, PrepareFailedError
from kenosis_rewrite.graph.rule_filter import op_filtered

__all__ = ["prepare", "PrepareFailedError", "PREPARE_TOLERANCE", "canonicalize"]

PREPARE_TOLERANCE = 1e-5
# Outputs behind a steep nonlinearity (DB text maps: sigmoid(50 x)) amplify any rounding: there the
# bound is what onnxruntime's own optimizations change on the same inputs, twice over.
NOISE_FACTOR = 2.0
_REWRITE_STEPS = 8
_HARDSWISH_OPSET = 14  # HardSwish is an ONNX op from opset 14
# prepare()'s first check runs this many feeds (see _verified), every feed where the graph routes
# inputs by their values
VERIFY_FEEDS = 2


def _op_counts(model: ir.Model) -> collections.Counter:
    return collections.Counter(node.op_type for node in model.graph.all_nodes())


def _fold(model: ir.Model, inferred: dict[ir.Node, tuple] | None = None) -> None:
    """Constant folding, small ConstantOfShape included, and onnxscript's default rewrites, to a
    fixed point (at most 3 steps). The small ConstantOfShape are folded in the steps themselves, not
    by a folding pass of their own before them: one pass over the graph less per fold (PP-OCRv2
    rec's prepare() 0.84 -> 0.74 s); the graphs are the same up to node order and the names
    deduplicated constants keep. ``inferred``: the shape inferences made so far on ``model``'s nodes
    (:class:`~kenosis_rewrite.canonicalization.folding.FoldConstantsKnownShapesPass`), shared by the
    folds of one canonicalization."""
    with quiet_logger("onnxscript"):
        _optimize_ir(model, num_iterations=3, should_fold=fold_small_constant_of_shape, inferred=inferred)


def _fold_static_dim_reads(model: ir.Model, inferred: dict[ir.Node, tuple]) -> None:
    """``Gather(Shape(x), i)`` of static dims as constants, and the arithmetic on them folded
    (:func:`~kenosis_rewrite.canonicalization.rules.shape_slices.static_dim_rules`): a ViT's patch grid or a TF
    export's padding read from a shape whose batch alone is symbolic folds without pinning it. The
    dims are those ONNX shape inference with data propagation finds
    (:func:`~kenosis_rewrite.canonicalization.shapes.propagated_dims`)."""
    # a Pad folded makes the shapes after it known, and the next Pad's parameters with them
    computed = computed_layout_parameters(model)
    while computed:
        found = propagated_dims(model)
        if not op_filtered(static_dim_rules()).apply_to_model(model) and not found:
            return
        _fold(model, inferred)
        before, computed = computed, computed_layout_parameters(model)
        if len(computed) >= len(before):  # nothing more folds this way
            return


def _apply_rules(model: ir.Model, report: FixReport) -> int:
    """Each family to a fixed point, in an order where one family's output is the next one's input.
    Returns the number of rewrites."""
    families = {
        "sink-transposes": transpose_sinking_rules(),
        "cancel-transposes": RewriteRuleSet([transpose_transpose_rule, no_op_transpose_rule]),
        "fold-channel-affine": channel_affine_rules(),
        "split-gemm-computed-addend": gemm_addend_rules(),
        "residual-add-as-sum": residual_sum_rules(),
    }
    if model.opset_imports.get("", 0) >= _HARDSWISH_OPSET:
        families = {"fuse-hardswish": fuse_hardswish_rules(), **families}
    counts: collections.Counter = collections.Counter()
    for _ in range(_REWRITE_STEPS):
        applied = 0
        for name, rules in families.items():
            count = op_filtered(rules).apply_to_model(model)
            counts[name] += count
            applied += count
        if not applied:
            break
    for name, count in counts.items():
        if count:
            report.changed(name, "graph", f"{count} rewrites", exact=True)
    return sum(counts.values())


def _folds_before_the_optimizer(model: ir.Model) -> bool:
    """Whether the graph needs onnxscript's folding before onnxruntime's basic optimizer sees it:
    where a Pad/Resize computes a parameter from anything but a constant (what pinning input shapes
    is for, on the graph folded first), or it has functions or subgraphs. Elsewhere that fold only
    folds constants, which the basic optimizer folds too, and the fold after it does the rest,
    shape reads included: the same canonical graphs but for the names of their constants
    (every zoo model's quantize() output: the same ops, bit for bit the same outputs), one fold
    less (canonicalize() on a loaded host, one-off: PP-OCR cls 0.16 -> 0.10 s, PP-OCRv3 det 0.23 ->
    0.15 s). Read after its Constant nodes became initializers."""
    has_subgraphs = sum(1 for _ in model.graph.all_nodes()) != len(model.graph)
    return bool(model.functions) or has_subgraphs or bool(computed_layout_parameters(model))


def canonicalize(model: ir.Model, report: FixReport, shapes: Mapping[str, Sequence[int | None]] | None = None,
                 source: str = "") -> ir.Model:
    """Steps 1-3 on ``model`` (no verification); returns the canonical model (``model`` is consumed)."""
    before = _op_counts(model)
    negative_dims_as_symbolic(model, report)
    inferred: dict[ir.Node, tuple] = {}
    # Constant nodes as initializers (what the fold's last steps make of them), so that the checks
    # below see constants
    LiftAllConstantsPass()(model)
    first_fold = _folds_before_the_optimizer(model)
    if first_fold:
        _fold(model, inferred)
    # and again where the shape reads became Shape(x, start, end): only where the first fold is
    # made (elsewhere the folds after the optimizer fold them)
    if op_filtered(shape_slice_rules()).apply_to_model(model) and first_fold:
        _fold(model, inferred)
    if shapes and computed_layout_parameters(model):
        # only while a Pad/Resize computes its parameters: a pinned model accepts no other shapes
        # (a beam search's batch, a sentence's length); the static dims it reads first, then the
        # spatial dims, the batch dim last, as padding reads the spatial dims
        _fold_static_dim_reads(model, inferred)
        without_batch = {name: [None, *dims[1:]] for name, dims in shapes.items() if dims}
        for attempt in (without_batch, shapes):
            if computed_layout_parameters(model) and pin_input_shapes(model, attempt, source, report):
                _fold(model, inferred)
                _fold_static_dim_reads(model, inferred)
    model = ort_basic_optimized(model, report)  # a new model: new nodes
    inferred = {}
    _fold(model, inferred)
    if _apply_rules(model, report):
        # without a rewrite the graph is the one just folded: folding it again changes nothing (the
        # whole zoo checked) and costs onnxscript's pattern matching over every node once more
        _fold(model, inferred)
    # what the folds left (the shape reads of static dims fold after the optimizer where no first fold ran)
    if reads_shapes(model) and symbolic_inputs(model):
        report.note("prepare: the input dims stay symbolic, so the model keeps accepting every shape; its shape "
                    "arithmetic stays float. To fold it for one deployment shape: fix(model, input_shapes={...})")
    after = _op_counts(model)
    for op_type in sorted(set(before) | set(after)):
        if before[op_type] != after[op_type]:
            report.note(f"prepare: {op_type} {before[op_type]} -> {after[op_type]}")
    return model


def prepare(
    model: model_io.ModelLike,
    calibration: Iterable[Mapping[str, np.ndarray]] | None = None,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    pin_shapes: bool = True,
    verify: bool = True,
    strict: bool = False,
    return_report: bool = False,
    feeds: Iterable[Mapping[str, np.ndarray]] | None = None,
):
    """Canonicalize an FP32 model (see the module docstring); the original is never modified.

    Args:
        model: the FP32 model (ModelProto, onnx_ir.Model or path).
        calibration: inputs the model will see (calibration data): their shapes pin symbolic dims where
            the graph computes with shapes, and the prepared model is verified on them. Without
            feeds, random inputs of the declared (static) shapes verify it.
        input_shapes: explicit shapes per input name (override the feeds' shapes).
        pin_shapes: False leaves symbolic input dims symbolic whatever the feeds' shapes (they
            only verify): for feeds that are not what the model will see, such as synthetic ones.
        verify: run both models and keep the original when they differ beyond float rounding.
        strict: raise :class:`PrepareFailedError` instead of keeping the original.

    Returns:
        The prepared model (same kind as given; a path gives a ModelProto), or ``(model, FixReport)``.
    """
    if feeds is not None:
        warnings.warn("prepare(feeds=) is deprecated and will be removed in the next release: use calibration=",
                      DeprecationWarning, stacklevel=2)
        calibration = feeds if calibration is None else calibration
    loaded = model_io.load(model, require_qdq=False)
    model_io.check_float(loaded.model, "prepare()")
    report = FixReport(target="prepare")
    for note in loaded.notes:
        report.note(note)
    prepared = prepare_serialized(ir.serde.serialize_model(loaded.model), calibration, report, input_shapes=input_shapes,
                                  pin_shapes=pin_shapes, verify=verify, strict=strict, work=loaded.model)
    result = prepared if loaded.returns == "ir" else ir.serde.serialize_model(prepared)
    return (result, report) if return_report else result


def prepare_serialized(
    original: onnx.ModelProto,
    feeds: Iterable[Mapping[str, np.ndarray]] | None,
    report: FixReport,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    pin_shapes: bool = True,
    verify: bool = True,
    strict: bool = False,
    reference: fidelity.ReferenceRuns | None = None,
    observer: TensorObserver | None = None,
    work: ir.Model | None = None,
) -> ir.Model:
    """:func:`prepare` of a model serialised by onnx_ir (what prepare() makes of any argument), its
    decisions added to ``report``: a new onnx_ir.Model (the original, copied, where canonicalizing
    failed or did not verify).

    ``work``: the onnx_ir.Model ``original`` was serialised from, where the caller gives it up (it
    is canonicalized in place): deserialising ``original`` again gives the same model (PP-OCR cls:
    12 ms of quantize()).

    ``reference``: the original's runs on ``feeds``, for a caller that runs it on them again
    (quantize(): its final fidelity); verification reads and adds to them. ``observer``: shown the
    tensors it names of the prepared model on each feed, from the verification's runs; it keeps
    them when the prepared model is returned (it is told to discard them otherwise)."""
    feeds = list(feeds) if feeds is not None else None
    if verify and reference is None and feeds:
        reference = fidelity.ReferenceRuns(original, feeds)
    if verify and reference is not None:
        # the original's runs the verification compares with first, made while canonicalize() holds
        # a core with Python
        reference.prefetch((True, VERIFY_FEEDS))
    if work is None:
        work = ir.serde.deserialize_model(original)
    if input_shapes is not None:
        shapes, source = {name: list(dims) for name, dims in input_shapes.items()}, "given input_shapes"
    elif feeds and pin_shapes:
        shapes, source = shapes_in_use(work, feeds), "from the feeds"
    else:
        shapes, source = None, ""
    try:
        work = canonicalize(work, report, shapes, source)
    except KenosisError:
        raise
    except Exception as error:  # noqa: BLE001 - a rewrite that fails leaves the model as exported
        report.note(f"prepare: canonicalization failed ({type(error).__name__}: {error}); "
                    "the model is used as exported")
        return ir.serde.deserialize_model(original)
    if shapes is None and symbolic_inputs(work) and reads_shapes(work):
        report.note("prepare: the graph computes with symbolic input dims; give feeds or input_shapes to fold them")
    if not verify:
        return work
    if reference is None:
        # without feeds, random inputs of the shapes the prepared model accepts
        reference = fidelity.ReferenceRuns(original, feeds or fidelity.random_feeds(ir.serde.serialize_model(work), 2))
    if _verified(reference, work, report, strict, observer):
        return work
    if observer is not None:
        observer.discard()
    return ir.serde.deserialize_model(original)


def _verified(original: fidelity.ReferenceRuns, work: ir.Model, report: FixReport, strict: bool,
              observer: TensorObserver | None = None) -> bool:
    """:func:`~kenosis_rewrite.canonicalization.verify.verified` with this module's ``PREPARE_TOLERANCE``,
    ``NOISE_FACTOR`` and ``VERIFY_FEEDS``, read at each call."""
    return verified(original, work, report, strict, observer, tolerance=PREPARE_TOLERANCE,
                    noise_factor=NOISE_FACTOR, verify_feeds=VERIFY_FEEDS)

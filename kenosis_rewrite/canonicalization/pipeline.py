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
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx_ir.passes import common as common_passes
from onnxscript.optimizer._constant_folding import (
    DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
    DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
    FoldConstantsPass,
)
from onnxscript.rewriter import _DEFAULT_REWRITE_RULES, RewritePass, RewriteRuleSet
from onnxscript.rewriter.rules.common import fuse_hardswish_rules, no_op_transpose_rule, transpose_transpose_rule

from kenosis_rewrite.core import model_io
from kenosis_rewrite.core import ort_sessions
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.errors import KenosisError, PrepareFailedError, RuntimeMeasurementError
from kenosis_rewrite.core.ort_quantize import quiet_logger
from kenosis_rewrite._upstream.lift_constants import LiftAllConstantsPass
from kenosis_rewrite.graph.value_origins import Origin, value_origins
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.canonicalization.rules.channel_affine import channel_affine_rules
from kenosis_rewrite.canonicalization.rules.gemm_addend import gemm_addend_rules
from kenosis_rewrite.canonicalization.rules.materialized_reshape import MATERIALIZE_RESHAPE_RULE_NAME, materialized_reshape_rules
from kenosis_rewrite.graph.rule_filter import op_filtered
from kenosis_rewrite.canonicalization.rules.residual_sum import residual_sum_rules
from kenosis_rewrite.canonicalization.rules.shape_slices import shape_slice_rules, static_dim_rules
from kenosis_rewrite.canonicalization.rules.transpose_sinking import transpose_sinking_rules

__all__ = ["prepare", "PrepareFailedError", "PREPARE_TOLERANCE", "canonicalize"]

PREPARE_TOLERANCE = 1e-5
# Outputs behind a steep nonlinearity (DB text maps: sigmoid(50 x)) amplify any rounding: there the
# bound is what onnxruntime's own optimizations change on the same inputs, twice over.
NOISE_FACTOR = 2.0
_SHAPE_READERS = ("Shape", "Size")
_REWRITE_STEPS = 8
_SMALL_CONSTANT_ELEMENTS = 1 << 16
_PROTOBUF_LIMIT = 2**31 - 1
_HARDSWISH_OPSET = 14  # HardSwish is an ONNX op from opset 14
# prepare()'s first check runs this many feeds (see _verified), every feed where the graph routes
# inputs by their values
VERIFY_FEEDS = 2
_DATA_ROUTED_OPS = frozenset({"If", "Loop", "Scan", "NonZero", "TopK", "NonMaxSuppression", "Unique", "Compress"})



def _op_counts(model: ir.Model) -> collections.Counter:
    return collections.Counter(node.op_type for node in model.graph.all_nodes())


def _reads_shapes(model: ir.Model) -> bool:
    return any(node.op_type in _SHAPE_READERS for node in model.graph.all_nodes())


# the parameter inputs of the layout ops whose run-time values keep a quantized graph from fusing: a
# Pad that cannot move into its Conv (TF "same" padding), a Resize of a table the graph computes from
# constants and shapes (a ViT's position embeddings resized to its patch grid: it folds away once the
# shapes are known)
_LAYOUT_PARAMETERS = {"Pad": (1, 2), "Resize": (1, 2, 3), "Upsample": (1,)}


def computed_layout_parameters(model: ir.Model) -> list[str]:
    """The Pad/Resize/Upsample nodes (names) whose parameters the graph computes at run time: what
    pinning input shapes is for. A graph that reads shapes only for anything else (a recurrent
    state's batch size, an attention mask's length, anchors) folds nothing a quantizer needs there;
    nor does a Resize of data to a computed size (``interpolate(size=y.shape[2:])``): it runs the
    same quantized (the same Q/DQ in ORT's optimized graph, with ``shape-of-codes``; the fuzz's
    dynamic-batch graphs), and pinned, the model would refuse every other batch and image size."""
    found, origins = [], None
    for node in model.graph.all_nodes():
        indices = _LAYOUT_PARAMETERS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if not indices or not any(index < len(node.inputs) and node.inputs[index] is not None
                                  and node.inputs[index].const_value is None for index in indices):
            continue
        if node.op_type != "Pad":
            origins = value_origins(model.graph) if origins is None else origins
            if origins.get(node.inputs[0]) is Origin.DATA:
                continue
        found.append(node.name or node.op_type)
    return found


def _is_static(dim) -> bool:
    return isinstance(dim, int) and dim >= 0


def _symbolic_inputs(model: ir.Model) -> list[ir.Value]:
    return [value for value in model.graph.inputs if value.shape is None or not all(_is_static(d) for d in value.shape)]


def negative_dims_as_symbolic(model: ir.Model, report: FixReport) -> None:
    """Paddle exports write an unknown dim as -1; read as a size, constant folding computes with it."""
    values = [*model.graph.inputs, *model.graph.outputs]
    for value in values:
        if value.shape is None or all(not isinstance(d, int) or d >= 0 for d in value.shape):
            continue
        old = list(value.shape)
        value.shape = ir.Shape([None if isinstance(d, int) and d < 0 else d for d in old])
        report.changed("negative-dims-as-symbolic", value.name, f"declared dims {old}: -1 read as unknown", exact=True)
    for node in model.graph.all_nodes():
        for value in node.outputs:
            if value.shape is not None and any(isinstance(d, int) and d < 0 for d in value.shape):
                value.shape = None  # an inferred-shape annotation carrying -1: let inference redo it


def _shapes_in_use(model: ir.Model, feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, list[int | None]]:
    """Per input, the dims every feed agrees on (None where they differ)."""
    shapes: dict[str, list[int | None]] = {}
    for value in model.graph.inputs:
        seen = [np.shape(feed[value.name]) for feed in feeds if value.name in feed]
        if not seen or len({len(shape) for shape in seen}) != 1:
            continue
        shapes[value.name] = [dims[0] if len(set(dims)) == 1 else None for dims in zip(*seen)]
    return shapes


def pin_input_shapes(model: ir.Model, shapes: Mapping[str, Sequence[int | None]], source: str, report: FixReport) -> bool:
    """Replace symbolic input dims by ``shapes``' static ones; True when anything was pinned."""
    pinned = False
    for value in _symbolic_inputs(model):
        wanted = shapes.get(value.name)
        if wanted is None:
            continue
        old = list(value.shape) if value.shape is not None else None
        if old is not None and len(old) != len(wanted):
            raise KenosisError(f"input {value.name!r} has rank {len(old)}, the shapes in use have rank {len(wanted)}")
        new = [
            dim if _is_static(dim) else (wanted[i] if wanted[i] is not None else dim)
            for i, dim in enumerate(old if old is not None else wanted)
        ]
        if old is not None and new == old:
            continue
        value.shape = ir.Shape(new)
        pinned = True
        shown = [str(d) if d is not None else "?" for d in old] if old is not None else ["?"]
        report.changed(
            "pin-input-shapes", value.name,
            f"dims [{', '.join(shown)}] -> [{', '.join(str(d) if d is not None else '?' for d in new)}] ({source}) so shape "
            "computations fold; the prepared model accepts only these shapes",
            exact=True,
        )
    return pinned


def _fold_small_constant_of_shape(node: ir.Node) -> bool | None:
    """onnxscript keeps every ConstantOfShape (model size); a small one computing padding or grids
    must fold for the arithmetic after it to fold."""
    if node.op_type != "ConstantOfShape" or node.inputs[0] is None or node.inputs[0].const_value is None:
        return None
    return int(np.prod(node.inputs[0].const_value.numpy())) <= _SMALL_CONSTANT_ELEMENTS or None


class _FoldConstantsKnownShapesPass(FoldConstantsPass):
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

    def _do_inference(self, node: ir.Node) -> None:
        if all(output.type is not None and output.shape is not None
               and all(isinstance(dim, int) for dim in output.shape) for output in node.outputs):
            return
        last = self._inferred.get(node)
        if last is not None and _same_inference_reads(last, _inference_reads(node)):
            return
        super()._do_inference(node)
        self._inferred[node] = _inference_reads(node)


def _inference_reads(node: ir.Node) -> tuple:
    """What ONNX shape inference of ``node`` reads, and its outputs' types and shapes."""
    def shape(value: ir.Value) -> tuple | None:
        return None if value.shape is None else tuple(value.shape)

    inputs = tuple(None if value is None else (value.name, value.type, shape(value), value.const_value)
                   for value in node.inputs)
    return (inputs, tuple(node.attributes.values()), tuple((value.type, shape(value)) for value in node.outputs))


def _same_inference_reads(last: tuple, now: tuple) -> bool:
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


def _rewrite_rules() -> tuple:
    """onnxscript's default rewrite rules, its MaterializeReshapeShape replaced by ours (valid before
    opset 14: :mod:`kenosis_rewrite.canonicalization.rules.materialized_reshape`)."""
    ours = materialized_reshape_rules().rules
    return tuple(replacement for rule in _DEFAULT_REWRITE_RULES
                 for replacement in (ours if rule.name == MATERIALIZE_RESHAPE_RULE_NAME else [rule]))


def _optimize_ir(model: ir.Model, num_iterations: int, should_fold=lambda node: None,
                 inferred: dict[ir.Node, tuple] | None = None) -> None:
    """``onnxscript.optimizer.optimize_ir(model, num_iterations)`` (onnxscript 0.7: the same passes,
    defaults and order), its default rewrite rules :func:`~kenosis_rewrite.graph.rule_filter.op_filtered`
    (the same rewrites without matching every rule at every node) and its constant folding
    :class:`_FoldConstantsKnownShapesPass` (no shape inference on nodes whose outputs have static
    shapes), which folds what ``should_fold`` asks for besides onnxscript's own choices."""
    passes = [
        common_passes.InlinePass(),
        ir.passes.PassManager(
            [
                _FoldConstantsKnownShapesPass(shape_inference=True,
                                              input_size_limit=DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                                              output_size_limit=DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                                              should_fold=should_fold, inferred=inferred),
                RewritePass(op_filtered(_rewrite_rules())),
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


def _fold(model: ir.Model, inferred: dict[ir.Node, tuple] | None = None) -> None:
    """Constant folding, small ConstantOfShape included, and onnxscript's default rewrites, to a
    fixed point (at most 3 steps). The small ConstantOfShape are folded in the steps themselves, not
    by a folding pass of their own before them: one pass over the graph less per fold (PP-OCRv2
    rec's prepare() 0.84 -> 0.74 s); the graphs are the same up to node order and the names
    deduplicated constants keep. ``inferred``: the shape inferences made so far on ``model``'s nodes
    (:class:`_FoldConstantsKnownShapesPass`), shared by the folds of one canonicalization."""
    with quiet_logger("onnxscript"):
        _optimize_ir(model, num_iterations=3, should_fold=_fold_small_constant_of_shape, inferred=inferred)


def _fold_static_dim_reads(model: ir.Model, inferred: dict[ir.Node, tuple]) -> None:
    """``Gather(Shape(x), i)`` of static dims as constants, and the arithmetic on them folded
    (:func:`~kenosis_rewrite.canonicalization.rules.shape_slices.static_dim_rules`): a ViT's patch grid or a TF
    export's padding read from a shape whose batch alone is symbolic folds without pinning it. The
    dims are those ONNX shape inference with data propagation finds (:func:`_propagated_dims`)."""
    # a Pad folded makes the shapes after it known, and the next Pad's parameters with them
    computed = computed_layout_parameters(model)
    while computed:
        found = _propagated_dims(model)
        if not op_filtered(static_dim_rules()).apply_to_model(model) and not found:
            return
        _fold(model, inferred)
        before, computed = computed, computed_layout_parameters(model)
        if len(computed) >= len(before):  # nothing more folds this way
            return


# the opset from which ONNX's Reshape inference reads a target shape known only by data propagation
_RESHAPE_INFERS_PROPAGATED_SHAPE = 14


def _propagated_dims(model: ir.Model) -> bool:
    """Fill the unknown dims of the main graph's values with the static ones ONNX shape inference
    finds when it propagates shape values (``data_prop``): behind a Resize to a computed size
    (``Concat(Shape(x)[0:2], Shape(x)[2:4] * 2)``) node-by-node inference knows no spatial dim, and
    the padding computed from them would only fold with the batch pinned too (fuzz seed 20002019).
    Nothing changes where inference fails. True when a dim became known.

    An opset-13 graph is inferred as opset 14, the same ops but for Reshape's ``allowzero``
    (default off, the same semantics): Reshape-13's inference ignores a propagated target shape,
    and a padding computed behind ``Reshape(x, Concat(Shape(x)[0:1], [...]))`` pinned the batch
    (fuzz seed 20002086)."""
    try:
        proto = ir.serde.serialize_model(model)
        for opset in proto.opset_import:
            if opset.domain in ("", "ai.onnx") and opset.version == _RESHAPE_INFERS_PROPAGATED_SHAPE - 1:
                opset.version = _RESHAPE_INFERS_PROPAGATED_SHAPE
        found = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a help here, not a requirement
        return False
    changed = False
    values = {value.name: value for node in model.graph for value in node.outputs}
    for info in [*found.graph.value_info, *found.graph.output]:
        value = values.get(info.name)
        tensor = info.type.tensor_type
        if value is None or not tensor.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if value.shape is None:
            if value.type is not None and any(d is not None for d in dims):
                value.shape, changed = ir.Shape(dims), True
            continue
        if len(value.shape) != len(dims):
            continue
        merged = [old if isinstance(old, int) or new is None else new for old, new in zip(value.shape, dims)]
        if merged != list(value.shape):
            value.shape, changed = ir.Shape(merged), True
    return changed


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


def _declared_output_repairs(model: ir.Model, observed: Sequence[np.ndarray], report: FixReport) -> bool:
    """Declare each graph output with the shape it has in ``observed``; True when any changed."""
    repaired = False
    for value, array in zip(model.graph.outputs, observed):
        declared = value.shape
        actual = np.shape(array)
        if declared is None:
            continue
        contradicts = len(declared) != len(actual) or any(
            isinstance(dim, int) and dim != size for dim, size in zip(declared, actual)
        )
        if contradicts:
            report.changed(
                "repair-declared-output-shapes", value.name,
                f"declared {list(declared)}, the model produces {list(actual)}: declaration replaced",
                exact=True,
            )
            # with symbolic inputs only the rank is known for every input the model accepts
            static = not _symbolic_inputs(model)
            value.shape = ir.Shape(list(actual) if static else [None] * len(actual))
            repaired = True
    return repaired


def _max_relative_error(reference: list[list[np.ndarray]], outputs: list[list[np.ndarray]]) -> float:
    worst = 0.0
    for ref_outputs, new_outputs in zip(reference, outputs):
        for ref, new in zip(ref_outputs, new_outputs):
            ref, new = np.asarray(ref), np.asarray(new)
            if ref.shape != new.shape:
                return float("inf")
            if not np.issubdtype(ref.dtype, np.floating):
                if not np.array_equal(ref, new):
                    return float("inf")
                continue
            scale = float(np.max(np.abs(ref), initial=0.0))
            error = float(np.max(np.abs(ref.astype(np.float64) - new), initial=0.0))
            worst = max(worst, error / scale if scale > 0 else error)
    return worst


def _rename_introduced_values(optimized: onnx.ModelProto, before: onnx.ModelProto) -> None:
    """Give the tensors ORT's optimizer introduced names it will not generate again.

    ORT names the tensors of its rewrites after the rewrite (MatMulAddFusion: ``gemm_input_shape``);
    when it loads the saved model and fuses a second site, it adds an initializer of the same name
    and refuses the model ("Attempt to replace the existing tensor", onnxruntime 1.32, seen on
    MiniLM with pinned shapes)."""
    graph = before.graph
    known = {value.name for value in [*graph.input, *graph.output, *graph.initializer, *graph.value_info]}
    known.update(name for node in graph.node for name in [*node.input, *node.output])
    renamed: dict[str, str] = {}

    def fresh(name: str) -> str:
        if not name or name in known:
            return name
        if name not in renamed:
            renamed[name] = f"{name}__kenosis_prepared"
        return renamed[name]

    new_graph = optimized.graph
    for tensor in new_graph.initializer:
        tensor.name = fresh(tensor.name)
    for info in new_graph.value_info:
        info.name = fresh(info.name)
    for node in new_graph.node:
        node.input[:] = [fresh(name) for name in node.input]
        node.output[:] = [fresh(name) for name in node.output]


def _ort_basic_optimized(model: ir.Model, report: FixReport) -> ir.Model:
    """onnxruntime's basic (level 1, standard ops only) optimizer: its transpose optimizer cancels the
    NHWC Transposes that fan out (residual blocks), which local sinking cannot. Kept when it loads."""
    proto = ir.serde.serialize_model(model)
    try:
        serialized = proto.SerializeToString()  # once: its length is the size check too
    except ValueError:  # protobuf refuses messages over 2 GB
        serialized = b""
    if not serialized or len(serialized) >= _PROTOBUF_LIMIT:
        report.note("prepare: onnxruntime's basic optimizer skipped (model over 2 GB)")
        return model
    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = os.path.join(folder, "basic.onnx")
        options.log_severity_level = 3
        try:
            ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
            optimized_proto = onnx.load(options.optimized_model_filepath)
            _rename_introduced_values(optimized_proto, proto)
            optimized = ir.serde.deserialize_model(optimized_proto)
        except Exception as error:  # noqa: BLE001 - ORT's refusal leaves our canonical graph as is
            report.note(f"prepare: onnxruntime's basic optimizer skipped ({type(error).__name__}: {error})")
            return model
    if any(node.domain not in ("", "ai.onnx") for node in optimized.graph.all_nodes()):
        report.note("prepare: onnxruntime's basic optimizer wrote non-standard ops; not used")
        return model
    # ORT writes its own model header; the user's metadata, producer and opsets stay the user's
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(optimized, field, getattr(model, field))
    optimized.metadata_props.clear()
    optimized.metadata_props.update(model.metadata_props)
    optimized.opset_imports.clear()
    optimized.opset_imports.update(model.opset_imports)
    optimized.graph.name = model.graph.name
    # and the output shapes the user declared: where they contradict the graph, ORT writes its own
    # silently, and the repair is prepare()'s to make and report (repair-declared-output-shapes)
    declared = {value.name: value.shape for value in model.graph.outputs}
    for value in optimized.graph.outputs:
        if value.name in declared:
            value.shape = None if declared[value.name] is None else ir.Shape(declared[value.name])
    return optimized


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


def canonicalize(model: ir.Model, report: FixReport, shapes: Mapping[str, Sequence[int | None]] | None = None, source: str = "") -> ir.Model:
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
    model = _ort_basic_optimized(model, report)  # a new model: new nodes
    inferred = {}
    _fold(model, inferred)
    if _apply_rules(model, report):
        # without a rewrite the graph is the one just folded: folding it again changes nothing (the
        # whole zoo checked) and costs onnxscript's pattern matching over every node once more
        _fold(model, inferred)
    # what the folds left (the shape reads of static dims fold after the optimizer where no first fold ran)
    if _reads_shapes(model) and _symbolic_inputs(model):
        report.note("prepare: the input dims stay symbolic, so the model keeps accepting every shape; its shape "
                    "arithmetic stays float. To fold it for one deployment shape: fix(model, input_shapes={...})")
    after = _op_counts(model)
    for op_type in sorted(set(before) | set(after)):
        if before[op_type] != after[op_type]:
            report.note(f"prepare: {op_type} {before[op_type]} -> {after[op_type]}")
    return model


def prepare(
    model: model_io.ModelLike,
    feeds: Iterable[Mapping[str, np.ndarray]] | None = None,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    pin_shapes: bool = True,
    verify: bool = True,
    strict: bool = False,
    return_report: bool = False,
):
    """Canonicalize an FP32 model (see the module docstring); the original is never modified.

    Args:
        model: the FP32 model (ModelProto, onnx_ir.Model or path).
        feeds: inputs the model will see (calibration data): their shapes pin symbolic dims where
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
    loaded = model_io.load(model, require_qdq=False)
    model_io.check_float(loaded.model, "prepare()")
    report = FixReport(target="prepare")
    for note in loaded.notes:
        report.note(note)
    prepared = prepare_serialized(ir.serde.serialize_model(loaded.model), feeds, report, input_shapes=input_shapes,
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
        shapes, source = _shapes_in_use(work, feeds), "from the feeds"
    else:
        shapes, source = None, ""
    try:
        work = canonicalize(work, report, shapes, source)
    except KenosisError:
        raise
    except Exception as error:  # noqa: BLE001 - a rewrite that fails leaves the model as exported
        report.note(f"prepare: canonicalization failed ({type(error).__name__}: {error}); the model is used as exported")
        return ir.serde.deserialize_model(original)
    if shapes is None and _symbolic_inputs(work) and _reads_shapes(work):
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


class TensorObserver(Protocol):
    """Something gathering statistics of the prepared model's tensors from the verification's runs
    (quantize(): equalization's channel maxima)."""

    def tensors(self, model: onnx.ModelProto) -> list[str]:
        """The tensors of ``model`` to show :meth:`observe` (and forget any earlier runs)."""

    def observe(self, values: Mapping[str, np.ndarray]) -> None:
        """One run's tensors, by name."""

    def discard(self) -> None:
        """Forget the runs: they were not of the model kept."""


def _with_observed(candidate: bytes, observer: TensorObserver | None) -> tuple[bytes, list[str], int | None, tuple]:
    """The candidate with ``observer``'s tensors as extra outputs, all its output names, how many
    are its own (None when there is nothing to observe: the candidate as it is), and (a probe
    computing only ``observer``'s tensors, their names) for the feeds whose outputs are not compared."""
    if observer is None:
        return candidate, [], None, (b"", [])
    proto = onnx.ModelProto.FromString(candidate)
    own = [o.name for o in proto.graph.output]
    watched = list(dict.fromkeys(observer.tensors(proto)))
    extra = [name for name in watched if name not in set(own)]
    if not extra:
        return candidate, [], None, (b"", [])
    probe = ort_sessions.computing_only(proto, watched).SerializeToString()
    proto.graph.output.extend(onnx.ValueInfoProto(name=name) for name in extra)
    return proto.SerializeToString(), [*own, *extra], len(own), (probe, watched)


def _routes_by_data(model: ir.Model) -> bool:
    """Whether different inputs can take different paths through ``model`` (control flow, or tensors
    whose size depends on the values): one input's run then says nothing about another's path."""
    return any(node.op_type in _DATA_ROUTED_OPS for node in model.graph.all_nodes())


def _observe_the_rest(probe: bytes, names: list[str], feeds: Sequence[Mapping[str, np.ndarray]],
                      observer: TensorObserver) -> None:
    """Show ``observer`` the feeds not compared, from ``probe`` (only the nodes its tensors need).
    Where that fails, the observer has not seen every feed and its user measures for itself."""
    try:
        for run in fidelity.run(probe, feeds, optimized=True):
            observer.observe(dict(zip(names, run)))
    except RuntimeMeasurementError:
        pass


def _verified(original: fidelity.ReferenceRuns, work: ir.Model, report: FixReport, strict: bool,
              observer: TensorObserver | None = None) -> bool:
    """Whether ``work`` reproduces the original model on its feeds (declared output shapes repaired
    on the way).

    First as both run in onnxruntime with every optimization on, as users run them: equal within
    ``PREPARE_TOLERANCE`` of the outputs' magnitude on the first ``VERIFY_FEEDS`` feeds verifies
    (the original's optimized runs are the ones quantize()'s final fidelity reads again). Every
    rewrite is an identity applied whatever the data, so a wrong one shows on any real input; a
    graph that routes inputs by their values (:func:`_routes_by_data`) is compared on every feed,
    and an ``observer`` is shown the prepared model's runs on every feed (those not compared from a
    probe computing only its tensors, :func:`~kenosis_rewrite.core.ort_sessions.computing_only`). Otherwise the graphs as
    written are compared, both run with optimizations off, within float rounding or ``NOISE_FACTOR`` x what onnxruntime's own optimizations change
    (:func:`_verified_as_written`, on the first ``VERIFY_FEEDS`` feeds unless the graph routes by
    value). ``observer``'s tensors are exposed as extra outputs of the first check's runs of the
    prepared model (onnxruntime keeps its fusions around them: they are outputs of the nodes it
    fuses into); those runs were of this model, so they stand when either check verifies it."""
    candidate = ir.serde.serialize_model(work).SerializeToString()  # once for both sessions and the checker
    observed, names, own, (probe, watched) = _with_observed(candidate, observer)
    compared = len(original.feeds) if _routes_by_data(work) else VERIFY_FEEDS
    feeds = original.feeds[:compared]
    try:
        reference = original.outputs(optimized=True, count=compared)
    except RuntimeMeasurementError as error:
        report.note(f"prepare: the original model does not run on these inputs ({error}); not verified")
        return True
    try:
        # it must load with every optimization on (ORT's own fusions can fail on a graph they or we
        # rewrote: that model would not run at all)
        outputs = fidelity.run(observed, feeds, optimized=True)
        if own is not None:
            for run in outputs:
                observer.observe(dict(zip(names, run)))
            outputs = [run[:own] for run in outputs]
            _observe_the_rest(probe, watched, original.feeds[compared:], observer)
        if _declared_output_repairs(work, outputs[0], report):
            candidate = ir.serde.serialize_model(work).SerializeToString()
        onnx.checker.check_model(candidate, full_check=True)
    except (RuntimeMeasurementError, onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as failure:
        return _refused(f"the prepared model fails: {failure}", report, strict)
    error = _max_relative_error(reference, outputs[:len(reference)])
    if error <= PREPARE_TOLERANCE:
        report.note(f"prepare: verified on {len(reference)} inputs, max error {error:.2g} of the output magnitude "
                    "(both optimized as onnxruntime runs them)")
        return True
    # the observed runs were of this model: they stand if it verifies as written
    return _verified_as_written(original, candidate, report, strict, _routes_by_data(work))


def _verified_as_written(original: fidelity.ReferenceRuns, candidate: bytes, report: FixReport, strict: bool,
                         every_feed: bool) -> bool:
    """The graphs as written (optimizations off) agree within float rounding, or ``NOISE_FACTOR`` x
    what onnxruntime's own optimizations change on the same inputs (outputs behind a steep
    nonlinearity amplify any rounding); on the first ``VERIFY_FEEDS`` feeds, or ``every_feed``
    (a graph that routes inputs by their values)."""
    count = len(original.feeds) if every_feed else min(VERIFY_FEEDS, len(original.feeds))
    feeds = original.feeds[:count]
    try:
        reference = original.outputs(optimized=False, count=count)
        # float rounding as the runtime itself has it: its own fusions (Conv+BN, ...) reorder arithmetic
        runtime_noise = _max_relative_error(reference, original.outputs(optimized=True, count=count))
    except RuntimeMeasurementError as error:
        report.note(f"prepare: the original model does not run on these inputs ({error}); not verified")
        return True
    tolerance = max(PREPARE_TOLERANCE, NOISE_FACTOR * runtime_noise)
    try:
        error = _max_relative_error(reference, fidelity.run(candidate, feeds, optimized=False))
    except RuntimeMeasurementError as failure:
        return _refused(f"the prepared model fails: {failure}", report, strict)
    if error > tolerance:
        return _refused(f"outputs differ by {error:.2g} of their magnitude (allowed {tolerance:.2g}: float rounding, or "
                        f"{NOISE_FACTOR:g}x what onnxruntime's own optimizations change, {runtime_noise:.2g})", report, strict)
    report.note(f"prepare: verified on {len(feeds)} inputs, max error {error:.2g} of the output magnitude "
                f"(onnxruntime's own optimizations: {runtime_noise:.2g})")
    return True


def _refused(reason: str, report: FixReport, strict: bool) -> bool:
    """False, with ``reason`` in the report (raised with ``strict``)."""
    if strict:
        raise PrepareFailedError(f"prepare(): {reason}")
    report.note(f"prepare: {reason}; the model is used as exported")
    return False

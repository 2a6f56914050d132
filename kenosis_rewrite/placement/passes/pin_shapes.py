"""Pin symbolic input dims of a quantized model and fold what then depends on nothing else.

``PinInputShapesPass({"pixel_values": [1, 3, 224, 224]})``: each symbolic dim of a graph input is
replaced by the given size. A value computed only from constants and from the shapes of tensors
whose shapes are now static (``Shape``/``Size`` readers; ``Range``, ``ConstantOfShape``, ``Resize``
... downstream) is the same on every run: it becomes an initializer. A ViT exported with a
symbolic image size interpolates its position embedding at run time (``Shape -> ... -> Resize``
(cubic) of a constant: 20 ms of 89 ms per image on NNCF's ViT-S); with the size pinned it is a
constant. An exporter's run-time "same" padding becomes constant pads.

The values are computed by ONNX Runtime itself, on the graph as written (optimizations off), for
an input of the pinned shapes: the constants are exactly what the model computed at run time. A
quantized shape computation (``-> Q -> DQ ->``, as node-by-node quantizers write it) is folded up to
its QuantizeLinear's input, so the Q/DQ pair, and the integer kernels that read it, stay. A value
over ``MAX_FOLDED_ELEMENTS`` elements stays computed (model size).

Exact for the pinned shapes (the same values, from the same runtime); the resulting model accepts
only those shapes, which the report says. It is an opt-in: ``fix(..., input_shapes=...)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import common as common_passes

from kenosis_rewrite.canonicalization.pipeline import negative_dims_as_symbolic, pin_input_shapes
from kenosis_rewrite.core import fidelity, model_io, ort_sessions
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import KenosisError, RuntimeMeasurementError
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass
from kenosis_rewrite.graph.value_origins import INDEX_GENERATORS, SHAPE_READERS

# a folded constant larger than this stays computed at run time (model size)
MAX_FOLDED_ELEMENTS = 1 << 20
# a value computed from these is not the same on every run
_NONDETERMINISTIC = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                               "Bernoulli", "Dropout"})
_CHECK_FEEDS = 2
# a shape known only once an earlier computation is folded (padding after padding) takes another round
_FOLD_ROUNDS = 8


def _is_static_shape(value: ir.Value) -> bool:
    return value.shape is not None and all(isinstance(d, int) and d >= 0 for d in value.shape)


def _shape_only_values(graph: ir.Graph) -> dict[ir.Value, None]:
    """Values computed only from constants and from static shapes, at least one shape among them, in
    graph order (the folded initializers come out in that order on every run)."""
    constant = set(graph.initializers.values())
    shape_only: dict[ir.Value, None] = {}
    for node in graph:  # topological order
        if node.domain not in ("", "ai.onnx") or node.op_type in _NONDETERMINISTIC or any(
                attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()):
            continue
        inputs = [v for v in node.inputs if v is not None]
        if node.op_type in SHAPE_READERS:
            fixed = bool(inputs) and _is_static_shape(inputs[0])
            reads_shape = True
        else:
            fixed = all(v in constant or v in shape_only for v in inputs)
            reads_shape = any(v in shape_only for v in inputs) or node.op_type in INDEX_GENERATORS
        if not fixed:
            continue
        for value in node.outputs:
            if reads_shape:
                shape_only[value] = None
            else:
                constant.add(value)
    return shape_only


def _fold_points(shape_only: dict[ir.Value, None]) -> list[ir.Value]:
    """The shape-only values something else reads: where the computation can stop. Behind a
    ``Q -> DQ`` pair, the Q's input (the pair stays for the integer kernels that read it)."""
    points: dict[ir.Value, None] = {}
    for value in shape_only:
        readers = [use.node for use in value.uses()]
        if not (value.is_graph_output() or any(not all(out in shape_only for out in r.outputs) for r in readers)):
            continue
        producer = value.producer()
        if qdq_params.is_dequantize(producer) and producer.inputs[0] in shape_only:
            quantize = producer.inputs[0].producer()
            if qdq_params.is_quantize(quantize) and quantize.inputs[0] in shape_only:
                value = quantize.inputs[0]
        if value.producer() is not None and not value.is_graph_output():
            points[value] = None
    return list(points)


def _infer_pinned_shapes(model: ir.Model) -> None:
    for node in model.graph:  # shapes inferred with the symbolic dims would win over the pinned ones
        for value in node.outputs:
            if not value.is_graph_output():
                value.shape = None
    common_passes.ShapeInferencePass()(model)


class PinInputShapesPass(ReportingPass):
    """Pin the given input dims and fold the shape computations they feed; see the module docstring."""

    rule_name = "pin-input-shapes"

    def __init__(self, shapes: Mapping[str, Sequence[int]], report=None):
        super().__init__(report)
        self.shapes = {name: list(dims) for name, dims in shapes.items()}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        names = {value.name for value in model.graph.inputs}
        unknown = sorted(set(self.shapes) - names)
        if unknown:
            raise KenosisError(f"input_shapes names {unknown}, which are not graph inputs (inputs: {sorted(names)})")
        report = self.report or FixReport(target="")
        # Paddle's -1 dims read as unknown first: pinned, a declared -1 would contradict the pinned size
        negative_dims_as_symbolic(model, report)
        if not pin_input_shapes(model, self.shapes, "given input_shapes", report):
            return ir.passes.PassResult(model, modified=False)
        before, folded = len(model.graph), 0
        for _ in range(_FOLD_ROUNDS):
            _infer_pinned_shapes(model)
            points = _fold_points(_shape_only_values(model.graph))
            newly = self._fold(model, points) if points else 0
            if not newly:
                break
            folded += newly
            common_passes.RemoveUnusedNodesPass()(model)
        if folded:
            self.changed("graph", f"{folded} values computed from the pinned shapes are constants now "
                         f"({before - len(model.graph)} nodes removed)", exact=True)
        return ir.passes.PassResult(model, modified=True)

    def _fold(self, model: ir.Model, points: list[ir.Value]) -> int:
        """Evaluate ``points`` with ONNX Runtime and make each an initializer; how many were."""
        probe = ir.serde.serialize_model(model)
        del probe.graph.output[:]
        probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(v.name) for v in points)
        try:
            session = ort_sessions.session(probe, ort_sessions.options(1, level="none"))
            values = session.run(None, fidelity.random_feeds(probe, 1)[0])
        except Exception as error:  # noqa: BLE001 - ORT raises many types; nothing is folded then
            self.refused("graph", f"ONNX Runtime could not evaluate the shape computations: {error}")
            return 0
        folded = 0
        for value, array in zip(points, values):
            if array.size > MAX_FOLDED_ELEMENTS:
                continue
            constant = ir.Value(name=None, const_value=ir.tensor(np.asarray(array)))
            constant.name = value.name
            value.name = None
            value.replace_all_uses_with(constant)
            model.graph.register_initializer(constant)
            folded += 1
        return folded


def _matching_feeds(model: onnx.ModelProto, feeds: list[Mapping[str, np.ndarray]] | None) -> list[dict]:
    """Feeds the pinned ``model`` accepts: the caller's where their shapes match, else random ones."""
    declared = {value.name: [d.dim_value for d in value.type.tensor_type.shape.dim] for value in model.graph.input}
    matching = [dict(feed) for feed in feeds or [] if all(
        name in feed and list(np.shape(feed[name])) == dims for name, dims in declared.items())]
    return matching[:_CHECK_FEEDS] or fidelity.random_feeds(model, _CHECK_FEEDS)


def _checker_regression(original: onnx.ModelProto, pinned: onnx.ModelProto) -> str | None:
    """Why ``pinned`` fails the full ONNX check that ``original`` passes, or None."""
    after = model_io.full_check_problem(pinned)
    if after is None or model_io.full_check_problem(original) is not None:
        return None
    return f"the pinned model fails the ONNX checker where the input passes it ({after.splitlines()[0]})"


def pinned_model(model: model_io.ModelLike, shapes: Mapping[str, Sequence[int]],
                 feeds: Iterable[Mapping[str, np.ndarray]] | None = None):
    """``(model with pinned shapes, FixReport)``, the model of the kind given (a path gives a ModelProto).

    The pinned model must reproduce the input bit for bit on ``feeds`` of the pinned shapes (random
    ones when none match), both run as written; otherwise the input comes back as it was and the
    report says why.
    """
    loaded = model_io.load(model)
    report = FixReport(target="pin-input-shapes")
    original = ir.serde.serialize_model(loaded.model)
    PinInputShapesPass(shapes, report)(loaded.model)
    pinned = ir.serde.serialize_model(loaded.model)
    check = _matching_feeds(pinned, list(feeds) if feeds is not None else None)
    try:
        # the graphs as written: the folded values came from this evaluation, so equal bit for bit
        expected, actual = fidelity.run(original, check, optimized=False), fidelity.run(pinned, check, optimized=False)
        same = all(np.array_equal(a, b) for got, want in zip(actual, expected) for a, b in zip(got, want))
        problem = None if same else "the pinned model's outputs differ from the input's"
    except RuntimeMeasurementError as error:
        problem = f"the pinned model does not run like the input ({error})"
    if problem is None:
        problem = _checker_regression(original, pinned)
    if problem is not None:
        refused = FixReport(target="pin-input-shapes")
        refused.refused(PinInputShapesPass.rule_name, "graph", f"{problem}; shapes left symbolic")
        return model, refused
    report.note(f"pin-input-shapes: checked on {len(check)} inputs of the pinned shapes")
    return (loaded.model if loaded.returns == "ir" else pinned), report

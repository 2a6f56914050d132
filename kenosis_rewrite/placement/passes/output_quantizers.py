"""Give a quantized Conv the output quantizer ORT CPU needs to run it as an integer kernel.

Transformation, for a weighted op ``W`` whose data input and weight are dequantized but whose output
reaches no QuantizeLinear (NNCF and OpenVINO-style placement: ``DQ -> Conv -> HardSwish -> Q``)::

    DQ(x) -> W(., DQ(w)) -> consumers       ==>     DQ(x) -> W(., DQ(w)) -> Q(s, z) -> DQ(s, z) -> consumers

(after the BatchNormalization that alone reads a Conv's output, when there is one, so that
``fold-batchnorm-into-conv`` folds it). A data input dequantized before a Split counts as
dequantized (``move-dq-past-split`` moves that DQ). When the data input is a Concat of dequantized
tensors with no quantizer after it (NNCF's YOLOv8 C2f blocks), the Concat output gets one too::

    DQ(a), DQ(b) -> Concat -> W      ==>     DQ(a), DQ(b) -> Concat -> Q(s, z) -> DQ(s, z) -> W

which ORT runs as QLinearConcat feeding the integer op; unless all its inputs share one set of
parameters, seen through MaxPools (YOLOv8's SPPF): ``move-dq-forward`` then moves the DQ past the
MaxPools and the Concat, exactly, and the Concat needs no quantizer.
with ``(s, z)`` the asymmetric grid of the data input's type over ``[min(lo, 0), max(hi, 0)]``, where
``[lo, hi]`` is

* the range the op's output took on the caller's calibration feeds, measured with ONNX Runtime on
  the input model (:func:`measure_output_ranges`), clipped to the bounds below when they apply;
* without calibration, the bounds the quantizer after a saturating activation puts on its input
  (:func:`~kenosis_rewrite.placement.passes.saturation.saturation_bounds`): the op's output read only
  by a HardSwish, HardSigmoid, SiLU (``x * Sigmoid(x)``), Gelu, Mish, Sigmoid or Tanh whose output
  only quantizers with one set of per-tensor parameters read (NNCF's ``Conv -> SiLU -> Q``). Outside
  them every value gives that quantizer the same code as the bound itself, so clipping there is
  exact (the bounds per activation are in :mod:`~kenosis_rewrite.placement.passes.saturation`);
* for a Concat's output without calibration, the union of the ranges of the dequantized tensors it
  joins: every value lies in it. A range is a fact about data; these are facts about the graph.

Why: ORT CPU fuses ``DQ -> Conv -> Q`` (optionally with a Relu/Clip before the Q) into QLinearConv;
without a Q after the Conv it runs it in float on dequantized tensors. A MatMul or Gemm needs no
output quantizer: ORT runs it as an integer kernel with a float output (MatMulIntegerToFloat, QGemm),
so one would add a rounding and no integer MACs (ViT-S by NNCF, fix(calibration=16 scenes), the zoo's
fix-fidelity table: with quantizers on its 60 MatMul outputs 1.66x FP32 and -0.0125 on the worst of
40 photos against FP32; without, 1.70x and -0.0010); only a Concat feeding one (its input) gets a
quantizer. OpenVINO fuses
Conv with the activation after it, so NNCF places no Q there; on ORT CPU a PP-LCNet quantized by
NNCF 3.4 runs every Conv in float (explain(): 0% integer MACs).

Exactness: approximate. One rounding step more: at most one step ``s`` of the new grid per element
inside the range (half a step of rounding, and up to half a step where the zero point's rounding
moves the grid's end inside the range), and a clamp at its bounds, exact for the saturation
bounds; through the activation the downstream quantizer's input moves by at most ``L * s`` (``L``
its slope: HardSwish <= 1.5 on its range, HardSigmoid ``alpha``). ``fix()``'s run-time guard measures the
result against FP32 (or the input without its activation roundings) and, where it costs more than
its tolerance, undoes the quantizers at the sites that cost it (each site is the tensor's name).

Left alone: a MatMul's or Gemm's output (above); an op whose output already reaches a Q (directly or
through a Relu/Clip), is a graph output, or has neither a measured range nor saturation bounds; ops
whose data input is not a per-tensor 8-bit DQ; and a measured range of one sign where the tensor
reaches a graph output with no quantizer on the way (:func:`answer_reached`): the grid then ends at
0, so every value of the other sign in the model's answer, which the calibration feeds never showed,
becomes 0. A score head calibrated on data without its objects is such a range: MediaPipe's face
detector by NNCF on 16 street scenes measured ``[-6.2, 0]`` at its score heads, every positive face
score became 0 (-0.0025 mean cosine against FP32 on 8 photos of faces; the face mesh's presence
score, YOLOv8's class logits the same). A range of both signs keeps its quantizer: it clamps only
beyond what the feeds showed, and a score's threshold lies inside it (PicoDet's heads, 6% of its
MACs, stay integer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from kenosis_rewrite.core import fidelity, op_tables
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass
from kenosis_rewrite.placement.passes.qdq_propagation import commutes_with_qdq
from kenosis_rewrite.placement.passes.saturation import saturation_bounds
from kenosis_rewrite.placement.rules.conv_affine_folding import conv_affine

RULE_NAME = "quantize-weighted-outputs"
# in a change's detail: the quantizer sits on the model's answer (a graph output with no quantizer
# between); where undoing single rules does not satisfy the run-time guard, it tries them with these
# sites undone too (placement.guarded)
ON_THE_ANSWER = "on the model's answer"


def _dequantized_params(value: ir.Value | None) -> qdq_params.QuantParams | None:
    """Per-tensor 8-bit parameters of the DQ writing ``value``, seen through a Split and through
    MaxPools (opset >= 12): ``move-dq-past-split`` and ``move-dq-forward`` then put a DQ right at
    ``value``, exactly."""
    node = value.producer() if value is not None else None
    if node is not None and node.op_type == "Split" and node.inputs[0] is not None:
        node = node.inputs[0].producer()
    # the MaxPools move-dq-forward moves a DQ past (8-bit types are checked below)
    while (node is not None and node.op_type == "MaxPool" and node.graph is not None and node.inputs[0] is not None
           and commutes_with_qdq(node, qdq_params.default_opset(node.graph))):
        node = node.inputs[0].producer()
    if not qdq_params.is_dequantize(node):
        return None
    params = qdq_params.quant_params(node)
    return params if params is not None and params.is_per_tensor and params.dtype in qdq_params.EIGHT_BIT else None


def _concat_of_dequantized(value: ir.Value | None) -> tuple[qdq_params.QuantParams, bool] | None:
    """When ``value`` is a Concat of dequantized 8-bit tensors of one type: the first input's
    parameters, and whether all inputs share them (then ``move-dq-forward`` makes the Concat output
    a dequantized tensor exactly, and it needs no quantizer of its own)."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Concat" or node.domain not in qdq_params.DEFAULT_DOMAINS or not node.inputs:
        return None
    params = [_dequantized_params(v) for v in node.inputs]
    if any(p is None for p in params) or len({p.dtype for p in params}) != 1:
        return None
    return params[0], all(p.same_as(params[0]) for p in params)


def _has_weight(node: ir.Node) -> bool:
    """The op's weight is a dequantized constant: ``DQ(int8 constant)``, or ``DQ(Q(float constant))``
    as ModelOpt writes it (``fold-constant-quantize`` turns that into the first form)."""
    weight = node.inputs[1].producer() if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if not qdq_params.is_dequantize(weight):
        return False
    source = weight.inputs[0].producer()
    if qdq_params.is_quantize(source):
        return qdq_params.const_array(source.inputs[0]) is not None
    return qdq_params.const_array(weight.inputs[0]) is not None


def _reaches_quantizer(value: ir.Value) -> bool:
    for user, _ in value.uses():
        if qdq_params.is_quantize(user):
            return True
        if user.op_type in op_tables.ORT_ABSORBED_ACTIVATIONS and any(qdq_params.is_quantize(u) for u, _ in user.outputs[0].uses()):
            return True
    return False


def quantizer_site(node: ir.Node) -> ir.Value:
    """Where the output quantizer of ``node`` goes: its output, or, for a Conv, after the chain of
    BatchNormalizations and constant per-channel Mul/Div/Add/Sub that alone reads its output
    (``fold-batchnorm-into-conv`` and ``fold-affine-into-conv`` then fold the chain into the Conv)."""
    site = node.outputs[0]
    weights = qdq_params.constant_or_dequantized(node.inputs[1]) if node.op_type == "Conv" and len(node.inputs) > 1 else None
    if weights is None:
        return site
    while not site.is_graph_output():
        users = list(site.uses())
        # read once, as the first input (either one of a commutative Add/Mul)
        if len(users) != 1 or (users[0][1] != 0 and users[0][0].op_type not in ("Add", "Mul")):
            break
        user = users[0][0]
        foldable = (user.op_type == "BatchNormalization" and user.domain in qdq_params.DEFAULT_DOMAINS
                    or not isinstance(conv_affine(user, site, weights.shape[0], weights.ndim), str))
        if not foldable:
            break
        site = user.outputs[0]
    return site


@dataclasses.dataclass(frozen=True)
class Site:
    """A float tensor next to a weighted op that needs a Q/DQ for ORT to run the op integer."""

    value: ir.Value
    like: qdq_params.QuantParams  # the grid type to use (the op's data input's)
    op: ir.Node
    kind: str  # "output" or "input"


def _open(value: ir.Value) -> bool:
    return bool(value.name) and not value.is_graph_output() and bool(value.uses()) and not _reaches_quantizer(value)


def sites(graph: ir.Graph) -> list[Site]:
    """The tensors of weighted ops (top-level graph) that miss a quantizer: the output of an op whose
    data input is dequantized, and the data input itself when it is a Concat of dequantized tensors
    (NNCF leaves Concat outputs float; ORT fuses DQs -> Concat -> Q into QLinearConcat)."""
    found, seen = [], set()
    for node in graph:
        if node.op_type not in op_tables.WEIGHTED_OPS or node.domain not in qdq_params.DEFAULT_DOMAINS or not _has_weight(node):
            continue
        like = _dequantized_params(node.inputs[0])
        concat = _concat_of_dequantized(node.inputs[0]) if like is None else None
        if concat is not None:
            like, shared = concat
            if not shared and _open(node.inputs[0]) and node.inputs[0] not in seen:
                found.append(Site(node.inputs[0], like, node, "input"))
                seen.add(node.inputs[0])
        if node.op_type in op_tables.INTEGER_WITH_FLOAT_OUTPUT_OPS:  # integer already: a Q would only round
            continue
        site = quantizer_site(node)
        if like is not None and _open(site) and not _reaches_quantizer(node.outputs[0]) and site not in seen:
            found.append(Site(site, like, node, "output"))
            seen.add(site)
    return found


def _concat_union(value: ir.Value) -> tuple[float, float, str] | None:
    """The union of the ranges of the dequantized tensors a Concat joins: every value of its output
    lies in it (a fact about the graph: no clamp, one rounding onto the joint grid)."""
    params = [_dequantized_params(v) for v in value.producer().inputs]
    if not params or any(p is None for p in params):
        return None
    lo = min((p.qmin - p.scalar_zero_point) * p.scalar_scale for p in params)
    hi = max((p.qmax - p.scalar_zero_point) * p.scalar_scale for p in params)
    return lo, hi, "the union of its inputs' quantizer ranges"


def one_signed(measured: tuple[float, float]) -> bool:
    """Whether a measured range has values of one sign only (its grid then ends at 0)."""
    return measured[0] >= 0.0 or measured[1] <= 0.0


def answer_reached(value: ir.Value, max_nodes: int = 256) -> str | None:
    """The name of a graph output ``value`` flows into with no QuantizeLinear on the way (through any
    float op), or None: a quantizer there would clamp the model's answer itself."""
    pending, seen = [value], {id(value)}
    while pending and len(seen) <= max_nodes:
        current = pending.pop()
        if current.is_graph_output():
            return current.name
        for user, _ in current.uses():
            if qdq_params.is_quantize(user):
                continue
            for output in user.outputs:
                if id(output) not in seen:
                    seen.add(id(output))
                    pending.append(output)
    return None


def site_range(site: Site, measured: tuple[float, float] | None) -> tuple[float, float, str] | None:
    """``(lo, hi, source)`` for ``site``: the measured range clipped to the saturation bounds, or the
    bounds alone without a measurement (a Concat's input site: the union of its inputs' ranges);
    None when there is neither."""
    if site.kind == "input" and measured is None:
        return _concat_union(site.value)
    # without a measurement, per-channel quantizers' span is the whole grid: the widest channel's
    # range, far coarser than a narrow channel's step (NNCF's PP-LCNet: -0.009 cosine against FP32)
    bounds = saturation_bounds(site.value, per_channel=measured is not None) if site.kind == "output" else None
    if bounds is None:
        return None if measured is None else (measured[0], measured[1], "the measured range")
    low, high, why = bounds
    if measured is None:
        return low, high, f"the bounds of {why}"
    lo, hi = max(measured[0], low), min(measured[1], high)
    if not lo < hi:  # every measured value saturates: the bounds alone
        return low, high, f"the bounds of {why}"
    return lo, hi, f"the measured range within the bounds of {why}"


_ULP_STEPS = 64


def covering_grid(lo: float, hi: float, qmin: int, qmax: int) -> tuple[np.float32, int] | None:
    """``(scale, zero_point)`` of the asymmetric grid over ``[min(lo, 0), max(hi, 0)]`` whose codes
    reach both ends: the zero point's rounding would otherwise leave up to half a step of one end
    outside, which clamps values a saturation bound promises to keep."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if not (np.isfinite(lo) and np.isfinite(hi) and hi > lo):
        return None
    scale = (hi - lo) / (qmax - qmin)
    zero_point = int(np.clip(np.rint(qmin - lo / scale), qmin, qmax))
    if zero_point < qmax:
        scale = max(scale, hi / (qmax - zero_point))
    if zero_point > qmin:
        scale = max(scale, lo / (qmin - zero_point))
    scale = np.float32(scale)
    # float32 rounding must not leave an end outside either (a few steps of one ulp at most; a grid
    # whose zero point sits at an end while the range reaches past it never gets there)
    for _ in range(_ULP_STEPS):
        if (qmax - zero_point) * float(scale) >= hi and (qmin - zero_point) * float(scale) <= lo:
            return scale, zero_point
        scale = np.nextafter(scale, np.float32(np.inf))
    return None


def _in_float_type(scale: np.float32, like: qdq_params.QuantParams) -> np.ndarray:
    """``scale`` in the float type of the grid it copies (float16 in a float16 model: QuantizeLinear's
    input and scale share one type), rounded up so that the grid still reaches both ends."""
    dtype = np.asarray(like.scale).dtype if np.issubdtype(np.asarray(like.scale).dtype, np.floating) else np.float32
    typed = np.asarray(scale, dtype)
    if typed < scale:
        typed = np.nextafter(typed, dtype.type(np.inf))
    return np.asarray(typed, dtype)


def candidates(graph: ir.Graph) -> list[ir.Node]:
    """The weighted ops one of whose tensors :func:`sites` would quantize."""
    return list(dict.fromkeys(site.op for site in sites(graph)))


def measure_output_ranges(model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, tuple[float, float]]:
    """``{output name: (lo, hi)}`` of every candidate op of ``model`` over ``feeds`` (ONNX Runtime)."""
    graph = ir.serde.deserialize_model(model).graph
    names = [site.value.name for site in sites(graph)]
    if not names or not feeds:
        return {}
    augmented = onnx.ModelProto()
    augmented.CopyFrom(model)
    present = {o.name for o in augmented.graph.output}
    augmented.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names if name not in present)
    session = fidelity.session(augmented, optimized=False)
    ranges: dict[str, tuple[float, float]] = {}
    for feed in feeds:
        for name, array in zip(names, session.run(names, dict(feed))):
            if array.size == 0 or not np.all(np.isfinite(array)):
                continue
            lo, hi = float(array.min()), float(array.max())
            old = ranges.get(name, (lo, hi))
            ranges[name] = (min(lo, old[0]), max(hi, old[1]))
    return ranges


class QuantizeWeightedOutputsPass(ReportingPass):
    """Insert the output Q/DQ of weighted ops that have none; see the module docstring."""

    rule_name = RULE_NAME

    def __init__(self, ranges: Mapping[str, tuple[float, float]], report=None):
        super().__init__(report)
        self.ranges = dict(ranges)
        # the output quantizers inserted after a BatchNormalization/affine chain, for
        # undo_unfolded_chains: (site, Q, DQ, the report's change)
        self.after_chains: list[tuple[Site, ir.Node, ir.Node, object]] = []

    def undo_unfolded_chains(self, model: ir.Model) -> int:
        """Remove each output quantizer this pass put after a Conv's BatchNormalization/affine chain
        that the fold rules then left in place (NNCF's PP-OCRv3 rec at opset 12: no per-channel
        DequantizeLinear, and the per-tensor weight scale cannot hold the folded channels). ORT
        fuses ``DQ -> Conv -> Q`` only with nothing but a Relu/Clip between: there the Conv stays
        float and the quantizer is one rounding and two ops more per run (4.5% of that model's
        time). Exact: the Q/DQ pair goes, which is the graph as it was before this pass.
        Returns the number removed."""
        removed = 0
        for site, quantize, dequantize, change in self.after_chains:
            if quantize.graph is not model.graph or dequantize.graph is not model.graph:
                continue  # a rule replaced them: the pair is no longer this pass's
            if _fused_producer(quantize.inputs[0]) or len(quantize.outputs[0].uses()) != 1 \
                    or dequantize.inputs[0] is not quantize.outputs[0] or dequantize.outputs[0].is_graph_output():
                continue
            source = quantize.inputs[0]
            for user, index in list(dequantize.outputs[0].uses()):
                user.replace_input_with(index, source)
            model.graph.remove([dequantize, quantize], safe=True)
            if self.report is not None and change in self.report.changes:
                self.report.changes.remove(change)
            chain = source.producer().op_type if source.producer() is not None else "?"
            self.refused(site.op.name or site.op.op_type,
                         f"the {chain} between it and its output quantizer did not fold into it, so ORT would run "
                         "it in float either way: quantizer removed")
            removed += 1
        return removed

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, modified = model.graph, False
        names = qdq_params.NameAllocator(graph)  # one scan of the graph for every quantizer inserted
        for site in sites(graph):
            where = site.op.name or site.op.op_type
            if self.held(site.value.name, site.op):  # the guard's own refusal says why
                continue
            measured = self.ranges.get(site.value.name)
            reached = answer_reached(site.value) if measured is not None else None
            answer = reached if reached and one_signed(measured) else None
            chosen = site_range(site, None if answer else measured)
            if chosen is None and answer:
                self.refused(where, f"its {site.kind} {site.value.name!r} reaches the graph output {answer!r} with no "
                             f"quantizer on the way, and the calibration feeds showed it of one sign only "
                             f"[{measured[0]:.4g}, {measured[1]:.4g}]: a quantizer there would set every value of the "
                             "other sign in the model's answer to 0")
                continue
            if chosen is None:
                self.refused(where, f"no range measured for its {site.kind} {site.value.name!r} (pass calibration= feeds)")
                continue
            if reached and not answer:
                chosen = (*chosen[:2], f"{chosen[2]}, {ON_THE_ANSWER} ({reached!r})")
            modified |= self._insert(graph, names, site, *chosen)
        return ir.passes.PassResult(model, modified=modified)

    def _insert(self, graph: ir.Graph, names: qdq_params.NameAllocator, site: Site, lo: float, hi: float, source: str) -> bool:
        """Q/DQ on ``site`` over ``[lo, hi]`` in its grid type."""
        like = site.like
        grid = covering_grid(lo, hi, like.qmin, like.qmax)
        if grid is None:
            return False
        scale, zero_point = grid
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        producer, output = site.value.producer(), site.value
        base = output.name
        scale_name = names.fresh(f"{base}_output_scale")
        scale_value = qdq_params.add_initializer(graph, ir.tensor(_in_float_type(scale, like), name=scale_name), scale_name)
        zp_name = names.fresh(f"{base}_output_zero_point")
        zp_value = qdq_params.add_initializer(graph, qdq_params.integer_tensor(np.asarray(zero_point), like.dtype, zp_name), zp_name)
        readers = list(output.uses())
        quantize = ir.Node("", qdq_params.QUANTIZE, [output, scale_value, zp_value], name=names.fresh(f"{base}_QuantizeLinear"))
        dequantize = ir.Node("", qdq_params.DEQUANTIZE, [quantize.outputs[0], scale_value, zp_value],
                             name=names.fresh(f"{base}_DequantizeLinear"))
        quantize.outputs[0].name = names.fresh(f"{base}_quantized")
        dequantize.outputs[0].name = names.fresh(f"{base}_dequantized")
        graph.insert_after(producer, [quantize, dequantize])
        for user, index in readers:
            user.replace_input_with(index, dequantize.outputs[0])
        self.changed(site.op.name or site.op.op_type, f"{site.kind} quantizer {like.dtype.name.lower()} s={float(scale):.6g} "
                     f"zp={zero_point} over [{lo:.4g}, {hi:.4g}], {source}", exact=False, site=site.value.name)
        if site.kind == "output" and site.value is not site.op.outputs[0]:
            self.after_chains.append((site, quantize, dequantize, self.report.changes[-1] if self.report is not None else None))
        return True


def _fused_producer(value: ir.Value) -> bool:
    """Whether ``value`` comes from a weighted op directly or through Relu/Clip each read once: what
    ORT fuses with the Q after it."""
    node = value.producer()
    while node is not None and node.op_type in op_tables.ORT_ABSORBED_ACTIVATIONS and node.domain in qdq_params.DEFAULT_DOMAINS \
            and node.inputs[0] is not None and len(node.inputs[0].uses()) == 1:
        node = node.inputs[0].producer()
    return node is not None and node.op_type in op_tables.WEIGHTED_OPS and node.domain in qdq_params.DEFAULT_DOMAINS

"""Requantize activations to symmetric int8 (zero point 0), as TensorRT and NPU compilers require.

Transformation, per quantized activation tensor and per activation-typed constant::

    Q(x; s, z) -> DQ(.; s, z)   ==>   Q(x; s', 0: int8) -> DQ(.; s', 0),   s' = max(-lo, hi) / 127

where ``[lo, hi] = [s (qmin - z), s (qmax - z)]`` is the range the old quantizer represented, so
the new one covers the same values (and their negatives). uint8 weights become int8 with zero point
0 the same way, per channel when they were per-channel.

The old Q clamped at ``lo`` and ``hi``; the new one at ``+-max(-lo, hi)``. The clamp it loses may be
an activation quantize_static deleted (zero point qmin: a Relu; a Clip(a, b): its bounds), so it is
put back in front of the new Q (Relu or Clip), and the model computes the same function.

Exactness: approximate. The range is kept, the grid changes: a tensor that used [lo, hi] with
256 levels now spends half of its 255 levels on ``[-max, 0)``; for a one-sided tensor the step
doubles. This is the price of the target's symmetric-only integer kernels (TensorRT explicit
quantization accepts zero point 0 only). Per-axis or blocked activations, non-8-bit types, Q
outputs that are graph outputs and Qs read by anything but DequantizeLinear are left alone and
reported.

A pair whose dequantized value only leaves the model (a graph output nothing else reads) and whose
step would grow ``OUTPUT_STEP_GROWTH`` times or more (a one-sided tensor: Softmax, Sigmoid, Relu)
is removed instead: no op reads it as int8, so the coarser grid would only add error, and on values
below the new step (a Softmax over many classes) it rounds them all to 0. The output then carries
its value unrounded, clamped where the Q clamped values its input can reach (a Relu or Clip that
quantize_static deleted, or a calibrated bound): the input model's function without its last
rounding.

**Tensors whose conversion costs too much stay float** (the target runs them in FP16). With
calibration feeds (``calibration=``, handed in by ``FixPass``), the cost of converting each tensor is
measured on them (:mod:`.symmetric_cost`): a tensor whose conversion alone lowers the whole model's
output cosine by more than ``MAX_COST`` (0.005) keeps no Q/DQ at all, its clamps
kept as for a graph output above, and the report says so with the cost measured. Without feeds
nothing is measured and every tensor is converted: no data-free rule tells a costly conversion
from a cheap one (on generated attention blocks the attention probabilities' conversion cost
0.0003 cosine at 8-16 keys and 0.012 at 197, with the same graph), and the run-time guard holds the
whole result to its stated bound.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.graph.dequantize import insert_clamp, remove_qdq_pair
from kenosis_rewrite.graph.pass_base import ReportingPass
from kenosis_rewrite.placement.passes import symmetric_cost

RULE_NAME = "symmetric-int8-activations"
_QMAX = 127
MAX_COST = symmetric_cost.MAX_COST  # the most output cosine one tensor's conversion may cost
# a one-sided tensor's step grows 255/127 = 2.0x; a two-sided one's at most 1.5x up to zero point
# 64 (or 191) of uint8
OUTPUT_STEP_GROWTH = 1.5


def _symmetric_scale(params: qdq_params.QuantParams) -> np.ndarray:
    scale = params.scale.astype(np.float64)
    zero_point = params.zero_point.astype(np.float64)
    reach = np.maximum(scale * (zero_point - params.qmin), scale * (params.qmax - zero_point))
    reach = np.where(reach > 0, reach, scale)
    return (reach / _QMAX).astype(params.scale.dtype)


def _only_leaves_model(dequantizers: list[ir.Node]) -> bool:
    """Whether the dequantized values are graph outputs that no node reads."""
    return all(dq.outputs[0].is_graph_output() and not dq.outputs[0].uses() for dq in dequantizers)


def _is_weight_use(node: ir.Node, index: int) -> bool:
    return index == 1 and node.op_type in op_tables.WEIGHTED_OPS


class SymmetricActivationsPass(ReportingPass):
    """Every activation Q/DQ (and uint8 weight) to int8 with zero point 0."""

    rule_name = RULE_NAME
    symmetric_scale = staticmethod(_symmetric_scale)

    def __init__(self, report=None, fused_activations: tuple[str, ...] = (), calibration=None,
                 only: frozenset[int] | None = None):
        super().__init__(report)
        self.fused_activations = frozenset(fused_activations)
        # feeds to measure each conversion's cost on (symmetric_cost); None: convert every tensor
        self.calibration = calibration
        # positions (in graph order) of the only quantizers to convert, constants left alone: the
        # variants symmetric_cost measures; None: the whole pass
        self.only = only

    def _params(self, graph: ir.Graph, names: qdq_params.NameAllocator, base: str, scale: np.ndarray, shape) -> tuple[ir.Value, ir.Value]:
        scale_name = names.fresh(f"{base}_sym_scale")
        scale_value = qdq_params.add_initializer(graph, ir.tensor(scale.reshape(shape), name=scale_name), scale_name)
        zp_name = names.fresh(f"{base}_sym_zero_point")
        zp_value = qdq_params.add_initializer(graph, ir.tensor(np.zeros(shape, np.int8), name=zp_name), zp_name)
        return scale_value, zp_value

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        costs = {}
        if self.calibration and self.only is None:
            costs = symmetric_cost.costly_conversions(model, self, self.calibration)
        graph = model.graph
        names = qdq_params.NameAllocator(graph)  # one scan of the graph for every name this pass gives
        modified = False
        for index, node in enumerate(list(graph)):
            if qdq_params.is_quantize(node) and (self.only is None or index in self.only):
                modified |= self._quantizer(graph, names, node, costs.get(index))
            elif self.only is None and qdq_params.is_dequantize(node) and qdq_params.const_array(node.inputs[0]) is not None:
                modified |= self._constant(graph, names, node)
        return ir.passes.PassResult(model, modified=modified)

    def candidate(self, node: ir.Node) -> qdq_params.QuantParams | list[ir.Node] | str | None:
        """What converting quantizer ``node`` involves: None when there is nothing to convert (not
        8-bit, or already symmetric int8), a reason (str) when it is refused, else its DQ readers."""
        params = qdq_params.quant_params(node)
        if params is None or params.dtype not in qdq_params.EIGHT_BIT:
            return None
        if params.dtype == ir.DataType.INT8 and not np.any(params.zero_point):
            return None
        if not params.is_per_tensor:
            return "per-axis activation quantization is left as it is"
        return qdq_params.requantizable(node.outputs[0])

    def _quantizer(self, graph: ir.Graph, names: qdq_params.NameAllocator, node: ir.Node, costly: str | None = None) -> bool:
        consumers = self.candidate(node)
        where = node.name or "QuantizeLinear"
        if consumers is None or isinstance(consumers, str):
            if consumers is not None:
                self.refused(where, consumers)
            return False
        params = qdq_params.quant_params(node)
        output = node.outputs[0]
        if costly is not None and remove_qdq_pair(node, value_range.quantizer_clamp(node), names=names):
            graph.remove([*consumers, node], safe=True)
            self.changed(where, f"{params.describe()}: left float, the target runs it in FP16: {costly}", exact=False)
            return True
        scale = _symmetric_scale(params)
        growth = float(scale.reshape(-1)[0]) / float(params.scale.reshape(-1)[0])
        # the clamps the Q applied stay (a Relu/Clip quantize_static deleted, or a calibrated bound): only
        # the rounding goes
        if growth >= OUTPUT_STEP_GROWTH and _only_leaves_model(consumers) \
                and remove_qdq_pair(node, value_range.quantizer_clamp(node), names=names):
            graph.remove([*consumers, node], safe=True)  # nothing reads them now
            self.changed(where, f"{params.describe()}: left float, a graph output no op reads as int8 (the symmetric "
                                f"step would be {growth:.2f}x coarser)", exact=False)
            return True
        scale_value, zp_value = self._params(graph, names, output.name or "activation", scale, params.scale.shape)
        restored = self._restore_clamp(graph, names, node, params, float(scale.reshape(-1)[0]), consumers)
        for user in (node, *consumers):
            user.replace_input_with(1, scale_value)
            if len(user.inputs) < 3:
                user.resize_inputs(3)
            user.replace_input_with(2, zp_value)
        if "output_dtype" in node.attributes:
            node.attributes["output_dtype"] = ir.AttrInt64("output_dtype", ir.DataType.INT8)
        output.type = ir.TensorType(ir.DataType.INT8)
        detail = f"{params.describe()} -> int8 s={float(scale.reshape(-1)[0]):.6g} zp=0"
        self.changed(where, detail + (f"; {restored}" if restored else ""), exact=False)
        return True

    def _restore_clamp(self, graph: ir.Graph, names: qdq_params.NameAllocator, quantize: ir.Node, params: qdq_params.QuantParams,
                       scale: float, dequantizers: list[ir.Node]) -> str:
        """Put back, in front of the Q, each clamp the old range applied that the new one no longer does.

        The old Q clamped reachable values at ``lo`` and ``hi``; the symmetric one clamps at
        ``+-m``, ``m = max(-lo, hi)``, so the side of smaller magnitude is lost. That clamp may be a
        Relu or Clip that quantize_static deleted (zero point qmin: a Relu; a Clip(a, b) leaves
        ``[a, b]`` as the calibrated range) or only a calibrated bound; both are what the input
        model computes, and which one it is cannot be told from the graph, so it stays. Except on
        the output of a Conv/MatMul/Gemm with its zero point above qmin that only activations the
        target fuses read: the fusion rule removes that pair anyway, and a clamp would block it.
        Returns what was restored ("" for nothing).
        """
        clamp = value_range.quantizer_clamp(quantize)
        if clamp is None:
            return ""
        lo, hi = clamp
        producer = quantize.inputs[0].producer()
        readers = [user for dq in dequantizers for user, _ in dq.outputs[0].uses()]
        fusible = self.fused_activations | ({"Mul"} if "Sigmoid" in self.fused_activations else set())  # SiLU
        fused = readers and all(user.op_type in fusible for user in readers)
        if producer is not None and producer.op_type in op_tables.WEIGHTED_OPS and lo != 0.0 and fused:
            # a Conv/MatMul/Gemm output read only by activations the target fuses into it: the
            # fusion rule removes this pair (approximate, as it states), and a clamp would block it
            return ""
        reach = _QMAX * scale
        lo = lo if lo is not None and lo > -reach + scale / 2 else None
        hi = hi if hi is not None and hi < reach - scale / 2 else None
        if lo is None and hi is None:
            return ""
        base = quantize.inputs[0].name or "x"
        clamped = insert_clamp(graph, quantize.inputs[0], lo, hi, params.scale.dtype, base, quantize, names)
        quantize.replace_input_with(0, clamped)
        return "Relu restored" if lo == 0.0 and hi is None else f"Clip({lo}, {hi}) restored"

    def _constant(self, graph: ir.Graph, names: qdq_params.NameAllocator, node: ir.Node) -> bool:
        params = qdq_params.quant_params(node)
        if params is None or params.dtype not in qdq_params.EIGHT_BIT or params.block_size:
            return False
        if params.dtype == ir.DataType.INT8 and not np.any(params.zero_point):
            return False
        weight = any(_is_weight_use(user, index) for user, index in node.outputs[0].uses())
        values = qdq_params.dequantize_array(qdq_params.const_array(node.inputs[0]), params).astype(np.float64)
        if params.is_per_tensor:
            reach = np.max(np.abs(values)) if values.size else 0.0
            scale = np.asarray(reach / _QMAX if reach > 0 else params.scalar_scale, dtype=params.scale.dtype).reshape(params.scale.shape)
            quantized = np.rint(values / float(scale.reshape(-1)[0]))
        else:
            axis = params.axis % values.ndim
            moved = np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1)
            reach = np.max(np.abs(moved), axis=1)
            scale = np.where(reach > 0, reach / _QMAX, params.scale.reshape(-1)).astype(params.scale.dtype)
            shape = [1] * values.ndim
            shape[axis] = -1
            quantized = np.rint(values / scale.astype(np.float64).reshape(shape))
        base = node.inputs[0].name or "constant"
        data_name = names.fresh(f"{base}_sym")
        data = qdq_params.add_initializer(graph, ir.tensor(np.clip(quantized, -_QMAX, _QMAX).astype(np.int8), name=data_name), data_name)
        scale_value, zp_value = self._params(graph, names, base, scale, params.scale.shape)
        node.replace_input_with(0, data)
        node.replace_input_with(1, scale_value)
        if len(node.inputs) < 3:
            node.resize_inputs(3)
        node.replace_input_with(2, zp_value)
        kind = "weight" if weight else "constant"
        self.changed(node.name or base, f"{kind} {base}: {params.describe()} -> symmetric int8", exact=False)
        return True

"""Weight MatMuls/Gemms quantize their input with its own range on every run, not a calibrated one.

Transformation (``dynamic-activations``; quantize()'s weighted plan for transformers), for a MatMul
or Gemm whose input is a per-tensor ``Q -> DQ`` pair of a computed tensor ``x`` and whose weight is
a dequantized constant 2-D int8/uint8 matrix, per tensor or per output column::

    Add(MatMul(DQ(Q(x; sx, zx)), DQ(w_q; sw, zw)), bias)             (or Gemm(., ., bias), transB 0/1)
        ==>
    xq, xs, xz = DynamicQuantizeLinear(x)                            (one per x: q/k/v projections share it)
    Add(Mul(Cast(MatMulInteger(xq, w_q', xz, zw), float), Mul(xs, sw)), bias)

(``w_q'``: the codes as ``[K, N]``; a Gemm's ``[N, K]`` weight is transposed). ONNX Runtime fuses
the result into ``DynamicQuantizeMatMul`` / ``MatMulIntegerToFloat`` with the bias inside, as it
does for ``quantize_dynamic``'s output; every op is standard ONNX.

Why: a calibrated activation range is a guess about inputs to come. On a transformer's attention
output projections the held-out inputs overshoot it (DINOv2 ViT-S: up to 39% beyond the range of
16 calibration photos), and the clipped outliers cost the worst photo its fidelity (cosine 0.9947
against quantize_dynamic's 0.9981). A range taken from each run never clips: same ViT 0.99985 /
0.99930 (mean / worst) with no loss of speed (48.6 vs 52.0 ms static on one thread: the min/max
pass is ``1/N`` of the GEMM, and ORT's dynamic kernels take the bias in).

Exactness: approximate by design: each run's tensor is quantized with ``DynamicQuantizeLinear``'s
uint8 range (its min and max, widened to hold 0) instead of the calibrated one; the error per
element is at most half of that run's step, and nothing is clipped. The weights, their grid and
the bias are unchanged.

Left alone: per-axis or blocked activation parameters, a DQ whose Q reads a constant, weights
that are not constant 2-D matrices quantized per tensor or per output column, Gemms with
``transA``, ``alpha`` or ``beta`` other than the defaults or a bias that is not a constant vector
(quantize_static's int32 bias is taken at its dequantized value),
non-float32 tensors, nodes in subgraphs.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.pass_base import ReportingPass, remove_unused_nodes

__all__ = ["DynamicActivationsPass", "RULE_NAME"]

RULE_NAME = "dynamic-activations"
_DYNAMIC_QUANTIZE_OPSET = 11


def _gemm_refusal(node: ir.Node) -> str | None:
    if node.op_type != "Gemm":
        return None
    attributes = node.attributes
    if attributes.get_int("transA", 0) or attributes.get_float("alpha", 1.0) != 1.0 or attributes.get_float("beta", 1.0) != 1.0:
        return "a Gemm with transA, alpha or beta"
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        bias = qdq_params.constant_or_dequantized(node.inputs[2])
        if bias is None or bias.ndim != 1 or bias.dtype != np.float32:
            return "a Gemm whose bias is not a constant float32 vector"
    return None


def _weight(node: ir.Node, w_dq: ir.Node, params: qdq_params.QuantParams) -> np.ndarray | str:
    """The weight codes as ``[K, N]``, or why they do not fit."""
    codes = qdq_params.const_array(w_dq.inputs[0])
    if codes is None or codes.ndim != 2:
        return "the weight is not a constant 2-D matrix"
    transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0)
    output_axis = 0 if transposed else 1
    if not qdq_params.per_output_column(params, codes.shape, output_axis):
        return "the weight is not quantized per tensor or per output column"
    return np.ascontiguousarray(codes.T) if transposed else codes


def _weight_or_refusal(node: ir.Node) -> np.ndarray | str:
    """The weight codes as ``[K, N]`` when ``node`` can take a run-time input range, else why it keeps its calibrated one."""
    x_dq, w_dq = (v.producer() if v is not None else None for v in node.inputs[:2])
    if not qdq_params.is_dequantize(w_dq):
        return "the weight is not dequantized"
    if not qdq_params.is_dequantize(x_dq) or not qdq_params.is_quantize(x_dq.inputs[0].producer()):
        return "the input is not a Q -> DQ pair"
    quantizer = x_dq.inputs[0].producer()
    x_params, q_params, w_params = qdq_params.quant_params(x_dq), qdq_params.quant_params(quantizer), qdq_params.quant_params(w_dq)
    if x_params is None or q_params is None or w_params is None or not x_params.same_as(q_params):
        return "quantization parameters that are not constants, or a Q and DQ that differ"
    if not x_params.is_per_tensor or x_params.dtype != ir.DataType.UINT8 or w_params.dtype not in qdq_params.EIGHT_BIT:
        return "not uint8 per-tensor activations with 8-bit weights"
    source = quantizer.inputs[0]
    if qdq_params.const_array(source) is not None:
        return "the quantized input is a constant"
    if any(v is not None and v.dtype not in (None, ir.DataType.FLOAT) for v in (source, node.outputs[0])) \
            or x_params.scale.dtype != np.float32 or w_params.scale.dtype != np.float32:
        return "not float32"
    if x_dq.attributes.get_int("output_dtype", 0) or w_dq.attributes.get_int("output_dtype", 0):
        return "a DequantizeLinear with an output_dtype attribute"
    return _gemm_refusal(node) or _weight(node, w_dq, w_params)


class DynamicActivationsPass(ReportingPass):
    """Calibrated ``Q -> DQ`` inputs of weight MatMuls/Gemms ==> ``DynamicQuantizeLinear -> MatMulInteger``."""

    rule_name = RULE_NAME

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if qdq_params.default_opset(graph) < _DYNAMIC_QUANTIZE_OPSET:
            return ir.passes.PassResult(model, False)
        names = qdq_params.NameAllocator(graph)
        dynamic: dict[int, tuple[ir.Value, ir.Value, ir.Value]] = {}  # per source value: its DQL outputs
        modified = False
        for node in list(graph):
            if node.domain not in qdq_params.DEFAULT_DOMAINS or node.op_type not in ("MatMul", "Gemm"):
                continue
            codes = _weight_or_refusal(node)
            where = node.name or node.op_type
            if isinstance(codes, str):
                if codes not in ("the weight is not dequantized", "the input is not a Q -> DQ pair"):
                    self.refused(where, codes)
                continue
            self._rewrite(graph, node, codes, dynamic, names)
            self.changed(where, "input quantized with its own range on every run (DynamicQuantizeLinear), "
                                "not a calibrated one", exact=False)
            modified = True
        remove_unused_nodes(model, modified)
        return ir.passes.PassResult(model, modified)

    def _rewrite(self, graph: ir.Graph, node: ir.Node, codes: np.ndarray, dynamic: dict, names: qdq_params.NameAllocator) -> None:
        x_dq, w_dq = node.inputs[0].producer(), node.inputs[1].producer()
        source = x_dq.inputs[0].producer().inputs[0]
        w_params = qdq_params.quant_params(w_dq)
        base = node.name or node.op_type
        new_nodes = []
        if id(source) not in dynamic:
            quantize = ir.node("DynamicQuantizeLinear", [source], num_outputs=3, name=names.fresh(f"{base}_dynamic_quantize"))
            for output, suffix, dtype in zip(quantize.outputs, ("quantized", "scale", "zero_point"),
                                             (ir.DataType.UINT8, ir.DataType.FLOAT, ir.DataType.UINT8)):
                output.name = names.fresh(f"{source.name or base}_dynamic_{suffix}")
                output.type = ir.TensorType(dtype)
            new_nodes.append(quantize)
            dynamic[id(source)] = tuple(quantize.outputs)
        x_q, x_scale, x_zero = dynamic[id(source)]

        def constant(values: np.ndarray, suffix: str) -> ir.Value:
            name = names.fresh(f"{base}_{suffix}")
            return qdq_params.add_initializer(graph, ir.tensor(values, name=name), name)

        transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0)
        weight = constant(codes, "weight_kn") if transposed else w_dq.inputs[0]
        w_zero = constant(qdq_params.column_params(w_params.zero_point, w_params), "weight_zero_point")
        w_scale = constant(qdq_params.column_params(w_params.scale, w_params), "weight_scale")
        integer = ir.node("MatMulInteger", [x_q, weight, x_zero, w_zero], name=names.fresh(f"{base}_integer"))
        cast = ir.node("Cast", integer.outputs, attributes={"to": ir.DataType.FLOAT}, name=names.fresh(f"{base}_cast"))
        scales = ir.node("Mul", [x_scale, w_scale], name=names.fresh(f"{base}_scales"))
        scaled = ir.node("Mul", [cast.outputs[0], scales.outputs[0]], name=names.fresh(f"{base}_scaled"))
        new_nodes += [integer, cast, scales, scaled]
        integer.outputs[0].type = ir.TensorType(ir.DataType.INT32)
        for made in (cast, scales, scaled):
            made.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
        result = scaled.outputs[0]
        if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
            # quantize_static's int32 bias was rounded to the static input's grid: its float value
            bias = node.inputs[2] if qdq_params.const_array(node.inputs[2]) is not None \
                else constant(qdq_params.constant_or_dequantized(node.inputs[2]), "bias")
            biased = ir.node("Add", [result, bias], name=names.fresh(f"{base}_bias"))
            biased.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
            new_nodes.append(biased)
            result = biased.outputs[0]
        replaced = node.outputs[0]
        result.shape = replaced.shape
        if replaced in graph.outputs:  # the graph output keeps its name
            result.name, replaced.name = replaced.name, names.fresh(f"{replaced.name}_replaced")
        else:
            result.name = names.fresh(f"{replaced.name or base}_dynamic")
        graph.insert_before(node, new_nodes)
        ir.convenience.replace_all_uses_with(replaced, result, replace_graph_outputs=True)
        _bias_second(result)
        graph.remove(node, safe=True)


def _bias_second(product: ir.Value) -> None:
    """``Add(bias, product)`` read as ``Add(product, bias)``: ORT's fusion looks for the bias second."""
    for user, index in list(product.uses()):
        if user.op_type == "Add" and user.domain in qdq_params.DEFAULT_DOMAINS and index == 0:
            return
        if (user.op_type == "Add" and user.domain in qdq_params.DEFAULT_DOMAINS and index == 1
                and qdq_params.const_array(user.inputs[0]) is not None):
            bias = user.inputs[0]
            user.replace_input_with(0, product)
            user.replace_input_with(1, bias)

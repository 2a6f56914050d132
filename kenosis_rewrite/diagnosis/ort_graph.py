"""The graph ONNX Runtime CPU actually runs, and which of its nodes runs each heavy op of the input graph.

Shared by :mod:`kenosis_rewrite.diagnosis.explain` (integer or float?) and :mod:`kenosis_rewrite.diagnosis.profiler`
(how long?).

How ORT 1.31 names things (measured on quantize_static output, which is what the mapping relies on):

* a fused ``QLinearConv`` is named ``<conv name>_token_<n>`` (NhwcTransformer) and reads the
  quantized weight initializer of the original weight DequantizeLinear (``w_quantized``);
* ``QLinearMatMul``, ``QGemm``, ``QLinearLeakyRelu``... keep the original node name;
* a float Conv/MatMul/Gemm that was not fused keeps its name and its inputs (the weight still comes
  through the DequantizeLinear, which ORT does not constant-fold);
* in float models the NCHWc transformer names a Conv ``<output name>_nchwc`` and replaces its weight
  by a reordered initializer, but keeps the bias initializer's name;
* nodes duplicated by EnsureUniqueDQForNodeUnit get a ``/duplicated`` suffix.

So a heavy op is matched by (1) base node name, (2) the name of its weight or bias initializer
(before or after its DequantizeLinear), (3) its output name (also the output of a Relu/Clip fused
into it) -- the first rule that finds a candidate wins.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import onnx
import onnx_ir as ir

from kenosis_rewrite.core import op_tables, ort_sessions
from kenosis_rewrite.errors import RuntimeMeasurementError

# Optimized-graph op types that run the heavy op's arithmetic in integers.
INTEGER_KERNELS = frozenset(
    {
        "QLinearConv", "QLinearMatMul", "MatMulInteger", "MatMulIntegerToFloat", "ConvInteger",
        "QGemm", "DynamicQuantizeMatMul", "MatMulNBits",
    }
)
# Input-graph op types counted as heavy ops. Integer ones only occur in QOperator/dynamic models.
FLOAT_HEAVY_OPS = op_tables.WEIGHTED_OPS
HEAVY_OPS = frozenset(FLOAT_HEAVY_OPS) | INTEGER_KERNELS
# Optimized-graph op types that may be the float form of a heavy op.
FLOAT_HEAVY_KERNELS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "FusedConv", "FusedGemm", "FusedMatMul"})
# Optimized-graph ops that move or relabel data without arithmetic worth calling an island.
TRIVIAL_OPS = frozenset(
    {
        "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "ReorderInput",
        "ReorderOutput", "Shape", "Constant", "Cast", "Gather", "Slice", "Concat", "Split", "Expand",
    }
)
QDQ_OPS = frozenset({op_tables.QUANTIZE, op_tables.DEQUANTIZE})


def node_input(node: ir.Node, index: int) -> ir.Value | None:
    """Input ``index`` of ``node``; None when it is absent (omitted optional inputs are None too)."""
    return node.inputs[index] if index < len(node.inputs) else None


# --------------------------------------------------------------------------------------------
# ORT: build the session and read back the optimized graph
# --------------------------------------------------------------------------------------------


def write_model(model: ir.Model, directory: str, name: str = "input") -> str:
    """Save ``model`` for ORT as ``<name>.onnx`` in ``directory``; large weights go to an external file next to it."""
    path = os.path.join(directory, f"{name}.onnx")
    tensors = [v.const_value for v in model.graph.initializers.values() if v.const_value is not None]
    # external tensors are written out again: their files sit next to the caller's model, not here
    external = sum(t.nbytes for t in tensors) > 1 << 30 or any(isinstance(t, ir.ExternalTensor) for t in tensors)
    ir.save(model, path, external_data=f"{name}.data" if external else None)
    return path


def optimized_graph(model: ir.Model, directory: str, threads: int = 1, source: str | None = None) -> onnx.ModelProto:
    """The graph ORT CPU actually runs for ``model`` at ORT_ENABLE_ALL (weights not loaded).

    ``source``: a file holding ``model`` as it is (a lazily loaded path), given to ORT instead of a copy.
    """
    source = source or write_model(model, directory)
    optimized = os.path.join(directory, "optimized.onnx")
    try:
        ort_sessions.session(source, ort_sessions.options(threads, optimized_path=optimized))
    except Exception as error:  # noqa: BLE001 - ORT raises several unrelated exception types
        raise RuntimeMeasurementError(
            f"ONNX Runtime (CPU) could not build a session for the model: {error}"
        ) from None
    try:
        return onnx.load(optimized, load_external_data=False)
    except Exception as error:  # noqa: BLE001
        raise RuntimeMeasurementError(f"ONNX Runtime did not write a readable optimized model: {error}") from None


# --------------------------------------------------------------------------------------------
# Mapping optimized nodes back to input heavy ops
# --------------------------------------------------------------------------------------------


_SUFFIXES = re.compile(r"(_token_\d+|/duplicated|_nchwc|/MatMulAddFusion)+$")


def base_name(name: str) -> str:
    """``Conv_4_token_1`` -> ``Conv_4``: the input node name ORT derived an optimized name from."""
    return _SUFFIXES.sub("", name)


def _source_names(value: ir.Value | None) -> set[str]:
    """Names along the DQ/Transpose/Reshape/Cast chain behind a constant ``value``; empty for activations."""
    names: set[str] = set()
    for _ in range(4):
        if value is None:
            return set()
        if value.name:
            names.add(value.name)
        if value.is_initializer() or value.const_value is not None:
            return names
        producer = value.producer()
        if producer is None or producer.op_type not in ("DequantizeLinear", "Transpose", "Reshape", "Cast"):
            return set()
        value = node_input(producer, 0)
    return set()


def _fused_consumer_outputs(node: ir.Node, depth: int = 3) -> list[ir.Value]:
    """The outputs along the chain of single non-heavy consumers after ``node`` (ORT may fuse them in:
    FusedConv, Conv+Add, an NCHWc Conv with its BatchNormalization and activation)."""
    found, current = [], node
    for _ in range(depth):
        uses = list(current.outputs[0].uses())
        if len(uses) != 1 or uses[0][0].op_type in HEAVY_OPS or not uses[0][0].outputs:
            break
        current = uses[0][0]
        found.append(current.outputs[0])
    return found


def _heavy_keys(node: ir.Node) -> tuple[set[str], set[str]]:
    """(constant parameter names, output names) that identify ``node`` in the optimized graph."""
    params: set[str] = set()
    for value in node.inputs[1:] if node.op_type != "MatMul" else node.inputs:
        params |= _source_names(value)
    outputs = {v.name for v in node.outputs if v.name}
    outputs |= {value.name for value in _fused_consumer_outputs(node) if value.name}
    return params, outputs


def _is_compute_candidate(node: onnx.NodeProto) -> bool:
    return node.op_type in INTEGER_KERNELS or node.op_type in FLOAT_HEAVY_KERNELS


def label(node: onnx.NodeProto) -> str:
    return f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def match_optimized(heavy: ir.Node, optimized: Sequence[onnx.NodeProto]) -> onnx.NodeProto | None:
    """The optimized node that runs ``heavy``: by base name, then parameter names, then outputs."""
    candidates = [n for n in optimized if _is_compute_candidate(n)]
    params, outputs = _heavy_keys(heavy)
    by_name = [n for n in candidates if heavy.name and base_name(n.name) == heavy.name]
    # ORT's NCHWc layout names a Conv with constant float weights after its output ("c" -> "c_nchwc")
    by_name += [n for n in candidates if base_name(n.name) in outputs and n.name.endswith("_nchwc")]
    # ORT renames a MatMulNBits weight "<name>_T" (transposed for the kernel).
    by_param = [n for n in candidates if params & ({*n.input} | {i[:-2] for i in n.input if i.endswith("_T")})]
    by_output = [n for n in candidates if outputs & set(n.output)]
    for group in (by_name, by_param, by_output):
        if group:
            integer = [n for n in group if n.op_type in INTEGER_KERNELS]
            return (integer or group)[0]
    return None

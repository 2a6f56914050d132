"""Multiply-accumulates of the heavy ops (Conv, ConvTranspose, MatMul, Gemm and their integer forms).

MACs weight :attr:`kenosis_rewrite.diagnosis.explain.FusionReport.integer_mac_fraction`, so they come from
the shapes of the heavy ops' inputs and outputs: ONNX shape inference first, then with symbolic
input dims bound, and, where dims are still unknown (shapes computed at run time, e.g. TF-style
SAME padding through Shape -> arithmetic -> Pad), the shapes ONNX Runtime produces on one run of
the model (:func:`with_shapes`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import onnx
import onnx_ir as ir

from kenosis_rewrite.core import model_io
from kenosis_rewrite.diagnosis.ort_graph import HEAVY_OPS, node_input, write_model
from kenosis_rewrite.errors import one_line


def with_shapes(model: ir.Model, directory: str, notes: list[str]) -> ir.Model:
    """A copy of ``model`` whose heavy ops' tensors carry shapes, for counting MACs.

    ONNX shape inference first; where it leaves heavy-op tensors without static dims, again with the
    graph inputs' symbolic dims bound as :func:`kenosis_rewrite.core.fidelity.random_feeds` binds them
    (batch 1, image sides 224, other dims 128); what is still unknown (shapes computed at run time,
    e.g. TF-style SAME padding) gets the shapes ONNX Runtime produces on one run of the model with
    such inputs. What could not be done is appended to ``notes``, with its cause; dims still unknown
    then count as 1. ``directory``: where the measuring copy of the model is written.
    """
    try:
        shaped = _inferred(model, bind_inputs=False)
    except Exception as error:  # noqa: BLE001 - onnx raises several types; the shapes are measured below
        notes.append(f"ONNX shape inference failed ({one_line(error)})")
        shaped = model.clone()
    if _unshaped_heavy_values(shaped) and any(not _static(v) for v in shaped.graph.inputs):
        try:
            bound = _inferred(model, bind_inputs=True)
        except Exception as error:  # noqa: BLE001
            notes.append(f"ONNX shape inference with the input dims bound failed ({one_line(error)})")
        else:
            if not _unshaped_heavy_values(bound):
                dims = ", ".join(f"{v.name} {list(v.shape)}" for v in bound.graph.inputs if v.shape is not None)
                notes.append(f"MACs counted with the symbolic input dims bound: {dims}")
                return bound
    unknown = _unshaped_heavy_values(shaped)
    if unknown:
        _measure_shapes(shaped, unknown, directory, notes)
    return shaped


def _inferred(model: ir.Model, bind_inputs: bool) -> ir.Model:
    """A copy of ``model`` after ONNX shape inference (with data propagation); ``bind_inputs``: the
    graph inputs' unknown dims set first, as :func:`kenosis_rewrite.core.fidelity.concrete_shape` does."""
    from kenosis_rewrite.core.fidelity import concrete_shape  # noqa: PLC0415 - fidelity imports ORT

    proto = model_io.graph_only_proto(model)  # inferred on the graph alone (any size)
    if bind_inputs:
        for value in proto.graph.input:
            if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
                continue
            for dim, size in zip(value.type.tensor_type.shape.dim, concrete_shape(value)):
                if not (dim.HasField("dim_value") and dim.dim_value > 0):
                    dim.Clear()
                    dim.dim_value = size
    shaped = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto, data_prop=True))
    for name, value in shaped.graph.initializers.items():  # the model's own tensors back
        value.const_value = model.graph.initializers[name].const_value
    return shaped


def _static(value: ir.Value) -> bool:
    return value.shape is not None and all(isinstance(d, int) for d in value.shape)


def _unshaped_heavy_values(model: ir.Model) -> list[ir.Value]:
    """Inputs and first outputs of the heavy ops whose shape is not fully static (graph inputs excluded)."""
    values: dict[str, ir.Value] = {}
    for node in model.graph:
        if node.op_type in HEAVY_OPS:
            for value in (*node.inputs, *node.outputs[:1]):
                if value is not None and value.name and not _static(value) and not value.is_graph_input():
                    values[value.name] = value
    return list(values.values())


def _measure_shapes(model: ir.Model, values: list[ir.Value], directory: str, notes: list[str]) -> None:
    """Set the shapes of ``values`` to those of one ORT run of ``model`` (graph as written, random inputs)."""
    from kenosis_rewrite.core import (
        fidelity,
        ort_sessions,  # noqa: PLC0415 - fidelity imports ORT; explain imports this
    )

    inputs = [v for v in model.graph.inputs if not v.is_initializer()]
    stub = onnx.ModelProto(graph=onnx.GraphProto(input=[ir.serde.serialize_value(v) for v in inputs]))
    added = [v for v in values if not v.is_graph_output()]
    try:
        model.graph.outputs.extend(added)
        try:
            path = write_model(model, directory, "shapes")
        finally:
            for _ in added:
                model.graph.outputs.pop()
        # refusals at a made-up size are expected (the next size is tried): not logged
        session = ort_sessions.session(path, ort_sessions.options(1, level="none", log_severity=4))
    except Exception as error:  # noqa: BLE001 - ORT and onnx raise several types; the note keeps the cause
        notes.append(f"MACs undercounted: {len(values)} heavy-op tensors have no static shape and the model "
                     f"does not load to measure them ({one_line(error)}); their unknown dims count as 1")
        return
    # the dynamic dims at the default size, then at the other sizes the run-time guard tries (a
    # recognizer whose height must pool to one row does not run at 224)
    first_failure = None
    sizes = [None, *fidelity.OTHER_DYNAMIC_SIZES] if fidelity.has_dynamic_dims(stub) else [None]
    for size in sizes:
        feed = fidelity.random_feeds(stub, 1, size=size)[0]
        try:
            arrays = session.run([v.name for v in values], feed)
            break
        except Exception as error:  # noqa: BLE001 - another size may run
            first_failure = first_failure or error
    else:
        notes.append(f"MACs undercounted: {len(values)} heavy-op tensors have no static shape and running the "
                     f"model to measure them failed ({one_line(first_failure)}); their unknown dims count as 1")
        return
    for value, array in zip(values, arrays):
        value.shape = ir.Shape(array.shape)
    bound = ", ".join(f"{name} {list(array.shape)}" for name, array in feed.items())
    notes.append(f"shapes of {len(values)} heavy-op tensors measured on one ONNX Runtime run with inputs {bound} "
                 "(ONNX shape inference left them unknown)")


def _dims(value: ir.Value | None) -> list[int] | None:
    """Static dims of ``value`` with unknown dims as 1 (see :func:`with_shapes`); None when the rank is unknown."""
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) and d > 0 else 1 for d in value.shape]


def _prod(values: Iterable[int]) -> int:
    return int(math.prod(values))


def _conv_output_spatial(node: ir.Node, x: list[int], w: list[int]) -> list[int]:
    """Output spatial dims of a Conv from its attributes (used when shape inference gave none)."""
    spatial = x[2:]
    n = len(spatial)
    strides = node.attributes.get_ints("strides", [1] * n)
    dilations = node.attributes.get_ints("dilations", [1] * n)
    pads = node.attributes.get_ints("pads", [0] * 2 * n)
    auto_pad = node.attributes.get_string("auto_pad", "NOTSET")
    out = []
    for i, size in enumerate(spatial):
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out.append(math.ceil(size / strides[i]))
            continue
        kernel = (w[2 + i] - 1) * dilations[i] + 1 if len(w) > 2 + i else 1
        extra = 0 if auto_pad == "VALID" else pads[i] + pads[i + n]
        out.append(max(1, (size + extra - kernel) // strides[i] + 1))
    return out


def _conv_macs(node: ir.Node, x_index: int, w_index: int) -> int:
    """N * Cout * prod(out spatial) * Cin/group * prod(kernel)."""
    x, w, y = _dims(node_input(node, x_index)), _dims(node_input(node, w_index)), _dims(node.outputs[0])
    if x is None or w is None or len(w) < 2:
        return 1
    if y is None or len(y) != len(x):
        y = [x[0], w[0], *_conv_output_spatial(node, x, w)]
    return _prod(y) * _prod(w[1:])  # w[1] = Cin/group


def _conv_transpose_macs(node: ir.Node) -> int:
    """N * prod(in spatial) * Cin * Cout/group * prod(kernel) (every input pixel scatters a kernel)."""
    x, w = _dims(node_input(node, 0)), _dims(node_input(node, 1))
    if x is None or w is None:
        return 1
    return x[0] * _prod(x[2:]) * _prod(w)


def _matmul_macs(a: list[int] | None, b: list[int] | None) -> int:
    """batch * M * K * N with numpy matmul broadcasting; 1-D operands count as vectors."""
    if a is None or b is None:
        return 1
    a2 = [1, *a] if len(a) == 1 else a
    b2 = [*b, 1] if len(b) == 1 else b
    batch = [max(x, y) for x, y in zip(_pad_left(a2[:-2], len(b2) - 2), _pad_left(b2[:-2], len(a2) - 2))]
    return _prod(batch) * a2[-2] * a2[-1] * b2[-1]


def _pad_left(dims: list[int], rank: int) -> list[int]:
    return [1] * (rank - len(dims)) + dims


def _gemm_macs(node: ir.Node, a_index: int, b_index: int) -> int:
    a, b = _dims(node_input(node, a_index)), _dims(node_input(node, b_index))
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return 1
    if node.attributes.get_int("transA", 0):
        a = a[::-1]
    if node.attributes.get_int("transB", 0):
        b = b[::-1]
    return a[0] * a[1] * b[1]


def _matmul_nbits_macs(node: ir.Node) -> int:
    a = _dims(node_input(node, 0))
    k, n = node.attributes.get_int("K", 1), node.attributes.get_int("N", 1)
    rows = _prod(a[:-1]) if a else 1
    return rows * k * n


def heavy_op_macs(node: ir.Node) -> int:
    """Multiply-accumulates of one heavy op from the static shapes (unknown dims count as 1)."""
    op = node.op_type
    if op == "Conv":
        return _conv_macs(node, 0, 1)
    if op in ("QLinearConv",):
        return _conv_macs(node, 0, 3)
    if op == "ConvInteger":
        return _conv_macs(node, 0, 1)
    if op == "ConvTranspose":
        return _conv_transpose_macs(node)
    if op == "Gemm":
        return _gemm_macs(node, 0, 1)
    if op == "QGemm":
        return _gemm_macs(node, 0, 3)
    if op == "QLinearMatMul":
        return _matmul_macs(_dims(node_input(node, 0)), _dims(node_input(node, 3)))
    if op == "MatMulNBits":
        return _matmul_nbits_macs(node)
    return _matmul_macs(_dims(node_input(node, 0)), _dims(node_input(node, 1)))

"""Relu and Clip after a weight-only MatMul, written as Max/Min: the form in which ORT still fuses the MatMul.

ORT's ``DQMatMulToMatMulNBits`` fusion (onnxruntime 1.31.1 and 1.32.0, x86 CPU EP) leaves a
weight-only ``MatMul(A, DequantizeLinear(W))`` as DequantizeLinear plus a float MatMul (or a float
``FusedGemm``) when its output reaches a Relu or a Clip

* directly (2-D and 3-D activations), or
* through one Add of a bias (2-D activations: ``MatMulAddFusion`` and ``GemmActivationFusion`` turn
  it into a float FusedGemm over the DequantizeLinear first),

and the MatMul's output has no other reader. ``Relu(x)`` ==> ``Max(x, 0)`` and ``Clip(x, lo, hi)`` ==>
``Min(Max(x, lo), hi)`` compute the same value for every non-NaN input (the same comparisons), and
ORT then fuses the MatMul, and its bias Add, into ``MatMulNBits``. Every other follower measured
(Gelu as ``com.microsoft.Gelu``, ONNX Gelu-20 or the Erf form, Sigmoid, Tanh, LeakyRelu, Elu,
HardSigmoid, HardSwish, Softmax, Softplus, nothing, a graph output) leaves the fusion alone and is
not touched. Measured by ``tests/unit/weight_only/test_activation_form.py``.

Not handled: a 2-D MatMul whose output is added to a non-constant ``[M, N]`` tensor (a residual
without a bias): ``MatMulAddFusion`` makes a float Gemm of it whatever follows (3-D activations fuse).

Used by :func:`kenosis_rewrite.quantize_weights` on what it writes, and by the ``fix()`` rules of
:mod:`kenosis_rewrite.placement.rules.matmul_nbits` on another quantizer's output.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from kenosis_rewrite.graph import qdq_params, value_range

__all__ = ["ACTIVATIONS", "blocked_matmul", "min_max_steps", "rewrite_as_min_max"]

ACTIVATIONS = ("Relu", "Clip")


def _sole_reader(matmul: ir.Node) -> bool:
    output = matmul.outputs[0]
    return len(output.uses()) == 1 and not output.is_graph_output()


def blocked_matmul(activation: ir.Node, weight_only: Callable[[ir.Node], bool]) -> ir.Node | None:
    """The MatMul whose ORT fusion ``activation`` stops, or None.

    ``activation`` is a Relu or Clip that reads, directly or through one Add, the output of a MatMul
    for which ``weight_only`` holds and which nothing else reads (nor is a graph output).
    """
    if not any(qdq_params.is_op(activation, op_type) for op_type in ACTIVATIONS) or activation.inputs[0] is None:
        return None
    producer = activation.inputs[0].producer()
    sources = [producer]
    if qdq_params.is_op(producer, "Add"):
        sources = [value.producer() for value in producer.inputs if value is not None]
    for node in sources:
        if qdq_params.is_op(node, "MatMul") and _sole_reader(node) and weight_only(node):
            return node
    return None


def min_max_steps(activation: ir.Node) -> list[tuple[str, float]] | str:
    """``[("Max", lo), ("Min", hi)]`` computing the Relu/Clip (unbounded sides left out), or why not."""
    bounds = value_range.activation_bounds(activation)
    if isinstance(bounds, str):
        return bounds
    return [(op_type, bound) for op_type, bound in zip(("Max", "Min"), bounds) if bound is not None]


def rewrite_as_min_max(activation: ir.Node, dtype: np.dtype, names: qdq_params.NameAllocator) -> bool:
    """Replace ``activation`` (Relu/Clip) in its graph by the Max/Min of :func:`min_max_steps`, with
    bounds of the float ``dtype``. False (nothing changed) where its bounds are not constants or it has none."""
    steps = min_max_steps(activation)
    if isinstance(steps, str) or not steps:
        return False
    graph, result, new_nodes = activation.graph, activation.inputs[0], []
    base = activation.name or activation.outputs[0].name or activation.op_type
    for op_type, bound in steps:
        name = names.fresh(f"{base}_{op_type.lower()}_bound")
        constant = qdq_params.add_initializer(graph, ir.tensor(np.asarray(bound, dtype=dtype), name=name), name)
        output = ir.Value(name=names.fresh(f"{base}_{op_type.lower()}"))
        new_nodes.append(ir.node(op_type, [result, constant], name=names.fresh(f"{base}_{op_type}"), outputs=[output]))
        result = output
    ir.convenience.replace_nodes_and_values(graph, activation, [activation], new_nodes, [activation.outputs[0]], [result])
    return True

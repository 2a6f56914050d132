"""Which ops ``quantize()`` quantizes: the whole graph, or only the weighted ops (transformers).

Two plans:

* ``"full"`` (CNNs): every op quantize_static knows gets Q/DQ; ``fix()`` then makes ORT run the
  chains Conv -> Relu -> Add -> Pool ... in integer kernels end to end.
* ``"weighted"`` (transformers): only the inputs of the MatMul/Gemm whose second input is a
  constant are quantized, and their outputs stay float, so
  ORT CPU runs each ``DQ -> MatMul`` as ``MatMulIntegerToFloat`` (int8 GEMM, float result, the
  bias Add and GELU fused after it). LayerNorm, Softmax, GELU, the residual stream and the
  attention score/context MatMuls (two activations) stay in float with no Q/DQ around them: ORT
  has no integer kernel for the first three, and on the attention MatMuls int8 measured no faster
  (MiniLM-L3, 128 tokens: 4.16 vs 4.12 ms on one thread, 2.94 vs 2.98 ms on two) for one more
  rounding of the scores and the probabilities.
  This is what ``quantize_dynamic`` leaves float too, with per-channel int8 weights. The MatMuls'
  inputs are quantized with their own range on every run (``DynamicQuantizeLinear``,
  :mod:`kenosis_rewrite.placement.passes.dynamic_activations`): held-out inputs overshoot calibrated ranges
  on attention output projections, and the per-run range measured as fast (DINOv2 ViT-S, one
  thread: 48.6 vs 52.0 ms static, cosine worst photo 0.99930 vs 0.99468). Convolutions (a ViT's patch embedding, a
  decoder head) stay float as well: on the DINOv2 ViT-S saliency model quantizing its Conv and
  ConvTranspose layers made it slower (1.60 vs 1.72x FP32 on 2 threads) and less faithful.
* ``"weighted-static"``: the same ops with calibrated (static) activation ranges: ``DQ -> MatMul``
  that ORT runs as ``MatMulIntegerToFloat``, one Q per tensor and no min/max pass per run.

``"auto"`` picks ``"weighted"`` when the graph has attention -- a Softmax whose output a MatMul
multiplies by another computed tensor -- and ``"full"`` otherwise; the report says which and why.
"""

from __future__ import annotations

import onnx

from kenosis_rewrite.core.model_io import constant_names
from kenosis_rewrite.errors import KenosisError

__all__ = ["PLANS", "WEIGHTED_PLANS", "choose_plan", "has_attention", "plan_options", "attention_matmuls",
           "constant_names"]

PLANS = ("auto", "full", "weighted", "weighted-static")
WEIGHTED_PLANS = ("weighted", "weighted-static")
# the ops the weighted plan quantizes; ORT CPU has integer kernels with float output for them, so
# their outputs get no quantizer
WEIGHTED_PLAN_OPS = ("MatMul", "Gemm")


def attention_matmuls(model: onnx.ModelProto) -> list[str]:
    """Names of the MatMuls (top-level graph) that multiply two computed tensors (attention scores
    and context); unnamed nodes cannot be excluded from quantize_static, so they are skipped."""
    constants = constant_names(model)
    return [node.name for node in model.graph.node
            if node.op_type == "MatMul" and node.name and not any(i in constants for i in node.input[:2])]


# ops an export puts between the attention Softmax and its MatMul (an inference-mode Dropout, a
# Dropout written as Identity, a Cast back from float16) that leave the probabilities as they are
_PASS_THROUGH = frozenset({"Identity", "Dropout", "Cast"})


def _masks(node: onnx.NodeProto, probabilities: set[str], constants: set[str]) -> bool:
    """``Where(c, p, k)`` or ``Where(c, k, p)`` of probabilities ``p`` and a constant ``k``: the
    probabilities, some of them replaced (torch.export's NaN guard ``where(isnan(p), 0, p)``)."""
    if node.op_type != "Where" or len(node.input) != 3:
        return False
    x, y = node.input[1], node.input[2]
    return (x in probabilities and y in constants) or (y in probabilities and x in constants)


def has_attention(model: onnx.ModelProto) -> bool:
    """A Softmax whose output a MatMul multiplies by a computed tensor (``softmax(QK^T) V``), the
    probabilities read directly or through :data:`_PASS_THROUGH` ops (PP-OCRv3's recognizer, as
    exported: Softmax -> Identity -> MatMul) or a constant-filled Where (torch.export's BERT:
    Softmax -> Where(IsNaN(p), 0, p) -> MatMul)."""
    constants = constant_names(model)
    probabilities = {node.output[0] for node in model.graph.node if node.op_type == "Softmax"}
    for node in model.graph.node:  # topological order: a pass-through op follows what it reads
        if ((node.op_type in _PASS_THROUGH and node.input and node.input[0] in probabilities)
                or _masks(node, probabilities, constants)):
            probabilities.add(node.output[0])
    return any(node.op_type == "MatMul" and node.input[0] in probabilities and node.input[1] not in constants
               for node in model.graph.node)


def choose_plan(model: onnx.ModelProto, plan: str = "auto") -> tuple[str, str]:
    """``(plan, reason)`` for ``model``."""
    if plan not in PLANS:
        raise KenosisError(f"unknown plan {plan!r}; choose one of {', '.join(PLANS)}")
    if plan != "auto":
        return plan, "asked for"
    if has_attention(model):
        return "weighted", "attention (Softmax -> MatMul of two computed tensors) found: transformer"
    return "full", "no attention found"


def plan_options(model: onnx.ModelProto, plan: str) -> dict:
    """quantize_static keyword arguments (beyond the target's) that carry out ``plan``."""
    if plan == "full":
        return {}
    # both weighted plans calibrate: the static one keeps the ranges, the dynamic one gives them up
    # at the end (bias correction and the FP32 fallbacks read the QDQ form first)
    return {
        "op_types_to_quantize": list(WEIGHTED_PLAN_OPS),
        "nodes_to_exclude": attention_matmuls(model),
        "extra_options": {"OpTypesToExcludeOutputQuantization": list(WEIGHTED_PLAN_OPS)},
    }

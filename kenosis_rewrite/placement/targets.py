"""Placement targets: each is a named rule set plus the runtime facts it relies on.

What is "fusible" depends on the runtime (shared research, anchors.md §0.2): ORT CPU fuses
``DQ -> Conv -> Q`` with the activation folded into the Q's range, and needs the Q/DQ pair between a
Conv and its LeakyRelu; TensorRT and NPU compilers fuse Conv with its activation and want no Q/DQ
between them. A target is data: the facts, the passes before the rules, the rules, the passes after.

* ``ort-cpu`` (default): ONNX Runtime CPU on x86. Measured (ort-cpu-facts.md): int8 activations
  with several consumers run float, so activations become uint8; Relu/Clip fold into the Q range
  (zero point qmin); PRelu replaced; BN folded; parameters aligned and biases requantized;
  quantized Softmaxes kept out of QLinearSoftmax, 1.2-6x slower than DQ + Softmax + Q on x86
  (``rules.softmax_float_input``).
* ``ort-cpu-arm``: ONNX Runtime CPU on ARM64, where the QDQ selectors accept int8 activations
  (``QDQIsInt8Allowed()`` is true under ``MLAS_TARGET_ARM_ANY``,
  ``qdq_selector_action_transformer.h``): the same rules without the uint8 retyping. Cited, not
  measured (no ARM machine here); ORT on x86 runs its output correctly.
* ``tensorrt``: TensorRT explicit quantization (NVIDIA's "Explicit Quantization" guide, Q/DQ
  placement recommendations): symmetric int8 (zero point 0) everywhere, Q/DQ only at the inputs of
  the ops that consume them, none between a weighted op and its activation, data movement on int8
  tensors (DQ forward, Q backward, redundant pairs removed), float biases, per-channel weights on
  the output-channel axis (quantize_static already emits axis 0 for Conv), a residual block's
  Conv + Add + Relu/Clip/LeakyRelu with no Q/DQ inside (``rules.residual_activation``). Cited, not
  measured (no TensorRT here).
* ``npu``: NPU/DPU compilers (Quark's ``Conv -> Relu -> Q -> DQ`` form): symmetric int8, the
  pre-activation Q/DQ removed for positively homogeneous activations (Relu, LeakyRelu, Clip(0, M))
  and HardSwish, whose post-activation range is already calibrated; int32 biases requantized.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from onnxscript.rewriter import RewriteRule

from kenosis_rewrite.canonicalization.rules.residual_sum import residual_sum_rules
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import UnsupportedTargetError
from kenosis_rewrite.graph.dequantize import DequantizeBiasPass
from kenosis_rewrite.placement.passes.activation_hoist import ActivationBeforeDataMovementPass
from kenosis_rewrite.placement.passes.activation_scale_folding import FoldPerChannelActivationScalesPass
from kenosis_rewrite.placement.passes.activation_u8 import ActivationInt8ToUint8Pass
from kenosis_rewrite.placement.passes.bias_rescale import BiasRescalePass
from kenosis_rewrite.placement.passes.concat_on_codes import ConcatOnCodesPass
from kenosis_rewrite.placement.passes.constant_quantize import FoldConstantQuantizePass
from kenosis_rewrite.placement.passes.contrib_qdq import ContribQDQToStandardPass
from kenosis_rewrite.placement.passes.dequantized_parameters import FoldDequantizedParametersPass
from kenosis_rewrite.placement.passes.float16_qdq import Float16QDQToFloat32Pass
from kenosis_rewrite.placement.passes.float_3d_conv import Float3DConvPass
from kenosis_rewrite.placement.passes.per_tensor_activations import PerTensorActivationsPass
from kenosis_rewrite.placement.passes.qdq_propagation import (
    DequantizeAfterPadPass,
    DequantizeAfterSplitPass,
    DequantizeForwardPass,
    QuantizeBackwardPass,
    RedundantQDQPass,
)
from kenosis_rewrite.placement.passes.qparam_propagation import PassThroughQParamsPass
from kenosis_rewrite.placement.passes.requantize_after_movement import RequantizeAfterDataMovementPass
from kenosis_rewrite.placement.passes.shape_arithmetic import FloatShapeArithmeticPass
from kenosis_rewrite.placement.passes.shared_quantizer import SharedQuantizerPass
from kenosis_rewrite.placement.passes.symmetric_int8 import SymmetricActivationsPass
from kenosis_rewrite.placement.rules.activation_fusion import NPU_FUSIBLE, TENSORRT_FUSIBLE, activation_fusion_rules
from kenosis_rewrite.placement.rules.activation_islands import (
    ClipZeroPointToQmin,
    FoldClipIsland,
    FoldReluIsland,
    ReluZeroPointToQmin,
)
from kenosis_rewrite.placement.rules.activation_on_codes import activation_on_codes_rules
from kenosis_rewrite.placement.rules.batchnorm_folding import FoldBatchNormIntoConv, FoldBatchNormIntoConvThroughQDQ
from kenosis_rewrite.placement.rules.conv_affine_folding import conv_affine_rules
from kenosis_rewrite.placement.rules.gather_dequantize import GatherBeforeDequantize
from kenosis_rewrite.placement.rules.integer_matmul_bias import integer_matmul_bias_rules
from kenosis_rewrite.placement.rules.matmul_nbits import matmul_nbits_rules
from kenosis_rewrite.placement.rules.prelu import PReluToLeakyRelu, PReluToReluMin
from kenosis_rewrite.placement.rules.residual_activation import residual_activation_rules
from kenosis_rewrite.placement.rules.shape_of_dequantized import shape_of_codes_rules
from kenosis_rewrite.placement.rules.sigmoid_gate import QuantizeSigmoidGate
from kenosis_rewrite.placement.rules.softmax_float_input import softmax_float_input_rules
from kenosis_rewrite.placement.rules.successive_activations import successive_activation_rules

__all__ = ["TargetFacts", "Target", "TARGETS", "get_target"]

Report = FixReport | None


@dataclasses.dataclass(frozen=True)
class TargetFacts:
    """What a runtime runs in integer kernels and how it wants Q/DQ placed."""

    runtime: str
    activation_type: str
    fused_activations: tuple[str, ...]
    quantize_weighted_outputs: bool
    basis: str


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    facts: TargetFacts
    pre_passes: Callable[[Report, Sequence], list]  # (report, the caller's calibration feeds)
    rules: Callable[[Report], list[RewriteRule]]
    post_passes: Callable[[Report], list]


def _conv_folds(report: Report) -> list[RewriteRule]:
    """BatchNormalization and constant affine arithmetic after a quantized Conv, into the Conv."""
    return [FoldBatchNormIntoConvThroughQDQ.rule(report), FoldBatchNormIntoConv.rule(report), *conv_affine_rules(report).rules]


def _ort_rules(report: Report) -> list[RewriteRule]:
    return [
        *_conv_folds(report),
        # exact first: the activation on the codes; the finer grid after it for what it refuses
        *activation_on_codes_rules(report).rules,
        FoldReluIsland.rule(report), FoldClipIsland.rule(report),
        ReluZeroPointToQmin.rule(report), ClipZeroPointToQmin.rule(report),
        # the islands folded leave Relu -> Relu where they were in a row: ORT fuses only one
        *successive_activation_rules(report).rules,
        PReluToLeakyRelu.rule(report), PReluToReluMin.rule(report),
        QuantizeSigmoidGate.rule(report),
        # a quantized embedding table is otherwise dequantized whole on every run
        GatherBeforeDequantize.rule(report),
        # and a quantized tensor whose run-time shape is read, too
        *shape_of_codes_rules(report).rules,
        *matmul_nbits_rules(report).rules,
    ]


def _ort_pre(report: Report, to_uint8: bool) -> list:
    """The ORT CPU targets' passes before the rules; ``to_uint8``: x86, where ORT runs int8 activations
    with several consumers in float, so every activation is retyped to uint8."""
    return [
        # float16 scales first: ORT's integer fusions, and the rules after, read float32 ones
        Float16QDQToFloat32Pass(report),
        ContribQDQToStandardPass(report), FloatShapeArithmeticPass(report), FoldConstantQuantizePass(report),
        FoldDequantizedParametersPass(report),
        Float3DConvPass(report), FoldPerChannelActivationScalesPass(report), PerTensorActivationsPass(report),
        *([ActivationInt8ToUint8Pass(report)] if to_uint8 else []), DequantizeAfterSplitPass(report),
    ]


def _symmetric_pre(report: Report, fusible: tuple[str, ...], calibration: Sequence = ()) -> list:
    """The symmetric-int8 targets' passes before the rules (TensorRT, NPU): every activation to
    symmetric int8, the Q/DQ before the activations the target fuses left for the rules to remove;
    with the caller's ``calibration`` feeds, what costs too much on them stays float."""
    return [
        ContribQDQToStandardPass(report), FloatShapeArithmeticPass(report), FoldConstantQuantizePass(report),
        FoldDequantizedParametersPass(report),
        FoldPerChannelActivationScalesPass(report), PerTensorActivationsPass(report),
        SymmetricActivationsPass(report, fusible, calibration=calibration or None),
    ]


def _ort_post(report: Report) -> list:
    return [
        # a Pad between a DQ and the Conv it pads for (EfficientNet's static_padding) runs on the codes;
        # after the rules, which want the Q -> DQ pair next to each other (zero point to qmin after a Relu)
        DequantizeAfterPadPass(report),
        PassThroughQParamsPass(report),
        # a MaxPool whose input another op's quantizer already puts on its own output grid (INC's BlazeFace)
        SharedQuantizerPass(report),
        # MaxPool/Concat outputs left float (NNCF's SPPF) would keep the Conv they feed float
        DequantizeForwardPass(report, ops=frozenset({"MaxPool", "Concat"}), float_consumers_only=True),
        # and a Concat on one grid, which ORT would run as a requantizing QLinearConcat
        ConcatOnCodesPass(report),
        BiasRescalePass(report), ActivationBeforeDataMovementPass(report), RequantizeAfterDataMovementPass(report),
    ]


TARGETS: dict[str, Target] = {
    "ort-cpu": Target(
        "ort-cpu",
        TargetFacts(
            runtime="ONNX Runtime CPU EP, x86-64",
            activation_type="uint8 (int8 only where a tensor has one consumer)",
            fused_activations=("Relu", "Clip"),
            quantize_weighted_outputs=True,
            basis="measured: shared research ort-cpu-facts.md, onnxruntime 1.31.1",
        ),
        pre_passes=lambda report, calibration=(): _ort_pre(report, to_uint8=True),
        # the integer MatMuls' bias Adds fused into MatMulIntegerToFloat (rules.integer_matmul_bias) before
        # residual_sum sees them; SkipLayerNormalization measured 1.3-8x slower than Sum +
        # LayerNormalization on x86 (rules.residual_sum), QLinearSoftmax 1.2-6x slower than
        # DQ + Softmax + Q (rules.softmax_float_input)
        rules=lambda report: [*_ort_rules(report), *integer_matmul_bias_rules(report).rules,
                              *residual_sum_rules(report).rules, *softmax_float_input_rules(report).rules],
        post_passes=_ort_post,
    ),
    "ort-cpu-arm": Target(
        "ort-cpu-arm",
        TargetFacts(
            runtime="ONNX Runtime CPU EP, ARM64",
            activation_type="int8 or uint8",
            fused_activations=("Relu", "Clip"),
            quantize_weighted_outputs=True,
            basis="cited: QDQIsInt8Allowed() under MLAS_TARGET_ARM_ANY (onnxruntime qdq_selector_action_transformer.h)",
        ),
        pre_passes=lambda report, calibration=(): _ort_pre(report, to_uint8=False),
        rules=_ort_rules,
        post_passes=_ort_post,
    ),
    "tensorrt": Target(
        "tensorrt",
        TargetFacts(
            runtime="TensorRT (explicit quantization)",
            activation_type="int8, zero point 0",
            fused_activations=TENSORRT_FUSIBLE,
            quantize_weighted_outputs=False,
            basis="cited: TensorRT developer guide, 'Explicit Quantization' / Q/DQ placement recommendations",
        ),
        pre_passes=lambda report, calibration=(): _symmetric_pre(report, TENSORRT_FUSIBLE, calibration),
        # and a residual block's Conv + Add + activation as one kernel (rules.residual_activation)
        rules=lambda report: [*_conv_folds(report), *activation_fusion_rules(TENSORRT_FUSIBLE, report),
                              *residual_activation_rules(report)],
        post_passes=lambda report: [
            DequantizeAfterPadPass(report), DequantizeForwardPass(report), QuantizeBackwardPass(report), RedundantQDQPass(report),
            DequantizeBiasPass(report), ActivationBeforeDataMovementPass(report), RequantizeAfterDataMovementPass(report),
        ],
    ),
    "npu": Target(
        "npu",
        TargetFacts(
            runtime="NPU/DPU compilers (e.g. AMD Ryzen AI via Quark)",
            activation_type="int8, zero point 0",
            fused_activations=NPU_FUSIBLE,
            quantize_weighted_outputs=False,
            basis="research: positive homogeneity f(a x) = a f(x), a > 0; Quark's DPU placement Conv -> Relu -> Q -> DQ",
        ),
        pre_passes=lambda report, calibration=(): _symmetric_pre(report, NPU_FUSIBLE, calibration),
        rules=lambda report: [*_conv_folds(report), *activation_fusion_rules(NPU_FUSIBLE, report)],
        post_passes=_ort_post,
    ),
}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise UnsupportedTargetError(f"Unknown target {name!r}; known targets: {', '.join(TARGETS)}.")
    return TARGETS[name]

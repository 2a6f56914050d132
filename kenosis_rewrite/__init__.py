"""kenosis_rewrite: make INT8 QDQ ONNX models run in fused integer kernels, without losing accuracy.

    import kenosis_rewrite
    fixed = kenosis_rewrite.fix(quantized_model)            # same kind of model back
    fixed, report = kenosis_rewrite.fix_with_report(quantized_model)
    print(kenosis_rewrite.explain(fixed).summary())          # which Conv/MatMul/Gemm run integer
    model = kenosis_rewrite.quantize(fp32_model)             # the whole pipeline, self-calibrated
    canonical = kenosis_rewrite.prepare(fp32_model, feeds)   # the FP32 graph a quantizer should see
    kenosis_rewrite.save(model, "out.onnx")                  # external data when over 2 GB
"""

from __future__ import annotations

from kenosis_rewrite.core.model_io import save
from kenosis_rewrite.errors import (
    AlreadyQuantizedError,
    ControlFlowError,
    InvalidModelError,
    KenosisError,
    ModelTooLargeError,
    NoQDQError,
    NotAnOnnxModelError,
    QOperatorFormatError,
    RewriteError,
    RuntimeMeasurementError,
    UnsupportedOpsetError,
    UnsupportedTargetError,
    UnsupportedValueTypeError,
    ZooError,
)
from kenosis_rewrite.diagnosis.explain import FusionReport, explain
from kenosis_rewrite.placement.pipeline import TARGETS, FixPass, fix, fix_with_report, rules
from kenosis_rewrite.canonicalization.pipeline import PrepareFailedError, prepare
from kenosis_rewrite.quantization.pipeline import quantize
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.weight_only.weights import quantize_weights

__version__ = "0.1.0"


__all__ = [
    "save", "TARGETS", "FixPass", "FixReport", "FusionReport", "prepare", "PrepareFailedError", "quantize", "quantize_weights", "fix", "fix_with_report", "rules", "explain",
    "KenosisError", "AlreadyQuantizedError", "ControlFlowError", "InvalidModelError", "ModelTooLargeError", "NoQDQError", "NotAnOnnxModelError",
    "QOperatorFormatError", "RewriteError", "RuntimeMeasurementError", "UnsupportedOpsetError", "UnsupportedValueTypeError",
    "UnsupportedTargetError", "ZooError",
]

from kenosis_rewrite._submodules import submodule_getattr  # noqa: E402 - after the public names

__getattr__ = submodule_getattr(__name__)

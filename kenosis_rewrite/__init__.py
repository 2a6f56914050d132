"""kenosis_rewrite: make INT8 QDQ ONNX models run in fused integer kernels, without losing accuracy.

    import kenosis_rewrite
    fixed = kenosis_rewrite.fix(quantized_model)                      # same kind of model back
    fixed, report = kenosis_rewrite.fix(quantized_model, return_report=True)
    print(kenosis_rewrite.explain(fixed).summary())                    # which Conv/MatMul/Gemm run integer
    model = kenosis_rewrite.quantize(fp32_model, calibration=feeds)    # the whole pipeline
    canonical = kenosis_rewrite.prepare(fp32_model, feeds)             # the FP32 graph a quantizer should see
    kenosis_rewrite.save(model, "out.onnx")                            # external data when over 2 GB

The subpackages, bottom to top: ``core`` and ``graph`` (infrastructure and QDQ graph primitives),
``diagnosis`` (explain), ``canonicalization`` (prepare), ``accuracy`` and ``calibration``,
``placement`` (fix's rules, passes, targets and guard), ``quantization`` (quantize), ``weight_only``,
``zoo``, ``benchmark``, ``testing`` (the property fuzz, for your own rules) and ``cli``. Every module
is reachable as an attribute: ``kenosis_rewrite.placement.rules.prelu``.
"""

from __future__ import annotations

from kenosis_rewrite._submodules import submodule_getattr
from kenosis_rewrite.canonicalization.pipeline import prepare
from kenosis_rewrite.core.model_io import save
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.diagnosis.explain import FusionReport, explain
from kenosis_rewrite.errors import (
    AlreadyQuantizedError,
    CalibrationError,
    ControlFlowError,
    InvalidModelError,
    KenosisError,
    ModelTooLargeError,
    NoQDQError,
    NotAnOnnxModelError,
    PackageUnavailableError,
    PeerFailedError,
    PeerNotInstalledError,
    PrepareFailedError,
    QOperatorFormatError,
    RewriteError,
    RuntimeMeasurementError,
    UnsupportedOpsetError,
    UnsupportedTargetError,
    UnsupportedValueTypeError,
    ZooError,
)
from kenosis_rewrite.placement.fix_pass import TARGETS, FixPass, rules
from kenosis_rewrite.placement.pipeline import fix, fix_with_report
from kenosis_rewrite.quantization.pipeline import quantize
from kenosis_rewrite.weight_only.weights import quantize_weights

__version__ = "0.1.0"

__all__ = [
    # functions
    "fix", "quantize", "quantize_weights", "prepare", "explain", "save", "rules",
    # what they return and take
    "FixReport", "FusionReport", "FixPass", "TARGETS",
    # errors: every one kenosis_rewrite raises on purpose, all defined in kenosis_rewrite.errors
    "KenosisError", "AlreadyQuantizedError", "CalibrationError", "ControlFlowError", "InvalidModelError",
    "ModelTooLargeError", "NoQDQError", "NotAnOnnxModelError", "PackageUnavailableError", "PeerFailedError",
    "PeerNotInstalledError", "PrepareFailedError", "QOperatorFormatError", "RewriteError", "RuntimeMeasurementError",
    "UnsupportedOpsetError", "UnsupportedTargetError", "UnsupportedValueTypeError", "ZooError",
    # deprecated, kept for one release
    "fix_with_report",
]

__getattr__ = submodule_getattr(__name__)

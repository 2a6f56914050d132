"""The ``KenosisError`` family: every input kenosis_rewrite refuses gets one of these.

Each error names what was wrong with the input and what the user can do about it; none is a
traceback from deep inside onnx or onnxruntime.
"""

from __future__ import annotations

__all__ = [
    "KenosisError",
    "AlreadyQuantizedError",
    "ControlFlowError",
    "NotAnOnnxModelError",
    "InvalidModelError",
    "NoQDQError",
    "QOperatorFormatError",
    "UnsupportedOpsetError",
    "ModelTooLargeError",
    "UnsupportedTargetError",
    "ZooError",
    "RuntimeMeasurementError",
    "RewriteError",
    "UnsupportedValueTypeError",
    "CalibrationError",
    "PrepareFailedError",
    "PackageUnavailableError",
    "PeerNotInstalledError",
    "PeerFailedError",
]


class KenosisError(Exception):
    """Base class of every error kenosis_rewrite raises on purpose."""


class NotAnOnnxModelError(KenosisError):
    """The input is not an ONNX model (unreadable file, wrong format, wrong Python type)."""


class InvalidModelError(KenosisError):
    """The input is an ONNX model but fails the ONNX checker, so no rewrite can be trusted."""


class NoQDQError(KenosisError):
    """The model has no QuantizeLinear/DequantizeLinear nodes: there is nothing to fix."""


class AlreadyQuantizedError(KenosisError):
    """quantize()/prepare() take an FP32 model; this one is already quantized (QDQ, QOperator or dynamic)."""


class ControlFlowError(KenosisError):
    """quantize(): the model's layers are all inside If/Loop/Scan bodies, which quantize_static leaves float."""


class QOperatorFormatError(KenosisError):
    """The model uses QOperator format (QLinearConv, ...) instead of QDQ; re-quantize with QuantFormat.QDQ."""


class UnsupportedOpsetError(KenosisError):
    """The default-domain opset is outside the range the rules were written and tested for."""


class ModelTooLargeError(KenosisError):
    """The model exceeds protobuf's 2 GB limit and does not use external data."""


class UnsupportedTargetError(KenosisError):
    """The requested target runtime has no rule set."""


class ZooError(KenosisError):
    """A real model or sample could not be fetched or failed its checksum."""


class RuntimeMeasurementError(KenosisError):
    """ONNX Runtime could not build a session for the model (needed for explain/benchmarks)."""


class UnsupportedValueTypeError(KenosisError):
    """The graph has a value of a type onnx_ir cannot represent (a map: ZipMap's classifier output)."""


class RewriteError(KenosisError):
    """A rewrite produced a model that fails validation; nothing is returned rather than a broken model."""


class CalibrationError(KenosisError):
    """Calibration could not run: bad feeds, a model ORT cannot run, or an unusable cache file."""


class PrepareFailedError(KenosisError):
    """The canonical graph did not reproduce the model's outputs (raised only with ``strict=True``)."""


class PackageUnavailableError(ZooError):
    """pip could not obtain a pinned package (offline, or the index does not carry it)."""


class PeerNotInstalledError(KenosisError):
    """The peer quantizer has no interpreter that can import it."""


class PeerFailedError(KenosisError):
    """The peer quantizer ran and failed (its own error is in the message)."""


def one_line(error: BaseException, limit: int = 300) -> str:
    """``"TypeName: first line of the message"``, at most ``limit`` characters: a cause kept in a report or note."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:limit]

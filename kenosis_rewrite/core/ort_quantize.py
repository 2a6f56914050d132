"""Run onnxruntime's ``quantize_static`` in the named configurations users actually ship.

These are the inputs ``fix()`` is written for; tests, examples and benchmarks build them here so
that every comparison uses the same, documented quantizer settings.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

__all__ = ["ORT_CONFIGS", "FeedsReader", "quantize_with_ort"]

# name -> keyword arguments of quantize_static (see shared research, "Config names").
ORT_CONFIGS: dict[str, dict] = {
    "default": {},  # onnxruntime >= 1.2x defaults: int8 activations, int8 weights, per-tensor
    "u8s8": {"activation_type": QuantType.QUInt8},
    "sym": {"extra_options": {"ActivationSymmetric": True}},
    "u8s8_sym": {"activation_type": QuantType.QUInt8, "extra_options": {"ActivationSymmetric": True}},
    "pc": {"per_channel": True},
    "u8s8_pc": {"activation_type": QuantType.QUInt8, "per_channel": True},
    "keep": {"extra_options": {"QDQKeepRemovableActivations": True}},
    "convmm": {"op_types_to_quantize": ["Conv", "MatMul", "Gemm"]},
    "u8s8_convmm": {"activation_type": QuantType.QUInt8, "op_types_to_quantize": ["Conv", "MatMul", "Gemm"]},
}


class FeedsReader(CalibrationDataReader):
    """A CalibrationDataReader over any iterable of ``{input_name: array}`` feed dicts."""

    def __init__(self, feeds: Iterable[Mapping[str, np.ndarray]]):
        self._feeds = [dict(f) for f in feeds]
        self._iterator = iter(self._feeds)

    def get_next(self):
        return next(self._iterator, None)

    def rewind(self) -> None:
        self._iterator = iter(self._feeds)


@contextlib.contextmanager
def quiet_logger(name: str | None = None):
    """Only errors from logger ``name`` (the root logger by default) while the block runs:
    quantize_static logs a 'consider pre-processing' warning on every call, onnxscript's constant
    folder one per node it cannot evaluate; the report says what matters."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def quantize_with_ort(
    float_model: onnx.ModelProto,
    feeds: Iterable[Mapping[str, np.ndarray]],
    config: str = "default",
    **overrides,
) -> onnx.ModelProto:
    """``quantize_static`` (QDQ format) of ``float_model`` in configuration ``config``."""
    if config not in ORT_CONFIGS:
        raise ValueError(f"unknown quantize_static config {config!r}; known: {sorted(ORT_CONFIGS)}")
    kwargs = {k: (dict(v) if isinstance(v, dict) else v) for k, v in ORT_CONFIGS[config].items()}
    extra = dict(kwargs.pop("extra_options", {}))
    extra.update(overrides.pop("extra_options", {}))
    kwargs.update(overrides)
    kwargs.setdefault("quant_format", QuantFormat.QDQ)
    with tempfile.TemporaryDirectory() as tmp, quiet_logger():
        source = os.path.join(tmp, "float.onnx")
        target = os.path.join(tmp, "qdq.onnx")
        onnx.save(float_model, source)
        quantize_static(
            source,
            target,
            FeedsReader(feeds),
            extra_options=extra,
            **kwargs,
        )
        return onnx.load(target)

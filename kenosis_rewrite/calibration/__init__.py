"""Calibration: per-tensor ranges from the FP32 model, self-calibration, and ORT reader adapters.

* :func:`collect_ranges` streams feeds through the FP32 model (intermediate tensors exposed as
  outputs) and returns :class:`TensorRanges` (min/max, percentile, entropy or MSE ranges), cacheable
  as JSON. :func:`quantize_with_ranges` / :meth:`TensorRanges.write_ort_cache` hand them to
  ``onnxruntime.quantization.quantize_static`` through its ``calibration_cache_path``.
* :func:`synthetic_feeds` / :func:`infer_inputs` make valid inputs with no user data
  (see :mod:`kenosis_rewrite.calibration.inputs` for what is inferred and how).
* :func:`calibration_reader` turns feed dicts, a folder of images or ``"synthetic"`` into an ORT
  ``CalibrationDataReader``.
"""

from kenosis_rewrite.calibration.collect import (
    CalibrationError,
    TensorRanges,
    calibrated_tensors,
    collect_histograms,
    collect_ranges,
    model_hash,
    quantize_with_ranges,
)
from kenosis_rewrite.calibration.histogram import METHODS, PercentileTails, StreamingHistogram, range_from_histogram
from kenosis_rewrite.calibration.inputs import (
    InputSpec,
    describe,
    infer_inputs,
    iter_synthetic_feeds,
    natural_image,
    runnable_synthetic_feeds,
    synthetic_feeds,
)
from kenosis_rewrite.calibration.readers import StreamingReader, calibration_reader, image_feeds

__all__ = [
    "CalibrationError", "TensorRanges", "calibrated_tensors", "collect_histograms", "collect_ranges",
    "model_hash", "quantize_with_ranges", "METHODS", "PercentileTails", "StreamingHistogram", "range_from_histogram",
    "InputSpec", "describe", "infer_inputs", "iter_synthetic_feeds", "natural_image", "runnable_synthetic_feeds",
    "synthetic_feeds", "StreamingReader", "calibration_reader", "image_feeds",
]

from kenosis_rewrite._submodules import submodule_getattr  # noqa: E402 - after the public names

__getattr__ = submodule_getattr(__name__)

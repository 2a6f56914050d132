"""quantize()'s settings: its keyword arguments, held once, and the constants its stages share."""

from __future__ import annotations

import dataclasses

FIDELITY_FEEDS = 8  # the calibration feeds the report's fidelity compares on
# the first of them, on which weight rounding and bias correction must not move the output away: by
# more than this factor on its error (1 - cosine). Measured, 16 scenes calibrating, their error on 4
# of them against 84 held-out: YOLOX (ddddocr det) x4.4 on the 4, held-out cosine 0.99235 with them,
# 0.99759 without; PP-OCRv5 rec x6.6; PP-LCNet x1.18 (held-out 0.98965 with, 0.9891 without: noise
# on 4 feeds), the layout YOLO x1.01, the ViT x1.2 (kept)
CORRECTION_CHECK_FEEDS = 4
CORRECTION_ERROR_GROWTH = 1.5


@dataclasses.dataclass(frozen=True)
class QuantizeSettings:
    """The keyword arguments of :func:`kenosis_rewrite.quantize` (documented there)."""

    calibration: object = None
    per_channel: bool | str = True
    target: str = "ort-cpu"
    calibration_samples: int = 32
    calibration_method: str | None = None
    protect_outputs: bool = True
    protect_metadata_inputs: bool = True
    snr_threshold_db: float | None = None
    target_cosine: float | None = None
    optimize_for: str | None = None
    latency_budget_s: float = 60.0
    seed: int = 0
    canonicalize: bool = True
    bias_correction: bool = True
    weight_rounding: bool = True
    equalization: bool = True
    plan: str = "auto"
    share_concat_ranges: bool = True
    compare_quantize_static: bool = False
    validate: object = None  # the user's metric, model -> float (quantization.accuracy_control)
    max_drop: float | None = None

    @property
    def self_calibrated(self) -> bool:
        """No calibration data: the feeds are made up (their input sizes too)."""
        return self.calibration is None or (isinstance(self.calibration, str) and self.calibration == "synthetic")

    @property
    def corrected(self) -> bool:
        """Weight rounding or bias correction runs (and is checked against the output's error)."""
        return self.weight_rounding or self.bias_correction

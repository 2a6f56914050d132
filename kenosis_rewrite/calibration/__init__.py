"""Calibration: per-tensor ranges from the FP32 model, self-calibration, and ORT reader adapters."""

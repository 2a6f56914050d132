"""Never below the baseline: quantize() against plain quantize_static of the same configuration.

quantize() builds on onnxruntime's quantize_static and adds to it (canonicalization, its range
method, equalization, weight rounding, bias correction, placement). Each addition measures better on
the models it was developed on; on a model it never saw any of them can lose (issue 53: a PicoDet
layout detector 0.787 against plain quantize_static's 0.8125; a generated Gemm + HardSwish + Softmax
block 0.017 below). So the result is compared with the model the user would otherwise have:
quantize_static of the model as given, on the same calibration feeds, with the same activation and
weight types and per-channel setting, and its own min/max ranges. Both are compared with the model
as given, by the cosine over all float outputs, on feeds neither was calibrated on: blends
``t a + (1 - t) b`` of two calibration feeds (``t`` in [0.3, 0.7]; integer inputs from ``a``), near
the data and not in it. On the feeds themselves the comparison is blind to what fits them: a
generated Gemm + BatchNorm + HardSwish + Softmax block calibrated on 4 feeds scored 0.99994 there
against plain's 0.99980, and 0.972 against 0.990 on others.

Where the baseline is closer by more than :func:`margin` (0.001, or 5% of the result's own error
``1 - cosine`` where that is larger), ``fix()`` of the baseline, its guard holding it to the model as
given (``float_model=``) on the calibration feeds, is returned instead, or the baseline itself where
that fix() lost what made it closer; the report says so. Either way ``report.baseline`` holds
both cosines.

Skipped, and said, where the caller's own metric decides (``validate=``) or quantize_static refuses
the model.

Where the baseline wins and quantize() chose its range method itself, the pipeline runs once more
with :data:`RETRY_METHOD` ranges (entropy: it places each range by the information kept, not by a
tail percentile that a few feeds set): MediaPipe's palm detector, 16 scenes: percentile 0.9614 and
plain quantize_static 0.9640 on the blends, entropy 0.9877 (0.9834 on 8 held-out photos, NNCF 0.9778).
The retry is returned where it is closer than the replacement on the same blends by the margin.
"""

from __future__ import annotations

import numpy as np
import onnx

from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import one_line
from kenosis_rewrite.placement.pipeline import fix
from kenosis_rewrite.quantization.settings import QuantizeSettings

__all__ = ["RETRY_METHOD", "held_back_cosine", "held_back_feeds", "margin", "never_below"]

MARGIN = 0.001
RETRY_METHOD = "entropy"
RELATIVE_MARGIN = 0.05
# the options of quantize_static that make "the same configuration"; ranges, plan and exclusions are ours
_SAME_CONFIGURATION = ("quant_format", "activation_type", "weight_type", "per_channel")


def margin(cosine: float) -> float:
    """How much closer than ``cosine`` the baseline must be to be preferred: a few feeds do not tell
    smaller differences apart."""
    return max(MARGIN, RELATIVE_MARGIN * (1.0 - cosine))


def held_back_feeds(feeds: list[dict], count: int, seed: int = 0) -> list[dict]:
    """``count`` blends of two different calibration feeds (float inputs), each near the data and
    none of it; the first feed's own values where there is one feed or an input is not float."""
    rng = np.random.default_rng(seed)
    blends = []
    for _ in range(count):
        a, b = (rng.choice(len(feeds), 2, replace=False) if len(feeds) > 1 else (0, 0))
        t = rng.uniform(0.3, 0.7)
        blends.append({
            name: (t * value + (1.0 - t) * feeds[b][name]).astype(value.dtype)
            if np.issubdtype(value.dtype, np.floating) and feeds[b][name].shape == value.shape else value
            for name, value in feeds[a].items()
        })
    return blends


def held_back_cosine(original: onnx.ModelProto, model: onnx.ModelProto, feeds: list[dict], count: int) -> float:
    """``model``'s cosine against ``original`` on the ``count`` held-back blends :func:`never_below` uses."""
    held_back = held_back_feeds(feeds, count)
    return fidelity.scores(fidelity.run(original, held_back), fidelity.run(model, held_back))["cosine"]


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _baseline(original: onnx.ModelProto, feeds: list[dict], options: dict) -> onnx.ModelProto | str:
    """Plain quantize_static of the model as given in ``options``' configuration, or why not."""
    same = {key: options[key] for key in _SAME_CONFIGURATION if key in options}
    extra = {key: value for key, value in options.get("extra_options", {}).items()
             if key in ("ActivationSymmetric", "WeightSymmetric")}
    try:
        return ort_quantize.quantize_with_ort(_copy(original), feeds, extra_options=extra, **same)
    except Exception as error:  # noqa: BLE001 - ORT's quantizer raises many unrelated types
        return f"quantize_static refused the model as given ({one_line(error, 200)})"


def _fixed_baseline(baseline: onnx.ModelProto, original: onnx.ModelProto, feeds: list[dict],
                    settings: QuantizeSettings) -> tuple[onnx.ModelProto, FixReport] | None:
    try:
        return fix(baseline, target=settings.target, calibration=feeds, float_model=original,
                   return_report=True)
    except Exception:  # noqa: BLE001 - the baseline as it is then
        return None


def never_below(original: onnx.ModelProto, candidate: onnx.ModelProto, feeds: list[dict], fidelity_runs: list,
                options: dict, settings: QuantizeSettings, report: FixReport) -> onnx.ModelProto | None:
    """The model to return instead of quantize()'s ``candidate``, or None to keep it; the report
    says which and why (``report.baseline``: both cosines on the held-back feeds). ``fidelity_runs``:
    the model as given on the report's fidelity feeds (the first calibration feeds), on which
    ``report.fidelity["quantized"]`` is restated for a replacement."""
    if settings.validate is not None:
        report.note("baseline: not compared with plain quantize_static (validate= decides what is good enough)")
        return None
    baseline = _baseline(original, feeds, options)
    if isinstance(baseline, str):
        report.note(f"baseline: {baseline}; not compared")
        return None
    held_back = held_back_feeds(feeds, len(fidelity_runs))
    expected = fidelity.run(original, held_back)
    ours = fidelity.scores(expected, fidelity.run(candidate, held_back))["cosine"]
    try:
        theirs = fidelity.scores(expected, fidelity.run(baseline, held_back))["cosine"]
    except Exception as error:  # noqa: BLE001 - e.g. per-axis DequantizeLinear written at opset 11
        report.note(f"baseline: quantize_static's model of the model as given does not run ({one_line(error, 200)}); "
                    "not compared")
        return None
    report.baseline = {"held_back_feeds": len(held_back), "quantized_cosine": ours, "quantize_static_cosine": theirs}
    needed = margin(ours)
    if theirs <= ours + needed:
        return None
    how = (f"plain quantize_static (the same types and per-channel setting, its min/max ranges) scored cosine "
           f"{theirs:.5f} against the model as given on {len(held_back)} blends of calibration feeds, this "
           f"pipeline {ours:.5f} (margin {needed:.4f})")
    fixed = _fixed_baseline(baseline, original, feeds, settings)
    fixed_cosine = (fidelity.scores(expected, fidelity.run(fixed[0], held_back))["cosine"] if fixed is not None
                    else float("-inf"))
    if fixed_cosine > ours + needed:
        model = fixed[0]
        _adopt(report, fixed[1], f"{how}: returned fix() of quantize_static's model ({fixed_cosine:.5f}) instead")
    else:
        model = baseline
        _adopt(report, FixReport(target=settings.target), f"{how}: returned quantize_static's model instead")
    report.fidelity["quantized"] = fidelity.scores(fidelity_runs, fidelity.run(model, feeds[:len(fidelity_runs)]))
    return model


def _adopt(report: FixReport, replacement: FixReport, why: str) -> None:
    """``report`` now describes the replacement: its changes and refusals, the notes of both."""
    report.changes[:] = replacement.changes
    report.refusals[:] = replacement.refusals
    report.guard_fidelity = replacement.guard_fidelity
    for note in replacement.notes:
        report.note(note)
    report.note(f"baseline: {why}")

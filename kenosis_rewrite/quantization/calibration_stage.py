"""Calibration for quantize(): the feeds, then the ranges quantize_static will use.

A stage of :func:`kenosis_rewrite.quantize`: :func:`calibrate` measures only the tensors quantize_static
reads a range for, gives the tensors whose values are the model's answer their extremes or their
activation's whole range, and one range to each Concat group (so ORT concatenates the codes).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping

import onnx

from kenosis_rewrite import calibration as calib
from kenosis_rewrite.accuracy.weight_rounding import InputMoments
from kenosis_rewrite.calibration.feed_files import feeds_from_path, is_feed_path
from kenosis_rewrite.calibration.ort_static import ranges_the_quantizer_sets
from kenosis_rewrite.calibration.output_extremes import mixed_output_concats, output_value_tensors
from kenosis_rewrite.calibration.shared_scales import SAME_SCALE_OPS, shared_concat_ranges
from kenosis_rewrite.core import model_io
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.errors import KenosisError, one_line
from kenosis_rewrite.quantization.configuration import Configuration, exclude
from kenosis_rewrite.quantization.graph_preparation import QuantizableGraph
from kenosis_rewrite.quantization.plan import WEIGHTED_PLANS
from kenosis_rewrite.quantization.settings import QuantizeSettings

SHARED_RANGE_RULE = "share-concat-ranges"
MIXED_OUTPUT_CONCAT_RULE = "mixed-output-concat-float"


@dataclasses.dataclass
class Calibrated:
    """The ranges quantize_static uses, the model they were measured on (``measured``: the proto
    itself or its validated serialisation), and weight rounding's gathered layer inputs (or None)."""

    ranges: calib.TensorRanges
    measured: onnx.ModelProto
    layer_inputs: InputMoments | None


def calibration_feeds(model: onnx.ModelProto, calibration, samples: int, seed: int) -> tuple[list[dict], str]:
    """``samples`` calibration feeds from ``calibration`` (feed dicts; a path: a ``.npz`` file, a folder
    of them or of images, :mod:`kenosis_rewrite.calibration.feed_files`; None / ``"synthetic"``:
    made up), and a line saying where they came from."""
    if calibration is None or (isinstance(calibration, str) and calibration == "synthetic"):
        feeds, sizes = calib.runnable_synthetic_feeds(model, samples, seed)
        return feeds, f"synthetic ({samples} samples{'; ' + sizes if sizes else ''})"
    if is_feed_path(calibration):
        feeds = feeds_from_path(calibration, model, samples, seed)
        return feeds, f"{len(feeds)} samples from {os.fspath(calibration)}"
    feeds = [dict(f) for f in itertools.islice(iter(calibration), samples)]
    if not feeds:
        raise KenosisError("the calibration iterable is empty")
    return feeds, f"{len(feeds)} user feeds"


def _shared_concat_ranges(model: onnx.ModelProto, ranges, excluded, report: FixReport):
    shared, decisions = shared_concat_ranges(model, ranges, excluded_nodes=excluded)
    for decision in decisions:
        if decision.applied:
            report.changed(SHARED_RANGE_RULE, decision.concat, decision.reason, exact=False)
        else:
            report.refused(SHARED_RANGE_RULE, decision.concat, decision.reason)
    return shared


def _calibrated(model: onnx.ModelProto, chosen_plan: str, options: Mapping, layer_inputs: InputMoments | None
                ) -> set[str] | None:
    """The tensors calibration must measure: every one for the full plan (None); for the weighted
    plans, the computed inputs of the ops quantize_static quantizes (their outputs stay float) and
    weight rounding's layer inputs. The rest stay inside onnxruntime's graph, free to be fused."""
    if chosen_plan not in WEIGHTED_PLANS:
        return None
    constants = {init.name for init in model.graph.initializer}
    quantized_ops, excluded = set(options["op_types_to_quantize"]), set(options.get("nodes_to_exclude", ()))
    wanted = {name for node in model.graph.node if node.op_type in quantized_ops and node.name not in excluded
              for name in node.input if name and name not in constants}
    return wanted | (layer_inputs.sources() if layer_inputs is not None else set())


def _borrowed(model: onnx.ModelProto, options: Mapping, shared_ranges: bool, layer_inputs: InputMoments | None
              ) -> dict[str, str | tuple[float, float]]:
    """Tensors calibration need not measure: quantize_static overwrites their ranges (a Relu or Clip's
    sole input takes its output's range). Not those that shared Concat ranges may read (a member of
    a Concat's group must have its own measured range), nor the layer inputs weight rounding reads."""
    borrowed = ranges_the_quantizer_sets(
        model, options.get("op_types_to_quantize"), options.get("nodes_to_quantize"), options.get("nodes_to_exclude"))
    if shared_ranges:
        grouping = SAME_SCALE_OPS | {"Concat"}
        near_groups = {name for node in model.graph.node if node.op_type in grouping
                       for name in (*node.input, *node.output)}
        borrowed = {name: source for name, source in borrowed.items() if name not in near_groups}
    kept = layer_inputs.sources() if layer_inputs is not None else set()
    return {name: source for name, source in borrowed.items() if name not in kept}


def _output_value_ranges(ranges: calib.TensorRanges, output_values: Mapping[str, tuple[float, float] | None],
                         extremes: set[str]) -> tuple[calib.TensorRanges, str]:
    """``ranges`` with each measured tensor of ``output_values`` that has a natural range given it
    (:mod:`~kenosis_rewrite.calibration.output_extremes`), and what was done (empty: nothing): how
    many took their natural range, how many their min/max (``extremes``, already in ``ranges``)."""
    natural = {name: bounds for name, bounds in output_values.items() if bounds is not None and name in ranges}
    parts = [f"{len(natural)} tensors take their activation's whole range"] if natural else []
    at_extremes = len(extremes & set(ranges))
    if at_extremes:
        parts.append(f"{at_extremes} their min/max, not {ranges.method} ranges")
    if not natural:
        return ranges, "; ".join(parts)
    return dataclasses.replace(ranges, ranges={**ranges.ranges, **natural}), "; ".join(parts)


def _collect(measured: onnx.ModelProto, feeds: list[dict], graph: QuantizableGraph, config: Configuration,
             layer_inputs: InputMoments | None, extremes: set[str], settings: QuantizeSettings) -> calib.TensorRanges:
    """calibration's ranges, its failures said in terms of quantize()'s inputs."""
    proto, method = graph.proto, config.method
    try:
        return calib.collect_ranges(measured, feeds, method, progress=False, serialised=True,
                                    observe=layer_inputs.tasks if layer_inputs is not None else None,
                                    tensors=_calibrated(proto, config.plan, config.options, layer_inputs),
                                    borrowed=_borrowed(proto, config.options,
                                                       settings.share_concat_ranges and config.plan == "full",
                                                       layer_inputs),
                                    extremes=extremes)
    except calib.CalibrationError as error:
        if not settings.self_calibrated:
            raise
        sizes = ", ".join(f"{name} {list(value.shape)}" for name, value in feeds[0].items())
        raise calib.CalibrationError(
            f"{error}. Self-calibration made up the sizes of the symbolic input dims ({sizes}) and the model does "
            "not run at them: pass calibration feeds (or a folder of images) of the sizes it expects") from None
    except KenosisError:
        raise
    except Exception as error:  # noqa: BLE001 - calibration runs ORT sessions, which raise many types
        raise KenosisError(f"calibration ({method}) failed on this model: {one_line(error)}") from error


def calibrate(graph: QuantizableGraph, config: Configuration, feeds: list[dict], settings: QuantizeSettings,
              report: FixReport) -> Calibrated:
    """The ranges for ``graph.proto`` on ``feeds``, by ``config.method``; Concats whose inputs mix
    an output's values with others are excluded from ``config.options`` (left float)."""
    proto = graph.proto
    # weight rounding's layer inputs, gathered from the calibration run (which computes every tensor)
    layer_inputs = InputMoments(proto) if settings.weight_rounding else None
    # the tensors whose extremes are the answer (a detector's scores): never clipped by the method
    output_values = output_value_tensors(proto)
    clipping = config.method != "minmax"
    extremes = {name for name, bounds in output_values.items() if bounds is None and clipping}
    measured = proto if graph.unconverted else model_io.to_output(model_io.load(proto, require_qdq=False))
    ranges = _collect(measured, feeds, graph, config, layer_inputs, extremes, settings)
    ranges, widened = _output_value_ranges(ranges, output_values, extremes)
    if widened:
        report.note(f"{widened}: their values reach a graph output, whose rare extremes are the answer (detection "
                    "scores, text pixels)")
    if config.plan == "full":  # the weighted plan leaves Concats float anyway
        mixed = mixed_output_concats(proto, output_values, ranges)
        for name, reason in mixed.items():
            report.changed(MIXED_OUTPUT_CONCAT_RULE, name, reason, exact=True)
        if mixed:
            exclude(config.options, mixed)
    if settings.share_concat_ranges and config.plan == "full":  # the weighted plan leaves Concats float
        ranges = _shared_concat_ranges(proto, ranges, config.options.get("nodes_to_exclude", ()), report)
    return Calibrated(ranges, measured, layer_inputs)

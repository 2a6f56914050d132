"""fix() of a peer's output with no data against fix() with calibration feeds: speed and fidelity.

    kenosis-rewrite peers install nncf        # once: the peer in its own venv
    python benchmarks/fix_without_data.py nudenet_yolov8n --peer nncf \\
        --json docs/benchmarks/fix_without_data/nudenet_yolov8n_nncf.json

Quantizes the zoo model with the peer (or ``--peer ort:CONFIG``, onnxruntime's quantize_static)
on 16 real photos (scenes), then times, interleaved in one process (warm-up, medians), at 1 and 2
threads: FP32, the peer's model as given, fix() with no arguments, and fix(calibration=the same 16
feeds). Fidelity is the cosine against FP32 on 100 held-out photos of objects (mean and worst
feed), and the task metric where the model has one.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import onnx

import kenosis_rewrite
from kenosis_rewrite import zoo
from kenosis_rewrite.accuracy import rounding_noise
from kenosis_rewrite.benchmark.bench import measure_latency
from kenosis_rewrite.benchmark.pages import save_variants_record, variants_record
from kenosis_rewrite.benchmark.peers import quantize_with_peer
from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.core.ort_quantize import ORT_CONFIGS


def _fidelity(reference: list, outputs: list) -> dict:
    """Pooled over outputs (``cosine``, ``worst_feed_cosine``, as recorded since the first runs) and
    per float output: the mean over feeds of its cosine and its worst feed's (``outputs``), with the
    lowest of each over the outputs (what fix()'s guard holds to its budget)."""
    per_feed = [fidelity.scores([r], [o])["cosine"] for r, o in zip(reference, outputs)]
    per_output = []
    for index in range(len(reference[0])):
        if not np.issubdtype(np.asarray(reference[0][index]).dtype, np.floating):
            continue
        cosines = [fidelity.cosine(r[index], o[index]) for r, o in zip(reference, outputs)]
        per_output.append({"mean_cosine": float(np.mean(cosines)), "worst_feed_cosine": float(np.min(cosines))})
    return {"cosine": fidelity.scores(reference, outputs)["cosine"], "worst_feed_cosine": float(np.min(per_feed)),
            "outputs": per_output, "min_mean_cosine": min(o["mean_cosine"] for o in per_output),
            "min_worst_feed_cosine": min(o["worst_feed_cosine"] for o in per_output)}


def record_speeds(result: dict, variants: dict, feed: dict, threads: list[int], seconds: float) -> None:
    """Each variant's interleaved median (``median_ms_Nt``) and speed against ``variants["fp32"]``
    (``x_fp32_Nt``) at each thread count, written into ``result[name]``."""
    for count in threads:
        stats = measure_latency(variants, feed, threads=count, min_seconds=seconds)
        for name, stat in stats.items():
            result[name][f"median_ms_{count}t"] = stat.median_ms
            result[name][f"x_fp32_{count}t"] = stats["fp32"].median_ms / stat.median_ms


def add_rounding_noise(entry: dict, model: onnx.ModelProto, reference: list, evaluation: list) -> None:
    """Each output's rounding noise (:mod:`kenosis_rewrite.accuracy.rounding_noise`: the most a photo's
    cosine against FP32 moves when the model's activation scales move by 1e-5), into ``entry``."""
    noise = rounding_noise.rounding_noise(model, reference, fidelity.run(model, evaluation),
                                          lambda jittered: fidelity.run(jittered, evaluation))
    for output, moved in zip(entry["outputs"], noise):
        output["rounding_noise"] = moved


def _peer_failure(model: onnx.ModelProto) -> str | None:
    """Why ONNX Runtime cannot run the peer's model as written (Quark's opset-9 Q/DQ), or None."""
    try:
        fidelity.session(model, True, 1)
    except Exception as error:  # noqa: BLE001 - the reason is the finding
        return str(error).splitlines()[0][:300]
    return None


def _peer_model(peer: str, model_name: str, float_model, calibration, cache: str | None):
    """The peer's output, from ``cache`` (a folder) when an earlier run left it there."""
    path = os.path.join(cache, f"{model_name}_{peer}.onnx") if cache else None
    if path and os.path.exists(path):
        return onnx.load(path)
    if peer.startswith("ort:"):  # onnxruntime's own quantize_static in a named configuration
        quantized = ort_quantize.quantize_with_ort(float_model, calibration, peer.removeprefix("ort:"))
    else:
        quantized = quantize_with_peer(peer, float_model, calibration).model
    if path:
        os.makedirs(cache, exist_ok=True)
        onnx.save(quantized, path)
    return quantized


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a zoo model name")
    parser.add_argument("--peer", default="nncf", choices=["nncf", "inc", "quark", *(f"ort:{name}" for name in ORT_CONFIGS)],
                        help="a peer quantizer, or ort:CONFIG for onnxruntime's quantize_static (core.ort_quantize.ORT_CONFIGS)")
    parser.add_argument("--calibration-samples", type=int, default=16)
    parser.add_argument("--evaluation-samples", type=int, default=100)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--peer-cache", help="a folder to keep the peer's output in (reruns and other checkouts reuse it)")
    args = parser.parse_args(argv)

    float_model = zoo.load_model(args.model)
    calibration = zoo.model_feeds(args.model, zoo.load_photo_set("scenes", args.calibration_samples))
    evaluation = zoo.model_feeds(args.model, zoo.load_photo_set("objects", args.evaluation_samples))
    peer = _peer_model(args.peer, args.model, float_model, calibration, args.peer_cache)
    no_data, no_data_report = kenosis_rewrite.fix(peer, return_report=True)
    with_data, with_data_report = kenosis_rewrite.fix(peer, calibration=calibration, return_report=True)
    variants = {"fp32": float_model, args.peer: peer, f"{args.peer}+fix()": no_data,
                f"{args.peer}+fix(calibration=)": with_data}
    reference = fidelity.run(float_model, evaluation)
    result = variants_record("fix_without_data", args.model, "benchmarks/fix_without_data.py", sys.argv[1:], peer=args.peer)
    failure = _peer_failure(peer)
    if failure is not None:  # fix() may still make it run: the row says so, with no baseline
        result["peer_does_not_run"] = failure
        del variants[args.peer]
    for name, model in variants.items():
        entry = {"integer_mac_fraction": kenosis_rewrite.explain(model).integer_mac_fraction}
        if name != "fp32":
            entry.update(_fidelity(reference, fidelity.run(model, evaluation)))
        result["variants"][name] = entry
    if failure is None:
        add_rounding_noise(result["variants"][args.peer], peer, reference, evaluation)
    record_speeds(result["variants"], variants, evaluation[0], [int(t) for t in args.threads.split(",")], args.min_seconds)
    result["notes"] = {"fix()": no_data_report.notes, "fix(calibration=)": with_data_report.notes}
    save_variants_record(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

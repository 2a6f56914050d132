"""Issue 17's per-model table from `kenosis-rewrite bench --json` results: quantize() against the best other variant.

    for m in $(python -c "from kenosis_rewrite import zoo; print(*zoo.list_models())"); do
        kenosis-rewrite bench zoo:$m --configs u8s8_pc,u8s8 --quantize --peers nncf,inc,quark \\
            --threads 1,2 --calibration-samples 16 --photos large --min-seconds 1 \\
            --json docs/benchmarks/zoo/$m.json --markdown docs/benchmarks/zoo/$m.md
    done
    python benchmarks/zoo_table.py docs/benchmarks/zoo/*.json

For each model and thread count: quantize()'s speed against FP32, the fastest other variant that ran
(quantize_static configs and peers, each as given and after fix()), quantize()'s speed as a fraction
of that one's (the bar is 0.97), quantize()'s cosine beside fix(quantize_static u8s8 per-channel)'s
(u8s8 per-tensor where per-channel gave no valid model: opsets below 13), the same two variants' task
scores where the model has a task metric (the JSON's ``task`` names it; "-" where it has none), and
quantize()'s build seconds beside the fastest peer's.
"""

from __future__ import annotations

import json
import sys

PEERS = ("nncf", "inc", "quark")


def _ok(variant: dict) -> bool:
    return not variant.get("error") and bool(variant.get("latency"))


def _speed(variant: dict, threads: int, base_threads: int) -> float | None:
    if threads == base_threads:
        return variant.get("speedup_vs_fp32")
    return (variant.get("speedup_by_threads") or {}).get(str(threads))


def _cosine(variant: dict | None) -> float | None:
    return (variant or {}).get("fidelity", {}).get("cosine") if variant and variant.get("fidelity") else None


def _row(data: dict) -> str:
    variants = {v["name"]: v for v in data["variants"] if _ok(v)}
    ours = variants.get("quantize()")
    if ours is None:
        return f"| {data['model']} | quantize() failed | | | | | |"
    cells = []
    base = data["threads"]
    for threads in sorted({base, *data.get("also_threads", [])}):
        others = {name: _speed(v, threads, base) for name, v in variants.items()
                  if name not in ("fp32", "quantize()", "quantize(synthetic)")}
        others = {name: s for name, s in others.items() if s}
        mine = _speed(ours, threads, base)
        if not others or not mine:
            cells.append("n/a")
            continue
        best = max(others, key=others.get)
        cells.append(f"{mine:.2f} vs {others[best]:.2f} {best} = **{mine / others[best]:.2f}**")
    reference = variants.get("u8s8_pc+fix") or variants.get("u8s8+fix")
    reference_name = "pc" if "u8s8_pc+fix" in variants else "u8s8"
    ours_cos, ref_cos = _cosine(ours), _cosine(reference)
    cosine = f"{ours_cos:.5f} vs {ref_cos:.5f} ({reference_name})" if ours_cos is not None and ref_cos is not None else "n/a"
    peer_builds = [v["build_s"] for name, v in variants.items() if name in PEERS and v.get("build_s")]
    fastest = min(peer_builds) if peer_builds else None
    build = f"{ours['build_s']:.1f} vs {fastest:.1f}" if fastest and ours.get("build_s") else f"{ours.get('build_s') or 0:.1f}"
    ours_task, ref_task = ours.get("task"), (reference or {}).get("task")
    task = (f"{ours_task:.3f} vs {ref_task:.3f}" if ours_task is not None and ref_task is not None
            else "-" if not data.get("task") else "n/a")
    return f"| {data['model']} | " + " | ".join(cells) + f" | {cosine} | {task} | {build} |"


def main(paths: list[str]) -> None:
    print("| model | quantize() vs best other, × FP32, 1 thr | same, 2 thr | cosine: quantize() vs fix(quantize_static) "
          "| task: quantize() vs fix(quantize_static) | build s: quantize() vs fastest peer |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as handle:
            print(_row(json.load(handle)))


if __name__ == "__main__":
    main(sys.argv[1:])

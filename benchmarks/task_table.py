"""Task scores of quantize() beside fix(quantize_static) and the peers, on the zoo models that have one.

    python benchmarks/task_table.py [MODELS] [--peers inc,nncf] [--calibration 16]
        [--calibration-method minmax] [--no-reference]

Each model is calibrated on the first ``--calibration`` zoo scenes and evaluated on the 100 zoo
photos of objects (none seen in calibration), as ``kenosis-rewrite bench --photos large`` does.
Variants: quantize(), fix(quantize_static u8s8 per-channel; per-tensor below opset 13) and each
peer's output as it gives it. Per variant: the worst output's cosine against FP32 and the model's task score
(:mod:`kenosis_rewrite.zoo.task_metrics`: its outputs decoded as its package decodes them, against FP32's
decoding), with the number of evaluated images the task score counts (those where FP32 or the
variant finds anything). No timing: ``bench`` measures speed. Peers run in their own venvs
(``kenosis-rewrite peers install inc``); one that is not installed is left out with its reason.
"""

from __future__ import annotations

import argparse

import kenosis_rewrite
from kenosis_rewrite import zoo
from kenosis_rewrite.benchmark import peers
from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.errors import InvalidModelError, one_line
from kenosis_rewrite.zoo import task_metrics


def _counted(metric: task_metrics.TaskMetric, reference, runs) -> int:
    """How many images the metric scored (the others have nothing to agree on)."""
    return sum(metric([r], [c]) is not None for r, c in zip(reference, runs))


def _fixed_quantize_static(model, calibration):
    """fix(quantize_static u8s8 per-channel), per-tensor where per-channel gives no valid model
    (opsets below 13), as the zoo table compares."""
    try:
        return kenosis_rewrite.fix(ort_quantize.quantize_with_ort(model, calibration, "u8s8_pc"))
    except InvalidModelError:
        return kenosis_rewrite.fix(ort_quantize.quantize_with_ort(model, calibration, "u8s8"))


def _variants(model, calibration, peer_names, method, with_reference):
    label = "quantize()" if method is None else f'quantize(calibration_method="{method}")'
    yield label, lambda: kenosis_rewrite.quantize(model, calibration=calibration, calibration_method=method)
    if with_reference:
        yield "fix(quantize_static)", lambda: _fixed_quantize_static(model, calibration)
    for name in peer_names:
        yield name, lambda name=name: peers.quantize_with_peer(name, model, calibration).model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    with_task = [entry.name for entry in zoo.MODELS if entry.task is not None]
    parser.add_argument("models", nargs="?", default=",".join(with_task), help="comma-separated zoo names")
    parser.add_argument("--peers", default="", help="comma-separated: inc, nncf, quark")
    parser.add_argument("--calibration", type=int, default=16)
    parser.add_argument("--calibration-method", help="quantize()'s (minmax, percentile, ...); its default when left out")
    parser.add_argument("--no-reference", action="store_true", help="quantize() alone, without fix(quantize_static)")
    args = parser.parse_args()
    scenes = zoo.load_photo_set("scenes", args.calibration)
    objects = zoo.load_photo_set("objects")
    print("| model | task metric | variant | cosine | task score | images scored |")
    print("|---|---|---|---:|---:|---:|")
    for name in args.models.split(","):
        entry = zoo.get_model(name)
        model = zoo.load_model(name)
        calibration, evaluation = zoo.model_feeds(name, scenes), zoo.model_feeds(name, objects)
        reference = fidelity.run(model, evaluation)
        peer_names = [p for p in args.peers.split(",") if p]
        for label, build in _variants(model, calibration, peer_names, args.calibration_method, not args.no_reference):
            try:
                runs = fidelity.run(build(), evaluation)
            except Exception as error:  # noqa: BLE001 - a variant that fails is a row saying why
                print(f"| {name} | {entry.task.name} | {label} | failed: {one_line(error)} | | |", flush=True)
                continue
            cosine = fidelity.output_fidelity(reference, runs).cosine
            score = entry.task(reference, runs)
            shown = "n/a" if score is None else f"{score:.3f}"
            print(f"| {name} | {entry.task.name} | {label} | {cosine:.5f} | {shown} | "
                  f"{_counted(entry.task, reference, runs)} / {len(evaluation)} |", flush=True)


if __name__ == "__main__":
    main()

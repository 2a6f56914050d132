"""The ``kenosis-rewrite`` command line.

    kenosis-rewrite fix IN.onnx OUT.onnx [--calibration PATH] [--report] [--report-json R.json] [--float-model F.onnx]
                    [--optimize-for latency] [--latency-budget S] [--threads N]
    kenosis-rewrite explain MODEL.onnx [--json]
    kenosis-rewrite profile MODEL.onnx [--runs N]
    kenosis-rewrite quantize FP32.onnx OUT.onnx [--calibration PATH|synthetic] [--per-tensor] [--fidelity COS]
        [--validate FILE.py:FUNCTION --max-drop D]
    kenosis-rewrite quantize-weights FP32.onnx OUT.onnx [--bits 4] [--block-size 32] [--asymmetric] [--rtn]
    kenosis-rewrite bench MODEL.onnx|zoo:NAME [--peers nncf,inc,quark] [--threads 1,2] [...]
    kenosis-rewrite peers list | install NAME

fix, quantize, quantize-weights and bench also take a folder or a .txt list of models instead of one
model (the output is then a folder; bench takes --out DIR): --engine local|ray, --jobs N, --force,
--ray-address ADDR; see :mod:`kenosis_rewrite.cli.batch`. Models over 2 GB are read and written with
external data (``OUT.onnx.data`` next to ``OUT.onnx``). quantize, bench and the batch commands show
progress bars on a terminal (not when piped or with ``CI`` set; ``--progress``/``--no-progress``).

Exit codes: 0 success, 1 the input was refused (a KenosisError; the message says why),
2 bad command line.
"""

from __future__ import annotations

import argparse
import sys

import onnx

from kenosis_rewrite.cli.batch import BATCH_COMMANDS, batch_main, is_batch_input
from kenosis_rewrite.core.model_io import save
from kenosis_rewrite.core.progress import progress_default
from kenosis_rewrite.errors import KenosisError

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2


def _fix(args: argparse.Namespace) -> int:
    from kenosis_rewrite.placement.pipeline import fix_loaded  # noqa: PLC0415

    loaded, report, _ = fix_loaded(
        args.input, target=args.target, float_model=args.float_model, calibration=args.calibration,
        optimize_for=args.optimize_for,
        latency_budget_s=args.latency_budget, threads=args.threads, verify=False if args.no_guard else None,
        input_shapes=_input_shapes(args.input_shape),
    )
    save(loaded.model, args.output)
    if args.report:
        print(report.summary())
    if args.report_json:
        with open(args.report_json, "w", encoding="utf-8") as handle:
            handle.write(report.to_json())
    counts = report.change_counts()
    total = sum(counts.values())
    print(f"wrote {args.output}: {total} change(s)" + (f" ({', '.join(f'{k} {v}' for k, v in counts.items())})" if counts else ""),
          file=sys.stderr)
    return EXIT_OK


def _input_shapes(specs: list[str] | None) -> dict[str, list[int]] | None:
    """``["x=1,3,224,224", ...]`` -> ``{"x": [1, 3, 224, 224]}``; a malformed one is a KenosisError."""
    if not specs:
        return None
    shapes = {}
    for spec in specs:
        name, _, dims = spec.rpartition("=")
        try:
            shapes[name] = [int(d) for d in dims.split(",")]
        except ValueError:
            name = ""
        if not name:
            raise KenosisError(f"--input-shape {spec!r}: expected NAME=D,D,... (e.g. pixel_values=1,3,224,224)")
    return shapes


def _explain(args: argparse.Namespace) -> int:
    from kenosis_rewrite.diagnosis.explain import explain  # noqa: PLC0415

    report = explain(args.model)
    print(report.to_json() if args.json else report.summary())
    return EXIT_OK


def _quantize(args: argparse.Namespace) -> int:
    from kenosis_rewrite.quantization.pipeline import quantize  # noqa: PLC0415

    calibration = None if args.calibration in (None, "synthetic") else args.calibration
    validate = None
    if args.validate is not None:
        from kenosis_rewrite.quantization.accuracy_control import load_metric  # noqa: PLC0415

        validate = load_metric(args.validate)
    model, report = quantize(
        args.input, calibration, per_channel=args.per_channel, target=args.target,
        calibration_samples=args.samples, calibration_method=args.method, target_cosine=args.fidelity,
        snr_threshold_db=args.snr_threshold, optimize_for=args.optimize_for, return_report=True,
        bias_correction=not args.no_bias_correction, share_concat_ranges=not args.separate_concat_ranges,
        compare_quantize_static=args.compare_quantize_static, validate=validate, max_drop=args.max_drop,
        progress=args.progress if args.progress is not None else progress_default(),
    )
    save(model, args.output)
    if args.report:
        print(report.summary())
    print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


def _quantize_weights(args: argparse.Namespace) -> int:
    from kenosis_rewrite.weight_only.weights import quantize_weights_loaded  # noqa: PLC0415

    loaded = quantize_weights_loaded(
        args.input, bits=args.bits, block_size=args.block_size, symmetric=not args.asymmetric, form=args.form,
        scale_search=not args.rtn, accuracy_level=args.accuracy_level,
    )
    save(loaded.model, args.output)
    print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


def _profile(args: argparse.Namespace) -> int:
    from kenosis_rewrite.core import (
        fidelity,  # noqa: PLC0415
        model_io,  # noqa: PLC0415
    )
    from kenosis_rewrite.diagnosis import profiler

    model_io.refuse_over_2gb(args.model)  # profiling runs the whole model in memory
    model = onnx.load(args.model) if isinstance(args.model, str) else args.model
    feed = fidelity.random_feeds(model, 1)[0]
    print(profiler.comparison_table(profiler.compare_integer_and_float(model, feed, runs=args.runs, threads=args.threads)))
    return EXIT_OK


def _peers(args: argparse.Namespace) -> int:
    from kenosis_rewrite.benchmark import peers  # noqa: PLC0415

    if args.action == "install":
        python = peers.install(args.name, progress=lambda message: print(message, file=sys.stderr))
        print(f"{peers.PEERS[args.name].title}: {python}")
        return EXIT_OK
    for name, peer in peers.PEERS.items():
        python = peers.find_python(name)
        where = python or f"not installed (kenosis-rewrite peers install {name})"
        print(f"{name:6s} {peer.title}: {where}")
    return EXIT_OK


def _bench(argv: list[str]) -> int:
    from kenosis_rewrite.benchmark.bench import bench_main  # noqa: PLC0415

    return bench_main(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kenosis-rewrite",
        description="Make INT8 QDQ ONNX models run in fused integer kernels on ONNX Runtime.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    fix = commands.add_parser("fix", help="rewrite a QDQ model for faster integer execution")
    fix.add_argument("input", help="quantized (QDQ) .onnx model")
    fix.add_argument("output", help="where to write the fixed model")
    fix.add_argument("--target", default="ort-cpu", help="runtime to place Q/DQ for (default: ort-cpu)")
    fix.add_argument("--float-model", help="FP32 original: report fidelity before/after against it")
    fix.add_argument("--calibration", metavar="PATH", default=None,
                     help="real inputs for the guard, output quantizers and the fidelity report: a .npz (one array per "
                          "input name, samples along the first axis), a folder of .npz files, or a folder of images")
    fix.add_argument("--optimize-for", choices=["latency"], default=None,
                     help="also measure per layer and return layers to float where that is faster here")
    fix.add_argument("--latency-budget", type=float, default=60.0, metavar="S", help="seconds for that search")
    fix.add_argument("--threads", type=int, default=1, help="intra-op threads to measure with (default 1)")
    fix.add_argument("--no-guard", action="store_true",
                     help="skip the run-time guard (ORT runs of input and output; rules that break their bound are "
                          "undone; by default it runs on models up to 256 MiB)")
    fix.add_argument("--input-shape", action="append", metavar="NAME=D,D,...",
                     help="pin a symbolic input's dims and fold the shape arithmetic they feed (repeatable)")
    fix.add_argument("--report", action="store_true", help="print what changed and what was left alone")
    fix.add_argument("--report-json", metavar="PATH", help="write the report as JSON")
    fix.set_defaults(handler=_fix)
    explain = commands.add_parser("explain", help="which Conv/MatMul/Gemm ORT CPU runs as integer kernels, and why not")
    explain.add_argument("model", help=".onnx model (quantized or not)")
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.set_defaults(handler=_explain)
    quant = commands.add_parser("quantize", help="FP32 model -> quantized, fixed, protected QDQ model")
    quant.add_argument("input", help="FP32 .onnx model")
    quant.add_argument("output", help="where to write the quantized model")
    quant.add_argument("--calibration", metavar="PATH|synthetic", default=None,
                       help="a .npz (one array per input name, samples along the first axis), a folder of .npz files "
                            "or of images, or 'synthetic' (default: self-calibration)")
    quant.add_argument("--samples", type=int, default=32, help="calibration samples (default 32)")
    quant.add_argument("--method", default=None, choices=["minmax", "percentile", "entropy", "mse"],
                       help="activation ranges (default: percentile for CNNs, minmax for transformers)")
    quant.add_argument("--per-channel", dest="per_channel", action="store_true", default=True,
                       help="per-channel weights (default)")
    quant.add_argument("--per-tensor", dest="per_channel", action="store_false", help="per-tensor weights")
    quant.add_argument("--fidelity", type=float, metavar="COS", default=None,
                       help="keep the fewest layers in FP32 that bring the output cosine to COS")
    quant.add_argument("--snr-threshold", type=float, metavar="DB", default=None,
                       help="keep layers whose weight SNR or local SQNR is below DB in FP32")
    quant.add_argument("--no-bias-correction", action="store_true",
                       help="leave the int32 biases as quantize_static wrote them (default: corrected)")
    quant.add_argument("--separate-concat-ranges", action="store_true",
                       help="calibrate each Concat input on its own (default: one shared range, faster Concats)")
    quant.add_argument("--target", default="ort-cpu")
    quant.add_argument("--optimize-for", choices=["latency"], default=None)
    quant.add_argument("--report", action="store_true")
    quant.add_argument("--compare-quantize-static", action="store_true",
                       help="also report the fidelity of quantize_static's own model (one more model to run)")
    quant.add_argument("--validate", metavar="FILE.py:FUNCTION", default=None,
                       help="your metric, FUNCTION(model: onnx.ModelProto) -> float, higher is better (or MODULE:FUNCTION)")
    quant.add_argument("--max-drop", type=float, default=None,
                       help="with --validate: how much of the metric quantization may cost; layers return to FP32 until it holds")
    quant.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="a bar over quantize()'s stages (default: on a terminal, not in CI)")
    quant.set_defaults(handler=_quantize)
    weights = commands.add_parser("quantize-weights", help="weight-only int4/int8 MatMul/Gemm weights (MatMulNBits)")
    weights.add_argument("input", help="float .onnx model (any size; external data is read one weight at a time)")
    weights.add_argument("output", help="where to write the quantized model")
    weights.add_argument("--bits", type=int, choices=[4, 8], default=4)
    weights.add_argument("--block-size", type=int, default=32, help="rows per scale, power of two 16..256 (default 32)")
    weights.add_argument("--asymmetric", action="store_true", help="unsigned values with a zero point per block")
    weights.add_argument("--rtn", action="store_true", help="plain absmax round-to-nearest (no per-block scale search)")
    weights.add_argument("--form", choices=["auto", "qdq", "matmul_nbits"], default="auto")
    weights.add_argument("--accuracy-level", type=int, default=None, help="MatMulNBits accuracy_level")
    weights.set_defaults(handler=_quantize_weights)
    prof = commands.add_parser("profile", help="per-layer time: as the model runs now vs in float")
    prof.add_argument("model", help=".onnx model")
    prof.add_argument("--runs", type=int, default=20)
    prof.add_argument("--threads", type=int, default=1)
    prof.set_defaults(handler=_profile)
    commands.add_parser("bench", help="FP32 vs quantize_static vs fixed, measured side by side", add_help=False)
    peer = commands.add_parser("peers", help="the peer quantizers bench --peers runs, each in its own venv")
    peer_actions = peer.add_subparsers(dest="action", required=True)
    peer_actions.add_parser("list", help="where each peer's interpreter is, or how to install it")
    install = peer_actions.add_parser("install", help="make a peer's virtual environment (pip install)")
    install.add_argument("name", choices=["nncf", "inc", "quark"])
    peer.set_defaults(handler=_peers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if len(argv) > 1 and argv[0] in BATCH_COMMANDS and is_batch_input(argv[1]):
            return batch_main(argv[0], argv[1:], main)
        if argv and argv[0] == "bench":
            return _bench(argv[1:])
        args = _parser().parse_args(argv)
        return args.handler(args)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2)
        return int(exit_.code or 0)
    except KenosisError as error:
        print(f"kenosis-rewrite: error: {error}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as error:
        print(f"kenosis-rewrite: error: {error}", file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())

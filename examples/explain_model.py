"""explain(): which Conv/MatMul/Gemm of a model ORT CPU runs in integer kernels, which in float, and why.

    python examples/explain_model.py                   # an NNCF output in tests/fixtures, before fix()
    python examples/explain_model.py MODEL.onnx        # any model: QDQ, QOperator or float
    python examples/explain_model.py MODEL.onnx --json report.json --threads 2

explain() builds an ONNX Runtime session, reads back the graph ORT optimised, and matches each heavy
op of your graph to the kernel that runs it. Each float op comes with the reason and, where one
exists, the kenosis rule that fixes it; so the same command on fix()'s output shows what changed.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import kenosis_rewrite

DEFAULT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "c2fish_nncf3.4.onnx"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=str(DEFAULT), help="an .onnx file")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of the ORT session (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the whole report as JSON")
    args = parser.parse_args(argv)

    report = kenosis_rewrite.explain(args.model, threads=args.threads)
    print(report.summary())

    print("\nheavy ops, most multiply-accumulates first:")
    for op in sorted(report.ops, key=lambda op: -op.macs)[:10]:
        kernel = op.optimized_op_type or "?"
        print(f"  {op.op_type:8s} {op.name!r:40s} {op.macs / 1e6:9.2f}M MACs  {op.kernel:7s} ({kernel})")
    common = ", ".join(f"{name} x{count}" for name, count in report.optimized_op_counts.most_common(8))
    print(f"\nthe graph ORT runs, most frequent ops: {common}")
    if report.float_ops:
        print("what fix() makes of them: python examples/fix_peer_output.py MODEL.onnx")
    if args.json:
        pathlib.Path(args.json).write_text(report.to_json())
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""quantize() on an MLP block with a residual, with and without ``split-gemm-computed-addend``.

The block is ``x -> Gemm(+bias) -> Relu -> h``, ``MatMul(h, W2) -> Add(h) -> MatMul(W3)`` on
``[8, 256]`` activations. prepare()'s onnxruntime pass fuses ``MatMul -> Add(h)`` into a Gemm whose C
is ``h``; without the split, that Gemm has no integer kernel. Both models come from quantize() on the
same 16 random feeds; the split is switched off by making the rule's check refuse. Prints the
ops ORT runs and the interleaved median per run (one thread, several rounds, order alternating).

    python benchmarks/gemm_addend_speed.py [--rounds 3] [--seconds 2]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import tempfile
from unittest import mock

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper
from onnxscript.rewriter import MatchResult

import kenosis_rewrite
from kenosis_rewrite.canonicalization.rules.gemm_addend import GemmComputedAddendToAdd
from kenosis_rewrite.core import interleaved_timing
from kenosis_rewrite.diagnosis import ort_graph

WIDTH, ROWS = 256, 8


def residual_mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    initializers = [numpy_helper.from_array(rng.normal(0, 0.1, (WIDTH, WIDTH)).astype(np.float32), name)
                    for name in ("w1", "w2", "w3")]
    initializers.append(numpy_helper.from_array(rng.normal(0, 0.1, WIDTH).astype(np.float32), "b1"))
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["g"]), helper.make_node("Relu", ["g"], ["h"]),
             helper.make_node("MatMul", ["h", "w2"], ["m"]), helper.make_node("Add", ["m", "h"], ["r"]),
             helper.make_node("MatMul", ["r", "w3"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, WIDTH])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _refuse(self, context, **_) -> MatchResult:
    return MatchResult().fail("switched off for the comparison")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    model = residual_mlp()
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.normal(0, 1, (ROWS, WIDTH)).astype(np.float32)} for _ in range(16)]
    variants = {}
    for name, patch in (("split", contextlib.nullcontext()),
                        ("not split", mock.patch.object(GemmComputedAddendToAdd, "check", _refuse))):
        with patch:
            variants[name] = kenosis_rewrite.quantize(model, feeds).SerializeToString()
        with tempfile.TemporaryDirectory() as tmp:
            ran = ort_graph.optimized_graph(ir.serde.deserialize_model(onnx.load_from_string(variants[name])), tmp)
        heavy = collections.Counter(n.op_type for n in ran.graph.node if n.op_type not in ort_graph.QDQ_OPS)
        print(f"{name}: ORT runs {dict(heavy)}")
    sessions = {name: interleaved_timing.session(data, threads=1) for name, data in variants.items()}
    rounds = [interleaved_timing.interleaved_medians(sessions, feeds[0], seconds=args.seconds) for _ in range(args.rounds)]
    for name in variants:
        values = [r[name] * 1e6 for r in rounds]
        print(f"{name}: median of {args.rounds} rounds {np.median(values):.1f} us (rounds: "
              f"{', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()

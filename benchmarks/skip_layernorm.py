"""SkipLayerNormalization vs Add + LayerNormalization, Add vs Sum on ORT CPU (the facts behind ``residual-add-as-sum``).

The rule lives in ``kenosis_rewrite/canonicalization/rules/residual_sum.py``.

    python benchmarks/skip_layernorm.py [--seconds S]

Each model is one block on x[1, S, H] (and a residual r of the same shape):

* ``Add -> LN``: what ORT fuses into ``com.microsoft.SkipLayerNormalization`` at session time;
* ``Sum -> LN``: the same arithmetic written as the two-input Sum (``residual-add-as-sum``), which
  ORT leaves as Sum + LayerNormalization;
* ``Add(bias)`` vs ``Sum(bias)``: a bias add on its own (what ``matmul-bias-as-sum`` costs where it
  applies).

Interleaved medians (``kenosis_rewrite.core.interleaved_timing``), microseconds per run, 1 and 2 threads.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.core import interleaved_timing
from kenosis_rewrite.testing import model_checks


def _block(op: str, seq: int, hidden: int, layer_norm: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    shape = [1, seq, hidden]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)]
    initializers = [numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), name)
                    for name in ("gamma", "beta", "bias")]
    if layer_norm:
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, shape))
        nodes = [helper.make_node(op, ["x", "r"], ["s"]),
                 helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1)]
    else:
        nodes = [helper.make_node(op, ["x", "bias"], ["y"])]
    graph = helper.make_graph(nodes, "block", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    print(f"onnxruntime CPU, {interleaved_timing.cpu_description()}; microseconds per run (median)")
    print("| shape | threads | Add -> LN (ORT runs) | Sum -> LN | Add(bias) | Sum(bias) |")
    print("|---|---:|---|---:|---:|---:|")
    for hidden in (384, 768):
        for seq in (8, 128, 512):
            models = {"add_ln": _block("Add", seq, hidden, True), "sum_ln": _block("Sum", seq, hidden, True),
                      "add": _block("Add", seq, hidden, False), "sum": _block("Sum", seq, hidden, False)}
            fused = "SkipLayerNormalization" in model_checks.ort_optimized_op_types(models["add_ln"])
            rng = np.random.default_rng(1)
            feed = {"x": rng.standard_normal((1, seq, hidden)).astype(np.float32),
                    "r": rng.standard_normal((1, seq, hidden)).astype(np.float32)}
            for threads in (1, 2):
                medians = {}
                for pair in (("add_ln", "sum_ln"), ("add", "sum")):
                    sessions = {name: interleaved_timing.session(models[name].SerializeToString(), threads) for name in pair}
                    wanted = feed if pair[0] == "add_ln" else {"x": feed["x"]}
                    medians.update(interleaved_timing.interleaved_medians(sessions, wanted, seconds=args.seconds))
                us = {name: f"{value * 1e6:.1f}" for name, value in medians.items()}
                print(f"| [1,{seq},{hidden}] | {threads} | {us['add_ln']} ({'SkipLayerNormalization' if fused else 'unfused'}) "
                      f"| {us['sum_ln']} | {us['add']} | {us['sum']} |")


if __name__ == "__main__":
    main()

"""QLinearSoftmax vs float Softmax between the same Q/DQ on ORT CPU (the facts behind ``softmax-float-input``).

The rule lives in ``kenosis_rewrite/placement/rules/softmax_float_input.py``.

    python benchmarks/qlinear_softmax.py [--seconds S] [--threads 1,2]

Each model reads a uint8 tensor and writes a uint8 tensor (the Softmax's calibrated output range is
[0, 1]), with data movement before the Softmax, as in a detector's DFL head (``Flatten`` and
``Reshape`` alias their input in ORT: no copy):

* ``fused``: ``x_q -> Flatten -> Reshape -> DQ -> Softmax -> Q``: ORT fuses ``DQ -> Softmax -> Q``
  into ``com.microsoft.QLinearSoftmax`` (checked on the graph ORT runs);
* ``float``: ``x_q -> DQ -> Flatten -> Reshape -> Softmax -> Q``: the same values (a per-tensor DQ
  commutes with data movement bit for bit), and ORT runs ``DequantizeLinear``, float ``Softmax``
  and ``QuantizeLinear``: its QDQ propagation carries a DQ forward through Reshape, Transpose,
  Squeeze, Unsqueeze, Slice and MaxPool (and the fusion follows), not through Flatten;
* ``softmax``: a float Softmax on its own (float in, float out), for reference.

Interleaved medians (``kenosis_rewrite.core.interleaved_timing``), microseconds per run.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kenosis_rewrite.core import interleaved_timing
from kenosis_rewrite.testing import model_checks

# (label, shape the Softmax reads, its axis); "YOLOv8 DFL": x[1,64,N] -> Reshape[1,4,16,N] -> Transpose(0,2,1,3)
# -> Softmax(axis=1), as Ultralytics exports it (N = 2100 anchors at 320x320, 8400 at 640x640). Here the
# Transpose stays before the Softmax (its output is the graph's); in the whole model ORT's transpose
# optimizer moves it after the Softmax and the Q (towards the NHWC QLinearConv), which then runs on
# [1,4,16,N] over axis 2: the "DFL [1,4,16,N]" rows
SHAPES: list[tuple[str, list[int], int]] = [
    ("DFL", [1, 4, 2100, 16], -1),
    ("DFL", [1, 4, 8400, 16], -1),
    ("YOLOv8 DFL", [1, 16, 4, 2100], 1),
    ("YOLOv8 DFL", [1, 16, 4, 8400], 1),
    ("DFL", [1, 4, 16, 2100], 2),  # what ORT runs of YOLOv8's head: it moves the Transpose after the Softmax
    ("DFL", [1, 4, 16, 8400], 2),
    ("DFL", [1, 64, 8400], 1),
    ("attention", [1, 12, 16, 16], -1),
    ("attention", [1, 12, 64, 64], -1),
    ("attention", [1, 12, 128, 128], -1),
    ("attention", [1, 12, 256, 256], -1),
    ("attention", [1, 12, 512, 512], -1),
    ("logits", [1, 1000], -1),
]

SCALE_IN, ZERO_IN = 0.08, 128  # logits in [-10, 10]
SCALE_OUT, ZERO_OUT = 1 / 255, 0  # probabilities in [0, 1]


def _movement(label: str, shape: list[int], source: str, out: str) -> tuple[list[int], list[onnx.NodeProto]]:
    """The model's input shape and the data movement from ``source`` to ``out`` (the Softmax's input)."""
    if label == "YOLOv8 DFL":
        anchors = shape[-1]
        return [1, 64, anchors], [
            helper.make_node("Flatten", [source], [f"{out}_flat"], axis=1),
            helper.make_node("Reshape", [f"{out}_flat", "shape"], [f"{out}_boxes"]),
            helper.make_node("Transpose", [f"{out}_boxes"], [out], perm=[0, 2, 1, 3])]
    return shape, [helper.make_node("Flatten", [source], [f"{out}_flat"], axis=1),
                   helper.make_node("Reshape", [f"{out}_flat", "shape"], [out])]


def _model(label: str, variant: str, shape: list[int], axis: int) -> onnx.ModelProto:
    reshaped = [1, 4, 16, shape[-1]] if label == "YOLOv8 DFL" else shape
    params = [numpy_helper.from_array(np.array(SCALE_IN, np.float32), "s_in"),
              numpy_helper.from_array(np.array(ZERO_IN, np.uint8), "z_in"),
              numpy_helper.from_array(np.array(SCALE_OUT, np.float32), "s_out"),
              numpy_helper.from_array(np.array(ZERO_OUT, np.uint8), "z_out"),
              numpy_helper.from_array(np.array(reshaped, np.int64), "shape")]
    if variant == "softmax":
        in_shape, movement = _movement(label, shape, "x", "r")
        nodes = [*movement, helper.make_node("Softmax", ["r"], ["y"], axis=axis)]
        in_type = out_type = TensorProto.FLOAT
    else:
        if variant == "fused":
            in_shape, movement = _movement(label, shape, "x", "r_q")
            head = [*movement, helper.make_node("DequantizeLinear", ["r_q", "s_in", "z_in"], ["r"])]
        else:
            in_shape, movement = _movement(label, shape, "x_f", "r")
            head = [helper.make_node("DequantizeLinear", ["x", "s_in", "z_in"], ["x_f"]), *movement]
        nodes = [*head, helper.make_node("Softmax", ["r"], ["p"], axis=axis),
                 helper.make_node("QuantizeLinear", ["p", "s_out", "z_out"], ["y"])]
        in_type = out_type = TensorProto.UINT8
    graph = helper.make_graph(nodes, variant, [helper.make_tensor_value_info("x", in_type, in_shape)],
                              [helper.make_tensor_value_info("y", out_type, shape)], params)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    threads_list = [int(t) for t in args.threads.split(",")]
    print(f"onnxruntime CPU, {interleaved_timing.cpu_description()}; microseconds per run (median)")
    print("| Softmax input | axis | threads | fused (QLinearSoftmax) | float (DQ, Softmax, Q) | float/fused | Softmax alone |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, shape, axis in SHAPES:
        models = {name: _model(label, name, shape, axis) for name in ("fused", "float", "softmax")}
        ran = {name: model_checks.ort_optimized_op_types(model) for name, model in models.items()}
        assert ran["fused"]["QLinearSoftmax"] == 1, ran["fused"]
        assert "QLinearSoftmax" not in ran["float"] and ran["float"]["Softmax"] == 1, ran["float"]
        rng = np.random.default_rng(0)
        in_shape = [d.dim_value for d in models["fused"].graph.input[0].type.tensor_type.shape.dim]
        codes = rng.integers(0, 256, in_shape).astype(np.uint8)
        feeds = {"fused": {"x": codes}, "float": {"x": codes},
                 "softmax": {"x": ((codes.astype(np.float32) - ZERO_IN) * SCALE_IN)}}
        fused_out = model_checks.session(models["fused"]).run(None, feeds["fused"])[0]
        float_out = model_checks.session(models["float"]).run(None, feeds["float"])[0]
        differ = float(np.mean(fused_out != float_out))
        worst = int(np.abs(fused_out.astype(np.int32) - float_out).max())
        for threads in threads_list:
            sessions = {name: interleaved_timing.session(model.SerializeToString(), threads) for name, model in models.items()}
            # one feed for all: the float model's input is float, so time it in its own interleaving round
            pair = interleaved_timing.interleaved_medians({k: sessions[k] for k in ("fused", "float")}, feeds["fused"],
                                               seconds=args.seconds)
            alone = interleaved_timing.interleaved_medians({"softmax": sessions["softmax"]}, feeds["softmax"], seconds=args.seconds / 2)
            us = {name: value * 1e6 for name, value in {**pair, **alone}.items()}
            print(f"| {label} {shape} | {axis} | {threads} | {us['fused']:.1f} | {us['float']:.1f} "
                  f"| {us['float'] / us['fused']:.2f} | {us['softmax']:.1f} |"
                  + (f" codes differ: {differ:.1%} (at most {worst})" if threads == threads_list[0] else ""), flush=True)


if __name__ == "__main__":
    main()

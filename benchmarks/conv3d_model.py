"""Write the 3-D Conv model behind docs/benchmarks/float_3d_conv (two 1x11x11 Conv3D + Relu, opset 13).

    python benchmarks/conv3d_model.py /tmp/conv3d.onnx
    kenosis-rewrite bench /tmp/conv3d.onnx --configs u8s8_sym --threads 1,2 --min-seconds 2 \\
        --json docs/benchmarks/float_3d_conv/conv3d.json
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def conv3d_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, inits, x, channels = [], [], "x", 4
    for i in range(2):
        weight = (rng.standard_normal((8, channels, 1, 11, 11)) * 0.05).astype(np.float32)
        inits.append(numpy_helper.from_array(weight, f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[0, 5, 5, 0, 5, 5], name=f"conv{i}"),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        x, channels = f"r{i}", 8
    graph = helper.make_graph(nodes, "conv3d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 2, 48, 48])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 8, 2, 48, 48])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


if __name__ == "__main__":
    onnx.save(conv3d_model(), sys.argv[1])

"""The image-reading Conv of quantize()'s model in float: its kernel time, and the whole model's speed.

    python benchmarks/stem_conv_float.py mtcnn_pnet,mobilenet_v2,efficientnet_lite0 [--rounds 3]

For each zoo model (quantize() on the 16 scenes of `bench --photos large`), the first Conv whose
weights have at most 27 values per output channel and that reads a graph input (through a
Transpose at most) is changed in two ways:

* ``float``: the Conv in FP32, its input and output Q/DQ removed (``sensitivity.keep_fp32``):
  ORT's profiler gives the Conv's kernel time against the QLinearConv's (one thread);
* ``float, output quantized``: the Conv in FP32 reading the float input, its output Q/DQ kept:
  quantize()'s model against it, interleaved medians over ``--rounds`` at 1 and 2 threads.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import onnx
import onnx_ir as ir

from kenosis_rewrite.accuracy import sensitivity
from kenosis_rewrite.benchmark import bench
from kenosis_rewrite.diagnosis import profiler
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.graph.dequantize import dequantize_constants, remove_qdq_pair

MAX_COLUMNS = 27  # 3 channels x 3 x 3


def _stem(model: ir.Model) -> ir.Node | None:
    inputs = {value.name for value in model.graph.inputs}
    for node in model.graph:
        dq = node.inputs[0].producer() if node.op_type == "Conv" else None
        q = dq.inputs[0].producer() if qdq_params.is_dequantize(dq) else None
        weights = node.inputs[1].producer() if q is not None else None
        if not (qdq_params.is_quantize(q) and qdq_params.is_dequantize(weights)):
            continue
        shape = weights.inputs[0].const_value.shape
        source = q.inputs[0]
        reads_input = source.name in inputs or (
            source.producer() is not None and source.producer().op_type == "Transpose"
            and source.producer().inputs[0].name in inputs)
        if reads_input and shape[1] * shape[2] * shape[3] <= MAX_COLUMNS:
            return node
    return None


def _float_input_quantized_output(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    model = ir.serde.deserialize_model(proto)
    stem = _stem(model)
    if stem is None:
        return None
    names = qdq_params.NameAllocator(model.graph)
    dequantize_constants(stem, model.graph, names=names)
    dq = stem.inputs[0].producer()
    q = dq.inputs[0].producer()
    if len(dq.inputs[0].uses()) == 1 and len(q.outputs[0].uses()) == 1:
        remove_qdq_pair(q, names=names)
    else:
        stem.replace_input_with(0, q.inputs[0])
    return ir.serde.serialize_model(model)


def _kernel_us(proto: onnx.ModelProto, feed, op_type: str) -> float:
    times = profiler.profile(proto, feed, runs=100, warmup=10)
    first = next(name for name, kind in times.node_types.items() if kind == op_type)  # the stem runs first
    return times.node_us[first]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        inputs = bench._zoo_inputs(name, 16, None, photos="large")
        built, _ = bench._build_variants(inputs, [], True, lambda _: None, include_quantize=True, peer_specs=[])
        ours = built["quantize()"]
        proto = ours if isinstance(ours, onnx.ModelProto) else ir.serde.serialize_model(ours)
        stem = _stem(ir.serde.deserialize_model(proto))
        if stem is None:
            print(name, "no image-reading Conv of <= 27 weights per channel")
            continue
        kept = ir.serde.deserialize_model(proto)
        sensitivity.keep_fp32(kept, [stem.name])
        feed = inputs.evaluation[0]
        print(f"{name}: {stem.name} QLinearConv {_kernel_us(proto, feed, 'QLinearConv'):.0f} us, "
              f"float Conv {_kernel_us(ir.serde.serialize_model(kept), feed, 'Conv'):.0f} us (ORT profiler, 1 thread)")
        chosen = {"quantize()": proto, "float stem": _float_input_quantized_output(proto)}
        for threads in (1, 2):
            ratios = []
            for _ in range(args.rounds):
                latency = bench.measure_latency(chosen, feed, threads=threads, runs=100, min_seconds=3)
                ratios.append(latency["quantize()"].median_ms / latency["float stem"].median_ms)
            rounds = ", ".join(f"{r:.3f}" for r in ratios)
            print(f"  {threads} thr: float stem (output quantized) speed / quantize()'s: {rounds}; "
                  f"median {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

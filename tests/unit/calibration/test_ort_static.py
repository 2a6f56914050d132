"""ort_static: per-channel parameters as ORT computes them channel by channel, and the same QDQ model as quantize_static."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import QuantType, quantize_static
from onnxruntime.quantization.quant_utils import compute_data_quant_params

from kenosis_rewrite import calibration as calib
from kenosis_rewrite.calibration.ort_static import channel_quant_params, quantize_static_qdq, quantize_static_qdq_proto
from kenosis_rewrite.quantization.configuration import per_channel_overrides, quantize_static_options
from kenosis_rewrite.testing import toy_models


@pytest.mark.parametrize("quant_type", [onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16])
@pytest.mark.parametrize("reduce_range", [False, True])
def test_channel_parameters_are_orts_channel_by_channel(quant_type, reduce_range):
    rng = np.random.default_rng(0)
    data = rng.standard_normal((6, 3, 3, 3)).astype(np.float32) * np.float32(0.05)
    data[1] = 0.0  # a dead channel: ORT's scale 1, zero point 0
    data[2] = np.abs(data[2])  # one sign only
    data[3] *= np.float32(1e-39)  # subnormal: below float32's tiny
    for axis in (0, 1):
        zero_point, scale = channel_quant_params(data, axis, quant_type, reduce_range)
        expected = [compute_data_quant_params(data.take(i, axis).ravel(), quant_type, True, reduce_range=reduce_range)
                    for i in range(data.shape[axis])]
        assert zero_point.dtype == np.asarray([z for z, _ in expected]).dtype
        assert scale.dtype == np.float32
        assert zero_point.tobytes() == np.asarray([z for z, _ in expected]).tobytes()
        assert scale.tobytes() == np.asarray([s for _, s in expected]).tobytes()


def _both(model: onnx.ModelProto, **options) -> tuple[bytes, bytes]:
    """quantize_static's model and ours, through files; ours in memory must be the same."""
    feeds = toy_models.random_feeds(model, 3)
    ranges = calib.collect_ranges(model, feeds, "minmax", progress=False)
    before = model.SerializeToString()
    in_memory = quantize_static_qdq_proto(model, ranges.to_cached_tensors_data(), **options).SerializeToString()
    assert model.SerializeToString() == before
    with tempfile.TemporaryDirectory() as tmp:
        source, cache = os.path.join(tmp, "float.onnx"), os.path.join(tmp, "ranges.json")
        onnx.save(model, source)
        ranges.write_ort_cache(cache)
        outputs = []
        for name, quantizer in (("ort.onnx", quantize_static), ("ours.onnx", None)):
            target = os.path.join(tmp, name)
            if quantizer is None:
                quantize_static_qdq(source, target, cache, **options)
            else:
                quantizer(source, target, None, calibration_cache_path=cache, **options)
            outputs.append(onnx.load(target).SerializeToString())
    assert in_memory == outputs[1]
    return outputs[0], outputs[1]


@pytest.mark.parametrize("name", ["resnetish", "gemm_relu", "matmul_relu", "conv_prelu"])
@pytest.mark.parametrize("per_channel", [True, False, "auto"])
def test_same_model_as_quantize_static(name, per_channel):
    model = toy_models.build(name)
    options = quantize_static_options("ort-cpu", per_channel is True)
    if per_channel == "auto":
        options["extra_options"]["TensorQuantOverrides"] = per_channel_overrides(model)
    ort_bytes, our_bytes = _both(model, **options)
    assert ort_bytes == our_bytes


def test_same_model_as_quantize_static_with_symmetric_activations_and_reduce_range():
    model = toy_models.build("resnetish")
    options = quantize_static_options("tensorrt", True)
    ort_bytes, our_bytes = _both(model, reduce_range=True, **options)
    assert ort_bytes == our_bytes
    options["activation_type"] = QuantType.QInt16  # 16-bit: contrib QDQ ops, still the same model
    options["weight_type"] = QuantType.QInt16
    ort_bytes, our_bytes = _both(model, **options)
    assert ort_bytes == our_bytes


def _conv_with_tiny_weights_and_large_biases() -> onnx.ModelProto:
    """A Conv whose channels 0 and 2 have weights so small and biases so large that input scale x
    weight scale would put the int32 bias out of range: quantize_static raises those weight scales."""
    rng = np.random.default_rng(1)
    weights = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * np.float32(0.1)
    weights[0] *= np.float32(1e-6)
    weights[2] *= np.float32(3e-5)
    bias = np.array([1e3, 0.5, -2e4, 0.0], np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", ["x", "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
         onnx.helper.make_node("Relu", ["conv"], ["y"])],
        "tiny_weights",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 8, 8])],
        [onnx.numpy_helper.from_array(weights, "w"), onnx.numpy_helper.from_array(bias, "b")],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


@pytest.mark.parametrize("per_channel", [True, False])
def test_weight_scales_raised_for_int32_biases_as_quantize_static_raises_them(per_channel):
    model = _conv_with_tiny_weights_and_large_biases()
    ort_bytes, our_bytes = _both(model, **quantize_static_options("ort-cpu", per_channel))
    assert ort_bytes == our_bytes
    if not per_channel:
        return  # one scale for all channels: ORT's own per-tensor branch
    scales = {init.name: onnx.numpy_helper.to_array(init) for init in onnx.load_from_string(our_bytes).graph.initializer}
    plain = np.abs(onnx.numpy_helper.to_array(model.graph.initializer[0])).reshape(4, -1).max(axis=1) / np.float32(127)
    assert (scales["w_scale"][[0, 2]] > 1.5 * plain[[0, 2]]).all()  # raised: the test reaches the adjustment
    np.testing.assert_array_equal(scales["w_scale"][[1, 3]], plain[[1, 3]])


@pytest.mark.parametrize("name", ["concat", "conv_add_relu", "gap_head", "conv_bn"])
def test_same_model_as_quantize_static_on_more_graphs(name):
    """Concats, residual Adds, pooling heads and BatchNorms: more tensors rewired and more biases replaced."""
    model = toy_models.build(name)
    ort_bytes, our_bytes = _both(model, **quantize_static_options("ort-cpu", True))
    assert ort_bytes == our_bytes


@pytest.mark.parametrize("seed", range(6))
def test_indexed_lookups_change_the_graph_as_orts_scans_do(seed):
    """Random sequences of the graph edits ORT's quantizer makes, on ORT's ONNXModel and on the
    indexed one: every lookup answers the same and the graphs end byte for byte the same. Names
    repeat on purpose (initializers of one name, nodes reading a tensor twice); each tensor's count
    of readers is the length of its list in ORT's map."""
    from onnx import helper  # noqa: PLC0415
    from onnxruntime.quantization.onnx_model import ONNXModel  # noqa: PLC0415

    from kenosis_rewrite.calibration.ort_indexed_model import ScanningONNXModel  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    names = [f"t{i}" for i in range(8)]

    def tensor(name: str) -> onnx.TensorProto:
        return onnx.numpy_helper.from_array(rng.standard_normal(2).astype(np.float32), name)

    graph = helper.make_graph(
        [helper.make_node("Add", [names[i], names[(i * 3) % 8]], [f"o{i}"], name=f"n{i}") for i in range(8)],
        "g", [helper.make_tensor_value_info("t0", onnx.TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("o7", onnx.TensorProto.FLOAT, [2])], [tensor(name) for name in names[1:6]])
    graph.initializer.append(tensor("t3"))  # a repeated name: lookups answer the first
    base = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    theirs, ours = ONNXModel(onnx.ModelProto.FromString(base.SerializeToString())), ScanningONNXModel(
        onnx.ModelProto.FromString(base.SerializeToString()))
    added = 0
    for _ in range(120):
        action = rng.integers(0, 9)
        name, other = (str(rng.choice([*names, "new0", "new1"])) for _ in range(2))
        if action == 0:
            for model in (theirs, ours):
                model.replace_input_of_all_nodes(name, other)
        elif action == 1:
            init = tensor(name)
            for model in (theirs, ours):
                model.add_initializer(init)
        elif action == 2:
            found = [model.get_initializer(name) for model in (theirs, ours)]
            assert (found[0] is None) == (found[1] is None)
            if found[0] is not None:
                assert found[0] == found[1]
                for model, init in zip((theirs, ours), found):
                    model.remove_initializer(init)
        elif action == 3:
            node = helper.make_node("Mul", [name, name, other], [f"m{added}"], name=f"m{added}")
            added += 1
            for model in (theirs, ours):
                model.add_node(node)
        elif action == 4 and len(theirs.nodes()):
            index = int(rng.integers(0, len(theirs.nodes())))
            for model in (theirs, ours):
                node = model.nodes()[index]
                model.replace_node_input(node, node.input[0], other)
        elif action == 5 and len(theirs.nodes()) > 4:
            index = int(rng.integers(0, len(theirs.nodes())))
            for model in (theirs, ours):
                model.remove_node(model.nodes()[index])
        elif action == 6:
            inits = [tensor(name), tensor(other)]
            for model in (theirs, ours):
                model.initializer_extend(inits)
        elif action == 7:
            chosen = {f"n{rng.integers(0, 8)}"}
            for model in (theirs, ours):
                model.replace_input_of_nodes(name, other, chosen)
        else:
            target = str(rng.choice([f"o{i}" for i in range(8)] + [f"m{i}" for i in range(added)]))
            for model in (theirs, ours):
                model.replace_output_of_all_nodes(target, f"{target}_renamed")
        assert theirs.model.SerializeToString() == ours.model.SerializeToString(), (action, name, other)
        for probe in (name, other):
            found = [model.get_initializer(probe) for model in (theirs, ours)]
            assert found[0] == found[1]
            assert ours.reader_count(probe) == len(theirs.input_name_to_nodes().get(probe, []))
    assert theirs.model.SerializeToString() == ours.model.SerializeToString()


@pytest.mark.parametrize("weight_declared_as_input", [False, True])
def test_shape_inference_without_the_weights_gives_infer_shapes_model_byte_for_byte(weight_declared_as_input, monkeypatch):
    """shape_inferred leaves large float weights out of the copy it infers (as typed inputs) and
    puts them back: infer_shapes' model, whatever reads a small constant (a Reshape's shape), a
    weight declared as a graph input too (IR 3 style), a subgraph; the input model untouched."""
    from onnx import helper  # noqa: PLC0415

    from kenosis_rewrite.calibration.ort_static import _INFERENCE_WEIGHTS_LEFT_OUT, shape_inferred  # noqa: PLC0415

    rng = np.random.default_rng(0)
    width = int(np.ceil(np.sqrt(_INFERENCE_WEIGHTS_LEFT_OUT))) + 8
    weight = onnx.numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), "w")
    branch = helper.make_graph([helper.make_node("Relu", ["y"], ["then_out"])], "then", [], [
        helper.make_tensor_value_info("then_out", onnx.TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["y"], ["else_out"])], "else", [], [
        helper.make_tensor_value_info("else_out", onnx.TensorProto.FLOAT, None)])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Reshape", ["m", "shape"], ["y"]),
             helper.make_node("Add", ["y", "bias"], ["b"]),
             helper.make_node("If", ["flag"], ["z"], then_branch=branch, else_branch=other)]
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", width]),
              helper.make_tensor_value_info("flag", onnx.TensorProto.BOOL, [])]
    if weight_declared_as_input:
        inputs.append(helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [width, width]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, None),
                                                   helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None)],
                              [weight, onnx.numpy_helper.from_array(np.array([-1, 2, width // 2], np.int64), "shape"),
                               onnx.numpy_helper.from_array(np.ones(width // 2, np.float32), "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=3 if weight_declared_as_input else 8)
    model.metadata_props.add(key="source", value="test")
    before = model.SerializeToString()
    expected = onnx.shape_inference.infer_shapes(model)
    inferring = onnx.shape_inference.infer_shapes
    seen = []
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes",
                        lambda m, *a, **k: (seen.append([i.name for i in m.graph.initializer]), inferring(m, *a, **k))[1])
    got = shape_inferred(model)
    assert seen == [["shape", "bias"]]  # the weight was left out of the copy inferred
    assert model.SerializeToString() == before
    assert got.SerializeToString() == expected.SerializeToString()
    assert {value.name for value in got.graph.value_info} >= {"m", "y"}  # inference reached past the weight
    shape = next(value for value in got.graph.value_info if value.name == "y").type.tensor_type.shape
    assert [d.dim_value for d in shape.dim][1:] == [2, width // 2]  # the Reshape's constant was read

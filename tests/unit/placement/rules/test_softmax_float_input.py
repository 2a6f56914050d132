"""Tests of softmax-float-input: a quantized Softmax stays float (no QLinearSoftmax), bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes import common as common_passes

from kenosis_rewrite.placement.rules.softmax_float_input import RULE_NAME, softmax_float_input_rules
from kenosis_rewrite.testing import model_checks

ANCHORS = 12


def _movement(kind: str, source: str, out: str, opset: int) -> tuple[list[int], list[onnx.NodeProto], list[onnx.TensorProto], int]:
    """(input shape, data-movement nodes from ``source`` to ``out``, their constants, the Softmax's axis)."""
    def axes(name, values):
        return numpy_helper.from_array(np.array(values, np.int64), name)

    if kind == "dfl":  # YOLOv8: [1,64,N] -> Reshape [1,4,16,N] -> Transpose(0,2,1,3) -> Softmax(axis=1)
        return [1, 64, ANCHORS], [
            helper.make_node("Reshape", [source, "dfl_shape"], [f"{out}_r"]),
            helper.make_node("Transpose", [f"{out}_r"], [out], perm=[0, 2, 1, 3]),
        ], [axes("dfl_shape", [1, 4, 16, ANCHORS])], 1
    if kind == "squeeze":  # [1,1,6,10] -> Squeeze -> Unsqueeze -> Softmax(-1)
        if opset < 13:
            raise ValueError(opset)
        return [1, 1, 6, 10], [
            helper.make_node("Squeeze", [source, "sq_axes"], [f"{out}_s"]),
            helper.make_node("Unsqueeze", [f"{out}_s", "sq_axes"], [out]),
        ], [axes("sq_axes", [1])], -1
    if kind == "flatten_slice":  # [1,3,4,5] -> Flatten -> Slice(columns 2..18) -> Softmax(-1)
        return [1, 3, 4, 5], [
            helper.make_node("Flatten", [source], [f"{out}_f"], axis=2),
            helper.make_node("Slice", [f"{out}_f", "starts", "ends", "slice_axes"], [out]),
        ], [axes("starts", [2]), axes("ends", [18]), axes("slice_axes", [1])], -1
    if kind == "none":  # attention scores: the DQ straight before the Softmax
        return [1, 2, 8, 8], [], [], -1
    raise ValueError(kind)


def _model(kind: str = "dfl", form: str = "wrapped", dtype: str = "uint8", opset: int = 17, seed: int = 0,
           per_axis: bool = False, softmax_output: bool = False, shared: bool = False,
           symbolic: bool = False) -> onnx.ModelProto:
    """``x -> Q -> [data movement] -> DQ -> Softmax -> Q -> DQ -> y``: the movement on the codes
    (``form="codes"``) or wrapped in ``DQ -> P -> Q`` as quantize_static writes it (``"wrapped"``)."""
    rng = np.random.default_rng(seed)
    np_type = np.uint8 if dtype == "uint8" else np.int8
    shape, movement, constants, axis = _movement(kind, "m_in", "m_out", opset)
    zero = (128 if dtype == "uint8" else 0) + int(rng.integers(-20, 21))
    constants += [
        numpy_helper.from_array(np.array(rng.uniform(0.02, 0.1), np.float32), "s_in"),
        numpy_helper.from_array(np.array(zero, np_type), "z_in"),
        numpy_helper.from_array(np.array(1 / 255, np.float32), "s_out"),
        numpy_helper.from_array(np.array(0 if dtype == "uint8" else -128, np_type), "z_out"),
    ]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s_in", "z_in"], ["x_q"])]
    if form == "codes":
        for node in movement:
            node.input[0] = "x_q" if node.input[0] == "m_in" else node.input[0]
        nodes += movement
        codes = "m_out" if movement else "x_q"
        nodes += [helper.make_node("DequantizeLinear", [codes, "s_in", "z_in"], ["sm_in"])]
    else:
        previous = "x_q"
        for index, node in enumerate(movement):  # DQ -> P -> Q around every op
            node = onnx.NodeProto.FromString(node.SerializeToString())
            nodes.append(helper.make_node("DequantizeLinear", [previous, "s_in", "z_in"], [f"w{index}_dq"]))
            node.input[0] = f"w{index}_dq"
            node.output[0] = f"w{index}_p"
            nodes.append(node)
            previous = f"w{index}_q"
            nodes.append(helper.make_node("QuantizeLinear", [f"w{index}_p", "s_in", "z_in"], [previous]))
        if shared:  # the first wrapped op's codes are read elsewhere too
            nodes.append(helper.make_node("DequantizeLinear", ["w0_q", "s_in", "z_in"], ["side"]))
        nodes.append(helper.make_node("DequantizeLinear", [previous, "s_in", "z_in"], ["sm_in"]))
    if per_axis:
        channels = shape[1]
        constants += [numpy_helper.from_array(rng.uniform(0.02, 0.1, channels).astype(np.float32), "s_axis"),
                      numpy_helper.from_array(np.full(channels, zero, np_type), "z_axis")]
        nodes[-1] = helper.make_node("DequantizeLinear", [nodes[-1].input[0], "s_axis", "z_axis"], ["sm_in"], axis=1)
    nodes.append(helper.make_node("Softmax", ["sm_in"], ["probs"], axis=axis))
    if not softmax_output:
        nodes += [helper.make_node("QuantizeLinear", ["probs", "s_out", "z_out"], ["p_q"]),
                  helper.make_node("DequantizeLinear", ["p_q", "s_out", "z_out"], ["y"])]
    in_shape = ["batch", *shape[1:]] if symbolic else shape
    outputs = [helper.make_tensor_value_info("probs" if softmax_output else "y", TensorProto.FLOAT, None)]
    if shared:
        outputs.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "softmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
                              outputs, constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8 if opset <= 17 else (9 if opset <= 19 else 10)
    return onnx.shape_inference.infer_shapes(model)


def _apply(proto: onnx.ModelProto):
    """The rule set on a copy of ``proto``, then what it left unread removed (as fix()'s cleanup does)."""
    rewritten, report, count = model_checks.apply_reporting_rules(proto, softmax_float_input_rules)
    model = ir.serde.deserialize_model(rewritten)
    common_passes.RemoveUnusedNodesPass()(model)
    return ir.serde.serialize_model(model), report, count


def _feed(model: onnx.ModelProto, seed: int) -> dict:
    dims = [d.dim_value or 1 for d in model.graph.input[0].type.tensor_type.shape.dim]
    return {"x": (np.random.default_rng(seed).standard_normal(dims) * 3).astype(np.float32)}


def _chain_to_softmax(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes from the graph input's Q to the Softmax, walking back along first inputs."""
    softmax = next(node for node in model.graph.node if node.op_type == "Softmax")
    chain = [softmax]
    while (producer := model_checks.producer_of(model, chain[0].input[0])) is not None:
        chain.insert(0, producer)
    return chain


def _assert_bit_exact(original: onnx.ModelProto, rewritten: onnx.ModelProto) -> None:
    for seed in range(3):
        feed = _feed(original, seed)
        want = model_checks.outputs(original, feed, optimized=False)
        for optimized in (False, True):  # the float Softmax ORT runs computes what the graph says
            for got, expected in zip(model_checks.outputs(rewritten, feed, optimized), want):
                np.testing.assert_array_equal(got, expected)


MOVEMENT_OPS = {"dfl": ["Reshape", "Transpose"], "squeeze": ["Squeeze", "Unsqueeze"],
                "flatten_slice": ["Flatten", "Slice"], "none": []}


@pytest.mark.parametrize("kind", sorted(MOVEMENT_OPS))
@pytest.mark.parametrize("form", ["wrapped", "codes"])
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_softmax_reads_float_data_movement_of_one_dequantize_bit_exactly(kind, form, dtype):
    original = _model(kind, form, dtype)
    # what the rule is for; x86 fuses int8 only where its int8 -> uint8 conversion of a Q -> DQ pair
    # applies, not to int8 codes moved before the DQ (there the rule changes only the graph)
    fused = not (dtype == "int8" and form == "codes" and kind != "none")
    assert model_checks.ort_optimized_op_types(original)["QLinearSoftmax"] == int(fused)
    rewritten, report, count = _apply(original)
    assert count == 1 and [(c.rule, c.exact) for c in report.changes] == [(RULE_NAME, True)]
    assert not report.refusals
    chain = _chain_to_softmax(rewritten)
    # Q(x) -> DQ -> Flatten -> Reshape -> the data movement, now float -> Softmax -> the same Q
    assert [node.op_type for node in chain] == [
        "QuantizeLinear", "DequantizeLinear", "Flatten", "Reshape", *MOVEMENT_OPS[kind], "Softmax"]
    dq = chain[1]
    assert list(dq.input) == ["x_q", "s_in", "z_in"]
    assert helper.get_attribute_value(chain[2].attribute[0]) == 0  # Flatten(axis=0)
    shape = model_checks.initializer(rewritten, chain[3].input[1])
    assert shape.tolist() == list(_feed(original, 0)["x"].shape)  # back to the codes' own shape
    assert [n.op_type for n in rewritten.graph.node if "p_q" in n.output] == ["QuantizeLinear"]
    assert model_checks.producer_of(rewritten, "p_q").input[0] == chain[-1].output[0]
    # no Q/DQ left between the codes and the Softmax; ORT runs a float Softmax
    assert sum(n.op_type == "DequantizeLinear" for n in rewritten.graph.node) == 2
    ran = model_checks.ort_optimized_op_types(rewritten)
    assert ran["QLinearSoftmax"] == 0 and ran["Softmax"] == 1
    _assert_bit_exact(original, rewritten)


def test_symbolic_shapes_reshape_back_with_the_codes_shape():
    original = _model("dfl", "codes", symbolic=True)
    rewritten, _, count = _apply(original)
    assert count == 1
    reshape = _chain_to_softmax(rewritten)[3]
    assert reshape.op_type == "Reshape" and model_checks.producer_of(rewritten, reshape.input[1]).op_type == "Shape"
    assert model_checks.producer_of(rewritten, reshape.input[1]).input[0] == "x_q"
    assert model_checks.ort_optimized_op_types(rewritten)["QLinearSoftmax"] == 0
    _assert_bit_exact(original, rewritten)


def test_codes_read_elsewhere_stop_the_walk_there():
    original = _model("dfl", "wrapped", shared=True)
    rewritten, _, count = _apply(original)
    assert count == 1
    chain = _chain_to_softmax(rewritten)
    # w0_q (the Reshape's codes) has a second reader: dequantized from there, only the Transpose moves
    assert [node.op_type for node in chain[-5:]] == ["DequantizeLinear", "Flatten", "Reshape", "Transpose", "Softmax"]
    assert chain[-5].input[0] == "w0_q"
    assert model_checks.ort_optimized_op_types(rewritten)["QLinearSoftmax"] == 0
    _assert_bit_exact(original, rewritten)


def test_per_axis_dequantize_is_refused_with_a_reason():
    original = _model("none", "codes", per_axis=True)
    rewritten, report, count = _apply(original)
    assert count == 0 and [r.rule for r in report.refusals] == [RULE_NAME]
    assert "per-axis" in report.refusals[0].reason
    assert model_checks.op_types(rewritten) == model_checks.op_types(original)


def test_an_unquantized_softmax_output_is_left_without_a_refusal():
    original = _model("dfl", "codes", softmax_output=True)
    rewritten, report, count = _apply(original)
    assert count == 0 and not report.refusals and not report.changes
    assert model_checks.op_types(rewritten) == model_checks.op_types(original)


def test_the_rewrite_does_not_match_its_own_output():
    once, _, _ = _apply(_model("dfl", "wrapped"))
    twice, _, count = _apply(once)
    assert count == 0 and model_checks.op_types(twice) == model_checks.op_types(once)


@pytest.mark.parametrize("seed", range(24))
def test_random_chains_stay_bit_exact_and_unfused(seed):
    """Property: over random movement chains, forms, types, opsets and parameters the rewrite is
    bit-exact and ORT runs no QLinearSoftmax."""
    rng = np.random.default_rng(1000 + seed)
    kind = str(rng.choice(sorted(MOVEMENT_OPS)))
    form = str(rng.choice(["wrapped", "codes"]))
    dtype = str(rng.choice(["uint8", "int8"]))
    opset = int(rng.integers(13, 22))
    original = _model(kind, form, dtype, opset=opset, seed=seed, symbolic=bool(rng.random() < 0.3))
    rewritten, report, count = _apply(original)
    assert count == 1 and all(change.exact for change in report.changes)
    softmax = _chain_to_softmax(rewritten)[-1]
    assert model_checks.producer_of(rewritten, softmax.input[0]).op_type != "DequantizeLinear"
    assert model_checks.ort_optimized_op_types(rewritten)["QLinearSoftmax"] == 0
    _assert_bit_exact(original, rewritten)


def _dfl_float_model() -> onnx.ModelProto:
    """FP32 ``Conv(64) -> Reshape [1,4,16,N] -> Transpose -> Softmax(axis=1) -> Conv(16 -> 1, weights 0..15)``:
    YOLOv8's box head on a 4x4 map."""
    rng = np.random.default_rng(0)
    anchors = 16
    constants = [
        numpy_helper.from_array((rng.standard_normal((64, 8, 1, 1)) * 0.5).astype(np.float32), "w_box"),
        numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "b_box"),
        numpy_helper.from_array(np.array([1, 64, anchors], np.int64), "flat_shape"),
        numpy_helper.from_array(np.array([1, 4, 16, anchors], np.int64), "dfl_shape"),
        numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(1, 16, 1, 1), "w_dfl"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w_box", "b_box"], ["box"]),
        helper.make_node("Reshape", ["box", "flat_shape"], ["flat"]),
        helper.make_node("Reshape", ["flat", "dfl_shape"], ["boxes"]),
        helper.make_node("Transpose", ["boxes"], ["bins"], perm=[0, 2, 1, 3]),
        helper.make_node("Softmax", ["bins"], ["probs"], axis=1),
        helper.make_node("Conv", ["probs", "w_dfl"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "dfl", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, anchors])], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _ort_graph(model: onnx.ModelProto) -> onnx.GraphProto:
    """The graph ORT CPU runs (ORT_ENABLE_ALL, one thread), structure only."""
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from kenosis_rewrite.core import ort_sessions  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        ort_sessions.session(model, ort_sessions.options(1, optimized_path=path))
        return onnx.load(path, load_external_data=False).graph


def _float_feeds(count: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 8, 4, 4)).astype(np.float32)} for _ in range(count)]


def test_fix_and_quantize_run_the_dfl_softmax_float_between_integer_convs():
    from kenosis_rewrite import fix, quantize  # noqa: PLC0415
    from kenosis_rewrite.core import ort_quantize
    from kenosis_rewrite.diagnosis.explain import explain  # noqa: PLC0415
    from kenosis_rewrite.placement.pipeline import FixPass  # noqa: PLC0415

    float_model = _dfl_float_model()
    qdq = ort_quantize.quantize_with_ort(float_model, _float_feeds(4), "u8s8")
    assert model_checks.ort_optimized_op_types(qdq)["QLinearSoftmax"] == 1
    fixed, report = fix(qdq, return_report=True, verify=False)
    assert [c.exact for c in report.changes if c.rule == RULE_NAME] == [True]
    ran = model_checks.ort_optimized_op_types(fixed)
    assert ran["QLinearSoftmax"] == 0 and ran["Softmax"] == 1 and ran["QLinearConv"] == 2  # both Convs integer
    # the Transpose, replayed after the barrier, is still one ORT's transpose optimizer moves past the
    # Softmax: the Softmax runs over axis 2 of [1,4,16,N] (fast), not over axis 1 of [1,16,4,N]
    ran_nodes = list(_ort_graph(fixed).node)
    at = next(index for index, node in enumerate(ran_nodes) if node.op_type == "Softmax")
    assert helper.get_attribute_value(ran_nodes[at].attribute[0]) == 2
    assert [node.op_type for node in ran_nodes[at - 3:at + 3]] == [
        "Flatten", "Reshape", "Reshape", "Softmax", "QuantizeLinear", "Transpose"]
    # the rule changes no value: fix() with it equals fix() without it, bit for bit, in the graph
    model = ir.serde.deserialize_model(qdq)
    FixPass("ort-cpu", disabled=(RULE_NAME,))(model)
    without = ir.serde.serialize_model(model)
    assert model_checks.ort_optimized_op_types(without)["QLinearSoftmax"] == 1
    islands = [island for island in explain(fixed).float_islands if "Softmax" in island.op_types]
    assert len(islands) == 1 and "QLinearSoftmax" in islands[0].reason and islands[0].fixing_rule is None
    for feed in _float_feeds(3, seed=1):
        for got, want in zip(model_checks.outputs(fixed, feed, optimized=False), model_checks.outputs(without, feed, optimized=False)):
            np.testing.assert_array_equal(got, want)
    quantized = quantize(float_model, _float_feeds(4))
    ran = model_checks.ort_optimized_op_types(quantized)  # (quantize() keeps the output Conv float: protection)
    assert ran["QLinearSoftmax"] == 0 and ran["Softmax"] == 1 and ran["QLinearConv"] >= 1

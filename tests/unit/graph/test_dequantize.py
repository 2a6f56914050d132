"""Tests of returning layers (or the whole model) to float."""

from __future__ import annotations

import onnx
import onnx_ir as ir

import kenosis_rewrite
from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.graph.dequantize import DequantizeAllPass, FloatRegionsPass
from kenosis_rewrite.testing import model_checks, toy_models


def _fixed(name, config="u8s8"):
    float_model = toy_models.build(name)
    feeds = toy_models.random_feeds(float_model, 6)
    return float_model, feeds, kenosis_rewrite.fix(ort_quantize.quantize_with_ort(float_model, feeds, config))


def _run(proto, pass_):
    model = ir.serde.deserialize_model(proto)
    pass_(model)
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out, full_check=True)
    return out


def test_dequantize_all_gives_the_float_model_the_qdq_model_describes():
    float_model, feeds, fixed = _fixed("resnetish")
    dequantized = _run(fixed, DequantizeAllPass())
    types = model_checks.op_types(dequantized)
    assert types["QuantizeLinear"] == 0 and types["DequantizeLinear"] == 0
    assert not any(t.data_type == onnx.TensorProto.INT8 for t in dequantized.graph.initializer)
    scores = fidelity.compare_to_float(float_model, {"qdq": fixed, "float": dequantized}, feeds)
    # Only the int8 weight rounding is left (it dominates here); the removed Relus came back as Clips.
    assert scores["float"]["sqnr_db"] >= scores["qdq"]["sqnr_db"] - 0.5 and scores["float"]["sqnr_db"] > 35
    assert model_checks.op_types(dequantized)["Clip"] >= 1
    assert model_checks.ort_optimized_op_types(dequantized)["QLinearConv"] == 0


def test_float_region_runs_float_and_drops_only_the_pairs_around_float_neighbours():
    float_model, feeds, fixed = _fixed("conv_hardswish")
    convs = [n.name for n in fixed.graph.node if n.op_type == "Conv"]
    report = FixReport()
    out = _run(fixed, FloatRegionsPass([convs[0]], report))
    assert [c.rule for c in report.changes] == ["return-to-float"]
    # the pair before the HardSwish, and the graph input's (a float tensor: its Q only served the Conv)
    assert "2 Q/DQ pair(s) removed" in report.changes[0].detail
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == out.graph.input[0].name for n in out.graph.node)
    report_after = kenosis_rewrite.explain(out)
    kernels = {op.name: op.kernel for op in report_after.ops}
    assert kernels[convs[0]] == "float" and kernels[convs[1]] == "integer"
    first = next(n for n in out.graph.node if n.name == convs[0])
    assert model_checks.producer_of(out, first.input[1]) is None  # float weight initializer
    scores = fidelity.compare_to_float(float_model, {"qdq": fixed, "region": out}, feeds)
    assert scores["region"]["sqnr_db"] >= scores["qdq"]["sqnr_db"]


def test_pairs_feeding_integer_kernels_stay():
    float_model, feeds, fixed = _fixed("resnetish")
    first_conv = next(n.name for n in fixed.graph.node if n.op_type == "Conv")
    report = FixReport()
    out = _run(fixed, FloatRegionsPass([first_conv], report))
    # its output feeds an integer-capable MaxPool: that pair stays; the graph input's pair goes
    assert "1 Q/DQ pair(s) removed" in report.changes[0].detail
    first = next(n for n in out.graph.node if n.name == first_conv)
    assert first.input[0] == out.graph.input[0].name
    held_out = toy_models.random_feeds(float_model, 30)[6:]
    scores = fidelity.compare_to_float(float_model, {"qdq": fixed, "region": out}, held_out)
    assert scores["region"]["sqnr_db"] >= scores["qdq"]["sqnr_db"] - 0.5  # one rounding fewer: no loss on average


def _conv_hardsigmoid_qdq() -> onnx.ModelProto:
    """x -> Q/DQ -> Conv -> Q/DQ (zp 0: a Relu folded away) -> HardSigmoid -> Q/DQ (zp 0) -> y."""
    import numpy as np  # noqa: PLC0415
    from onnx import TensorProto, helper, numpy_helper  # noqa: PLC0415

    rng = np.random.default_rng(0)
    weight = rng.integers(-127, 128, size=(4, 3, 3, 3), dtype=np.int8)
    inits = [
        numpy_helper.from_array(weight, "w_q"), numpy_helper.from_array(np.float32(0.01), "w_s"),
        numpy_helper.from_array(np.int8(0), "w_z"),
        numpy_helper.from_array(np.float32(4 / 255), "a_s"), numpy_helper.from_array(np.uint8(0), "a_z"),
        numpy_helper.from_array(np.float32(1 / 255), "h_s"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "a_s", "a_z"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "a_s", "a_z"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"]),
        helper.make_node("Conv", ["x_dq", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["c", "a_s", "a_z"], ["c_q"]),
        helper.make_node("DequantizeLinear", ["c_q", "a_s", "a_z"], ["c_dq"]),
        helper.make_node("HardSigmoid", ["c_dq"], ["h"], name="hardsigmoid"),
        helper.make_node("QuantizeLinear", ["h", "h_s", "a_z"], ["h_q"]),
        helper.make_node("DequantizeLinear", ["h_q", "h_s", "a_z"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_clamps_come_back_only_where_a_negative_value_could_pass():
    import numpy as np  # noqa: PLC0415

    qdq = _conv_hardsigmoid_qdq()
    out = _run(qdq, DequantizeAllPass())
    clipped = {node.input[0] for node in out.graph.node if node.op_type == "Clip"}
    # the Conv's Q (zp = qmin) may stand for a removed Relu, and the graph input may be negative;
    # the HardSigmoid's output is never negative: its Q clamped nothing but the calibrated top
    assert clipped == {"x", "c"}
    feed = {"x": np.random.default_rng(1).uniform(-1, 4, size=(1, 3, 8, 8)).astype(np.float32)}
    # what the graphs compute (no host-dependent integer kernel): only the removed roundings differ
    def run(m):
        return model_checks.outputs(m, feed, optimized=False)[0]

    np.testing.assert_allclose(run(out), run(qdq), atol=3 / 255)


def test_a_float_layer_between_integer_layers_is_not_requantized_by_ort():
    """ORT quantizes the float weight of a Conv fed by a DequantizeLinear (WeightBiasQuantization)
    and fuses it again: a layer returned to float must not be fed by a DQ."""
    float_model, feeds, fixed = _fixed("resnetish")
    convs = [n.name for n in fixed.graph.node if n.op_type == "Conv"]
    for name in convs[1:3]:  # layers in the middle, integer neighbours on both sides
        report = FixReport()
        out = _run(fixed, FloatRegionsPass([name], report))
        kernels = {op.name: op.kernel for op in kenosis_rewrite.explain(out).ops}
        node = next(n for n in out.graph.node if n.name == name)
        fed_by_dq = model_checks.producer_of(out, node.input[0])
        if report.changes:  # it claims float: ORT must really run it float, on our weights
            assert kernels[name] == "float", (name, report.summary())
            assert fed_by_dq is None or fed_by_dq.op_type != "DequantizeLinear"
        else:  # refused with the reason, and left exactly as it was
            assert "stays integer" in report.refusals[0].reason and kernels[name] == "integer"
        assert all(kernels[c] == "integer" for c in convs if c != name)
        held_out = toy_models.random_feeds(float_model, 30)[6:]
        scores = fidelity.compare_to_float(float_model, {"qdq": fixed, "region": out}, held_out)
        assert scores["region"]["sqnr_db"] >= scores["qdq"]["sqnr_db"] - 0.5

"""Tests of measuring each symmetric int8 conversion's cost, and leaving the costly ones float."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

import kenosis_rewrite
from kenosis_rewrite.core import fidelity, ort_quantize
from kenosis_rewrite.placement.passes import symmetric_cost, symmetric_int8
from kenosis_rewrite.testing import model_checks, toy_models

SEQ, HIDDEN = 197, 64


def _attention_block(seed: int = 1) -> onnx.ModelProto:
    """x[1, 197, 64] -> Q/K/V MatMul + bias -> scores / sqrt(d) -> Softmax -> P V -> output projection:
    one head over 197 keys, whose probabilities sit near 1/197."""
    rng = np.random.default_rng(seed)
    make, nodes, inits = helper.make_node, [], []
    for name in ("q", "k", "v", "o"):
        inits += [numpy_helper.from_array((rng.standard_normal((HIDDEN, HIDDEN)) / 8).astype(np.float32), f"{name}.w"),
                  numpy_helper.from_array((0.02 * rng.standard_normal(HIDDEN)).astype(np.float32), f"{name}.b")]
    inits.append(numpy_helper.from_array(np.array(1 / 8, np.float32), "scale"))

    def linear(x: str, name: str) -> str:
        nodes.extend([make("MatMul", [x, f"{name}.w"], [f"{name}_mm"]), make("Add", [f"{name}_mm", f"{name}.b"], [name])])
        return name

    q, k, v = (linear("x", n) for n in "qkv")
    nodes += [make("Transpose", [k], ["kt"], perm=[0, 2, 1]), make("MatMul", [q, "kt"], ["scores"]),
              make("Mul", ["scores", "scale"], ["scaled"]), make("Softmax", ["scaled"], ["probs"], axis=-1, name="softmax"),
              make("MatMul", ["probs", v], ["context"])]
    nodes.append(make("Identity", [linear("context", "o")], ["y"]))
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("x", 1, [1, SEQ, HIDDEN])],
                              [helper.make_tensor_value_info("y", 1, [1, SEQ, HIDDEN])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def attention():
    float_model = _attention_block()
    rng = np.random.default_rng(11)
    feeds = [{"x": rng.standard_normal((1, SEQ, HIDDEN)).astype(np.float32)} for _ in range(16)]
    return float_model, feeds, ort_quantize.quantize_with_ort(float_model, feeds[:8], "default")


def _probability_readers(model: onnx.ModelProto) -> list[str]:
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    return [n.op_type for n in model.graph.node if softmax.output[0] in n.input]


@pytest.mark.parametrize("target", ["tensorrt", "npu"])
def test_costly_probabilities_stay_float_and_the_rest_becomes_symmetric(attention, target):
    float_model, feeds, qdq = attention
    assert _probability_readers(qdq) == ["QuantizeLinear"]
    fixed, report = kenosis_rewrite.fix(qdq, target=target, calibration=feeds[:8], return_report=True)
    blind = kenosis_rewrite.fix(qdq, target=target)  # no feeds: every tensor converted, as before
    # node by node: the Softmax output reaches the MatMul in float; every quantizer left is int8, zero point 0
    assert _probability_readers(fixed) == ["MatMul"] and _probability_readers(blind) == ["QuantizeLinear"]
    float_kept = [c for c in report.changes if "left float" in c.detail]
    assert len(float_kept) == 1 and "cost" in float_kept[0].detail and "FP16" in float_kept[0].detail
    quantizers = [n for n in fixed.graph.node if n.op_type == "QuantizeLinear"]
    assert len(quantizers) >= 8
    for node in quantizers:
        zero_point = model_checks.initializer(fixed, node.input[2])
        assert zero_point.dtype == np.int8 and not zero_point.any()
    scores = fidelity.compare_to_float(float_model, {"input": qdq, "fixed": fixed, "blind": blind}, feeds[8:],
                                       optimized=False)
    # the whole model within 0.005 of the input's cosine against FP32; converting everything was not
    assert scores["fixed"]["cosine"] >= scores["input"]["cosine"] - 0.005
    assert scores["blind"]["cosine"] < scores["input"]["cosine"] - 0.005


def test_measured_cost_ranks_the_probabilities_first_and_tracks_the_fall_against_fp32(attention):
    float_model, feeds, qdq = attention
    model = ir.serde.deserialize_model(qdq)
    convert = symmetric_int8.SymmetricActivationsPass(None, ())
    kept = symmetric_cost.costly_conversions(model, convert, feeds[:8])
    (index,) = kept
    node = list(model.graph)[index]
    assert node.inputs[0].producer().op_type == "Softmax" and "alone cost" in kept[index]
    # the measured cost against the fall of the cosine against FP32 with that one tensor converted
    alone = ir.serde.deserialize_model(qdq)
    symmetric_int8.SymmetricActivationsPass(None, (), only=frozenset({index}))(alone)
    scores = fidelity.compare_to_float(float_model, {"input": qdq, "alone": ir.serde.serialize_model(alone)}, feeds[8:],
                                       optimized=False)
    fall = scores["input"]["cosine"] - scores["alone"]["cosine"]
    measured = float(kept[index].split("alone cost ")[1].split()[0])
    assert fall > symmetric_cost.MAX_COST and fall <= measured * 1.2  # the perturbation reads high, not low


def test_cheap_conversions_measure_once_and_keep_nothing_float():
    float_model = toy_models.build("conv_relu")
    feeds = toy_models.random_feeds(float_model, 6)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds[:3], "u8s8")
    model = ir.serde.deserialize_model(qdq)
    assert symmetric_cost.costly_conversions(model, symmetric_int8.SymmetricActivationsPass(None, ()), feeds) == {}
    fixed, report = kenosis_rewrite.fix(qdq, target="tensorrt", calibration=feeds, return_report=True)
    assert not [c for c in report.changes if "left float" in c.detail]


def test_a_model_the_feeds_do_not_fit_is_converted_whole_with_a_note():
    float_model = toy_models.build("conv_relu")
    feeds = toy_models.random_feeds(float_model, 3)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds, "u8s8")
    model = ir.serde.deserialize_model(qdq)
    report = kenosis_rewrite.core.report.FixReport()
    wrong = [{"x": np.zeros((1, 1), np.float32)}]
    assert symmetric_cost.costly_conversions(model, symmetric_int8.SymmetricActivationsPass(report, ()), wrong) == {}
    assert any("could not be measured" in note for note in report.notes)

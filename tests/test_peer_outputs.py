"""fix() on small models quantized by the peers (NNCF, Quark presets, INC), committed as fixtures
(tests/fixtures/README.md says how each was made): accepted, faster kernels, the peer's fidelity kept."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import pytest

from kenosis_rewrite import explain, fix
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.errors import KenosisError
from kenosis_rewrite.testing import model_checks

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
PEER_OUTPUTS = sorted(p.name for p in FIXTURES.glob("*.onnx") if not p.name.endswith(("_fp32.onnx", "_fp16.onnx")))
FP16_OUTPUTS = sorted(p.name for p in FIXTURES.glob("*_fp16.onnx"))


def _feeds(seed: int, n: int = 6) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(n)]


def test_every_peer_and_preset_is_covered():
    made_by = {name.split("_", 1)[1].removesuffix(".onnx") for name in PEER_OUTPUTS}
    assert made_by == {"nncf3.4", "inc3.7", "quark0.13_xint8", "quark0.13_cnn", "modelopt0.47"}


def _quantized_weight_mac_fraction(model: onnx.ModelProto) -> float:
    """Share of Conv/MatMul/Gemm MACs whose weight the quantizer put behind a DequantizeLinear
    (ModelOpt leaves small and depthwise convs float: no rewrite can make those integer)."""
    producers = {out: node for node in model.graph.node for out in node.output}
    nodes = {node.name: node for node in model.graph.node}
    ops = explain(model).ops
    quantized = sum(op.macs for op in ops if (w := producers.get(nodes[op.name].input[1])) is not None
                    and w.op_type == "DequantizeLinear")
    return quantized / sum(op.macs for op in ops)


@pytest.mark.parametrize("name", PEER_OUTPUTS)
def test_fix_accepts_the_peer_output_runs_it_in_integer_kernels_and_keeps_its_fidelity(name):
    peer = onnx.load(FIXTURES / name)
    float_model = onnx.load(FIXTURES / f"{name.split('_', 1)[0]}_fp32.onnx")
    calibration, held_out = _feeds(1), _feeds(2)
    fixed, report = fix(peer, calibration=calibration, return_report=True)
    onnx.checker.check_model(fixed, full_check=True)
    assert [o.name for o in fixed.graph.output] == [o.name for o in peer.graph.output]
    scores = fidelity.compare_to_float(float_model, {"peer": peer, "fixed": fixed}, held_out)
    assert scores["fixed"]["cosine"] >= scores["peer"]["cosine"] - 0.002, report.summary()
    # every Conv/MatMul/Gemm MAC with a quantized weight runs in an integer kernel after fix(),
    # whatever placement the peer chose (all of them but ModelOpt's small/depthwise convs)
    quantized = _quantized_weight_mac_fraction(peer)
    assert explain(fixed).integer_mac_fraction == pytest.approx(quantized), report.summary()
    kernels = model_checks.ort_optimized_op_types(fixed)
    assert kernels["QLinearConv"] >= 2, kernels
    if quantized == 1.0:
        assert kernels["Conv"] == 0 and kernels["QLinearConv"] >= 4, kernels


def test_quark_xint8_is_unsorted_and_keeps_every_conv_float_until_fix():
    """XINT8 (Quark's NPU preset): graph not in topological order (the checker refuses it), int8
    biases with their own power-of-two scales, Conv -> Clip -> Q(zero point 128): ORT runs no Conv
    in integer; fix() sorts, makes the biases int32 and applies each Clip to the Q's codes (exact)."""
    peer = onnx.load(FIXTURES / "mbv2ish_quark0.13_xint8.onnx")
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(peer)
    assert model_checks.ort_optimized_op_types(peer)["QLinearConv"] == 0
    # explain() names the blockers and the rules that lift them (an int8 bias first where there is no Clip)
    reasons = {(op.reason, op.fixing_rule) for op in explain(peer).ops}
    assert ("bias not int32", "requantize-stale-bias") in reasons and not any(r.startswith("unknown") for r, _ in reasons)
    fixed, report = fix(peer, calibration=_feeds(1), return_report=True)
    counts = report.change_counts()
    assert counts["requantize-stale-bias"] == 7 and counts["clip-on-codes"] == 4
    assert any("topological order" in note for note in report.notes)
    assert model_checks.ort_optimized_op_types(fixed)["QLinearConv"] == 6


def test_nncf_sppf_and_neck_run_integer_after_fix_without_requantizing_the_unified_concats():
    """NNCF 3.4 on a YOLOv8 SPPF + neck (tests/fixtures/makers/make_sppfish.py): the SPPF's MaxPools and
    Concat stay float and NNCF gives each Concat's inputs one scale. fix() moves the DQs past the
    MaxPools and the Concats (exact) and leaves the neck's Resize unaligned so its Concat keeps the
    shared scale: every Conv integer, no new quantizer at any Concat."""
    peer = onnx.load(FIXTURES / "sppfish_nncf3.4.onnx")
    assert model_checks.ort_optimized_op_types(peer)["QLinearConv"] == 0
    fixed, report = fix(peer, calibration=_feeds(1), return_report=True)
    counts = report.change_counts()
    assert counts["move-dq-forward"] >= 5, report.summary()  # three MaxPools and two Concats
    assert any(r.rule == "align-pass-through-qparams" and "unified" in r.reason for r in report.refusals)
    kernels = model_checks.ort_optimized_op_types(fixed)
    assert kernels["QLinearConv"] == 5 and kernels["Conv"] == 0 and kernels["QLinearConcat"] == 0, kernels


def test_nncf_paddle_lcnet_layers_run_integer_after_fix_without_calibration():
    """NNCF 3.4 on PP-LCNetV3-style layers as Paddle2ONNX writes them (tests/fixtures/makers/make_lcnetish.py):
    each Conv is followed by a float Add(bias) -> Mul -> Add chain, so ORT runs every Conv in float.
    fix() folds each chain into its Conv (fold-affine-into-conv) and gives the Conv the quantizer its
    HardSwish -> Mul -> Add -> Q bounds (quantize-weighted-outputs), without any calibration feeds:
    every Conv but the head (a Relu then the graph output: nothing bounds it) runs as QLinearConv, and
    the head, in float, on float weights (float-weights-for-float-kernels: ORT's NCHWc Conv, Relu fused)."""
    peer = onnx.load(FIXTURES / "lcnetish_nncf3.4.onnx")
    float_model = onnx.load(FIXTURES / "lcnetish_fp32.onnx")
    assert model_checks.ort_optimized_op_types(peer)["QLinearConv"] == 0
    fixed, report = fix(peer, return_report=True)
    counts = report.change_counts()
    assert counts["fold-affine-into-conv"] == 15 and counts["quantize-weighted-outputs"] == 5, report.summary()
    assert counts["float-weights-for-float-kernels"] == 1, report.summary()
    kernels = model_checks.ort_optimized_op_types(fixed)
    assert kernels["QLinearConv"] == 5 and kernels["Conv"] == 1 and kernels["ReorderInput"] == 1, kernels
    assert "Relu" not in kernels  # fused into the head's float Conv
    scores = fidelity.compare_to_float(float_model, {"peer": peer, "fixed": fixed}, _feeds(2))
    assert scores["fixed"]["cosine"] >= scores["peer"]["cosine"] - 0.002, scores


@pytest.mark.parametrize("name", FP16_OUTPUTS)
def test_modelopt_fp16_outputs_are_accepted_and_still_run_with_their_fidelity(name):
    """ModelOpt's default writes the whole float graph in fp16: ORT CPU has no fp16 integer kernels,
    so fix() gains nothing there, but it must return a valid model that runs as faithfully."""
    peer = onnx.load(FIXTURES / name)
    float_model = onnx.load(FIXTURES / f"{name.split('_', 1)[0]}_fp32.onnx")
    fixed = fix(peer, calibration=_feeds(1))
    onnx.checker.check_model(fixed, full_check=True)
    scores = fidelity.compare_to_float(float_model, {"peer": peer, "fixed": fixed}, _feeds(2))
    assert scores["fixed"]["cosine"] >= scores["peer"]["cosine"] - 0.002


@pytest.mark.parametrize("toy", ["mbv2ish", "c2fish"])
def test_fix_corrects_nncf_float_biases_against_the_fp32_model_on_request(toy):
    """NNCF keeps biases in float: fix(bias_correction=True) subtracts each layer's measured mean shift
    from them (opt-in; needs the FP32 model and calibration feeds)."""
    quantized = onnx.load(FIXTURES / f"{toy}_nncf3.4.onnx")
    float_model = onnx.load(FIXTURES / f"{toy}_fp32.onnx")
    calibration, held_out = _feeds(11, 8), _feeds(12, 8)
    plain = fix(quantized, float_model=float_model, calibration=calibration)
    corrected, report = fix(quantized, float_model=float_model, calibration=calibration,
                                            bias_correction=True, return_report=True)
    changes = [c for c in report.changes if c.rule == "bias-correction"]
    assert changes and all("float bias" in c.detail for c in changes)
    onnx.checker.check_model(corrected, full_check=True)
    plain_nodes = [(n.op_type, list(n.input)) for n in plain.graph.node]
    assert [(n.op_type, list(n.input)) for n in corrected.graph.node] == plain_nodes  # only bias values move
    scores = fidelity.compare_to_float(float_model, {"plain": plain, "corrected": corrected}, held_out)
    assert scores["corrected"]["cosine"] >= scores["plain"]["cosine"] - 1e-4
    with pytest.raises(KenosisError, match="bias_correction=True needs float_model="):
        fix(quantized, bias_correction=True)

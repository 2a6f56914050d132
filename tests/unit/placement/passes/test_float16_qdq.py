"""fix() of QDQ models with float16 scales: made float32 inside, float16 at the boundary, then fused.

Node by node (scales float32 and equal to the input's float16 ones, the interface unchanged, every
heavy op an integer kernel in ORT's optimized graph) and numerically (against the input with ORT:
float16 outputs, cosine within fix()'s budget). Every target runs such a model to a valid result.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, numpy_helper

import kenosis_rewrite
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.ort_quantize import quantize_with_ort
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.placement.passes.float16_qdq import RULE_NAME, Float16QDQToFloat32Pass
from kenosis_rewrite.testing import toy_models
from kenosis_rewrite.testing.float16_models import FLOAT16_QDQ_OPSET, float16_feeds, float16_model
from kenosis_rewrite.testing.model_checks import apply_pass

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


@pytest.fixture(scope="module")
def qdq16() -> onnx.ModelProto:
    """quantize_static's per-channel ResNet-style toy, then every float tensor and scale float16 (opset 19)."""
    fp32 = toy_models.build("resnetish")
    return float16_model(quantize_with_ort(fp32, toy_models.random_feeds(fp32, 8), per_channel=True),
                         opset=FLOAT16_QDQ_OPSET)


def _feeds(n: int = 4, seed: int = 11) -> list[dict[str, np.ndarray]]:
    return float16_feeds(toy_models.random_feeds(toy_models.build("resnetish"), n, seed=seed))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _scales(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Each Q/DQ node's scale, by node name."""
    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return {n.name: constants[n.input[1]] for n in model.graph.node if n.op_type in QDQ_OPS}


def test_pass_makes_scales_float32_exactly_and_keeps_the_interface(qdq16):
    out, report = apply_pass(qdq16, Float16QDQToFloat32Pass)
    assert [(c.rule, c.exact) for c in report.changes] == [(RULE_NAME, False)]
    assert "keep float16" in report.changes[0].detail
    before, after = _scales(qdq16), _scales(out)
    assert before.keys() == after.keys() and len(before) > 20
    for name, scale in after.items():
        assert scale.dtype == np.float32 and before[name].dtype == np.float16
        assert np.array_equal(scale, before[name].astype(np.float32))
    assert [(v.name, v.type) for v in out.graph.input] == [(v.name, v.type) for v in qdq16.graph.input]
    assert [(v.name, v.type.tensor_type.elem_type) for v in out.graph.output] == [
        (v.name, v.type.tensor_type.elem_type) for v in qdq16.graph.output]
    assert [n.op_type for n in out.graph.node if n.op_type == "Cast"] == ["Cast", "Cast"]
    for feed in _feeds():
        theirs, ours = (fidelity.session(m, optimized=False).run(None, feed)[0] for m in (qdq16, out))
        assert ours.dtype == np.float16 and _cosine(ours, theirs) >= 0.9999


def test_float32_scales_are_left_alone():
    fp32 = toy_models.build("conv_relu")
    qdq = quantize_with_ort(fp32, toy_models.random_feeds(fp32, 4))
    model = ir.serde.deserialize_model(qdq)
    report = FixReport()
    assert not Float16QDQToFloat32Pass(report)(model).modified and not report.changes
    assert ir.serde.serialize_model(model) == ir.serde.serialize_model(ir.serde.deserialize_model(qdq))


def test_fix_fuses_what_float16_scales_kept_float(qdq16):
    assert kenosis_rewrite.explain(qdq16).integer_mac_fraction == 0.0  # ORT fuses no float16-scale QDQ
    fixed, report = kenosis_rewrite.fix(qdq16, return_report=True)
    onnx.checker.check_model(fixed, full_check=True)
    assert RULE_NAME in {c.rule for c in report.changes}
    assert kenosis_rewrite.explain(fixed).integer_mac_fraction == 1.0
    assert [v.type.tensor_type.elem_type for v in fixed.graph.output] == [TensorProto.FLOAT16]
    for feed in _feeds():
        theirs, ours = (fidelity.session(m).run(None, feed)[0] for m in (qdq16, fixed))
        assert ours.dtype == np.float16 and _cosine(ours, theirs) >= 0.999


@pytest.mark.parametrize("target", ["ort-cpu-arm", "tensorrt", "npu"])
def test_every_target_gives_a_valid_model(qdq16, target):
    fixed, report = kenosis_rewrite.fix(qdq16, target=target, return_report=True)
    onnx.checker.check_model(fixed, full_check=True)
    # each bias requantized once at most: a float16 bias scale compared in float16, not forever
    biased = sum(n.op_type in ("Conv", "Gemm") for n in qdq16.graph.node)
    assert sum(c.rule == "requantize-stale-bias" for c in report.changes) <= biased
    assert (RULE_NAME in {c.rule for c in report.changes}) == target.startswith("ort-cpu")
    for feed in _feeds(2):
        theirs, ours = (fidelity.session(m, optimized=False).run(None, feed)[0] for m in (qdq16, fixed))
        assert ours.dtype == np.float16 and _cosine(ours, theirs) >= 0.99

"""Tests of the Gemm computed-addend split (a residual ORT's MatMulAddFusion put into a Gemm's C)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import kenosis_rewrite
from kenosis_rewrite.canonicalization.rules.gemm_addend import RULE_NAME, gemm_addend_rules
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.testing import model_checks

GEMM = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4,16] x) => (float[4,16] y)
<float[16,16] w = {{{weights}}}, float[16] b = {{{bias}}}>
{{
  h = Gemm(x, w, b)
  r = Relu(h)
  y = Gemm(r, w, {addend}) <alpha = 0.5, transB = 1{beta}>
}}
"""


def _gemm(addend: str = "r", beta: str = "") -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = ", ".join(f"{v:.4f}" for v in rng.normal(0, 0.3, 256))
    bias = ", ".join(f"{v:.4f}" for v in rng.normal(0, 0.1, 16))
    return onnx.parser.parse_model(GEMM.format(weights=weights, bias=bias, addend=addend, beta=beta))


def _feeds(n: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(0, 1, (4, 16)).astype(np.float32)} for _ in range(n)]


def test_a_computed_addend_moves_into_an_add_with_the_gemms_attributes():
    model = _gemm()
    rewritten, report, count = model_checks.apply_reporting_rules(model, gemm_addend_rules)
    assert count == 1 and report.change_counts() == {RULE_NAME: 1}
    gemms = [node for node in rewritten.graph.node if node.op_type == "Gemm"]
    assert [len(node.input) for node in gemms] == [3, 2]  # the bias Gemm keeps its constant C
    split = gemms[1]
    assert {a.name: onnx.helper.get_attribute_value(a) for a in split.attribute} == {"alpha": 0.5, "transB": 1}
    add = next(node for node in rewritten.graph.node if node.op_type == "Add")
    assert list(add.input) == [split.output[0], "r"] and list(add.output) == ["y"]
    for feed in _feeds():
        np.testing.assert_allclose(model_checks.outputs(rewritten, feed, optimized=False)[0],
                                   model_checks.outputs(model, feed, optimized=False)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("addend,beta", [("b", ""), ("r", ", beta = 2.0")])
def test_constant_addends_and_scaled_ones_are_left_alone(addend, beta):
    _, report, count = model_checks.apply_reporting_rules(_gemm(addend, beta), gemm_addend_rules)
    assert count == 0 and not report.changes


def test_quantize_keeps_an_mlp_residual_integer():
    """MatMul -> Add(residual): prepare()'s ORT pass fuses it into Gemm(C = residual), which would run
    float; after the split, every weighted op of the quantized model runs as an integer kernel."""
    rng = np.random.default_rng(2)
    width = 64
    mlp = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[8,{width}] x) => (float[8,{width}] y)
    {{
      h = Relu(x)
      m = MatMul(h, w2)
      r = Add(m, h)
      y = MatMul(r, w3)
    }}
    """)
    for name in ("w2", "w3"):
        mlp.graph.initializer.append(onnx.numpy_helper.from_array(rng.normal(0, 0.1, (width, width)).astype(np.float32), name))
    feeds = [{"x": rng.normal(0, 1, (8, width)).astype(np.float32)} for _ in range(9)]
    quantized, report = kenosis_rewrite.quantize(mlp, feeds[:8], return_report=True)
    assert report.change_counts().get(RULE_NAME) == 1  # the canonical graph was used, its residual split out
    ran = model_checks.ort_optimized_op_types(quantized)
    assert not ran.get("Gemm") and not ran.get("MatMul"), ran  # no float GEMM at run time
    assert model_checks.op_types(quantized)["Add"] == 1
    cosine = fidelity.cosine(model_checks.outputs(mlp, feeds[8])[0], model_checks.outputs(quantized, feeds[8])[0])
    assert cosine > 0.999

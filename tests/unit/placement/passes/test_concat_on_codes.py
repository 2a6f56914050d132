"""Tests of the Concat that runs on the quantized codes where its inputs and readers share one grid."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import kenosis_rewrite
from kenosis_rewrite.placement.passes.concat_on_codes import RULE_NAME, ConcatOnCodesPass
from kenosis_rewrite.testing import model_checks


def _model(out_scale: str = "0.05", out_zero: str = "128", second_scale: str = "0.05", output_reader: bool = False) -> onnx.ModelProto:
    """Two branches quantized on one grid, concatenated, requantized onto ``(out_scale, out_zero)``,
    then a quantized Conv reads it (ORT's QLinearConcat -> QLinearConv)."""
    weights = ", ".join(str(int(v)) for v in np.random.default_rng(0).integers(-90, 90, 4 * 4 * 3 * 3))
    extra = ", float[1, 4, 6, 6] c" if output_reader else ""
    tail = "\n  c = Identity(cat)" if output_reader else ""
    return onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1, 2, 6, 6] a, float[1, 2, 6, 6] b) => (float[1, 4, 6, 6] y{extra})
    <float s = {{0.05}}, uint8 z = {{128}}, float s2 = {{{second_scale}}}, float so = {{{out_scale}}}, uint8 zo = {{{out_zero}}},
     int8[4, 4, 3, 3] wq = {{{weights}}}, float ws = {{0.01}}, int8 wz = {{0}}, float sy = {{0.1}}, uint8 zy = {{128}}>
    {{
      qa = QuantizeLinear(a, s, z)
      da = DequantizeLinear(qa, s, z)
      qb = QuantizeLinear(b, s2, z)
      db = DequantizeLinear(qb, s2, z)
      cat = Concat <axis = 1> (da, db)
      qc = QuantizeLinear(cat, so, zo)
      dc = DequantizeLinear(qc, so, zo)
      w = DequantizeLinear(wq, ws, wz)
      conv = Conv <pads = [1, 1, 1, 1]> (dc, w)
      qy = QuantizeLinear(conv, sy, zy)
      y = DequantizeLinear(qy, sy, zy){tail}
    }}""")


def _feeds(n: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"a": rng.normal(0, 2, (1, 2, 6, 6)).astype(np.float32), "b": rng.normal(0, 9, (1, 2, 6, 6)).astype(np.float32)}
            for _ in range(n)]


def test_a_concat_on_one_grid_runs_on_the_codes_bit_for_bit():
    proto = _model()
    fixed, report = model_checks.apply_pass(proto, ConcatOnCodesPass)
    assert report.change_counts() == {RULE_NAME: 1} and all(c.exact for c in report.changes)
    concat = next(n for n in fixed.graph.node if n.op_type == "Concat")
    assert list(concat.input) == ["qa", "qb"]  # the codes, no DQ before and no Q after
    # typed as the codes are (onnx_ir drops, with a warning, a shape that has no type)
    assert [v.type.tensor_type.elem_type for v in fixed.graph.value_info if v.name == concat.output[0]] == [onnx.TensorProto.UINT8]
    assert model_checks.op_types(fixed)["QuantizeLinear"] == 3  # qa, qb, qy: the Q after the Concat is gone
    for feed in _feeds():  # inputs far beyond the grid included: the clamps are the Qs' own
        for optimized in (False, True):
            np.testing.assert_array_equal(model_checks.outputs(fixed, feed, optimized=optimized)[0],
                                          model_checks.outputs(proto, feed, optimized=optimized)[0])
    # ORT no longer runs a requantizing QLinearConcat; the Conv stays integer
    ops = model_checks.op_types(model_checks.ort_optimized(fixed))
    assert "QLinearConcat" not in ops and "QLinearConv" in ops
    assert "QLinearConcat" in model_checks.op_types(model_checks.ort_optimized(proto))


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"second_scale": "0.06"}, "inputs on two grids"),
    ({"out_scale": "0.06"}, "the output requantized onto another grid"),
    ({"out_zero": "127"}, "another zero point after the Concat"),
    ({"output_reader": True}, "the Concat output is read by something other than its Q"),
])
def test_left_alone_where_the_concat_is_a_real_requantization(kwargs, why):
    proto = _model(**kwargs)
    fixed, report = model_checks.apply_pass(proto, ConcatOnCodesPass)
    assert RULE_NAME not in report.change_counts(), why
    assert model_checks.op_types(fixed) == model_checks.op_types(proto)


def test_fix_on_ort_cpu_applies_it():
    fixed, report = kenosis_rewrite.fix(_model(), return_report=True)
    assert report.change_counts().get(RULE_NAME) == 1, report.summary()
    for feed in _feeds():
        np.testing.assert_array_equal(model_checks.outputs(fixed, feed)[0], model_checks.outputs(_model(), feed)[0])


def test_the_fuzz_unified_grids_config_feeds_it_and_fix_stays_bit_exact():
    """The property fuzz's ``unified_concat_grids`` (NNCF/Quark-style one grid per Concat) makes the
    pattern; fix() without its guard rewrites it and claims exactness, which the outputs bear out."""
    from kenosis_rewrite.testing import (
        fuzz_configs,  # noqa: PLC0415
        toy_models,
    )

    float_model = toy_models.build("concat", seed=2)
    feeds = toy_models.random_feeds(float_model, 4, seed=3)
    config = {**fuzz_configs.plain_quant_config(), "unified_concat_grids": True}
    qdq, why = fuzz_configs.quantize_or_skip(float_model, config, feeds)
    assert qdq is not None, why
    fixed, report = kenosis_rewrite.fix(qdq, return_report=True, verify=False)
    assert report.change_counts().get(RULE_NAME) == 1, report.summary()
    assert all(c.exact for c in report.changes)
    for feed in feeds:
        np.testing.assert_array_equal(model_checks.outputs(fixed, feed, optimized=False)[0],
                                      model_checks.outputs(qdq, feed, optimized=False)[0])

"""fix() of quantize_static(per_channel=True) below opset 13: converted to opset 13, checked, then fixed."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import kenosis_rewrite
from kenosis_rewrite.core import fidelity, model_io
from kenosis_rewrite.core.ort_quantize import quantize_with_ort
from kenosis_rewrite.errors import InvalidModelError
from kenosis_rewrite.placement import opset_upgrade
from kenosis_rewrite.testing.model_checks import op_types
from kenosis_rewrite.testing.toy_models import ToyBuilder, random_feeds


def _float_model(opset: int) -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Softmax over channels: Softmax changed meaning at opset 13, so the
    converter must rewrite it, and the check must see the same outputs."""
    b = ToyBuilder(seed=3)
    x = b.node("Relu", [b.conv("x", 3, 8)])
    y = b.conv(x, 8, 4)
    return b.model({"x": [1, 3, 12, 12]}, b.node("Softmax", [y], axis=1), opset=opset)


@pytest.mark.parametrize("opset", [10, 11, 12])
def test_per_channel_qdq_below_opset_13_is_upgraded_then_fixed(opset):
    float_model = _float_model(opset)
    feeds = random_feeds(float_model, 6, seed=1)
    qdq = quantize_with_ort(float_model, feeds[:4], "u8s8_pc")
    with pytest.raises(InvalidModelError, match="axis"):
        model_io.load(qdq)  # as written, the checker refuses it (and so does onnxruntime)

    fixed, report = kenosis_rewrite.fix(qdq, return_report=True)

    onnx.checker.check_model(fixed, full_check=True)
    assert [(o.domain, o.version) for o in fixed.opset_import if o.domain == ""] == [("", 13)]
    assert any(note.startswith(f"opset {opset} -> 13") for note in report.notes)
    assert op_types(fixed)["DequantizeLinear"] > 0 and any(
        a.name == "axis" for node in fixed.graph.node if node.op_type == "DequantizeLinear" for a in node.attribute)
    reference, ours = fidelity.run(float_model, feeds[4:]), fidelity.run(fixed, feeds[4:])
    assert [o.shape for o in ours[0]] == [o.shape for o in reference[0]]
    converted = onnx.version_converter.convert_version(qdq, 13)
    as_given = fidelity.scores(reference, fidelity.run(converted, feeds[4:]))["cosine"]
    assert fidelity.scores(reference, ours)["cosine"] >= as_given - 0.005  # the guard's bound
    # the same as fixing the model converted by hand
    by_hand = kenosis_rewrite.fix(converted)
    for a, b in zip(fidelity.run(by_hand, feeds[4:]), ours):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_the_caller_model_is_not_modified():
    qdq = quantize_with_ort(_float_model(11), random_feeds(_float_model(11), 4), "u8s8_pc")
    before = qdq.SerializeToString()
    kenosis_rewrite.fix(qdq)
    assert qdq.SerializeToString() == before


def test_a_conversion_that_fails_keeps_the_original_error(monkeypatch):
    qdq = quantize_with_ort(_float_model(11), random_feeds(_float_model(11), 4), "u8s8_pc")

    def broken(model, version):
        raise RuntimeError("no adapter")

    monkeypatch.setattr(onnx.version_converter, "convert_version", broken)
    with pytest.raises(InvalidModelError, match=r"axis.*converting it to opset 13 failed too: RuntimeError: no adapter"):
        kenosis_rewrite.fix(qdq)


def test_a_conversion_that_changes_the_float_outputs_is_refused(monkeypatch):
    qdq = quantize_with_ort(_float_model(11), random_feeds(_float_model(11), 4), "u8s8_pc")
    real = onnx.version_converter.convert_version

    def changing(model, version):
        converted = real(model, version)
        softmax = next(node for node in converted.graph.node if node.op_type == "Softmax")
        for attribute in softmax.attribute:
            if attribute.name == "axis":
                attribute.i = 0  # another axis: other values
        return converted

    monkeypatch.setattr(onnx.version_converter, "convert_version", changing)
    with pytest.raises(InvalidModelError, match="changed the float outputs"):
        kenosis_rewrite.fix(qdq)


def test_other_checker_failures_are_not_upgrades():
    assert not opset_upgrade.needs_per_axis_upgrade(InvalidModelError("Unrecognized attribute: foo for operator Conv"))
    assert opset_upgrade.needs_per_axis_upgrade(
        InvalidModelError("Unrecognized attribute: axis for operator DequantizeLinear"))


def test_qdq_below_opset_10_written_out_of_order_is_upgraded_then_fixed():
    """Quark keeps an opset-9 model's opset and writes Q/DQ, which exist from opset 10, and some nodes
    out of order (open_nsfw): valid at 13 once the converter lets the Q/DQ pass unchanged."""
    b = ToyBuilder(seed=4)
    float_model = b.model({"x": [1, 3, 12, 12]}, b.conv(b.node("Relu", [b.conv("x", 3, 8)]), 8, 4), opset=13)
    feeds = random_feeds(float_model, 6, seed=2)
    valid = quantize_with_ort(float_model, feeds[:4], "u8s8")  # per-tensor: the same at every opset from 10
    qdq = onnx.ModelProto()
    qdq.CopyFrom(valid)
    qdq.opset_import[0].version = 9
    qdq.graph.node.reverse()
    with pytest.raises(InvalidModelError):
        model_io.load(qdq)

    fixed, report = kenosis_rewrite.fix(qdq, return_report=True)

    onnx.checker.check_model(fixed, full_check=True)
    assert [(o.domain, o.version) for o in fixed.opset_import] == [("", 13)]
    assert any(note.startswith("opset 9 -> 13") for note in report.notes)
    assert op_types(fixed)["QuantizeLinear"] > 0
    # numbers: the fix of the valid opset-13 model, bit for bit
    for a, b in zip(fidelity.run(kenosis_rewrite.fix(valid), feeds[4:]), fidelity.run(fixed, feeds[4:])):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)

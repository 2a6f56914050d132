"""End-to-end behaviour of fix(): contracts, numerics and ORT fusion on quantize_static outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript
import pytest

import kenosis_rewrite
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.placement.targets import TARGETS
from kenosis_rewrite.testing import model_checks, toy_models

CONFIGS = ["default", "u8s8", "sym", "keep", "convmm", "pc"]
NETS = ["resnetish", "conv_add_relu", "conv_clip_maxpool", "concat", "conv_silu", "conv_prelu", "gap_head",
        "matmul_relu", "gemm_relu", "avgpool", "conv_bn"]


def _quantized(name: str, config: str):
    float_model = toy_models.build(name)
    feeds = toy_models.random_feeds(float_model, 6)
    return float_model, feeds, ort_quantize.quantize_with_ort(float_model, feeds, config)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", NETS)
def test_fix_keeps_contracts_and_fidelity(name, config):
    float_model, feeds, qdq = _quantized(name, config)
    before = qdq.SerializeToString()
    fixed, report = kenosis_rewrite.fix(qdq, float_model=float_model, calibration=feeds, return_report=True)
    assert qdq.SerializeToString() == before, "fix() must not mutate its input"
    onnx.checker.check_model(fixed, full_check=True)
    assert [i.name for i in fixed.graph.input] == [i.name for i in qdq.graph.input]
    assert [o.name for o in fixed.graph.output] == [o.name for o in qdq.graph.output]
    assert list(fixed.opset_import) == list(qdq.opset_import)
    assert not any(p.key.startswith("pkg.onnxscript") for n in fixed.graph.node for p in n.metadata_props)
    # Never less faithful to FP32 than the quantizer's own output: the graph itself, and as this host runs it.
    assert model_checks.graph_cosine(float_model, fixed, feeds) >= model_checks.graph_cosine(float_model, qdq, feeds) - 2e-5
    tolerance = model_checks.saturation_tolerance(2e-5)
    assert report.fidelity["fixed"]["cosine"] >= report.fidelity["input"]["cosine"] - tolerance, report.summary()
    # Every Conv/MatMul/Gemm that ORT ran as integer before still does, and none runs float.
    optimized = model_checks.ort_optimized_op_types(fixed)
    float_heavy = {op: optimized[op] for op in ("Conv", "FusedConv", "MatMul", "Gemm", "FusedGemm") if optimized[op]}
    assert not float_heavy, (float_heavy, report.summary())
    assert "PRelu" not in optimized


@pytest.mark.parametrize("name", ["resnetish", "conv_add_relu", "concat", "conv_silu"])
def test_default_int8_fan_out_nets_become_all_integer_like_uint8_quantization(name):
    _, _, default = _quantized(name, "default")
    _, _, u8 = _quantized(name, "u8s8")
    assert model_checks.ort_optimized_op_types(default)["Conv"] > 0  # the problem being fixed
    fixed_ops = model_checks.ort_optimized_op_types(kenosis_rewrite.fix(default))
    u8_ops = model_checks.ort_optimized_op_types(u8)
    for op in ("QLinearConv", "QLinearAdd", "QLinearConcat", "QLinearSigmoid", "QLinearMul"):
        assert fixed_ops[op] == u8_ops[op], op


def test_symmetric_outputs_lose_every_relu_clip_island():
    _, _, sym = _quantized("resnetish", "sym")
    assert model_checks.ort_optimized_op_types(sym)["Relu"] == 7
    fixed = kenosis_rewrite.fix(sym)
    optimized = model_checks.ort_optimized_op_types(fixed)
    assert optimized["Relu"] == 0 and optimized["QLinearConv"] == 7


def test_fix_is_idempotent_and_deterministic():
    _, _, qdq = _quantized("resnetish", "sym")
    once = kenosis_rewrite.fix(qdq)
    assert kenosis_rewrite.fix(qdq).SerializeToString() == once.SerializeToString()
    twice, report = kenosis_rewrite.fix(once, return_report=True)
    assert twice.SerializeToString() == once.SerializeToString()
    assert not report.changes


def test_kinds_in_and_out(tmp_path):
    _, feeds, qdq = _quantized("conv_relu", "default")
    path = tmp_path / "model.onnx"
    onnx.save(qdq, path)
    from_path = kenosis_rewrite.fix(str(path))
    assert isinstance(from_path, onnx.ModelProto)
    ir_model = ir.serde.deserialize_model(qdq)
    ir_before = ir.serde.serialize_model(ir_model).SerializeToString()
    from_ir = kenosis_rewrite.fix(ir_model)
    assert isinstance(from_ir, ir.Model) and from_ir is not ir_model
    assert ir.serde.serialize_model(ir_model).SerializeToString() == ir_before
    np.testing.assert_array_equal(
        model_checks.outputs(from_path, feeds[0])[0], model_checks.outputs(ir.serde.serialize_model(from_ir), feeds[0])[0]
    )


def test_metadata_and_doc_strings_survive():
    _, _, qdq = _quantized("conv_relu", "sym")
    onnx.helper.set_model_props(qdq, {"author": "me", "labels": "cat,dog"})
    qdq.doc_string = "my model"
    qdq.graph.doc_string = "graph doc"
    fixed = kenosis_rewrite.fix(qdq)
    assert {p.key: p.value for p in fixed.metadata_props} == {"author": "me", "labels": "cat,dog"}
    assert fixed.doc_string == "my model" and fixed.graph.doc_string == "graph doc"


def test_fix_pass_runs_in_a_pass_manager_after_onnxscript_optimizer():
    _, feeds, qdq = _quantized("resnetish", "sym")
    model = ir.serde.deserialize_model(qdq)
    onnxscript.optimizer.optimize(model)
    report = kenosis_rewrite.FixReport()
    result = ir.passes.PassManager([kenosis_rewrite.FixPass("ort-cpu", report)])(model)
    assert result.modified and report.change_counts()["relu-island-on-codes"] == 7
    out = ir.serde.serialize_model(result.model)
    onnx.checker.check_model(out, full_check=True)
    assert model_checks.ort_optimized_op_types(out)["Relu"] == 0


def test_rules_are_an_onnxscript_rule_set_usable_alone():
    _, _, qdq = _quantized("conv_prelu_uniform", "u8s8")
    rule_set = kenosis_rewrite.rules("ort-cpu")
    assert isinstance(rule_set, onnxscript.rewriter.RewriteRuleSet)
    model = ir.serde.deserialize_model(qdq)
    assert rule_set.apply_to_model(model) == 1
    assert "LeakyRelu" in {node.op_type for node in model.graph}


def test_unknown_target_is_a_typed_error():
    _, _, qdq = _quantized("conv_relu", "default")
    with pytest.raises(kenosis_rewrite.UnsupportedTargetError, match="known targets: ort-cpu"):
        kenosis_rewrite.fix(qdq, target="tpu")


def test_report_explains_changes_and_refusals():
    _, _, qdq = _quantized("conv_relu", "default")
    # make the output int8 Q a graph output: the u8 pass must refuse it and say why
    q_output = next(n for n in qdq.graph.node if n.op_type == "QuantizeLinear").output[0]
    inferred = onnx.shape_inference.infer_shapes(qdq)
    shape = next(v for v in inferred.graph.value_info if v.name == q_output).type.tensor_type.shape
    qdq.graph.output.append(onnx.helper.make_tensor_value_info(
        q_output, onnx.TensorProto.INT8, [d.dim_value for d in shape.dim]))
    fixed, report = kenosis_rewrite.fix(qdq, return_report=True)
    assert any("graph output" in r.reason for r in report.refusals)
    assert "activation-int8-to-uint8" in report.summary()
    assert report.to_dict()["change_counts"]["activation-int8-to-uint8"] >= 1
    assert fixed.graph.output[-1].name == q_output


def test_external_data_models_keep_their_weights(tmp_path):
    import copy

    _, feeds, qdq = _quantized("resnetish", "default")
    expected = model_checks.outputs(kenosis_rewrite.fix(qdq), feeds[0])[0]
    onnx.save(copy.deepcopy(qdq), tmp_path / "m.onnx", save_as_external_data=True,
              all_tensors_to_one_file=True, location="m.data", size_threshold=0)
    from_path = kenosis_rewrite.fix(tmp_path / "m.onnx")
    np.testing.assert_array_equal(model_checks.outputs(from_path, feeds[0])[0], expected)
    ir_model = ir.load(tmp_path / "m.onnx")
    fixed = kenosis_rewrite.fix(ir_model)
    (tmp_path / "out").mkdir()
    ir.save(fixed, tmp_path / "out" / "fixed.onnx", external_data="fixed.data")
    assert (tmp_path / "out" / "fixed.data").stat().st_size > 0
    reloaded = onnx.load(tmp_path / "out" / "fixed.onnx")
    np.testing.assert_array_equal(model_checks.outputs(reloaded, feeds[0])[0], expected)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fix_is_idempotent_for_every_target(target):
    _, _, qdq = _quantized("resnetish", "default")
    once = kenosis_rewrite.fix(qdq, target=target)
    twice, report = kenosis_rewrite.fix(once, target=target, return_report=True)
    assert twice.SerializeToString() == once.SerializeToString(), target
    assert not report.changes


def test_a_model_over_the_protobuf_limit_is_a_typed_error(monkeypatch):
    from kenosis_rewrite.core import model_io

    _, _, qdq = _quantized("conv_relu", "default")
    monkeypatch.setattr(model_io, "_PROTOBUF_LIMIT", qdq.ByteSize() - 1)
    with pytest.raises(kenosis_rewrite.ModelTooLargeError, match="2 GB"):
        kenosis_rewrite.fix(qdq)


def test_quantize_does_not_modify_its_input():
    model = toy_models.build("conv_relu")
    feeds = toy_models.random_feeds(model, 4)
    before = model.SerializeToString()
    kenosis_rewrite.quantize(model, calibration=feeds)
    assert model.SerializeToString() == before
    as_ir = ir.serde.deserialize_model(model)
    before_ir = ir.serde.serialize_model(as_ir).SerializeToString()
    kenosis_rewrite.quantize(as_ir, calibration=feeds)
    assert ir.serde.serialize_model(as_ir).SerializeToString() == before_ir


def _breaking_fix_pass(monkeypatch, damage):
    """FixPass as usual, then ``damage(model)``: a stand-in for a rule with a bug."""
    from kenosis_rewrite.placement import pipeline

    real = pipeline.FixPass.call

    def call(self, model):
        result = real(self, model)
        damage(model)
        return result

    monkeypatch.setattr(pipeline.FixPass, "call", call)


def test_a_rewrite_that_changes_the_interface_is_a_rewrite_error(monkeypatch):
    _, _, qdq = _quantized("conv_relu", "default")

    def rename_output(model):
        model.graph.outputs[0].name = "renamed"

    _breaking_fix_pass(monkeypatch, rename_output)
    with pytest.raises(kenosis_rewrite.RewriteError, match="interface"):
        kenosis_rewrite.fix(qdq, verify=False)


def test_a_rewrite_that_breaks_the_checker_is_a_rewrite_error(monkeypatch):
    _, _, qdq = _quantized("conv_relu", "default")

    def add_bad_node(model):
        output = model.graph.outputs[0]
        model.graph.append(ir.node("Relu", [output, output], name="two_inputs"))  # Relu takes one input

    _breaking_fix_pass(monkeypatch, add_bad_node)
    with pytest.raises(kenosis_rewrite.RewriteError, match="ONNX checker"):
        kenosis_rewrite.fix(qdq, verify=False)


def _with_unnamed_constant(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its first initializer read through a Constant node whose tensor has no name,
    as PyTorch's exporter writes them (onnx_ir names such a tensor after its output when it reads it)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    first = copy.graph.initializer[0]
    tensor = onnx.TensorProto()
    tensor.CopyFrom(first)
    tensor.ClearField("name")
    copy.graph.node.insert(0, onnx.helper.make_node("Constant", [], [first.name], value=tensor))
    del copy.graph.initializer[0]
    return copy


def test_neither_fix_nor_quantize_writes_into_the_callers_proto():
    float_model = _with_unnamed_constant(toy_models.build("conv_bn"))
    feeds = toy_models.random_feeds(float_model, 6)
    qdq = _with_unnamed_constant(ort_quantize.quantize_with_ort(toy_models.build("conv_relu"), feeds, "u8s8"))
    for call, model in ((lambda m: kenosis_rewrite.fix(m), qdq), (lambda m: kenosis_rewrite.fix(m, calibration=feeds), qdq),
                        (lambda m: kenosis_rewrite.quantize(m, calibration=feeds), float_model)):
        before = model.SerializeToString()
        call(model)
        assert model.SerializeToString() == before
        assert not [n for n in model.graph.node if n.op_type == "Constant"][0].attribute[0].t.name

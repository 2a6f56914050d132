"""op_filtered rule sets rewrite exactly as the rule sets they wrap; canonical's optimize_ir copy is onnxscript's."""

from __future__ import annotations

import onnx_ir as ir
import onnxscript.optimizer
import pytest
from onnxscript.rewriter import _DEFAULT_REWRITE_RULES, RewriteRuleSet

from kenosis_rewrite.canonicalization import pipeline
from kenosis_rewrite.canonicalization.rules.transpose_sinking import transpose_sinking_rules
from kenosis_rewrite.graph.rule_filter import op_filtered, producer_requirements, root_op_type
from kenosis_rewrite.testing import toy_models


def _ir(name: str) -> ir.Model:
    return ir.serde.deserialize_model(toy_models.build_export(name))


def _bytes(model: ir.Model) -> bytes:
    return ir.serde.serialize_model(model).SerializeToString()


def test_every_default_onnxscript_rule_is_filtered_by_its_root_op():
    assert all(root_op_type(rule) for rule in _DEFAULT_REWRITE_RULES)


@pytest.mark.parametrize("name", sorted(toy_models.EXPORT_TOYS))
@pytest.mark.parametrize("rules", [RewriteRuleSet(_DEFAULT_REWRITE_RULES), transpose_sinking_rules()],
                         ids=["onnxscript-default", "sink-transposes"])
def test_filtered_rules_rewrite_exactly_as_the_rules(name, rules):
    plain, filtered = _ir(name), _ir(name)
    onnxscript.optimizer.fold_constants(plain)
    onnxscript.optimizer.fold_constants(filtered)
    assert rules.apply_to_model(plain) == op_filtered(rules).apply_to_model(filtered)
    assert _bytes(plain) == _bytes(filtered)


@pytest.mark.parametrize("name", sorted(toy_models.EXPORT_TOYS))
def test_canonical_optimize_ir_is_onnxscripts(name):
    plain, ours = _ir(name), _ir(name)
    onnxscript.optimizer.optimize_ir(plain, num_iterations=3)
    pipeline._optimize_ir(ours, num_iterations=3)
    assert _bytes(plain) == _bytes(ours)


@pytest.mark.parametrize("name", sorted(toy_models.TOY_MODELS))
@pytest.mark.parametrize("target,config", [("ort-cpu", "keep"), ("ort-cpu", "u8s8_convmm"), ("tensorrt", "keep")])
def test_filtered_fix_rules_rewrite_quantized_graphs_exactly_as_the_rules(name, target, config):
    """The fix() rules, whose patterns read Q/DQ outputs (their producers pre-checked), on
    quantize_static's models (activations kept, or only Conv/MatMul/Gemm quantized: 35 rewrites
    over the toys on ort-cpu): the same rewrites, the same graph."""
    from kenosis_rewrite.core.ort_quantize import quantize_with_ort  # noqa: PLC0415
    from kenosis_rewrite.placement.targets import get_target  # noqa: PLC0415

    float_model = toy_models.build(name)
    quantized = quantize_with_ort(float_model, toy_models.random_feeds(float_model, 4), config)
    rules = get_target(target).rules(None)
    plain, filtered = ir.serde.deserialize_model(quantized), ir.serde.deserialize_model(quantized)
    assert RewriteRuleSet(rules).apply_to_model(plain) == op_filtered(rules).apply_to_model(filtered)
    assert _bytes(plain) == _bytes(filtered)


def test_producer_requirements_name_the_ops_a_pattern_reads_from():
    from kenosis_rewrite.placement.rules.conv_affine_folding import conv_affine_rules  # noqa: PLC0415

    by_inputs = {producer_requirements(rule) for rule in conv_affine_rules().rules if root_op_type(rule) == "Mul"}
    # Conv -> Q -> DQ -> Mul, the constant second or first; Conv -> Mul likewise
    through_qdq = ("DequantizeLinear", 0, ((0, "QuantizeLinear", 0, ((0, "Conv", 0, ()),)),))
    assert by_inputs == {((0, *through_qdq),), ((1, *through_qdq),), ((0, "Conv", 0, ()),), ((1, "Conv", 0, ()),)}
    shallow = {producer_requirements(rule, depth=1) for rule in conv_affine_rules().rules if root_op_type(rule) == "Mul"}
    assert ((0, "DequantizeLinear", 0, ()),) in shallow
    assert all(producer_requirements(rule) == () for rule in transpose_sinking_rules().rules if root_op_type(rule) is None)

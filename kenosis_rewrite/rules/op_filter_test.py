"""op_filtered rule sets rewrite exactly as the rule sets they wrap; canonical's optimize_ir copy is onnxscript's."""

from __future__ import annotations

import onnx_ir as ir
import onnxscript.optimizer
import pytest
from onnxscript.rewriter import _DEFAULT_REWRITE_RULES, RewriteRuleSet

from kenosis_rewrite import canonical, toy_models
from kenosis_rewrite.rules.op_filter import op_filtered, root_op_type
from kenosis_rewrite.rules.transpose_sinking import transpose_sinking_rules


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
    canonical._optimize_ir(ours, num_iterations=3)
    assert _bytes(plain) == _bytes(ours)

"""Tests of the op tables: defined once, read from there, and the alike-looking ones kept apart."""

from __future__ import annotations

import onnx_ir as ir

from kenosis_rewrite.core import op_tables
from kenosis_rewrite.diagnosis import float_reasons, ort_graph
from kenosis_rewrite.graph import qdq_params, value_range
from kenosis_rewrite.placement.rules import conv_affine_folding

_TABLES = ("WEIGHTED_OPS", "AFFINE_OPS", "ORT_ABSORBED_ACTIVATIONS", "DATA_MOVEMENT_OPS", "QDQ_COMMUTING_OPS",
           "VALUE_SELECTING_OPS", "ORDER_PRESERVING_OPS")


def test_every_table_is_immutable_and_exported():
    for name in _TABLES:
        assert name in op_tables.__all__
        assert isinstance(getattr(op_tables, name), tuple | frozenset), name


def test_modules_read_the_one_definition():
    assert qdq_params.WEIGHTED_OPS is op_tables.WEIGHTED_OPS
    assert ort_graph.FLOAT_HEAVY_OPS is op_tables.WEIGHTED_OPS
    assert conv_affine_folding.AFFINE_OPS is op_tables.AFFINE_OPS
    assert float_reasons.ABSORBABLE_ACTIVATIONS is op_tables.ORT_ABSORBED_ACTIVATIONS
    assert not hasattr(value_range, "PASS_THROUGH_OPS")  # renamed: it is VALUE_SELECTING_OPS


def test_the_members_of_each_table_stay_as_they_were():
    assert op_tables.WEIGHTED_OPS == ("Conv", "ConvTranspose", "MatMul", "Gemm")
    assert op_tables.AFFINE_OPS == ("Mul", "Div", "Add", "Sub")  # rules are built in this order
    assert op_tables.ORT_ABSORBED_ACTIVATIONS == ("Relu", "Clip")
    assert op_tables.QDQ_COMMUTING_OPS == op_tables.DATA_MOVEMENT_OPS | {"MaxPool"}
    assert "MaxPool" not in op_tables.DATA_MOVEMENT_OPS
    # alike but different questions: a selected value, against a value or a monotone function of one
    assert op_tables.VALUE_SELECTING_OPS - op_tables.ORDER_PRESERVING_OPS == {
        "GatherElements", "GatherND", "DepthToSpace", "SpaceToDepth", "ReduceMax", "ReduceMin"}
    assert op_tables.ORDER_PRESERVING_OPS - op_tables.VALUE_SELECTING_OPS == {
        "Concat", "Cast", "Dropout", "Sigmoid", "Tanh", "Relu", "LeakyRelu", "Clip", "HardSigmoid", "Softmax",
        "LogSoftmax", "Exp", "Elu", "Selu"}


def test_value_range_passes_values_through_exactly_the_value_selecting_ops():
    for op_type in ("Reshape", "ReduceMax", "Cast", "Sigmoid"):
        node = ir.node(op_type, [ir.Value(name="x")])
        assert value_range.is_pass_through(node) == (op_type in op_tables.VALUE_SELECTING_OPS), op_type

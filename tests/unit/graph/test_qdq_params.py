"""Tests of the Q/DQ helpers that the rules and passes share."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.graph import qdq_params
from kenosis_rewrite.testing import model_checks, toy_models


def test_small_constants_become_read_only_arrays_of_the_same_values():
    float_model = toy_models.build("resnetish")
    feeds = toy_models.random_feeds(float_model, 4)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds, "default")
    model = ir.serde.deserialize_model(qdq)
    before = {name: (value.const_value.numpy(), type(value.const_value)) for name, value in model.graph.initializers.items()}
    qdq_params.small_constants_as_arrays(model)
    held = 0
    for name, value in model.graph.initializers.items():
        array, kind = before[name]
        now = value.const_value.numpy()
        np.testing.assert_array_equal(now, array)
        assert now.dtype == array.dtype and value.const_value.dtype == value.dtype
        if array.size <= qdq_params._SMALL_CONSTANT_ELEMENTS:
            held += 1
            assert isinstance(value.const_value, ir.Tensor) and value.const_value.numpy() is now  # parsed once
            with pytest.raises(ValueError):
                now.reshape(-1)[0] = 0  # a rule writing into a tensor it read would change the model
        else:
            assert type(value.const_value) is kind  # weights stay as they were read
    assert held >= 2 * sum(node.op_type == "QuantizeLinear" for node in model.graph)  # every scale and zero point
    for feed in feeds:  # the same model, run
        for a, b in zip(model_checks.outputs(qdq, feed, optimized=False),
                        model_checks.outputs(ir.serde.serialize_model(model), feed, optimized=False)):
            np.testing.assert_array_equal(a, b)

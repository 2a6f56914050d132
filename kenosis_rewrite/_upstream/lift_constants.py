"""Every Constant node as an initializer: onnx_ir's ``LiftConstantsToInitializersPass(lift_all_constants=True,
size_limit=0)``, its tensor attributes read without a runtime Protocol check.

onnx_ir reads a ``value`` attribute with ``Attr.as_tensor()``, whose ``isinstance(value, TensorProtocol)``
against a runtime-checkable Protocol walks the Protocol's members: 33 us a Constant, 10 ms of the
308 Constants of PP-OCR cls's Paddle export, in every quantize() call. Here a tensor the
deserializer made (an ``ir.TensorProtoTensor``, or any concrete onnx_ir tensor class) is taken as
it is; anything else goes through onnx_ir's own conversion. Exact: the same initializers, names,
uses and graph (the sibling test compares the serialised models).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import common as common_passes

__all__ = ["LiftAllConstantsPass"]

# onnx_ir's concrete tensor classes: what a deserialised or built ``value`` attribute holds
_TENSOR_CLASSES = tuple(getattr(ir, name) for name in ("TensorProtoTensor", "Tensor", "ExternalTensor", "StringTensor",
                                                       "LazyTensor", "PackedTensor") if hasattr(ir, name))


class LiftAllConstantsPass(common_passes.LiftConstantsToInitializersPass):
    """onnx_ir's pass lifting every Constant (``lift_all_constants=True, size_limit=0``), faster; see the module.

    Internal: ``onnx_ir.passes.common.LiftConstantsToInitializersPass._constant_node_attribute_to_tensor(node,
    attr_name, attr_value, initializer_name)``, overridden (seen in onnx-ir 0.1.12 - 1.1). Public
    replacement: none public today (the pass itself, with its Protocol check on every tensor)."""

    def __init__(self):
        super().__init__(lift_all_constants=True, size_limit=0)

    def _constant_node_attribute_to_tensor(self, node, attr_name, attr_value, initializer_name):
        if (attr_name == "value" and attr_value.type == ir.AttributeType.TENSOR
                and isinstance(attr_value.value, _TENSOR_CLASSES)):
            return attr_value.value  # what as_tensor() returns, its check passed by construction
        return super()._constant_node_attribute_to_tensor(node, attr_name, attr_value, initializer_name)

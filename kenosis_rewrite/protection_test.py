"""Tests of the protection helpers quantize() applies before quantize_static."""

from __future__ import annotations

import onnx

from kenosis_rewrite import _testing
from kenosis_rewrite.protection import protected_nodes, unshare_protected_constants

# a stride constant shared by the box offsets (data) and a grid computed from the feature map's width
_SHARED_STRIDE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 2, 4, "W"] x) => (float[1, 2, 4, "W"] y)
<float stride = {8.0}, int64 axis = {3}, int64 zero = {0}, int64 one = {1}>
{
  offsets = Mul(x, stride)
  s = Shape(x)
  w = Gather(s, axis)
  r = Range(zero, w, one)
  c = Cast <to = 1> (r)
  grid = Mul(c, stride)
  y = Add(offsets, grid)
}"""


def test_a_constant_shared_with_a_protected_node_is_copied_for_it_only():
    proto = onnx.parser.parse_model(_SHARED_STRIDE)
    for index, node in enumerate(proto.graph.node):
        node.name = node.name or f"{node.op_type}_{index}"
    protected = protected_nodes(proto, set())
    grid_mul = next(n for n in proto.graph.node if n.output[0] == "grid")
    offsets_mul = next(n for n in proto.graph.node if n.output[0] == "offsets")
    assert grid_mul.name in protected and offsets_mul.name not in protected
    assert unshare_protected_constants(proto, protected) == 1
    assert offsets_mul.input[1] == "stride" and grid_mul.input[1] == "stride_float"
    assert float(_testing.initializer(proto, "stride_float")) == 8.0
    onnx.checker.check_model(proto, full_check=True)
    assert unshare_protected_constants(proto, protected) == 0  # nothing shared any more

"""Tests of the protection helpers quantize() applies before quantize_static."""

from __future__ import annotations

import onnx

from kenosis_rewrite.accuracy.protection import protected_nodes, unshare_protected_constants
from kenosis_rewrite.testing import model_checks

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


def _parsed(text: str, typed: bool = True) -> onnx.ModelProto:
    """The model of ``text`` (with its values' types inferred unless ``typed`` is False), every node named."""
    proto = onnx.parser.parse_model(text)
    if typed:
        proto = onnx.shape_inference.infer_shapes(proto)
    for index, node in enumerate(proto.graph.node):
        node.name = node.name or f"{node.op_type}_{index}"
    return proto


def _protected_outputs(text: str) -> set[str]:
    """The outputs of the nodes :func:`protected_nodes` names in the model of ``text``."""
    proto = _parsed(text)
    protected = set(protected_nodes(proto, set()))
    return {node.output[0] for node in proto.graph.node if node.name in protected}


def test_a_constant_shared_with_a_protected_node_is_copied_for_it_only():
    proto = _parsed(_SHARED_STRIDE, typed=False)
    protected = protected_nodes(proto, set())
    grid_mul = next(n for n in proto.graph.node if n.output[0] == "grid")
    offsets_mul = next(n for n in proto.graph.node if n.output[0] == "offsets")
    assert grid_mul.name in protected and offsets_mul.name not in protected
    assert unshare_protected_constants(proto, protected) == 1
    assert offsets_mul.input[1] == "stride" and grid_mul.input[1] == "stride_float"
    assert float(model_checks.initializer(proto, "stride_float")) == 8.0
    onnx.checker.check_model(proto, full_check=True)
    assert unshare_protected_constants(proto, protected) == 0  # nothing shared any more


# a CRNN's sequence: the feature map reshaped to [N, C, W] by a shape computed from its own Shape,
# then one time step gathered by a constant index
_RUN_TIME_RESHAPE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4, 2, "W"] x) => (float[1, 8] y)
<int64[1] c8 = {8}, int64[1] first = {0}, int64 step = {0}, int64[1] minus1 = {-1}, float three = {3.0}>
{
  s = Shape(x)
  n = Gather(s, first)
  shape = Concat <axis = 0> (n, c8, minus1)
  seq = Reshape(x, shape)
  t = Gather <axis = 2> (seq, step)
  w = Cast <to = 1> (n)
  scaled = Mul(w, three)
  y = Mul(t, scaled)
}"""


def test_a_shape_computed_from_shapes_protects_only_the_nodes_whose_float_inputs_it_reaches():
    protected = _protected_outputs(_RUN_TIME_RESHAPE)
    # the shape arithmetic, and the Mul that reads a float computed from it, stay float
    assert {"n", "shape", "w", "scaled", "y"} <= protected
    # the Reshape's and the Gather's data are the image's: their int64 shape and index are not quantized anyway
    assert "seq" not in protected and "t" not in protected


def test_an_untyped_input_computed_from_shapes_is_taken_for_a_float():
    # Expand(data, shape): without value_info nothing says the shape is int64
    text = _RUN_TIME_RESHAPE.replace("seq = Reshape(x, shape)", "seq = Expand(x, shape)")
    typed, untyped = _parsed(text), _parsed(text, typed=False)
    assert "Expand_3" not in protected_nodes(typed, set())
    assert "Expand_3" in protected_nodes(untyped, set())


# an old export's upsampling: float scales computed from the feature map's and the target's shapes
_RUN_TIME_SCALES = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4, "H", "W"] x, float[1, 4, "H2", "W2"] skip) => (float[1, 4, "H2", "W2"] y)
{
  small_shape = Shape(x)
  small = Cast <to = 1> (small_shape)
  large_shape = Shape(skip)
  large = Cast <to = 1> (large_shape)
  scales = Div(large, small)
  up = Resize <mode = "nearest"> (x, , scales)
  y = Add(up, skip)
}"""


def test_a_resize_whose_float_scales_come_from_shapes_still_has_its_data_quantized():
    protected = _protected_outputs(_RUN_TIME_SCALES)
    assert "scales" in protected  # the float arithmetic on shapes stays float
    assert "up" not in protected and "y" not in protected

"""A random model written as an exporter with a dynamic batch writes it: the shape arithmetic runs in the graph."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

BATCH = "batch"


class _ShapeArithmetic:
    """Appends the nodes an exporter writes to compute shapes at run time (``Shape -> Slice/Gather
    -> Concat``), uniquely named."""

    def __init__(self, taken: set[str]):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._taken = taken
        self._count = 0

    def name(self, base: str) -> str:
        while True:
            self._count += 1
            name = f"dyn_{base}_{self._count}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    def i64(self, values) -> str:
        name = self.name("i64")
        self.initializers.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name

    def node(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.name(f"n_{op}"), **attrs))
        return out

    def dims(self, tensor: str, start: int, end: int) -> str:
        """``tensor.shape[start:end]`` at run time."""
        return self.node("Slice", [self.node("Shape", [tensor]), self.i64([start]), self.i64([end])])

    def batch_then(self, tensor: str, rest, rng: np.random.Generator) -> str:
        """``[tensor.shape[0], *rest]``: ``x.view(x.size(0), ...)``, Sliced or Gathered and Unsqueezed."""
        if rng.random() < 0.5:
            batch = self.dims(tensor, 0, 1)
        else:
            scalar = self.node("Gather", [self.node("Shape", [tensor]), self.i64(0)], axis=0)
            batch = self.node("Unsqueeze", [scalar, self.i64([0])])
        return self.node("Concat", [batch, self.i64(rest)], axis=0)


def _constant_arrays(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    arrays = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            arrays[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return arrays


def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    values = [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
    return {v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim) for v in values
            if v.type.tensor_type.elem_type == TensorProto.FLOAT}


def as_dynamic_export(model: onnx.ModelProto, rng: np.random.Generator) -> onnx.ModelProto:
    """``model`` (static, batch 1) as an exporter with a dynamic batch writes it, computing the same:

    * the inputs' and outputs' first dim is the symbol ``batch``, and in one model in two the input's
      spatial dims (``height``, ``width``) or sequence length (``sequence``) are symbolic too;
    * a Reshape to a constant shape ``[1, ...]`` reads its shape from its data at run time
      (``x.view(x.size(0), ...)``: ``Shape -> Slice`` or ``Shape -> Gather -> Unsqueeze``, then
      ``Concat``), or from an earlier tensor of the target shape (``y.view(x.shape)``), or keeps the
      batch with a 0 (``[0, ...]``);
    * a Resize by 2 resizes to a computed size (``interpolate(size=(2 * h, 2 * w))``);
    * a 3x3 Conv's padding is, sometimes, a Pad computed from the input's shape (TF "same" padding);
    * zeros made from a tensor's run-time shape (``ConstantOfShape(Shape(y))``, a recurrent net's
      initial state) are added to one tensor, and a constant bias is Expanded to a tensor's shape and
      added to another (the float data the graph computes from shapes).
    """
    shapes = _static_shapes(model)
    constants = _constant_arrays(model)
    taken = {name for node in model.graph.node for name in [*node.input, *node.output, node.name]}
    taken.update(init.name for init in model.graph.initializer)
    taken.update(value.name for value in [*model.graph.input, *model.graph.output])
    arithmetic = _ShapeArithmetic(taken)
    outputs = {value.name for value in model.graph.output}
    produced: list[str] = [value.name for value in model.graph.input]
    nodes: list[onnx.NodeProto] = []
    padding_rng = np.random.Generator(rng.bit_generator.jumped())  # rng's own draws stay those of before
    for original in model.graph.node:
        node = onnx.NodeProto()
        node.CopyFrom(original)
        _dynamic_parameters(node, arithmetic, constants, shapes, produced, rng)
        _same_padding(node, arithmetic, padding_rng)
        nodes.extend(arithmetic.nodes)
        arithmetic.nodes.clear()
        nodes.append(node)
        produced.extend(name for name in node.output if name in shapes)
    inner = [name for name in produced[1:] if name not in outputs and shapes[name]]  # not scalars
    for kind in ("zeros", "expand"):
        if inner and rng.random() < 0.3:
            nodes = _add_from_shape(nodes, inner[int(rng.integers(len(inner)))], kind, arithmetic, shapes, rng)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input}
    kept = [init for init in result.graph.initializer if init.name in read]  # constant shapes replaced go
    del result.graph.initializer[:]
    result.graph.initializer.extend([*kept, *arithmetic.initializers])
    for value in [*result.graph.input, *result.graph.output]:
        value.type.tensor_type.shape.dim[0].dim_param = BATCH
    if rng.random() < 0.5:  # the image's or sequence's size too (the Reshapes' other dims stay constant)
        dims = result.graph.input[0].type.tensor_type.shape.dim
        symbolic = {4: {2: "height", 3: "width"}, 3: {1: "sequence"}}.get(len(dims), {})
        for index, name in symbolic.items():
            dims[index].dim_param = name
        if symbolic:  # the outputs' dims then follow them: declared unknown (a static one would
            for value in result.graph.output:  # tell ORT to fold shapes for that size alone)
                for dim in value.type.tensor_type.shape.dim[1:]:
                    dim.Clear()
    return result


def _dynamic_parameters(node: onnx.NodeProto, arithmetic: _ShapeArithmetic, constants, shapes, produced: list[str],
                        rng: np.random.Generator) -> None:
    """A constant Reshape target or Resize scale replaced by its run-time computation (sometimes)."""
    if node.op_type == "Reshape" and node.input[1] in constants and rng.random() < 0.85:
        target = [int(d) for d in constants[node.input[1]]]
        if not target or target[0] != 1:
            return
        like = [name for name in produced if shapes.get(name) == tuple(target)]
        choice = rng.random()
        if like and choice < 0.3:
            node.input[1] = arithmetic.node("Shape", [like[-1]])
        elif choice < 0.45:
            node.input[1] = arithmetic.i64([0, *target[1:]])
        else:
            node.input[1] = arithmetic.batch_then(node.input[0], target[1:], rng)
    elif (node.op_type == "Resize" and len(node.input) == 3 and node.input[2] in constants
          and rng.random() < 0.6):
        scales = constants[node.input[2]]
        if scales.shape != (4,) or not np.array_equal(scales[:2], [1, 1]) or not np.all(scales[2:] == np.round(scales[2:])):
            return
        spatial = arithmetic.node("Mul", [arithmetic.dims(node.input[0], 2, 4), arithmetic.i64(scales[2:].astype(np.int64))])
        sizes = arithmetic.node("Concat", [arithmetic.dims(node.input[0], 0, 2), spatial], axis=0)
        node.input[2] = ""
        node.input.append(sizes)


def _same_padding(node: onnx.NodeProto, arithmetic: _ShapeArithmetic, rng: np.random.Generator) -> None:
    """A Conv's symmetric padding (stride 1), sometimes, as a TF export computes "same" padding at run
    time: ``total = (ceil(hw / s) - 1) * s + k - hw``, ``before = total // 2``, then ``Pad``."""
    if node.op_type != "Conv" or rng.random() >= 0.3:
        return
    attributes = {a.name: a for a in node.attribute}
    kernel = list(attributes["kernel_shape"].ints) if "kernel_shape" in attributes else []
    pads = list(attributes["pads"].ints) if "pads" in attributes else []
    strides = list(attributes["strides"].ints) if "strides" in attributes else [1, 1]
    if kernel != [3, 3] or pads != [1, 1, 1, 1] or strides != [1, 1] or "dilations" in attributes:
        return
    shape = arithmetic.node("Shape", [node.input[0]])
    if rng.random() < 0.5:
        hw = arithmetic.node("Slice", [shape, arithmetic.i64([2]), arithmetic.i64([4])])
    else:  # read one dim at a time
        dims = [arithmetic.node("Unsqueeze", [arithmetic.node("Gather", [shape, arithmetic.i64(i)], axis=0), arithmetic.i64([0])])
                for i in (2, 3)]
        hw = arithmetic.node("Concat", dims, axis=0)
    cells = arithmetic.node("Div", [arithmetic.node("Add", [hw, arithmetic.i64([0, 0])]), arithmetic.i64([1, 1])])
    total = arithmetic.node("Sub", [arithmetic.node("Add", [arithmetic.node("Sub", [cells, arithmetic.i64([1, 1])]),
                                                             arithmetic.i64([3, 3])]), hw])
    total = arithmetic.node("Max", [total, arithmetic.i64([0, 0])])
    before = arithmetic.node("Div", [total, arithmetic.i64([2, 2])])
    after = arithmetic.node("Sub", [total, before])
    zeros = arithmetic.i64([0, 0])
    padded = arithmetic.node("Pad", [node.input[0], arithmetic.node("Concat", [zeros, before, zeros, after], axis=0)])
    node.input[0] = padded
    kept = [a for a in node.attribute if a.name != "pads"]
    del node.attribute[:]
    node.attribute.extend(kept)


def _add_from_shape(nodes: list[onnx.NodeProto], tensor: str, kind: str, arithmetic: _ShapeArithmetic, shapes,
                    rng: np.random.Generator) -> list[onnx.NodeProto]:
    """``nodes`` with ``tensor``'s readers reading ``tensor + zeros(tensor.shape)`` (``kind`` "zeros":
    ConstantOfShape) or ``tensor + expand(bias, tensor.shape)`` ("expand": a per-channel bias)."""
    shape_of = arithmetic.node("Shape", [tensor])
    if kind == "zeros":
        addend = arithmetic.node("ConstantOfShape", [shape_of], value=numpy_helper.from_array(np.zeros(1, np.float32)))
    else:
        channels = shapes[tensor][1] if len(shapes[tensor]) > 1 else shapes[tensor][-1]
        bias_shape = (channels,) + (1,) * (len(shapes[tensor]) - 2) if len(shapes[tensor]) > 1 else (channels,)
        bias = arithmetic.name("bias")
        arithmetic.initializers.append(numpy_helper.from_array(rng.normal(0, 0.1, bias_shape).astype(np.float32), bias))
        addend = arithmetic.node("Expand", [bias, shape_of])
    total = arithmetic.node("Add", [tensor, addend])
    added = list(arithmetic.nodes)
    arithmetic.nodes.clear()
    result = []
    for node in nodes:
        if tensor in node.input:
            node.input[:] = [total if name == tensor else name for name in node.input]
        result.append(node)
        if tensor in node.output:
            result.extend(added)
    return result

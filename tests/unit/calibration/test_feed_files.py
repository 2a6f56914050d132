"""Calibration data from files: .npz, folders of .npz, folders of images; bad files say what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import kenosis_rewrite
from kenosis_rewrite.calibration.feed_files import feeds_from_path, is_feed_path
from kenosis_rewrite.cli import main as cli
from kenosis_rewrite.core.ort_quantize import quantize_with_ort
from kenosis_rewrite.errors import CalibrationError
from kenosis_rewrite.testing import toy_models

SHAPE = [1, 3, 12, 12]


def _model():
    b = toy_models.ToyBuilder(seed=1)
    return b.model({"x": SHAPE}, b.node("Relu", [b.conv("x", 3, 4)]))


def _stack(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal([n, *SHAPE[1:]]).astype(np.float32)


def _assert_same(feeds, expected):
    assert len(feeds) == len(expected)
    for feed, want in zip(feeds, expected):
        assert feed.keys() == want.keys()
        for name in feed:
            np.testing.assert_array_equal(feed[name], want[name])


def test_a_batch_array_gives_one_sample_per_row(tmp_path):
    data = _stack(5)
    np.savez(tmp_path / "c.npz", x=data)
    _assert_same(feeds_from_path(tmp_path / "c.npz", _model()), [{"x": data[i:i + 1]} for i in range(5)])


def test_an_array_of_whole_inputs_gives_one_sample_per_entry(tmp_path):
    data = _stack(3)[:, None]  # [3, 1, 3, 12, 12]: samples of the input's full shape
    np.savez(tmp_path / "c.npz", x=data)
    _assert_same(feeds_from_path(tmp_path / "c.npz", _model(), samples=2), [{"x": data[i]} for i in range(2)])


def test_the_indexed_layout_and_a_folder_of_files_are_read_in_order(tmp_path):
    data = _stack(4)
    np.savez(tmp_path / "a.npz", **{f"{i}::x": data[i:i + 1] for i in range(2)})
    np.savez(tmp_path / "b.npz", x=data[2:])
    _assert_same(feeds_from_path(tmp_path, _model()), [{"x": data[i:i + 1]} for i in range(4)])


def test_a_folder_of_images_is_preprocessed_for_the_model(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (20, 16, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
    feeds = feeds_from_path(tmp_path, _model())
    assert len(feeds) == 3 and all(feed["x"].shape == tuple(SHAPE) and feed["x"].dtype == np.float32 for feed in feeds)


@pytest.mark.parametrize("write, message", [
    (lambda d: np.savez(d / "c.npz", y=_stack(2)), r"arrays \['y'\] name no input.*\['x'\]"),
    (lambda d: np.savez(d / "c.npz", x=_stack(2)[0, 0]), r"array 'x' has shape \[12, 12\].*rank 4"),
    (lambda d: (d / "c.npz").write_bytes(b"not a zip"), "is not a readable .npz"),
    (lambda d: np.savez(d / "c.npz", **{"0::x": _stack(1), "x": _stack(1)}), "mixes the '<index>::<input>' layout"),
])
def test_a_bad_file_names_itself_and_what_is_wrong(tmp_path, write, message):
    write(tmp_path)
    with pytest.raises(CalibrationError, match=message):
        feeds_from_path(tmp_path / "c.npz", _model())


def test_a_folder_without_samples_or_with_both_kinds_is_refused(tmp_path):
    with pytest.raises(CalibrationError, match="holds no .npz files and no images"):
        feeds_from_path(tmp_path, _model())
    np.savez(tmp_path / "c.npz", x=_stack(1))
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "i.png")
    with pytest.raises(CalibrationError, match="both .npz files and images"):
        feeds_from_path(tmp_path, _model())
    with pytest.raises(CalibrationError, match="neither a .npz file nor a folder"):
        feeds_from_path(tmp_path / "missing.npz", _model())
    assert not is_feed_path("synthetic") and is_feed_path(tmp_path) and not is_feed_path([{}])


def test_fix_and_quantize_read_a_path_as_they_read_the_feeds_it_holds(tmp_path):
    float_model = _model()
    data = _stack(6, seed=2)
    feeds = [{"x": data[i:i + 1]} for i in range(6)]
    np.savez(tmp_path / "c.npz", x=data)
    qdq = quantize_with_ort(float_model, feeds, "u8s8")
    by_path, path_report = kenosis_rewrite.fix(qdq, calibration=tmp_path / "c.npz", return_report=True)
    by_feeds, feeds_report = kenosis_rewrite.fix(qdq, calibration=feeds, return_report=True)
    assert by_path.SerializeToString() == by_feeds.SerializeToString()
    assert path_report.to_dict() == feeds_report.to_dict()
    quantized = kenosis_rewrite.quantize(float_model, calibration=str(tmp_path / "c.npz"))
    assert quantized.SerializeToString() == kenosis_rewrite.quantize(float_model, calibration=feeds).SerializeToString()


def test_the_command_line_takes_calibration_files_for_fix(tmp_path, capsys):
    float_model = _model()
    data = _stack(4, seed=3)
    np.savez(tmp_path / "c.npz", x=data)
    qdq = quantize_with_ort(float_model, [{"x": data[i:i + 1]} for i in range(4)], "u8s8")
    import onnx

    onnx.save(qdq, tmp_path / "in.onnx")
    assert cli.main(["fix", str(tmp_path / "in.onnx"), str(tmp_path / "out.onnx"), "--calibration",
                     str(tmp_path / "c.npz")]) == cli.EXIT_OK
    assert (tmp_path / "out.onnx").exists()
    np.savez(tmp_path / "bad.npz", y=data)
    assert cli.main(["fix", str(tmp_path / "in.onnx"), str(tmp_path / "out2.onnx"), "--calibration",
                     str(tmp_path / "bad.npz")]) == cli.EXIT_REFUSED
    assert "name no input of the model" in capsys.readouterr().err

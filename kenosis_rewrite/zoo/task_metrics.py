"""Task-level agreement of a model's outputs with its FP32 reference, where cosine misleads.

A detector's raw outputs are thousands of candidate scores and box offsets; a text detector's map is
mostly exact zeros; a recogniser's logits are a sequence. Cosine over those tensors weighs what no
user reads (scores far below any threshold) as much as what decides the answer. Each metric here
decodes the outputs as the model's own package does, with its thresholds, and scores how much of
FP32's answer the variant gives:

* :func:`map_iou`: DB text detectors (PaddleOCR), MTCNN P-Net: the map thresholded as the package
  thresholds it; per image, IoU of the variant's mask with FP32's.
* :func:`detection_f1`: box detectors (YOLOv8, YOLOX, PicoDet decoders below): per image, the F1 of
  the variant's detections against FP32's, matched greedily by IoU >= 0.5 within a class.
* :func:`ctc_lines`: CTC recognisers: the share of lines whose greedy decoding equals FP32's.

Each score is a mean over images; images where neither model finds anything (no text pixel, no
box) are left out, and where no image has anything the score is None: there was nothing to agree on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["TaskMetric", "map_iou", "detection_f1", "ctc_lines", "yolov8_detections", "yolox_detections",
           "picodet_detections", "matched_f1"]

Runs = Sequence[Sequence[np.ndarray]]  # per image, the model's outputs
Detections = tuple[np.ndarray, np.ndarray]  # boxes (n, 4) as x1, y1, x2, y2; class ids (n,)


@dataclasses.dataclass(frozen=True)
class TaskMetric:
    """A task score of a variant's runs against FP32's runs on the same images (1.0: the same answer)."""

    name: str  # short, for a table column: "text-map IoU@0.3"
    description: str  # what is decoded and how, with the package's thresholds
    score: Callable[[Runs, Runs], float | None]

    def __call__(self, reference: Runs, runs: Runs) -> float | None:
        if len(reference) != len(runs):
            raise ValueError(f"need the same number of images, got {len(reference)} and {len(runs)}")
        return self.score(reference, runs)


def _mean(values: Sequence[float | None]) -> float | None:
    kept = [value for value in values if value is not None]
    return float(np.mean(kept)) if kept else None


# --------------------------------------------------------------------------- maps


def _mask_iou(reference: np.ndarray, candidate: np.ndarray) -> float | None:
    union = np.count_nonzero(reference | candidate)
    return None if union == 0 else np.count_nonzero(reference & candidate) / union


def map_iou(output: int, threshold: float, channel: int | None = None, name: str = "map IoU",
            description: str = "") -> TaskMetric:
    """IoU of the masks ``map > threshold`` of output ``output`` (its last axis' ``channel`` when
    given, e.g. the face probability of a two-class softmax), per image."""

    def mask(run: Sequence[np.ndarray]) -> np.ndarray:
        values = np.asarray(run[output])
        return (values[..., channel] if channel is not None else values) > threshold

    def score(reference: Runs, runs: Runs) -> float | None:
        return _mean([_mask_iou(mask(r), mask(c)) for r, c in zip(reference, runs)])

    return TaskMetric(f"{name}@{threshold:g}", description or f"IoU of output {output} > {threshold:g}", score)


# --------------------------------------------------------------------------- detections


def _box_iou(a: np.ndarray, b: np.ndarray, pixels: bool = False) -> np.ndarray:
    """IoU of every box of ``a`` (n, 4) with every box of ``b`` (m, 4), as an (n, m) array;
    ``pixels``: the corners are inclusive pixel indices (a box spans x2 - x1 + 1), as YOLOX's NMS has it."""
    extra = 1.0 if pixels else 0.0
    low = np.maximum(a[:, None, :2], b[None, :, :2])
    high = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(high - low + extra, 0, None), axis=2)
    area_a = np.prod(np.clip(a[:, 2:] - a[:, :2] + extra, 0, None), axis=1)
    area_b = np.prod(np.clip(b[:, 2:] - b[:, :2] + extra, 0, None), axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter, dtype=np.float64), where=union > 0)


def _nms(boxes: np.ndarray, scores: np.ndarray, threshold: float, top_k: int | None = None,
         pixels: bool = False) -> np.ndarray:
    """Greedy non-maximum suppression: indices kept, best score first (``pixels``: as :func:`_box_iou`)."""
    order = np.argsort(-scores, kind="stable")
    kept = []
    while order.size and (top_k is None or len(kept) < top_k):
        best, order = order[0], order[1:]
        kept.append(best)
        order = order[_box_iou(boxes[best:best + 1], boxes[order], pixels)[0] <= threshold]
    return np.array(kept, dtype=np.int64)


def _xywh_to_xyxy(boxes: np.ndarray) -> np.ndarray:
    centre, size = boxes[:, :2], boxes[:, 2:4]
    return np.concatenate([centre - size / 2, centre + size / 2], axis=1)


def _clipped(boxes: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """``boxes`` inside an image of ``size`` (height, width)."""
    height, width = size
    return np.clip(boxes, 0, [width, height, width, height])


def matched_f1(reference: Detections, candidate: Detections, iou: float = 0.5) -> float | None:
    """F1 of ``candidate`` against ``reference``: pairs of the same class with IoU >= ``iou``,
    matched greedily (highest IoU first, each box once); None when both are empty."""
    (ref_boxes, ref_classes), (boxes, classes) = reference, candidate
    if len(ref_boxes) + len(boxes) == 0:
        return None
    if len(ref_boxes) == 0 or len(boxes) == 0:
        return 0.0
    overlaps = _box_iou(ref_boxes, boxes)
    overlaps[ref_classes[:, None] != classes[None, :]] = 0.0
    taken_reference, taken = set(), set()
    for flat in np.argsort(-overlaps, axis=None, kind="stable"):
        i, j = np.unravel_index(flat, overlaps.shape)
        if overlaps[i, j] < iou:
            break
        if i not in taken_reference and j not in taken:
            taken_reference.add(i)
            taken.add(j)
    return 2 * len(taken) / (len(ref_boxes) + len(boxes))


def detection_f1(decode: Callable[[Sequence[np.ndarray]], Detections], name: str, description: str,
                 iou: float = 0.5) -> TaskMetric:
    """Per image, :func:`matched_f1` of ``decode(variant's outputs)`` against ``decode(FP32's)``."""

    def score(reference: Runs, runs: Runs) -> float | None:
        return _mean([matched_f1(decode(r), decode(c), iou) for r, c in zip(reference, runs)])

    return TaskMetric(name, description, score)


def yolov8_detections(run: Sequence[np.ndarray], size: tuple[int, int], score: float = 0.25,
                      nms: float = 0.45) -> Detections:
    """Ultralytics YOLOv8's output ``(1, 4 + classes, anchors)`` (centre, size, class scores) as
    nudenet 3.4.2 decodes it (in the input's coordinates): best class score > ``score``, the top-left
    corner clipped into the input's ``size`` (height, width) and the size then to its far edges,
    class-agnostic NMS at ``nms`` (``cv2.dnn.NMSBoxes``)."""
    rows = np.asarray(run[0])[0].T.astype(np.float64)
    classes = rows[:, 4:].argmax(axis=1)
    scores = rows[:, 4:].max(axis=1)
    keep = scores > score
    height, width = size
    corner = np.clip(rows[keep, :2] - rows[keep, 2:4] / 2, 0, [width, height])
    extent = np.minimum(rows[keep, 2:4], [width, height] - corner)
    boxes = np.concatenate([corner, corner + extent], axis=1)
    kept = _nms(boxes, scores[keep], nms)
    return boxes[kept], classes[keep][kept]


def _grid_centres(size: tuple[int, int], strides: Sequence[int], offset: float,
                  partial_cells: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each anchor's (x, y) cell position plus ``offset`` and its stride, level after level, row by
    row; ``partial_cells``: a size that is not a multiple of the stride has a last, partial cell."""
    cells, scales = [], []
    for stride in strides:
        rounding = (lambda extent: -(-extent // stride)) if partial_cells else (lambda extent: extent // stride)
        rows, columns = rounding(size[0]), rounding(size[1])
        x, y = np.meshgrid(np.arange(columns), np.arange(rows))
        cells.append(np.stack([x.ravel(), y.ravel()], axis=1) + offset)
        scales.append(np.full(rows * columns, stride))
    return np.concatenate(cells).astype(np.float64), np.concatenate(scales).astype(np.float64)


def yolox_detections(run: Sequence[np.ndarray], size: tuple[int, int], strides: Sequence[int] = (8, 16, 32),
                     score: float = 0.1, nms: float = 0.45) -> Detections:
    """YOLOX's raw output ``(1, anchors, 5 + classes)`` as ddddocr 1.6.1 decodes it: centre
    ``(offset + cell) * stride``, size ``exp(log size) * stride``, score objectness x class score
    > ``score``, class-agnostic NMS at ``nms`` (on inclusive pixel corners, as ddddocr's), boxes clipped to
    the input's ``size`` (height, width)."""
    rows = np.asarray(run[0])[0].astype(np.float64)
    cells, stride = _grid_centres(size, strides, 0.0, partial_cells=False)
    if len(cells) != len(rows):
        raise ValueError(f"{len(rows)} anchors, but input {size} with strides {tuple(strides)} gives {len(cells)}")
    centre = (rows[:, :2] + cells) * stride[:, None]
    extent = np.exp(rows[:, 2:4]) * stride[:, None]
    class_scores = rows[:, 4:5] * rows[:, 5:]
    classes, scores = class_scores.argmax(axis=1), class_scores.max(axis=1)
    keep = scores > score
    boxes = _xywh_to_xyxy(np.concatenate([centre, extent], axis=1)[keep])
    kept = _nms(boxes, scores[keep], nms, pixels=True)
    return _clipped(boxes[kept], size), classes[keep][kept]


def picodet_detections(run: Sequence[np.ndarray], size: tuple[int, int], strides: Sequence[int] = (8, 16, 32, 64),
                       score: float = 0.5, nms: float = 0.5, level_top_k: int = 1000,
                       class_top_k: int = 100) -> Detections:
    """PicoDet's outputs (each level's class scores ``(1, anchors, classes)``, then each level's box
    distributions ``(1, anchors, 4 * bins)``) as rapid-layout 1.2.1 decodes them: distances are the
    softmax-weighted mean bin times the stride from the cell centre, the ``level_top_k`` best
    anchors of each level, then per class: score > ``score``, NMS at ``nms``, ``class_top_k`` kept;
    boxes clipped to the input's ``size`` (height, width)."""
    levels = len(run) // 2
    boxes, scores = [], []
    for stride, level_scores, distributions in zip(strides, run[:levels], run[levels:]):
        level_scores = np.asarray(level_scores)[0].astype(np.float64)
        distributions = np.asarray(distributions)[0].astype(np.float64)
        bins = distributions.shape[-1] // 4
        cells, _ = _grid_centres(size, [stride], 0.5, partial_cells=True)
        logits = distributions.reshape(-1, bins)
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))
        distance = ((weights / weights.sum(axis=1, keepdims=True)) @ np.arange(bins)).reshape(-1, 4) * stride
        best = np.argsort(-level_scores.max(axis=1), kind="stable")[:level_top_k]
        centre = cells[best] * stride
        boxes.append(np.concatenate([centre - distance[best, :2], centre + distance[best, 2:]], axis=1))
        scores.append(level_scores[best])
    all_boxes, all_scores = np.concatenate(boxes), np.concatenate(scores)
    picked_boxes, picked_classes = [], []
    for class_id in range(all_scores.shape[1]):
        keep = all_scores[:, class_id] > score
        kept = _nms(all_boxes[keep], all_scores[keep, class_id], nms, class_top_k)
        picked_boxes.append(_clipped(all_boxes[keep][kept], size))
        picked_classes.append(np.full(len(kept), class_id))
    return np.concatenate(picked_boxes), np.concatenate(picked_classes)


# --------------------------------------------------------------------------- sequences


def _greedy_ctc(logits: np.ndarray, blank: int) -> tuple[int, ...]:
    """The best path's labels with repeats merged and blanks dropped."""
    best = np.asarray(logits).argmax(axis=-1)
    merged = best[np.concatenate([[True], best[1:] != best[:-1]])]
    return tuple(int(label) for label in merged if label != blank)


def _lines(run: Sequence[np.ndarray], output: int, time_axis: int, blank: int) -> list[tuple[int, ...]]:
    logits = np.moveaxis(np.asarray(run[output]), time_axis, -2)  # (..., time, classes)
    return [_greedy_ctc(line, blank) for line in logits.reshape(-1, *logits.shape[-2:])]


def ctc_lines(output: int, blank: int, time_axis: int, description: str = "") -> TaskMetric:
    """The share of lines whose greedy CTC decoding (argmax per step, repeats merged, ``blank``
    dropped) equals FP32's; ``time_axis`` is the output's time axis (1 for (N, T, C), 0 for (T, N, C))."""
    decode = functools.partial(_lines, output=output, time_axis=time_axis, blank=blank)

    def score(reference: Runs, runs: Runs) -> float | None:
        pairs = [(r, c) for ref, run in zip(reference, runs) for r, c in zip(decode(ref), decode(run))]
        return float(np.mean([r == c for r, c in pairs])) if pairs else None

    return TaskMetric("CTC lines", description or f"lines decoded as FP32 does (blank {blank})", score)

"""Task metrics: each decoder against hand-built outputs whose answer is known, each score against
variants whose agreement with the reference is known."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from kenosis_rewrite.zoo import task_metrics as T


def _no_boxes():
    return np.zeros((0, 4)), np.zeros(0, np.int64)


# --------------------------------------------------------------------------- maps


def test_map_iou_is_the_iou_of_the_thresholded_masks_over_images_where_either_finds_something():
    metric = T.map_iou(0, 0.3, name="text-map IoU")
    reference = np.zeros((1, 1, 4, 4), np.float32)
    reference[..., :2, :2] = 0.9  # 4 pixels
    shifted = np.zeros_like(reference)
    shifted[..., :2, 1:3] = 0.9  # 4 pixels, 2 shared: IoU 2/6
    empty = np.zeros_like(reference)
    assert metric.name == "text-map IoU@0.3"
    assert metric([[reference]], [[reference]]) == 1.0
    assert metric([[reference]], [[shifted]]) == pytest.approx(2 / 6)
    # an image where neither finds anything is left out; one where only one does scores 0
    assert metric([[reference], [empty]], [[shifted], [empty]]) == pytest.approx(2 / 6)
    assert metric([[reference], [empty]], [[reference], [reference]]) == pytest.approx(0.5)
    assert metric([[empty]], [[empty]]) is None
    below = np.where(reference > 0, np.float32(0.3), np.float32(0))  # not above the threshold
    assert metric([[reference]], [[below]]) == 0.0


def test_map_iou_reads_one_channel_of_the_last_axis():
    metric = T.map_iou(1, 0.6, channel=1)
    faces = np.zeros((1, 3, 3, 2), np.float32)
    faces[0, 0, 0, 1] = 0.9
    faces[0, 1, 1, 0] = 0.9  # the no-face channel: not read
    moved = np.zeros_like(faces)
    moved[0, 2, 2, 1] = 0.9
    other_output = np.ones((1, 4))
    assert metric([[other_output, faces]], [[other_output, faces]]) == 1.0
    assert metric([[other_output, faces]], [[other_output, moved]]) == 0.0


def test_metrics_refuse_runs_of_different_lengths():
    with pytest.raises(ValueError, match="same number of images"):
        T.map_iou(0, 0.5)([[np.ones(2)]], [])


# --------------------------------------------------------------------------- detections


def test_matched_f1_matches_each_box_once_within_its_class():
    boxes = np.array([[0, 0, 10, 10], [20, 20, 30, 30]], np.float64)
    classes = np.array([0, 1])
    assert T.matched_f1((boxes, classes), (boxes, classes)) == 1.0
    assert T.matched_f1((boxes, classes), (boxes[:1], classes[:1])) == pytest.approx(2 / 3)
    assert T.matched_f1((boxes, classes), (boxes, classes[::-1])) == 0.0  # right places, wrong classes
    # two candidates on one reference box: one match, the duplicate counts against
    duplicate = np.array([[0, 0, 10, 10], [0, 0, 10, 9]], np.float64)
    assert T.matched_f1((boxes[:1], classes[:1]), (duplicate, np.array([0, 0]))) == pytest.approx(2 / 3)
    # IoU 0.5 matches, just below does not
    assert T.matched_f1((boxes[:1], classes[:1]), (np.array([[0, 0, 10, 5]], np.float64), classes[:1])) == 1.0
    assert T.matched_f1((boxes[:1], classes[:1]), (np.array([[0, 0, 10, 4.9]], np.float64), classes[:1])) == 0.0
    assert T.matched_f1(_no_boxes(), _no_boxes()) is None
    assert T.matched_f1((boxes, classes), _no_boxes()) == 0.0


def test_matched_f1_takes_the_best_overlaps_first():
    """Candidate A overlaps both references, B only the first: greedy by IoU pairs A with the
    second only if that overlap is the larger, so both references are matched."""
    references = np.array([[0, 0, 10, 10], [4, 0, 14, 10]], np.float64)
    candidates = np.array([[4, 0, 14, 10], [0, 0, 10, 10]], np.float64)
    assert T.matched_f1((references, np.zeros(2, np.int64)), (candidates, np.zeros(2, np.int64))) == 1.0


def _yolov8_output(rows: list[tuple[float, float, float, float, float, float]]) -> np.ndarray:
    """(1, 4 + 2 classes, anchors) from rows (cx, cy, w, h, score class 0, score class 1)."""
    return np.array(rows, np.float32).T[None]


def test_yolov8_decoding_thresholds_clips_and_suppresses_overlaps_across_classes():
    output = _yolov8_output([
        (50, 50, 20, 20, 0.9, 0.1),  # kept
        (51, 50, 20, 20, 0.1, 0.8),  # overlaps the first (class-agnostic NMS): suppressed
        (150, 150, 40, 40, 0.2, 0.3),  # kept, class 1
        (250, 250, 10, 10, 0.25, 0.0),  # not above 0.25
        (5, 300, 30, 60, 0.0, 0.5),  # corner clipped to (0, 270), height to the bottom edge
    ])
    boxes, classes = T.yolov8_detections([output], size=(320, 320))
    order = np.argsort(boxes[:, 0])
    np.testing.assert_allclose(boxes[order], [[0, 270, 30, 320], [40, 40, 60, 60], [130, 130, 170, 170]])
    assert classes[order].tolist() == [1, 0, 1]


def test_yolox_decoding_puts_each_anchor_on_its_grid_cell_and_stride():
    size = (32, 64)  # strides 8, 16: 4x8 + 2x4 anchors
    rows = np.zeros((1, 40, 6), np.float32)
    rows[..., 2:4] = np.log(1.0)  # 1 stride wide and high
    rows[0, 8 * 1 + 3] = [0.5, 0.5, np.log(2), np.log(2), 0.9, 0.9]  # stride 8, row 1, column 3
    rows[0, 32 + 4 * 1 + 2] = [0.0, 0.0, 0.0, 0.0, 0.5, 0.5]  # stride 16, row 1, column 2: score 0.25
    rows[0, 5] = [0, 0, 0, 0, 0.3, 0.3]  # score 0.09: not above 0.1
    boxes, classes = T.yolox_detections([rows], size=size, strides=(8, 16))
    # centre (3.5 * 8, 1.5 * 8) = (28, 12), 16 x 16; centre (32, 16), 16 x 16
    np.testing.assert_allclose(boxes, [[20, 4, 36, 20], [24, 8, 40, 24]])
    assert classes.tolist() == [0, 0]
    with pytest.raises(ValueError, match="anchors"):
        T.yolox_detections([rows[:, :39]], size=size, strides=(8, 16))


def test_picodet_decoding_reads_distances_from_the_bin_distributions():
    size = (16, 16)  # strides 8, 16: 2x2 and 1x1 anchors
    bins = 8
    scores = [np.zeros((1, 4, 2), np.float32), np.zeros((1, 1, 2), np.float32)]
    distributions = [np.full((1, 4, 4 * bins), -50.0, np.float32), np.full((1, 1, 4 * bins), -50.0, np.float32)]
    # stride 8, anchor 3 (row 1, column 1; centre (12, 12)): left, top, right, bottom 1, 0.5, 0.5, 0 bins
    scores[0][0, 3, 1] = 0.9
    logits = distributions[0][0, 3].reshape(4, bins)
    logits[0, 1] = logits[3, 0] = 50.0
    logits[1, 0] = logits[1, 1] = logits[2, 0] = logits[2, 1] = 50.0  # even splits: 0.5
    scores[1][0, 0, 0] = 0.4  # not above 0.5
    boxes, classes = T.picodet_detections([*scores, *distributions], size=size, strides=(8, 16))
    np.testing.assert_allclose(boxes, [[12 - 8, 12 - 4, 12 + 4, 12 + 0]], atol=1e-6)
    assert classes.tolist() == [1]


def test_picodet_boxes_are_clipped_to_the_input():
    size = (16, 16)
    scores = [np.zeros((1, 4, 1), np.float32)]
    distributions = [np.full((1, 4, 32), -50.0, np.float32)]
    scores[0][0, 0, 0] = 0.9
    distributions[0][0, 0].reshape(4, 8)[:, 7] = 50.0  # 7 bins (56 px) every side from (4, 4)
    boxes, _ = T.picodet_detections([*scores, *distributions], size=size, strides=(8,))
    np.testing.assert_allclose(boxes, [[0, 0, 16, 16]], atol=1e-6)


def test_detection_f1_decodes_both_runs_and_averages_over_images_with_boxes():
    decode = functools.partial(T.yolov8_detections, size=(320, 320))
    metric = T.detection_f1(decode, "box F1", "test")
    one = _yolov8_output([(50, 50, 20, 20, 0.9, 0.0), (200, 200, 20, 20, 0.0, 0.9)])
    half = _yolov8_output([(50, 50, 20, 20, 0.9, 0.0), (200, 200, 20, 20, 0.0, 0.1)])
    nothing = _yolov8_output([(50, 50, 20, 20, 0.1, 0.0)])
    assert metric([[one], [nothing]], [[one], [nothing]]) == 1.0
    assert metric([[one], [nothing]], [[half], [nothing]]) == pytest.approx(2 / 3)
    assert metric([[nothing]], [[nothing]]) is None


# --------------------------------------------------------------------------- sequences


def test_ctc_lines_compare_greedy_decodings():
    def logits(labels, classes=5):
        steps = np.full((len(labels), classes), -5.0, np.float32)
        steps[np.arange(len(labels)), labels] = 5.0
        return steps

    metric = T.ctc_lines(0, blank=0, time_axis=1)
    same_text = logits([1, 1, 0, 1, 2])  # "1 1 2": the blank separates the repeated 1
    reference = np.stack([logits([1, 0, 1, 2, 2]), logits([3, 3, 3, 0, 0])])  # batch of 2 lines
    candidate = np.stack([same_text, logits([3, 0, 4, 0, 0])])
    assert metric([[reference]], [[reference]]) == 1.0
    assert metric([[reference]], [[candidate]]) == 0.5
    # time-major (T, N, C) with the blank last
    time_major = T.ctc_lines(0, blank=4, time_axis=0)
    assert time_major([[logits([1, 4, 1])[:, None]]], [[logits([1, 1, 4])[:, None]]]) == 0.0
    assert time_major([[logits([1, 4, 4])[:, None]]], [[logits([1, 1, 4])[:, None]]]) == 1.0

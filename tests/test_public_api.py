"""The public API is pinned: its names, where errors come from, and the deprecated names that still work."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest

import kenosis_rewrite
from kenosis_rewrite import errors
from kenosis_rewrite.core import ort_quantize
from kenosis_rewrite.testing import model_checks, toy_models

PUBLIC = {
    "fix", "quantize", "quantize_weights", "prepare", "explain", "save", "rules",
    "FixReport", "FusionReport", "FixPass", "TARGETS",
    "KenosisError", "AlreadyQuantizedError", "CalibrationError", "ControlFlowError", "InvalidModelError",
    "ModelTooLargeError", "NoQDQError", "NotAnOnnxModelError", "PackageUnavailableError", "PeerFailedError",
    "PeerNotInstalledError", "PrepareFailedError", "QOperatorFormatError", "RewriteError", "RuntimeMeasurementError",
    "UnsupportedOpsetError", "UnsupportedTargetError", "UnsupportedValueTypeError", "ZooError",
    "fix_with_report",
}
CALIBRATION_TAKERS = ("fix", "quantize", "prepare")


def test_the_public_names_are_exactly_these():
    assert set(kenosis_rewrite.__all__) == PUBLIC
    assert len(kenosis_rewrite.__all__) == len(PUBLIC)
    for name in PUBLIC:
        assert getattr(kenosis_rewrite, name) is not None


def test_every_error_is_defined_in_errors_and_exported_at_the_top():
    defined = {name for name, value in vars(errors).items()
               if inspect.isclass(value) and issubclass(value, errors.KenosisError)}
    assert defined == set(errors.__all__)
    for name in defined:
        assert getattr(kenosis_rewrite, name) is getattr(errors, name)
        assert getattr(errors, name).__module__ == "kenosis_rewrite.errors"


def test_no_other_module_defines_an_error_class():
    import ast
    import pathlib

    root = pathlib.Path(kenosis_rewrite.__file__).parent
    elsewhere = [f"{path.relative_to(root)}:{node.name}" for path in root.rglob("*.py") if path.name != "errors.py"
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.ClassDef) and node.name.endswith("Error")]
    assert not elsewhere


def test_calibration_data_has_one_name():
    for name in CALIBRATION_TAKERS:
        assert "calibration" in inspect.signature(getattr(kenosis_rewrite, name)).parameters, name


def test_fix_with_report_still_works_and_says_it_is_deprecated():
    float_model = toy_models.build("conv_relu")
    feeds = toy_models.random_feeds(float_model, 4)
    qdq = ort_quantize.quantize_with_ort(float_model, feeds, "u8s8")
    with pytest.warns(DeprecationWarning, match=r"fix\(model, return_report=True\)"):
        old, old_report = kenosis_rewrite.fix_with_report(qdq)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new, new_report = kenosis_rewrite.fix(qdq, return_report=True)
    assert old.SerializeToString() == new.SerializeToString()
    assert old_report.to_dict() == new_report.to_dict()
    for a, b in zip(model_checks.outputs(old, feeds[0]), model_checks.outputs(new, feeds[0])):
        np.testing.assert_array_equal(a, b)


def test_prepare_feeds_keyword_still_works_and_says_it_is_deprecated():
    float_model = toy_models.build("conv_relu")
    feeds = toy_models.random_feeds(float_model, 2)
    with pytest.warns(DeprecationWarning, match=r"use calibration="):
        old = kenosis_rewrite.prepare(float_model, feeds=feeds)
    assert old.SerializeToString() == kenosis_rewrite.prepare(float_model, calibration=feeds).SerializeToString()

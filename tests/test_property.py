"""Property tests of fix() and quantize() on random small graphs (kenosis_rewrite.testing.fuzz).

Each case is one seed: a random FP32 model and a random quantize_static configuration; fix() runs
for every target and must not raise anything but a KenosisError, mutate its input, produce a model
ONNX Runtime refuses, change the interface or output shapes, differ between two calls or on a
second application, break an exact=True promise, or lose more than 0.01 cosine against FP32 —
with fix()'s run-time guard off, so the rules themselves are held to it.

    KENOSIS_PROPERTY_CASES=300 pytest tests/test_property.py      # more fix() cases
    KENOSIS_PROPERTY_QUANTIZE_CASES=50 pytest tests/test_property.py
    python -m kenosis_rewrite.testing.fuzz --replay SEED [--target T]      # one failing case in detail

A configuration that quantize_static itself refuses is skipped (not a failure of fix()).
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from kenosis_rewrite.testing import fuzz

FIX_CASES = int(os.environ.get("KENOSIS_PROPERTY_CASES", "200"))
QUANTIZE_CASES = int(os.environ.get("KENOSIS_PROPERTY_QUANTIZE_CASES", "30"))
SOFTMAX_CASES = int(os.environ.get("KENOSIS_PROPERTY_SOFTMAX_CASES", "24"))
DYNAMIC_CASES = int(os.environ.get("KENOSIS_PROPERTY_DYNAMIC_CASES", "16"))
TRANSFORMER_CASES = int(os.environ.get("KENOSIS_PROPERTY_TRANSFORMER_CASES", "6"))
QUARK_CONSTANT_CASES = int(os.environ.get("KENOSIS_PROPERTY_QUARK_CONSTANT_CASES", "40"))


def _failure_report(case: fuzz.CaseResult) -> str:
    lines = [f"{len(case.failures)} propert{'y' if len(case.failures) == 1 else 'ies'} violated on seed {case.seed} ({case.model})"]
    for failure in case.failures:
        lines.append(f"[{failure.category}] {failure.describe()}")
    return "\n".join(lines)


@pytest.mark.parametrize("seed", range(FIX_CASES))
def test_fix_properties(seed):
    # the run-time guard off: every rule must keep its own promises, not be rescued by the guard
    case = fuzz.check_fix_case(seed, verify=False)
    violated = [f"{f.category} ({f.target})" for f in case.failures]
    assert not violated, _failure_report(case)


# Open findings of the Softmax-head seeds, in other rules than softmax-float-input (which stays
# bit-exact on both): fix() with its run-time guard on catches them, the rules alone do not.
# (seed +19, fold-batchnorm-into-conv through a deleted Clip(-1, 1), passes since implied_clamp reads
# a grid of round bounds as the deleted Clip)
SOFTMAX_FINDINGS: dict[int, str] = {}


@pytest.mark.parametrize("seed", [
    pytest.param(seed, marks=pytest.mark.xfail(strict=True, reason=SOFTMAX_FINDINGS[seed])) if seed in SOFTMAX_FINDINGS
    else seed for seed in range(fuzz.SOFTMAX_HEAD_SEEDS, fuzz.SOFTMAX_HEAD_SEEDS + SOFTMAX_CASES)])
def test_fix_properties_with_softmax_heads(seed):
    # models ending in a Softmax, which softmax-float-input rewrites for ort-cpu
    case = fuzz.check_fix_case(seed, verify=False)
    assert "Softmax" in case.model or case.skipped
    violated = [f"{f.category} ({f.target})" for f in case.failures]
    assert not violated, _failure_report(case)


@pytest.mark.parametrize("seed", range(fuzz.QUARK_CONSTANT_SEEDS, fuzz.QUARK_CONSTANT_SEEDS + QUARK_CONSTANT_CASES))
def test_fix_properties_with_quark_constants(seed):
    # PRelu slopes and Clip bounds dequantized from int8 codes: fold-dequantized-parameters reads
    # them as constants, and the PRelu and Clip rules then apply; every rule still keeps its promise
    case = fuzz.check_fix_case(seed, verify=False)
    assert case.config.get("quantized_parameters")
    violated = [f"{f.category} ({f.target})" for f in case.failures]
    assert not violated, _failure_report(case)


@pytest.mark.parametrize("seed", range(fuzz.DYNAMIC_BATCH_SEEDS, fuzz.DYNAMIC_BATCH_SEEDS + DYNAMIC_CASES))
def test_fix_and_quantize_properties_on_dynamic_batch_exports(seed):
    # symbolic batch, Reshape targets and Resize sizes computed at run time, float data made from
    # shapes: fix() and quantize() outputs must also run at batch 2 where their input does
    model, _, _ = fuzz._model_and_config(seed)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    for case in (fuzz.check_fix_case(seed, verify=False), fuzz.check_quantize_case(seed)):
        violated = [f"{f.category} ({f.target})" for f in case.failures]
        assert not violated, _failure_report(case)


@pytest.mark.parametrize("seed", range(fuzz.TRANSFORMER_SEEDS, fuzz.TRANSFORMER_SEEDS + TRANSFORMER_CASES))
def test_fix_and_quantize_properties_on_small_transformer_encoders(seed):
    # attention (activation x activation MatMuls, heads split by Reshape/Transpose), LayerNormalization
    # or its decomposition, Gelu, residual Adds; exported with a dynamic batch
    model, _, _ = fuzz._model_and_config(seed)
    assert {"Softmax", "MatMul"} <= {node.op_type for node in model.graph.node}
    for case in (fuzz.check_fix_case(seed, verify=False), fuzz.check_quantize_case(seed)):
        violated = [f"{f.category} ({f.target})" for f in case.failures]
        assert not violated, _failure_report(case)


@pytest.mark.parametrize("seed", range(QUANTIZE_CASES))
def test_quantize_not_below_plain_quantize_static(seed):
    case = fuzz.check_quantize_case(seed)
    violated = [f"{f.category} ({f.target})" for f in case.failures]
    assert not violated, _failure_report(case)


def test_generator_is_deterministic_and_valid():
    """The same seed gives byte-identical models, feeds and configs; the models pass the full check."""
    for seed in range(5):
        first = fuzz._model_and_config(seed)
        second = fuzz._model_and_config(seed)
        assert first[0].SerializeToString() == second[0].SerializeToString()
        assert first[2] == second[2]
        assert all(np.array_equal(a[k], b[k]) for a, b in zip(first[1], second[1]) for k in a)
        onnx.checker.check_model(first[0], full_check=True)
        assert len(first[1]) == fuzz.N_FEEDS


def test_summarize_counts_every_category():
    case = fuzz.CaseResult(seed=7, config={"activation_type": "QUInt8"})
    case.fail("fidelity_drop", "npu", "cosine 0.99 -> 0.95", ["some-rule"], 0.04)
    skipped = fuzz.CaseResult(seed=8, skipped=True, skip_reason="quantize_static raised ValueError: x")
    summary = fuzz.summarize([case, skipped])
    assert summary["failures"]["fidelity_drop"] == 1
    assert set(summary["failures"]) == set(fuzz.CATEGORIES)
    assert summary["skipped"] == 1
    assert summary["worst"]["fidelity_drop"][0]["replay"] == "python -m kenosis_rewrite.testing.fuzz --replay 7 --target npu"


def _reference(seed: int):
    """Case ``seed``'s input QDQ model and the outputs every target is compared with (as check_fix_case builds them)."""
    from kenosis_rewrite.testing import fuzz_properties as properties  # noqa: PLC0415

    fp32, feeds, config = fuzz._model_and_config(seed)
    qdq, reason = properties.quantize_or_skip(fp32, config, feeds[:fuzz.N_CALIBRATION])
    assert qdq is not None, reason
    evaluation = feeds[fuzz.N_CALIBRATION:]
    names, qdq_outputs = properties.run_model(qdq.SerializeToString(), evaluation, "disable_all")
    _, fp32_outputs = properties.run_model(fp32.SerializeToString(), evaluation, "disable_all")
    return properties._Reference(qdq, qdq.SerializeToString(), names, qdq_outputs, fp32_outputs,
                                 properties.min_cosine(fp32_outputs, qdq_outputs), evaluation)


def test_scale_jitter_moves_only_the_activation_steps():
    from kenosis_rewrite.testing.fuzz_running import scale_jittered  # noqa: PLC0415

    ref = _reference(1)
    activation_scales = {node.input[1] for node in ref.qdq.graph.node if node.op_type == "QuantizeLinear"}
    assert activation_scales
    before = {t.name: onnx.numpy_helper.to_array(t) for t in ref.qdq.graph.initializer}
    jittered = scale_jittered(ref.qdq, np.random.default_rng(0), 0.01)
    after = {t.name: onnx.numpy_helper.to_array(t) for t in jittered.graph.initializer}
    assert before.keys() == after.keys()
    for name, array in before.items():
        if name in activation_scales:
            ratio = after[name].astype(np.float64) / array
            assert np.all(np.abs(ratio - 1) <= 0.01 + 1e-6) and not np.array_equal(after[name], array), name
        else:
            assert np.array_equal(after[name], array), name  # weights, their scales, zero points
    assert [n.SerializeToString() for n in jittered.graph.node] == [n.SerializeToString() for n in ref.qdq.graph.node]
    unchanged = scale_jittered(ref.qdq, np.random.default_rng(0), 0.0)
    assert all(np.array_equal(onnx.numpy_helper.to_array(t), before[t.name]) for t in unchanged.graph.initializer)


def test_a_real_fidelity_drop_still_fails_on_a_well_conditioned_graph():
    """The 1% jitter moves a well-conditioned graph's fidelity by less than half the tolerance, so a rewrite that ruins the
    outputs fails as before (its message gives the jitter's range)."""
    from kenosis_rewrite.core.report import FixReport  # noqa: PLC0415
    from kenosis_rewrite.testing import fuzz_properties as properties  # noqa: PLC0415
    from kenosis_rewrite.testing.fuzz_running import jittered_cosines  # noqa: PLC0415

    ref = _reference(1)
    jittered = jittered_cosines(ref.qdq, ref.eval_feeds, ref.fp32_outputs, seed=1)
    assert max(jittered) - min(jittered) < fuzz.FIDELITY_TOLERANCE / 2 and min(jittered) > 0.98, jittered
    case = fuzz.CaseResult(seed=1)
    result = fuzz.TargetResult("ort-cpu", changes={"some-approximate-rule": 1})
    report = FixReport(target="ort-cpu")
    report.changed("some-approximate-rule", "n", "changed", exact=False)
    ruined = [[np.asarray(o) + np.random.default_rng(0).normal(0, 0.5 * np.std(o) + 1e-3, np.shape(o)).astype(o.dtype)
               for o in outputs] for outputs in ref.qdq_outputs]
    properties._check_numbers(case, ref, result, ruined, report)
    assert [f.category for f in case.failures] == ["fidelity_drop"]
    assert "jittered by 1%" in case.failures[0].message and not result.notes


def test_a_drop_the_inputs_own_jitter_makes_is_not_a_failure():
    """Seed 30000770: a transformer with two LayerNorms in a row, one feed's rows of near-equal
    values amplifying rounding noise: ±1% on the activation steps alone moves the input's cosine by
    more than the tolerance, and TensorRT's symmetric conversion (within its bound on every tensor)
    lands inside that spread. Counted apart, not as a failure."""
    from kenosis_rewrite.testing.fuzz_running import jittered_cosines  # noqa: PLC0415

    ref = _reference(30000770)
    jittered = jittered_cosines(ref.qdq, ref.eval_feeds, ref.fp32_outputs, seed=30000770)
    assert ref.cos_qdq - min(jittered) > fuzz.FIDELITY_TOLERANCE, (ref.cos_qdq, jittered)
    case = fuzz.check_fix_case(30000770, targets=("tensorrt",), verify=False)
    assert not case.failures, [f.describe() for f in case.failures]
    notes = [note for result in case.targets for note in result.notes if note.startswith(fuzz.WITHIN_JITTER)]
    # TensorRT's residual Add -> Relu placed as it fuses (residual-add-activation) took this seed from
    # 0.86995 (a drop inside the jitter, noted) to 0.91653, inside the symmetric conversion's own bound
    (result,) = case.targets
    assert result.cos_fixed >= 0.86995 and result.changes.get("residual-add-activation")
    assert fuzz.summarize([case])["within_jitter"] == [f"seed 30000770 tensorrt {note}" for note in notes]

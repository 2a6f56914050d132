"""The properties the fuzz checks on one case (:mod:`kenosis_rewrite.testing.fuzz`), and how a case's result is recorded.

:func:`check_fix_case` and :func:`check_quantize_case` each take one seed; every property that
fails is a :class:`Failure` in one of :data:`CATEGORIES`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import time

import numpy as np
import onnx

from kenosis_rewrite.errors import KenosisError
from kenosis_rewrite.placement.guard import cosine_floor
from kenosis_rewrite.placement.pipeline import (
    fix,
    interface,  # what fix() promises to keep, as fix() checks it
)
from kenosis_rewrite.placement.targets import TARGETS
from kenosis_rewrite.quantization.pipeline import quantize
from kenosis_rewrite.testing.fuzz_configs import plain_quant_config, quantize_or_skip, random_quant_config, silenced
from kenosis_rewrite.testing.fuzz_models import N_CALIBRATION, N_FEEDS, random_float_model
from kenosis_rewrite.testing.fuzz_running import (
    all_equal,
    first_line,
    float_weighted_ops,
    jittered_cosines,
    max_abs_diff,
    min_cosine,
    run_model,
    short_traceback,
    structural_diff,
)

FIDELITY_TOLERANCE = 0.01
# quantize() against plain quantize_static, on QUANTIZE_EVAL_FEEDS held-out feeds (issue 53: never
# more than 0.005 below). On the 2 feeds fix() cases use, seed 7100195 read 0.972 against 0.990;
# on 64 fresh feeds of the same distribution it is 0.9730 against 0.9685.
QUANTIZE_TOLERANCE = 0.005
QUANTIZE_EVAL_FEEDS = 32
# a fidelity drop that the input's own noise makes as well (not a failure: counted apart)
WITHIN_JITTER = "within the input's jitter"

# Failure categories, in the order the summary prints them, with their titles.
CATEGORY_TITLES = (
    ("uncaught", "uncaught exception (not a KenosisError)"),
    ("input_mutated", "input mutated"),
    ("ort_enable_all", "ORT refuses ORT_ENABLE_ALL"),
    ("ort_disable_all", "ORT refuses ORT_DISABLE_ALL"),
    ("shape_change", "output names/shapes changed"),
    ("interface_change", "interface change"),
    ("non_idempotent", "non-idempotent"),
    ("non_deterministic", "non-deterministic"),
    ("exactness_break", "exactness break (all changes exact=True)"),
    ("fidelity_drop", f"fidelity drop > {FIDELITY_TOLERANCE}"),
    ("quantize_below_plain", f"quantize() below plain > {QUANTIZE_TOLERANCE}"),
    ("integer_lost", "runs float what its input / plain quantize_static runs integer"),
    ("batch_lost", "runs at batch 1 only where the input runs at batch 2"),
    ("timeout", "case timed out (hang in fix()/quantize()?)"),
    ("harness", "harness error (bug in the fuzzer itself)"),
)
CATEGORIES = tuple(key for key, _ in CATEGORY_TITLES)


# --- results


@dataclasses.dataclass
class Failure:
    """One violated property, with what it takes to replay it."""

    category: str
    seed: int
    target: str | None
    message: str
    config: dict | None = None
    rules: list[str] = dataclasses.field(default_factory=list)
    value: float | None = None  # the size of the violation (drop, max abs diff), for ranking

    @property
    def replay(self) -> str:
        if self.target == "quantize()":
            return f"python -m kenosis_rewrite.testing.fuzz --replay-quantize {self.seed}"
        target = f" --target {self.target}" if self.target else ""
        return f"python -m kenosis_rewrite.testing.fuzz --replay {self.seed}{target}"

    def describe(self) -> str:
        value = "" if self.value is None else f" [{self.value:.4g}]"
        rules = f" rules={','.join(self.rules)}" if self.rules else ""
        return (f"seed={self.seed} target={self.target}{value}{rules}: {self.message}\n    config={json.dumps(self.config)}\n"
                f"    replay: {self.replay}")


@dataclasses.dataclass
class TargetResult:
    """What one ``fix(target=...)`` call did on one case."""

    target: str
    seconds: float = 0.0
    typed_error: str | None = None  # "ClassName: message" of an allowed KenosisError
    changes: dict[str, int] = dataclasses.field(default_factory=dict)
    all_exact: bool | None = None
    cos_fixed: float | None = None
    drop: float | None = None
    max_abs_diff: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CaseResult:
    """Everything one seed produced: skip reason, per-target results, failures, timing."""

    seed: int
    kind: str = "fix"  # "fix" or "quantize"
    config: dict | None = None
    skipped: bool = False
    skip_reason: str | None = None
    model: str = ""  # opset and op-type counts of the FP32 model
    cos_qdq: float | None = None
    cos_plain: float | None = None
    cos_quantize: float | None = None
    targets: list[TargetResult] = dataclasses.field(default_factory=list)
    failures: list[Failure] = dataclasses.field(default_factory=list)
    fix_calls: int = 0
    quantize_calls: int = 0
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.failures)

    def fail(self, category: str, target: str | None, message: str, rules=(), value: float | None = None) -> None:
        self.failures.append(Failure(category, self.seed, target, message, self.config, list(rules), value))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _describe_model(model: onnx.ModelProto) -> str:
    counts = collections.Counter(node.op_type for node in model.graph.node)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    inputs = [list(d.dim_value for d in v.type.tensor_type.shape.dim) for v in model.graph.input]
    return f"opset {opset}, input {inputs}, outputs {len(model.graph.output)}, " + ", ".join(f"{k}x{v}" for k, v in sorted(counts.items()))


# --- property checks


@dataclasses.dataclass
class _Reference:
    """What every target's output is compared with: the input QDQ model and the FP32 outputs."""

    qdq: onnx.ModelProto
    qdq_bytes: bytes
    names: list[str]
    qdq_outputs: list[list[np.ndarray]]  # ORT_DISABLE_ALL
    fp32_outputs: list[list[np.ndarray]]  # ORT_DISABLE_ALL
    cos_qdq: float
    eval_feeds: list[dict]
    verify: bool = True  # fix()'s run-time guard on; off tests the rules' own promises
    batch_feeds: list[dict] | None = None  # dynamic-batch seeds: a batch of 2 the input model runs on
    batch_shapes: list[tuple] | None = None  # its output shapes there


def _batch_of_two(model_bytes: bytes, seed: int, eval_feeds: list[dict]) -> tuple[list[dict] | None, list[tuple] | None]:
    """For a dynamic-batch seed, the evaluation feeds as one batch of 2 and ``model``'s output
    shapes on it; (None, None) for other seeds and where the model runs at batch 1 only (an
    export that squeezes its batch dim)."""
    if seed < DYNAMIC_BATCH_SEEDS or len(eval_feeds) < 2:
        return None, None
    feeds = [{name: np.concatenate([eval_feeds[0][name], eval_feeds[1][name]]) for name in eval_feeds[0]}]
    try:
        _, outputs = run_model(model_bytes, feeds, "disable_all")
    except Exception:  # noqa: BLE001 - runs at batch 1 only: nothing to keep
        return None, None
    return feeds, [tuple(np.shape(o)) for o in outputs[0]]


def _check_batch(case: CaseResult, ref: _Reference, model_bytes: bytes, target: str, rules) -> None:
    """Where the input model runs at batch 2, the output runs there too, with the same output shapes."""
    if ref.batch_feeds is None:
        return
    try:
        _, outputs = run_model(model_bytes, ref.batch_feeds, "enable_all")
    except Exception as error:  # noqa: BLE001
        case.fail("batch_lost", target, f"the input runs at batch 2, the output does not: {first_line(error, 300)}", rules)
        return
    shapes = [tuple(np.shape(o)) for o in outputs[0]]
    if shapes != ref.batch_shapes:
        case.fail("batch_lost", target, f"at batch 2 the outputs have shapes {shapes}, the input's {ref.batch_shapes}", rules)


def _call_fix(model, target: str, verify: bool = True):

    return fix(model, target=target, return_report=True, verify=verify)


def _check_outputs(case: CaseResult, ref: _Reference, fixed_bytes: bytes, target: str, rules) -> dict:
    """Run the fixed model at both levels; record refusals and name/shape changes. Returns level -> outputs."""
    results = {}
    for level in ("enable_all", "disable_all"):
        try:
            names, outputs = run_model(fixed_bytes, ref.eval_feeds, level)
        except Exception as error:  # noqa: BLE001
            case.fail(f"ort_{level}", target, f"{type(error).__name__}: {first_line(error, 400)}", rules)
            continue
        shapes = [tuple(np.shape(o)) for o in outputs[0]]
        expected = [tuple(np.shape(o)) for o in ref.qdq_outputs[0]]
        if names != ref.names or shapes != expected:
            case.fail("shape_change", target,
                      f"{level}: outputs {list(zip(names, shapes))}, input QDQ {list(zip(ref.names, expected))}", rules)
            continue
        results[level] = outputs
    return results


def _check_numbers(case: CaseResult, ref: _Reference, result: TargetResult, outputs, report) -> None:
    """Exactness (all changes exact => bit-equal at ORT_DISABLE_ALL) and fidelity against FP32."""
    rules = sorted(result.changes)
    result.all_exact = all(change.exact for change in report.changes)
    result.max_abs_diff = max_abs_diff(ref.qdq_outputs, outputs)
    if result.all_exact and not all_equal(ref.qdq_outputs, outputs):
        exact_rules = sorted({c.rule for c in report.changes})
        case.fail("exactness_break", result.target, f"every change says exact=True but max abs diff {result.max_abs_diff:.4g}",
                  exact_rules, result.max_abs_diff)
    result.cos_fixed = min_cosine(ref.fp32_outputs, outputs)
    result.drop = ref.cos_qdq - result.cos_fixed
    if math.isnan(ref.cos_qdq):
        return  # the input QDQ model's own outputs are not finite: no fidelity to keep (exactness is checked above)
    floor = cosine_floor(ref.cos_qdq, set(result.changes), FIDELITY_TOLERANCE)
    if result.cos_fixed >= floor:
        return
    message = f"cosine vs FP32 {ref.cos_qdq:.5f} (input QDQ) -> {result.cos_fixed:.5f} (fixed; floor {floor:.5f})"
    # the input's fidelity is one draw of its rounding noise; where that draw moves as far with every
    # step jittered by 1%, the floor is taken from the input's worst draw
    jittered = jittered_cosines(ref.qdq, ref.eval_feeds, ref.fp32_outputs, case.seed)
    jitter_floor = cosine_floor(min(jittered), set(result.changes), FIDELITY_TOLERANCE)
    jitter = f"the input with its activation steps jittered by 1%: {min(jittered):.5f}-{max(jittered):.5f}"
    if result.cos_fixed >= jitter_floor:  # NaN counts as a drop
        result.notes.append(f"{WITHIN_JITTER}: {message}; {jitter}, floor {jitter_floor:.5f}")
        return
    case.fail("fidelity_drop", result.target, f"{message}; {jitter}", rules, result.drop)


def _check_repeat(case: CaseResult, ref: _Reference, fixed: onnx.ModelProto, fixed_bytes: bytes, target: str, rules) -> None:
    """Determinism (fix twice on the input) and idempotence (fix on the output)."""
    checks = (("non_deterministic", ref.qdq, "fix(input) again"), ("non_idempotent", fixed, "fix(fixed)"))
    for category, source, what in checks:
        case.fix_calls += 1
        try:
            again, _ = _call_fix(source, target, ref.verify)
        except Exception as error:  # noqa: BLE001

            typed = isinstance(error, KenosisError)
            kind = category if typed else "uncaught"
            detail = "" if typed else "\n" + short_traceback(error)
            case.fail(kind, target, f"{what} raised {type(error).__name__}: {first_line(error)}{detail}", rules)
            continue
        if again.SerializeToString() == fixed_bytes:
            continue
        diff = structural_diff(fixed, again)
        if category == "non_deterministic":
            case.fail(category, target, f"{what} gave different bytes; {diff or 'structurally equal (names/order/metadata differ)'}", rules)
        elif diff is not None:
            case.fail(category, target, f"{what} differs: {diff}", rules)
        else:
            note = "fix(fixed) byte-different but structurally equal"
            next(r for r in case.targets if r.target == target).notes.append(note)


def _check_target(case: CaseResult, ref: _Reference, target: str) -> None:
    """All properties of ``fix(qdq, target=target)``."""

    result = TargetResult(target)
    case.targets.append(result)
    start = time.perf_counter()
    case.fix_calls += 1
    try:
        fixed, report = _call_fix(ref.qdq, target, ref.verify)
    except KenosisError as error:
        result.typed_error = f"{type(error).__name__}: {first_line(error)}"
    except Exception as error:  # noqa: BLE001
        case.fail("uncaught", target, f"{type(error).__name__}: {first_line(error)}\n{short_traceback(error)}")
    if ref.qdq.SerializeToString() != ref.qdq_bytes:
        case.fail("input_mutated", target, "fix() modified the caller's ModelProto")
        ref.qdq.ParseFromString(ref.qdq_bytes)  # the next target must see the original
    if result.typed_error is not None or any(f.target == target and f.category == "uncaught" for f in case.failures):
        result.seconds = time.perf_counter() - start
        return
    result.changes = report.change_counts()
    result.notes.extend(f"{target}: {note}" for note in report.notes if note.startswith("run-time guard"))
    rules = sorted(result.changes)
    if interface(fixed) != interface(ref.qdq):
        case.fail("interface_change", target, "graph inputs, outputs or opset imports differ from the input", rules)
    fixed_bytes = fixed.SerializeToString()
    outputs = _check_outputs(case, ref, fixed_bytes, target, rules)
    if "disable_all" in outputs:
        _check_numbers(case, ref, result, outputs["disable_all"], report)
        _check_batch(case, ref, fixed_bytes, target, rules)
        if target == "ort-cpu" and "enable_all" in outputs:  # fix() must not lose an integer kernel
            _check_no_more_float(case, target, fixed_bytes, ref.qdq_bytes, "its input", rules)
    _check_repeat(case, ref, fixed, fixed_bytes, target, rules)
    result.seconds = time.perf_counter() - start


# Seeds from here on end every model in a Softmax head (fuzz_models._with_softmax_head); seeds below
# give the models they gave before heads existed (the regression seeds replay the same cases).
SOFTMAX_HEAD_SEEDS = 1_000_000
# Seeds from here up to DYNAMIC_BATCH_SEEDS have their PRelu slopes and Clip bounds written as
# dequantized int8 constants after quantize_static, as Quark writes every constant
# (fuzz_configs._quantized_parameters).
QUARK_CONSTANT_SEEDS = 10_000_000
# Seeds from here on are written as exported with a dynamic batch (fuzz_models.as_dynamic_export):
# symbolic batch dim, shape arithmetic in the graph; their outputs must also run at batch 2 where
# the input model does.
DYNAMIC_BATCH_SEEDS = 20_000_000
# Seeds from here on are small transformer encoders (fuzz_dense_layers.build_transformer), exported with a
# dynamic batch too.
TRANSFORMER_SEEDS = 30_000_000


def _more_feeds(like: dict, seed: int) -> list[dict]:
    """Held-out feeds for the quantize cases, beyond the case's own: drawn like them (N(0, 1)), from
    their own stream, up to :data:`QUANTIZE_EVAL_FEEDS` evaluation feeds in all."""
    rng = np.random.default_rng([seed, 53])
    extra = QUANTIZE_EVAL_FEEDS - (N_FEEDS - N_CALIBRATION)
    return [{name: rng.standard_normal(value.shape).astype(value.dtype) for name, value in like.items()}
            for _ in range(extra)]


def _random_model(seed: int, rng: np.random.Generator) -> tuple[onnx.ModelProto, list[dict]]:
    return random_float_model(rng, softmax_head=seed >= SOFTMAX_HEAD_SEEDS, dynamic_batch=seed >= DYNAMIC_BATCH_SEEDS,
                              transformer=seed >= TRANSFORMER_SEEDS)


def _model_and_config(seed: int) -> tuple[onnx.ModelProto, list[dict], dict]:
    rng = np.random.default_rng(seed)
    fp32, feeds = _random_model(seed, rng)
    config = random_quant_config(rng, [node.op_type for node in fp32.graph.node])
    if QUARK_CONSTANT_SEEDS <= seed < DYNAMIC_BATCH_SEEDS:
        config["quantized_parameters"] = True
    return fp32, feeds, config


def check_fix_case(seed: int, targets: tuple[str, ...] | None = None, verify: bool = True) -> CaseResult:
    """Generate, quantize and ``fix()`` case ``seed`` for every target; check every property.

    ``verify=False`` turns fix()'s run-time guard off, so that the rules themselves are held to
    their promises (the guard would undo a rule that breaks them).

    Failures are recorded in ``CaseResult.failures`` (never raised); a configuration that
    ``quantize_static`` (or ORT, on its output) refuses marks the case skipped.
    """

    start = time.perf_counter()
    fp32, feeds, config = _model_and_config(seed)
    case = CaseResult(seed=seed, kind="fix", config=config, model=_describe_model(fp32))
    case.quantize_calls += 1
    qdq, reason = quantize_or_skip(fp32, config, feeds[:N_CALIBRATION])
    if qdq is None:
        case.skipped, case.skip_reason = True, reason
        case.seconds = time.perf_counter() - start
        return case
    eval_feeds = feeds[N_CALIBRATION:]
    qdq_bytes = qdq.SerializeToString()
    try:
        names, qdq_outputs = run_model(qdq_bytes, eval_feeds, "disable_all")
    except Exception as error:  # noqa: BLE001 - the input, not fix(), is broken
        case.skipped, case.skip_reason = True, f"the quantize_static output fails on the evaluation feeds: {first_line(error)}"
        case.seconds = time.perf_counter() - start
        return case
    _, fp32_outputs = run_model(fp32.SerializeToString(), eval_feeds, "disable_all")
    case.cos_qdq = min_cosine(fp32_outputs, qdq_outputs)
    ref = _Reference(qdq, qdq_bytes, names, qdq_outputs, fp32_outputs, case.cos_qdq, eval_feeds, verify,
                     *_batch_of_two(qdq_bytes, seed, eval_feeds))
    for target in targets or TARGETS:
        _check_target(case, ref, target)
    case.seconds = time.perf_counter() - start
    return case


def _check_no_more_float(case: CaseResult, target: str, model_bytes: bytes, reference_bytes: bytes,
                         reference: str, rules) -> None:
    """ORT must run no more Conv/Gemm/MatMul in float on ``model_bytes`` than on ``reference_bytes``
    (graph-output producers aside: :func:`float_weighted_ops`)."""
    ours, theirs = float_weighted_ops(model_bytes), float_weighted_ops(reference_bytes)
    if len(ours) > len(theirs):
        case.fail("integer_lost", target, f"ORT runs {len(ours)} Conv/Gemm/MatMul in float on {target}'s model "
                  f"({', '.join(ours)}), {len(theirs)} on {reference}", rules, float(len(ours) - len(theirs)))


def _below_plain(case: CaseResult, result: TargetResult, plain: onnx.ModelProto, ref: _Reference) -> None:
    """quantize() more than the tolerance below plain quantize_static: a failure, unless plain
    itself falls as far with its activation steps jittered by 1% (its cosine is one draw of noise
    the graph amplifies, see :func:`jittered_cosines`)."""
    message = f"cosine vs FP32: quantize() {case.cos_quantize:.5f}, plain quantize_static {case.cos_plain:.5f}"
    jittered = jittered_cosines(plain, ref.eval_feeds, ref.fp32_outputs, case.seed)
    jitter = f"plain with its activation steps jittered by 1%: {min(jittered):.5f}-{max(jittered):.5f}"
    if case.cos_quantize >= min(jittered) - FIDELITY_TOLERANCE:
        result.notes.append(f"{WITHIN_JITTER}: {message}; {jitter}")
        return
    case.fail("quantize_below_plain", "quantize()", f"{message}; {jitter}", sorted(result.changes), result.drop)


def check_quantize_case(seed: int) -> CaseResult:
    """``kenosis_rewrite.quantize()`` against plain ``quantize_static`` (u8/s8 per-channel) on case ``seed``.

    Failures: quantize() raises a non-KenosisError, its output does not run (or changes output
    names/shapes, or runs at batch 1 only where the FP32 model runs at batch 2: dynamic-batch
    seeds), or its cosine against FP32 on :data:`QUANTIZE_EVAL_FEEDS` held-out feeds is more than
    :data:`QUANTIZE_TOLERANCE` below plain's. Where
    quantize_static refuses the model, quantize() must still give a model that runs (no cosine to
    compare with).
    """

    start = time.perf_counter()
    fp32, feeds = _random_model(seed, np.random.default_rng(seed))
    case = CaseResult(seed=seed, kind="quantize", config=plain_quant_config(), model=_describe_model(fp32))
    calibration, eval_feeds = feeds[:N_CALIBRATION], feeds[N_CALIBRATION:] + _more_feeds(feeds[0], seed)
    case.quantize_calls += 1
    plain, reason = quantize_or_skip(fp32, case.config, calibration)
    names, fp32_outputs = run_model(fp32.SerializeToString(), eval_feeds, "disable_all")
    if plain is None:
        # nothing to compare with, but quantize() must still give a model that runs
        case.skip_reason = f"plain: {reason}; quantize() checked for running only"
    else:
        case.cos_plain = min_cosine(fp32_outputs, run_model(plain.SerializeToString(), eval_feeds, "disable_all")[1])
    result = TargetResult("quantize()")
    case.targets.append(result)
    t0 = time.perf_counter()
    try:
        with silenced():
            model, report = quantize(fp32, calibration=calibration, return_report=True)
    except KenosisError as error:
        result.typed_error = f"{type(error).__name__}: {first_line(error)}"
        result.seconds = time.perf_counter() - t0
        case.seconds = time.perf_counter() - start
        return case
    except Exception as error:  # noqa: BLE001
        case.fail("uncaught", "quantize()", f"{type(error).__name__}: {first_line(error)}\n{short_traceback(error)}")
        case.seconds = time.perf_counter() - start
        return case
    result.seconds = time.perf_counter() - t0
    result.changes = report.change_counts()
    fp32_bytes = fp32.SerializeToString()
    ref = _Reference(fp32, b"", names, fp32_outputs, fp32_outputs, 1.0, eval_feeds, True, *_batch_of_two(fp32_bytes, seed, eval_feeds))
    model_bytes = model.SerializeToString()
    outputs = _check_outputs(case, ref, model_bytes, "quantize()", sorted(result.changes))
    if "disable_all" in outputs:
        _check_batch(case, ref, model_bytes, "quantize()", sorted(result.changes))
    if "disable_all" in outputs and plain is not None:
        case.cos_quantize = min_cosine(fp32_outputs, outputs["disable_all"])
        result.cos_fixed = case.cos_quantize
        result.drop = case.cos_plain - case.cos_quantize
        if not result.drop <= QUANTIZE_TOLERANCE:
            _below_plain(case, result, plain, ref)
        # where quantize() quantizes every op (the full plan), as many integer kernels as plain's
        if any(note.startswith("plan: full") for note in report.notes):
            _check_no_more_float(case, "quantize()", model_bytes, plain.SerializeToString(),
                                 "plain quantize_static's", sorted(result.changes))
    case.seconds = time.perf_counter() - start
    return case

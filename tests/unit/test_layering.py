"""DESIGN.md §1-§2: core/ is pure Python (no torch, no runner/engine/models), so it is tested with fake
runner outputs; inputs/ holds no engine state."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "mmserve"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted((SRC / "core").glob("*.py")), ids=lambda p: p.name)
def test_core_imports_no_torch_and_no_runner(path):
    bad = {n for n in _imports(path) if n.split(".")[0] == "torch"
           or n.startswith(("mmserve.runner", "mmserve.engine", "mmserve.models", "mmserve.entrypoints"))}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted((SRC / "inputs").glob("*.py")), ids=lambda p: p.name)
def test_inputs_know_no_engine(path):
    bad = {n for n in _imports(path) if n.startswith(("mmserve.core", "mmserve.runner", "mmserve.engine"))}
    assert not bad, f"{path.name} imports {sorted(bad)}"

"""docs/architecture.md §1-§3: core/ is pure Python (no torch, no runner/engine/models), so it is tested with fake
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


FAMILY_DIRS = sorted(p.name for p in (SRC / "models").iterdir()
                     if p.is_dir() and p.name not in ("layers", "__pycache__"))
OUTSIDE_MODELS = sorted(p for p in SRC.rglob("*.py") if "models" not in p.relative_to(SRC).parts)
SHARED_MODEL_MODULES = sorted(p for p in (SRC / "models").glob("*.py") if p.name != "registry.py")


def _family_imports(path: Path) -> set[str]:
    return {n for n in _imports(path) if n.split(".")[:2] == ["mmserve", "models"]
            and len(n.split(".")) > 2 and n.split(".")[2] in FAMILY_DIRS}


def test_family_folders_are_found():
    assert {"qwen2_vl", "qwen3_vl", "llava_onevision"} <= set(FAMILY_DIRS)


@pytest.mark.parametrize("path", OUTSIDE_MODELS + SHARED_MODEL_MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_only_the_registry_knows_families(path):
    """Families are plug-ins: the engine, runner, core, server and inputs read a FamilySpec; only
    models/registry.py names a family's folder."""
    bad = _family_imports(path)
    assert not bad, f"{path.relative_to(SRC)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted((SRC / "runner").glob("*.py")), ids=lambda p: p.name)
def test_runner_takes_from_core_only_the_step_contract(path):
    bad = {n for n in _imports(path) if n.startswith("mmserve.core") and n != "mmserve.core.step"}
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_the_layering_check_would_catch_a_family_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from mmserve.models.qwen2_vl.processor import Qwen2VLProcessor\n")
    assert _family_imports(probe) == {"mmserve.models.qwen2_vl.processor"}


@pytest.mark.parametrize("path", sorted((SRC / "workers").glob("*.py")), ids=lambda p: p.name)
def test_workers_hold_no_request_state(path):
    """Encoder workers see items only: nothing from the scheduler, the engine or the server."""
    bad = {n for n in _imports(path) if n.startswith(("mmserve.core", "mmserve.engine", "mmserve.entrypoints"))}
    assert not bad, f"{path.name} imports {sorted(bad)}"

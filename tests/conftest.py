"""Shared fixtures: tiny random checkpoints of every family, each built once per test session on
first use. `family` / `model_dir` run a test over the Qwen2-VL families (whose prompts and
references those tests spell out); `served_family` / `served_model_dir` run it over every family
the engine serves. Engines the tests build run their CPU decode step eagerly unless asked to compile
it (`MMSERVE_COMPILE_CPU_DECODE=0` for the session and the server processes it starts).

Tiers: a test is marked by its folder, `unit` (tests/unit: no weights, fake runner outputs), `models`
(tests/models: tiny checkpoints against transformers, engines in process, encoder workers) or `e2e`
(tests/e2e: the real server as a subprocess, the `openai` client, the browser) or `docs` (tests/docs: every
code block of the README and docs/ run against the demo model, and the site's build); `slow` is marked by
hand on what runs long or is timed, `kernels` on what builds or loads mmserve's C++ CPU kernels.
`bash scripts/test.sh --fast` runs `unit and not slow and not kernels`: a unit test not marked `kernels`
that tries to build a kernel fails (`_unit_tests_build_no_kernels`), so the fast tier never compiles C++.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from mmserve.envs import COMPILE_CPU_DECODE
from testkit.families import FAMILIES as SERVED_FAMILIES

# the suite builds hundreds of short-lived engines (and servers, whose processes inherit this): none
# compiles its CPU decode step in the background unless a test asks (tests/models/test_compiled_decode.py)
os.environ.setdefault(COMPILE_CPU_DECODE, "0")
# Hypothesis fails an example that runs past 200 ms unless told otherwise: a verdict a busy machine would
# decide. Nothing here is timed by Hypothesis; a hang is caught by fixtures/fuzz.py's `within`.
settings.register_profile("mmserve", deadline=None)
settings.load_profile("mmserve")

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
TIERS = ("unit", "models", "e2e", "docs")  # the folders under tests/, each its tier's marker


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    for item in items:
        folder = Path(item.fspath).relative_to(root).parts[0]
        if folder not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(folder)


def _plain_unit_test(node: pytest.Item) -> bool:
    """In the unit tier and not marked `kernels`: what `scripts/test.sh --fast` runs (but `slow`)."""
    return node.get_closest_marker("unit") is not None and node.get_closest_marker("kernels") is None


@pytest.fixture(autouse=True)
def _unit_tests_use_one_torch_thread(request):
    """A unit test's tensors are tiny: one intra-op thread computes them as fast as two, and on a busy
    machine two are ten times slower and more (each parallel region waits for a thread the OS has
    parked). The tests marked `kernels` keep every thread: splitting work between threads is theirs to test."""
    if not _plain_unit_test(request.node):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _unit_tests_build_no_kernels(request, monkeypatch):
    """Building a kernel takes seconds of a compiler per source: the fast tier leaves it to the tests
    marked `kernels`. A library already loaded in this process (by such a test) is still used."""
    if not _plain_unit_test(request.node):
        return

    def refuse(compiler, target_dir, source, isa=None):
        pytest.fail(f"{request.node.nodeid} builds the C++ kernel {Path(source).name}: mark it `kernels`")
    monkeypatch.setattr("mmserve.runner.cpu.native.build", refuse)


class _Checkpoints:
    """name -> checkpoint dir, built on first use."""

    def __init__(self, root) -> None:
        self.root = root
        self.dirs: dict = {}

    def __getitem__(self, name: str):
        if name not in self.dirs:
            seed = list(SERVED_FAMILIES).index(name)
            self.dirs[name] = SERVED_FAMILIES[name].build(self.root / name, seed)
        return self.dirs[name]


@pytest.fixture(scope="session")
def all_checkpoints(tmp_path_factory):
    return _Checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def checkpoint_dirs(all_checkpoints):
    return {family: all_checkpoints[family] for family in FAMILIES}


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def model_dir(checkpoint_dirs, family):
    return checkpoint_dirs[family]


@pytest.fixture(params=list(SERVED_FAMILIES))
def served_family(request):
    return request.param


@pytest.fixture
def served_model_dir(all_checkpoints, served_family):
    return all_checkpoints[served_family]

"""Shared fixtures: tiny random checkpoints of both families, built once per test session."""

from __future__ import annotations

import pytest

FAMILIES = ("qwen2_vl", "qwen2_5_vl")


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory):
    from tests.fixtures.tiny_checkpoints import build_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {family: build_checkpoint(root / family, family, seed=i) for i, family in enumerate(FAMILIES)}


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def model_dir(checkpoint_dirs, family):
    return checkpoint_dirs[family]

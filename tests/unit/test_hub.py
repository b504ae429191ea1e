"""A model named by a Hugging Face repository id resolves to a checkpoint directory: from the local cache
(filled here by the test, never the network: HF_HUB_OFFLINE is set), at a revision; a directory is taken as it
is; an id found nowhere gets one clear error that says so and shows the download command."""

from __future__ import annotations

import pytest

from mmserve import ModelLoadError
from mmserve.config import resolve_model
from mmserve.hub import checkpoint_dir, is_repo_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding `org/tiny` at main and at revision `v1`."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_a_repository_id_resolves_from_the_local_cache(hub_cache):
    assert checkpoint_dir("org/tiny") == hub_cache
    assert checkpoint_dir("org/tiny", revision="v1") == hub_cache
    assert resolve_model("org/tiny") == str(hub_cache)


def test_a_directory_is_taken_as_it_is(tmp_path, hub_cache):
    assert checkpoint_dir(str(tmp_path)) == tmp_path


def test_an_id_found_nowhere_says_so_and_how_to_download_it(hub_cache):
    with pytest.raises(ModelLoadError) as caught:
        checkpoint_dir("Qwen/Qwen2-VL-2B-Instruct", revision="abc")
    message = str(caught.value)
    assert "not a local directory and was not found in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE is set" in message
    assert "`hf download Qwen/Qwen2-VL-2B-Instruct --revision abc`" in message


def test_a_path_that_is_not_there_is_not_taken_for_an_id(tmp_path, hub_cache):
    with pytest.raises(ModelLoadError, match="no checkpoint directory at"):
        checkpoint_dir(str(tmp_path / "missing" / "model"))
    assert is_repo_id("Qwen/Qwen2-VL-2B-Instruct") and not is_repo_id("./a/b") and not is_repo_id("a/../b")

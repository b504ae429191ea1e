"""A model named by a Hugging Face repository id (`ORG/NAME`) becomes a checkpoint directory.

Role: `checkpoint_dir(model, revision)` returns `model` when it is a directory; a repository id is looked up
in the local Hugging Face cache first (nothing leaves the machine), then, unless `HF_HUB_OFFLINE` is set,
downloaded with `huggingface_hub` (its progress bars on stderr), only the files mmserve reads (configs,
tokenizer, chat templates, safetensors). When neither works, one `ModelLoadError` says the id was not
found locally and why it could not be fetched, with the command that downloads it.

What it does not know: what a checkpoint holds (the loader reads it), the network beyond huggingface_hub.
"""

from __future__ import annotations

import re
from pathlib import Path

from mmserve import envs
from mmserve.errors import ModelLoadError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.jinja", "additional_chat_templates/*", "tokenizer.model")


def is_repo_id(model: str) -> bool:
    return REPO_ID.fullmatch(model) is not None and ".." not in model


def checkpoint_dir(model: str, revision: str | None = None) -> Path:
    """The directory to load `model` from (a directory as given, or a repository's snapshot)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if not is_repo_id(model):
        raise ModelLoadError(f"no checkpoint directory at {model!r} (and it is not a Hugging Face repository id "
                             "like ORG/NAME)")
    import huggingface_hub  # only a hub id needs it
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = envs.hf_hub_cache()
    try:
        return Path(huggingface_hub.snapshot_download(model, revision=revision, cache_dir=cache,
                                                      allow_patterns=list(CHECKPOINT_FILES), local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    reason = "HF_HUB_OFFLINE is set"
    if not envs.hf_hub_offline():
        try:
            return Path(huggingface_hub.snapshot_download(model, revision=revision, cache_dir=cache,
                                                          allow_patterns=list(CHECKPOINT_FILES)))
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    at = f" --revision {revision}" if revision else ""
    raise ModelLoadError(f"model {model!r} is not a local directory and was not found in the Hugging Face cache "
                         f"({cache}); it could not be downloaded ({reason}). Download it with "
                         f"`hf download {model}{at}` (pip install huggingface_hub), or pass a checkpoint directory.")

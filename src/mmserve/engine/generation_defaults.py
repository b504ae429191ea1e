"""The sampling defaults a checkpoint's generation_config.json sets, applied where a request leaves a field
unset, as vLLM's `--generation-config auto` (its default) applies them.

Role: `generation_defaults(config)`: the defaults of the checkpoint's file ("auto"), none ("vllm"), or a
folder's file; `with_defaults(params, unset, defaults)`: a request's SamplingParams with the defaults in
the fields it left unset (max_new_tokens caps the max_tokens default, as vLLM does).
What it does not know: HTTP, requests' shapes, the engine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.sampling_params import SamplingParams

# generation_config.json's name -> SamplingParams' (vLLM's ModelConfig.get_diff_sampling_param reads these)
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: str, mode: str) -> dict[str, Any]:
    """SamplingParams field -> default: from `model_dir`'s generation_config.json ("auto"), none ("vllm"),
    or from the file in the folder `mode` names."""
    if mode == "vllm":
        return {}
    folder = Path(model_dir if mode == "auto" else mode)
    path = folder / "generation_config.json"
    if not path.is_file():
        if mode != "auto":
            raise ModelLoadError(f"--generation-config {mode}: no generation_config.json in that folder")
        return {}
    raw = json.loads(path.read_text())
    defaults = {ours: raw[theirs] for theirs, ours in SAMPLING_FIELDS.items() if raw.get(theirs) is not None}
    try:  # checked once at start, not by the first request that leaves a field unset
        SamplingParams(**defaults)
    except InvalidInputError as exc:
        raise ModelLoadError(f"{path}: {exc} (--generation-config vllm ignores the file)") from exc
    return defaults


def with_defaults(params: SamplingParams, unset: Collection[str], defaults: Mapping[str, Any]) -> SamplingParams:
    """`params` with each default in a field named in `unset` (the request did not give it); a
    max_tokens default (max_new_tokens) only lowers the max_tokens the request got (its room in the
    context), never under its min_tokens."""
    changes = {k: v for k, v in defaults.items() if k in unset and k != "max_tokens"}
    if "max_tokens" in unset and "max_tokens" in defaults:
        changes["max_tokens"] = min(params.max_tokens, max(int(defaults["max_tokens"]), params.min_tokens))
    return dataclasses.replace(params, **changes) if changes else params


def describe(defaults: Mapping[str, Any]) -> str:
    """One line for the start-up summary."""
    return ", ".join(f"{k}={v}" for k, v in defaults.items()) or "none"

"""Parse vLLM-style prompt inputs into the processor's arguments.

Role: accept a str, `{"prompt": str, ...}` or `{"prompt_token_ids": [...], ...}` with optional
`multi_modal_data` ({"image": one or a list, "video": one video or a list: frames, a (F, H, W, C)
array, or `VideoFrames` — frames with their fps; "audio": one clip or a list: vLLM's `(samples,
sampling_rate_hz)` tuple, an audio file's bytes, a data URL or local path: inputs/audio_sources.py}) and
`mm_processor_kwargs` and `multi_modal_uuids` (shaped like multi_modal_data), and reject anything
else with `InvalidInputError`; cut a processed text prompt to its last tokens (truncate_prompt_tokens);
check that a processed prompt fits the context and that the token ids a request names are in the vocabulary.
What it does not know: tokenizers, models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from mmserve.errors import InvalidInputError, out_of_vocabulary
from mmserve.inputs.chat import require_unicode
from mmserve.inputs.items import ProcessedPrompt
from mmserve.inputs.media import VideoFrames
from mmserve.sampling_params import SamplingParams, check_truncate_prompt_tokens, check_truncation_side

_PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids",
                "cache_salt"}


@dataclass
class PromptInput:
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    audios: list[Any] = field(default_factory=list)
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    uuids: dict[str, list[str | None]] = field(default_factory=dict)  # caller-supplied item identities
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks


def _is_frame(value: Any) -> bool:
    return isinstance(value, Image.Image) or (isinstance(value, np.ndarray) and value.ndim in (2, 3))


def _as_videos(value: Any) -> list[Any]:
    """One video (frames, a 4-D array, `VideoFrames` or a {"frames": [...], "fps": x} dict) or a list of
    videos -> a list of videos."""
    if isinstance(value, (VideoFrames, dict)):
        return [value]
    if isinstance(value, np.ndarray):
        return [value] if value.ndim == 4 else list(value)
    if isinstance(value, (list, tuple)) and value and all(_is_frame(v) for v in value):
        return [list(value)]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise InvalidInputError(f"multi_modal_data['video'] must be a list of frames or of videos, "
                            f"got {type(value).__name__}", param="multi_modal_data.video")


def _as_audios(value: Any) -> list[Any]:
    """One clip or a list of clips -> a list of clips. A tuple is one clip (vLLM's `(samples,
    sampling_rate_hz)`, as vLLM reads any tuple); a list is clips."""
    if isinstance(value, tuple):
        return [value]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def parse_prompt(raw: Any, mm_processor_kwargs: dict[str, Any] | None = None) -> PromptInput:
    if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, dict):
        raise InvalidInputError("mm_processor_kwargs must be a dict", param="mm_processor_kwargs")
    if isinstance(raw, str):
        return PromptInput(prompt=require_unicode(raw, "prompt"), mm_processor_kwargs=dict(mm_processor_kwargs or {}))
    if not isinstance(raw, dict):
        raise InvalidInputError(f"a prompt must be a str or a dict, got {type(raw).__name__}", param="prompt")
    unknown = sorted(set(raw) - _PROMPT_KEYS)
    if unknown:
        raise InvalidInputError(f"unknown prompt keys {unknown}; expected some of {sorted(_PROMPT_KEYS)}", param=unknown[0])
    if ("prompt" in raw) == ("prompt_token_ids" in raw):
        raise InvalidInputError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'", param="prompt")
    ids = raw.get("prompt_token_ids")
    if ids is not None and not (isinstance(ids, (list, tuple)) and all(isinstance(t, int) for t in ids)):
        raise InvalidInputError("prompt_token_ids must be a list of ints", param="prompt_token_ids")
    data = raw.get("multi_modal_data") or {}
    if not isinstance(data, dict) or set(data) - {"image", "video", "audio"}:
        raise InvalidInputError("multi_modal_data must be a dict with keys 'image', 'video' and/or 'audio'",
                                param="multi_modal_data")
    image = data.get("image")
    images = [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
    videos = [] if data.get("video") is None else _as_videos(data["video"])
    audios = [] if data.get("audio") is None else _as_audios(data["audio"])
    kwargs = dict(mm_processor_kwargs or {})
    per_prompt = raw.get("mm_processor_kwargs") or {}
    if not isinstance(per_prompt, dict):
        raise InvalidInputError("a prompt's mm_processor_kwargs must be a dict", param="mm_processor_kwargs")
    kwargs.update(per_prompt)
    uuids = raw.get("multi_modal_uuids") or {}
    if not isinstance(uuids, dict):
        raise InvalidInputError("multi_modal_uuids must be a dict like multi_modal_data", param="multi_modal_uuids")
    uuids = {m: (list(v) if isinstance(v, (list, tuple)) else [v]) for m, v in uuids.items()}
    prompt = raw.get("prompt")
    if isinstance(prompt, str):
        require_unicode(prompt, "prompt")
    return PromptInput(prompt, list(ids) if ids is not None else None, images, videos, audios, kwargs, uuids,
                       check_cache_salt(raw.get("cache_salt")))


def check_cache_salt(salt: Any) -> str | None:
    if salt is not None and not (isinstance(salt, str) and salt):
        raise InvalidInputError("cache_salt must be a non-empty string", param="cache_salt")
    return salt


def truncated_token_ids(prompt: ProcessedPrompt, keep: int | None, max_model_len: int,
                        side: str | None = None) -> list[int] | None:
    """vLLM's truncate_prompt_tokens: `keep` token ids of a longer prompt (-1: as many as the context holds
    with room for one generated token), cut on `side` (vLLM's truncation_side: "left", the default, keeps
    the last ones; "right" the first ones); None when the prompt stays as it is. A prompt with images or
    video is refused rather than cut, since a cut could fall inside an item's rows."""
    check_truncate_prompt_tokens(keep)
    check_truncation_side(side)
    if keep is None:
        return None
    keep = max_model_len - 1 if keep == -1 else keep
    if prompt.num_tokens <= keep:
        return None
    if prompt.items:
        raise InvalidInputError(f"truncate_prompt_tokens={keep} would cut a prompt with images or video: only "
                                "text prompts are truncated", param="truncate_prompt_tokens")
    return list(prompt.prompt_token_ids[:keep] if side == "right" else prompt.prompt_token_ids[-keep:])


def check_prompt_fits(prompt: ProcessedPrompt, max_model_len: int) -> None:
    """A prompt must have a token, and room for one output token in the context."""
    if prompt.num_tokens == 0:
        raise InvalidInputError("the prompt is empty", param="prompt")
    if prompt.num_tokens + 1 > max_model_len:
        raise InvalidInputError(f"the prompt has {prompt.num_tokens} tokens; the model's context is "
                                f"{max_model_len} tokens", param="prompt")


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids a request names must be in the model's vocabulary."""
    for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("stop_token_ids", params.stop_token_ids)):
        if message := out_of_vocabulary(ids, vocab_size):
            raise InvalidInputError(f"{name}: {message}", param=name)

"""The identity of a prompt's media items: the uuids a caller names them by, each engine item's content key.

Role: `item_uuids` checks vLLM's `multi_modal_uuids` (or the chat parts' `uuid`s) against the items given,
modality by modality; `content_key` hashes what the model sees of one item (its pixels, its frames, its
samples at the model's rate, or the caller's uuid instead) with what shaped it (the family's processing
key) and the model, so that equal inputs meet in the encoder cache and nothing else does; `item_keys` gives
one key per engine item: the whole item's, or each part's.

What it does not know: how media are loaded or expanded, any family, the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mmserve.errors import InvalidInputError
from mmserve.inputs.hashing import hash_item


def item_uuids(uuids: Mapping[str, Any] | None, counts: Mapping[str, int]) -> dict[str, list[str | None]]:
    """Each modality's uuids, one per item given (None: keyed by content); `counts` names every modality
    the processor knows, with the items given of each."""
    uuids = uuids or {}
    unknown = sorted(set(uuids) - set(counts))
    if unknown:
        raise InvalidInputError(f"multi_modal_uuids has unknown modalities {unknown}",
                                param="multi_modal_uuids")
    out = {}
    for modality, count in counts.items():
        given = uuids.get(modality)
        given = [given] if isinstance(given, str) else list(given or [None] * count)
        if len(given) != count:
            raise InvalidInputError(f"multi_modal_uuids['{modality}'] has {len(given)} entries for {count} "
                                    f"{modality}(s)", param=f"multi_modal_uuids.{modality}")
        if any(u is not None and not isinstance(u, str) for u in given):
            raise InvalidInputError("multi_modal_uuids entries must be strings or None",
                                    param="multi_modal_uuids")
        out[modality] = given
    return out


def content_key(modality: str, uuid: str | None, content: Any, shaping: dict[str, Any],
                model_key: str) -> str:
    """What the model sees (pixels, samples, or the caller's uuid), how it is shaped, which model."""
    what = {"uuid": uuid} if uuid is not None else content
    return hash_item({"modality": modality, "content": what, "processing": shaping, "model": model_key})


def item_keys(modality: str, uuid: str | None, content: Any, shaping: dict[str, Any], parts: Sequence[Any],
              model_key: str) -> list[str]:
    """One content key per engine item: the whole item's, or each of its `parts`' (processing.py's ItemPart).
    A part is keyed by its own content, so equal groups share an entry wherever they stand; under a
    caller's uuid (which names the whole video, e.g. a stream) by the uuid, the part's place and its
    content's shape."""
    if not parts:
        return [content_key(modality, uuid, content, shaping, model_key)]
    keys = []
    for k, part in enumerate(parts):
        part_shaping = {**shaping, "part_shape": part.shape}
        keys.append(content_key(modality, uuid, part.content, part_shaping if uuid is None
                                else {**part_shaping, "part": k}, model_key))
    return keys

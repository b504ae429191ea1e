"""The processed prompt: token ids plus one `MMItem` per image or video.

Role: the typed result of input processing and the only thing the engine sees of a prompt.
An item carries its placeholder span, its encoder sizes (pre-merge patches, post-merge rows),
its content key and, until it is encoded, its pixel payload.
What it does not know: engine state, tensors on devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IMAGE = "image"
VIDEO = "video"


@dataclass
class MMItem:
    modality: str  # IMAGE or VIDEO
    index: int  # position among the prompt's items of this modality
    offset: int  # first token of the item's placeholder span in the prompt
    length: int  # tokens in the span (embedding rows plus any special tokens inside it)
    grid_thw: tuple[int, int, int]  # patch grid before merging
    encoder_tokens: int  # pre-merge patches the vision tower processes
    output_rows: int  # post-merge embedding rows the item fills
    content_hash: str  # identity of what the model sees (pixels + processing)
    pixel_values: np.ndarray | None = None  # (encoder_tokens, C*T*P*P) float32; dropped once encoded
    time_interval: float = 1.0  # M-RoPE step between temporal patches (videos on Qwen2.5-VL)

    @property
    def ref(self) -> tuple[str, int]:
        return (self.modality, self.index)


@dataclass(frozen=True)
class ItemMetadata:
    """Per-item sizes of one prompt, in item order."""

    item_refs: tuple[tuple[str, int], ...]
    encoder_token_lengths: tuple[int, ...]  # pre-merge patches
    output_embedding_lengths: tuple[int, ...]  # post-merge rows

    @classmethod
    def of(cls, items: list[MMItem]) -> ItemMetadata:
        return cls(tuple(i.ref for i in items), tuple(i.encoder_tokens for i in items),
                   tuple(i.output_rows for i in items))


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    items: list[MMItem] = field(default_factory=list)
    mm_mask: np.ndarray | None = None  # (num_tokens,) bool: inside a multimodal span
    embed_mask: np.ndarray | None = None  # (num_tokens,) bool: row comes from an encoder output
    embed_cumsum: np.ndarray | None = None  # (num_tokens,) int64 running count of embed rows
    mrope_positions: np.ndarray | None = None  # (3, num_tokens) int64
    rope_delta: int = 0  # decode position = token index + rope_delta

    @property
    def metadata(self) -> ItemMetadata:
        return ItemMetadata.of(self.items)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

"""A request as the scheduler sees it: token ids, item specs, progress, status.

Role: one progress counter (`num_computed_tokens`) moves every request toward its prompt plus
output length; preemption resets it. Media appear only as torch-free `ItemSpec`s.
What it does not know: tensors, pixels, text.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mmserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    PARKED = 3  # a prefill replica's request after its first token: holds its KV until a decode replica takes it
    RECEIVING = 4  # a decode replica's request: blocks allocated, its KV on the way
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class ItemSpec:
    """What core knows of a media item: where its placeholder span is and what it costs."""

    index: int  # position among the request's items
    offset: int  # first token of the placeholder span
    length: int  # tokens in the span
    content_hash: str  # identity of what the model sees
    encoder_tokens: int  # pre-merge patches
    output_rows: int  # post-merge embedding rows
    # read by cross-attention layers (Llama 3.2 Vision): every token of the request depends on the item,
    # those before its placeholder too, so it is needed from the first prefill chunk on and keys every block
    cross_attention: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def needed_from(self) -> int:
        """The first token that needs the item's encoder output: where a chunk that cannot have it yet stops."""
        return 0 if self.cross_attention else self.offset

    def reaches(self, start: int, end: int) -> bool:
        """Do tokens [start, end) depend on this item's encoder output?"""
        return self.cross_attention or (self.offset < end and self.end > start)

    def needed_after(self, num_computed: int) -> bool:
        """Is the item's encoder output still needed once `num_computed` tokens are computed (or found in
        the prefix cache)? A cross-attention item always is: its K/V is built from it before any chunk."""
        return self.cross_attention or self.end > num_computed


def item_specs(items: Sequence[Any]) -> tuple[ItemSpec, ...]:
    """`ItemSpec`s of a processed prompt's items (anything with their offset, length, content hash,
    encoder tokens, output rows and cross-attention span or None): what the engine hands its scheduler
    and the router hashes."""
    return tuple(ItemSpec(i, it.offset, it.length, it.content_hash, it.encoder_tokens, it.output_rows,
                          it.cross_attention is not None)
                 for i, it in enumerate(items))


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    items: tuple[ItemSpec, ...] = ()
    arrival_time: float = field(default_factory=time.time)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_encoder_cached_items: int = 0  # items whose output was in the encoder cache at first admission
    num_prefix_cached_items: int = 0  # items wholly inside the prefix-cache hit at first admission
    num_preemptions: int = 0
    error: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks, in order
    # a sibling choice (n > 1) whose prefill this one waits for, to find its prompt in the prefix cache
    prefill_after: str | None = None
    cache_salt: str | None = None  # seeds the prompt's block hashes: only the same salt shares blocks
    hand_off: bool = False  # prefill only: park after the first token, for a decode replica to take its KV
    transferred: bool = False  # its prompt's KV came from a prefill replica (no media payloads here)
    cross_kv_bytes: int = 0  # its items' cross-attention K/V (families that cross-attend), held while it runs
    speculate: bool = False  # decoding, it may take draft tokens to verify (mmserve/speculative.py)
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for it, and those accepted
    num_accepted_draft_tokens: int = 0
    proposed_drafts: tuple[int, ...] = ()  # a draft model's proposal after its last step, for the next one
    num_mm_items: int = field(init=False)  # items with embedding rows (the media the prompt carries)

    def __post_init__(self) -> None:
        self.num_mm_items = sum(1 for item in self.items if item.output_rows > 0)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def stop_token_ids(self) -> frozenset[int]:
        ids = set(self.sampling_params.stop_token_ids or ())
        if not self.sampling_params.ignore_eos:
            ids.update(self.eos_token_ids)
        return frozenset(ids)

    @property
    def min_tokens_banned_ids(self) -> frozenset[int]:
        """What `min_tokens` bans until it is reached: every stop id and every EOS id, also under
        `ignore_eos` (transformers' min_new_tokens and vLLM ban the EOS ids whatever ignore_eos says)."""
        return frozenset(self.sampling_params.stop_token_ids or ()) | frozenset(self.eos_token_ids)

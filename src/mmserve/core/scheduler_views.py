"""The scheduler's read-only views: what the engine may read of its books, and nothing it could change.

Role: a mixin of `Scheduler` (core/scheduler.py): counters and ownership snapshots (core/snapshots.py), a
request's blocks, encoder-cache entry states, parked hand-offs, evictions since the last call.

What it does not know: scheduling; it only reads the books the scheduler holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmserve.core import snapshots
from mmserve.core.encoder_cache import EntryState

if TYPE_CHECKING:
    from collections import deque

    from mmserve.core.cross_kv import CrossKVBook
    from mmserve.core.encoder_cache import EncoderCacheManager
    from mmserve.core.handoff import HandOffBook
    from mmserve.core.kv_cache import KVCacheManager
    from mmserve.core.request import Request


class SchedulerViews:
    kv: KVCacheManager
    encoder_cache: EncoderCacheManager
    handoff: HandOffBook
    cross_kv: CrossKVBook | None
    requests: dict[str, Request]
    running: list[Request]
    waiting: deque[Request]
    stats: snapshots.SchedulerStats

    def snapshot(self) -> snapshots.SchedulerSnapshot:
        """The counters (O(1): taken after every step for the stats)."""
        return snapshots.scheduler_snapshot(len(self.running), len(self.waiting), self.stats, self.kv,
                                            self.encoder_cache, self.handoff, self.cross_kv)

    def draft_counts(self) -> dict[str, int]:
        """Speculative decoding's counters with vLLM's names (empty without speculation): drafts, draft tokens,
        accepted tokens, and accepted tokens at each draft position."""
        drafter = getattr(self, "drafter", None)
        if drafter is None:
            return {}
        d = drafter.stats
        counts = {"spec_decode_num_drafts": d.num_drafts, "spec_decode_num_draft_tokens": d.num_draft_tokens,
                  "spec_decode_num_accepted_tokens": d.num_accepted_tokens}
        counts.update({f"spec_decode_num_accepted_tokens_per_pos_{i}": n
                       for i, n in enumerate(d.accepted_per_position)})
        return counts

    def ownership(self) -> snapshots.SchedulerOwnership:
        """Who owns what (as large as the books: for integrity checks only)."""
        return snapshots.scheduler_ownership(self.requests, self.encoder_cache, self.cross_kv)

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The KV blocks a live request holds, in order."""
        return tuple(self.kv.block_ids(request_id))

    def blocks_at(self, request_id: str, indices: list[int]) -> tuple[list[int], list[int] | None]:
        """A live request's blocks at logical `indices`, and its window pool's there (core/window_kv.py; None:
        no window pool); a window entry the window has left is the pool's null block, which no query reads."""
        owned, window = self.kv.block_ids(request_id), self.kv.window_block_ids(request_id)
        return [owned[i] for i in indices], [window[i] for i in indices] if window else None

    def encoder_entry_state(self, key: str) -> EntryState | None:
        """The state of an item's encoder-cache entry (None: no entry)."""
        return self.encoder_cache.state(key)

    def holds_encoder_entry(self, request_id: str, key: str) -> bool:
        return self.encoder_cache.holds(request_id, key)

    def is_parked(self, request_id: str) -> bool:
        """Is the request parked for a hand-off (its KV held for a decode replica)?"""
        return request_id in self.handoff.parked

    def take_evictions(self) -> tuple[tuple[str, ...], tuple[bytes, ...]]:
        """(encoder content keys, KV prefix-block hashes) evicted since the last call."""
        return self.encoder_cache.take_evicted(), self.kv.take_evicted()

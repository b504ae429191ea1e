"""Read-only views of the scheduler's state, as frozen records: what the engine reads of core/.

Role: the engine's stats read the scheduler through `SchedulerSnapshot` (counts of requests, tokens,
KV blocks, encoder-cache bytes, hand-offs, cross-attention KV: O(1) to take, so after every step) and its
integrity check through `SchedulerOwnership` (live request ids, ready encoder keys, cross-attention KV
holders: sets as large as the books, built only for the check), never through its attributes, so the
scheduler's books (queues, block lists, cache entries) can change shape without the engine noticing.
Both are taken by the scheduler (`snapshot()`, `ownership()`) and never updated. `SchedulerStats` are the scheduler's own running counters.
What it does not know: tensors, the runner, how the engine names its stats.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mmserve.core.cross_kv import CrossKVBook
from mmserve.core.encoder_cache import EncoderCacheManager, EntryState
from mmserve.core.handoff import HandOffBook
from mmserve.core.kv_cache import KVCacheManager


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    prompt_tokens_computed: int = 0  # prompt tokens actually run through the model
    generation_tokens: int = 0
    encoder_items_scheduled: int = 0
    encoder_tokens_scheduled: int = 0
    requests_rejected: int = 0


@dataclass(frozen=True)
class RequestCounts:
    num_running: int
    num_waiting: int
    num_finished: int  # handed-off requests included (they finish on the prefill side too)
    num_rejected: int
    num_preemptions: int
    num_prompt_tokens: int  # of admitted requests, once each
    num_prompt_tokens_computed: int  # run through the model (recomputes included)
    num_generation_tokens: int


@dataclass(frozen=True)
class KVSnapshot:
    num_blocks: int
    num_free_blocks: int
    block_size: int  # tokens per block
    num_prefix_cache_hit_tokens: int
    num_evictions: int
    num_prefix_cache_queries: int = 0  # tokens looked up (at each admission), of which the hit tokens were cached
    num_window_blocks: int = 0  # the sliding layers' pool (core/window_kv.py); 0: none
    num_free_window_blocks: int = 0


@dataclass(frozen=True)
class EncoderCacheSnapshot:
    num_hits: int
    num_misses: int
    num_evictions: int
    used_bytes: int
    referenced_bytes: int  # held by live requests
    capacity_bytes: int


@dataclass(frozen=True)
class HandOffSnapshot:
    num_parked: int
    num_receiving: int
    num_handed_off: int
    num_received: int
    num_kv_blocks_sent: int
    num_kv_blocks_received: int
    num_kv_blocks_deduplicated: int


@dataclass(frozen=True)
class CrossKVSnapshot:
    used_bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class SchedulerSnapshot:
    requests: RequestCounts
    kv: KVSnapshot
    encoder_cache: EncoderCacheSnapshot
    handoff: HandOffSnapshot
    cross_kv: CrossKVSnapshot | None  # None: the family does not cross-attend


@dataclass(frozen=True)
class SchedulerOwnership:
    """Who owns what in the scheduler's books, for the engine's integrity check."""

    live_request_ids: frozenset[str]
    ready_encoder_keys: frozenset[str]  # entries whose outputs the runner must hold
    pending_freed_encoder_keys: frozenset[str]  # freed since the last step; the runner drops them next step
    cross_kv_holder_ids: frozenset[str]  # requests holding cross-attention KV bytes


def scheduler_ownership(live_request_ids: Iterable[str], cache: EncoderCacheManager,
                        cross_kv: CrossKVBook | None) -> SchedulerOwnership:
    ready = frozenset(k for k, e in cache.entries.items() if e.state == EntryState.READY)
    holders = frozenset(cross_kv.held) if cross_kv is not None else frozenset()
    return SchedulerOwnership(frozenset(live_request_ids), ready, frozenset(cache.pending_freed_keys), holders)


def kv_snapshot(kv: KVCacheManager) -> KVSnapshot:
    return KVSnapshot(kv.num_blocks, kv.num_free_blocks, kv.block_size, kv.stats.prefix_cache_hit_tokens,
                      kv.stats.evictions, kv.stats.prefix_cache_queries, kv.num_window_blocks,
                      kv.num_free_window_blocks)


def encoder_cache_snapshot(cache: EncoderCacheManager) -> EncoderCacheSnapshot:
    return EncoderCacheSnapshot(cache.stats.hits, cache.stats.misses, cache.stats.evictions, cache.used_bytes,
                                cache.referenced_bytes, cache.capacity_bytes)


def handoff_snapshot(book: HandOffBook) -> HandOffSnapshot:
    s = book.stats
    return HandOffSnapshot(len(book.parked), len(book.receiving), s.requests_handed_off, s.requests_received,
                           s.kv_blocks_sent, s.kv_blocks_received, s.kv_blocks_deduplicated)


def cross_kv_snapshot(book: CrossKVBook | None) -> CrossKVSnapshot | None:
    if book is None:
        return None
    return CrossKVSnapshot(book.used_bytes, book.capacity_bytes)


def scheduler_snapshot(num_running: int, num_waiting: int, stats: SchedulerStats,
                       kv: KVCacheManager, cache: EncoderCacheManager, handoff: HandOffBook,
                       cross_kv: CrossKVBook | None) -> SchedulerSnapshot:
    counts = RequestCounts(num_running, num_waiting, stats.requests_finished, stats.requests_rejected,
                           stats.num_preemptions, stats.prompt_tokens, stats.prompt_tokens_computed,
                           stats.generation_tokens)
    return SchedulerSnapshot(counts, kv_snapshot(kv), encoder_cache_snapshot(cache),
                             handoff_snapshot(handoff), cross_kv_snapshot(cross_kv))

"""The scheduler's books checked against each other (tests and `Engine.check_integrity` call it).

Role: KV blocks are held only by running or handing-off requests, and never fewer than their computed
tokens need; encoder-cache and cross-attention references belong to live requests; an idle scheduler
holds nothing. Split out of the scheduler so the scheduler keeps only the policy.
What it does not know: tensors, the runner, the engine.
"""

from __future__ import annotations

from mmserve.core.cross_kv import CrossKVBook
from mmserve.core.encoder_cache import EncoderCacheManager
from mmserve.core.handoff import HandOffBook
from mmserve.core.kv_cache import KVCacheManager
from mmserve.core.request import Request


def check_scheduler_books(kv: KVCacheManager, cache: EncoderCacheManager, cross_kv: CrossKVBook | None,
                          handoff: HandOffBook, running: list[Request], live_request_ids: set[str]) -> None:
    kv.check_integrity()
    cache.check_integrity(live_request_ids)
    running_ids = {r.request_id for r in running}
    if cross_kv is not None:
        cross_kv.check_integrity(running_ids)
        if not live_request_ids:
            assert not cross_kv.held, "idle engine holds cross-attention KV"
    owners = set(kv.req_blocks)
    holders = running_ids | handoff.holders
    assert owners <= holders, f"blocks held by requests neither running nor handing off: {owners - holders}"
    assert handoff.holders <= live_request_ids, "a parked or receiving request is not live"
    for r in running:
        held = len(kv.req_blocks.get(r.request_id, []))
        assert held * kv.block_size >= r.num_computed_tokens, f"{r.request_id} computed past its blocks"
    if not live_request_ids:
        assert kv.is_idle(), "idle engine holds KV blocks"

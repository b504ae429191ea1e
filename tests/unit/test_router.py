"""The router (cluster/router.py) and its keys (cluster/keys.py): scoring, balancing, evictions, deaths.

Pure Python: no torch, no processes. The keys are checked against the KV cache manager's own block
hashes, so a router and a replica agree on what a prompt's blocks are.
"""

from __future__ import annotations

import numpy as np
import pytest

from mmserve.cluster.keys import route_keys
from mmserve.cluster.router import RouteKeys, Router, RouterConfig
from mmserve.core.kv_cache import KVCacheManager
from mmserve.core.request import Request, item_specs
from mmserve.inputs.items import IMAGE, MMItem, ProcessedPrompt
from mmserve.sampling_params import SamplingParams


def keys(*media: str, blocks: tuple[bytes, ...] = (), rows: int = 64) -> RouteKeys:
    return RouteKeys(tuple((m, rows) for m in media), blocks, block_size=16)


def route(router: Router, k: RouteKeys) -> int:
    decision = router.choose(k)
    assert decision is not None
    router.dispatched(decision, k)
    return decision.replica


def test_a_request_goes_where_its_image_went_before():
    router = Router(4)
    first = route(router, keys("cat"))
    router.finished(first)
    for other in ("dog", "owl", "fox"):  # the others land elsewhere (rotation among the unloaded)
        router.finished(route(router, keys(other)))
    decision = router.choose(keys("cat"))
    assert decision.replica == first and decision.reason == "cache_hit" and decision.expected_media_hits == 1


def test_the_longest_cached_prefix_wins():
    router = Router(3)
    a, b = route(router, keys(blocks=(b"1", b"2", b"3"))), route(router, keys(blocks=(b"1",)))
    router.finished(a)
    router.finished(b)
    decision = router.choose(keys(blocks=(b"1", b"2", b"3", b"4")))
    assert decision.replica == a and decision.expected_prefix_tokens == 48


def test_one_hot_image_cannot_pin_all_traffic():
    """Every request asks about the same image and none finishes: past max_load_gap the others take it."""
    router = Router(3, RouterConfig(max_load_gap=2))
    chosen = [route(router, keys("hot")) for _ in range(12)]
    loads = [router.in_flight(i) for i in range(3)]
    assert max(loads) - min(loads) <= 2, loads
    assert len(set(chosen)) == 3
    assert router.stats.routed[("cache_aware", "balance")] >= 1


def test_round_robin_and_least_loaded_ignore_the_caches():
    rr = Router(3, RouterConfig(policy="round_robin"))
    assert [route(rr, keys("same")) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = Router(3, RouterConfig(policy="least_loaded"))
    for _ in range(3):
        route(ll, keys("same"))
    ll.finished(1)
    assert route(ll, keys("same")) == 1


def test_evictions_and_deaths_make_the_router_forget():
    router = Router(2)
    a = route(router, keys("cat", blocks=(b"1",)))
    router.finished(a)
    router.evicted(a, media_keys=["cat"], block_hashes=[b"1"])
    assert router.choose(keys("cat", blocks=(b"1",))).reason == "no_hit"
    b = route(router, keys("dog"))
    router.set_alive(b, False)
    assert router.in_flight(b) == 0
    for _ in range(3):  # only the live one is chosen; none once both are down
        assert router.choose(keys("dog")).replica == 1 - b
    router.set_alive(1 - b, False)
    assert router.choose(keys("dog")) is None
    router.set_alive(b, True)
    assert router.choose(keys("dog")).reason == "no_hit"  # it came back empty


def test_the_index_is_bounded():
    router = Router(1, RouterConfig(max_media_keys=2, max_blocks=3))
    for name in ("a", "b", "c"):
        router.finished(route(router, keys(name, blocks=(name.encode() * 2, name.encode() * 3))))
    assert router.choose(keys("a")).reason == "no_hit"  # the oldest key was forgotten
    assert router.choose(keys("c")).reason == "cache_hit"


def test_bad_router_settings_are_refused():
    with pytest.raises(ValueError, match="routing policy"):
        RouterConfig(policy="random")
    with pytest.raises(ValueError):
        RouterConfig(max_load_gap=-1)
    with pytest.raises(ValueError):
        Router(0)


def test_route_keys_are_the_kv_cache_managers_block_hashes():
    """The server hashes a prompt exactly as the replica's KV cache manager will: the same tokens,
    media and salt give the same blocks, and another image gives other blocks from the first it touches."""
    block_size = 4
    tokens = list(range(100, 118))  # 18 tokens: 4 full blocks
    item = MMItem(IMAGE, 0, offset=5, length=6, encoder_tokens=24, output_rows=6, content_hash="img-a")
    prompt = ProcessedPrompt(None, tokens, [item], np.zeros(18, bool), None, None, cache_salt="tenant")
    k = route_keys(prompt, block_size)
    request = Request("r", list(tokens), SamplingParams(max_tokens=1), (2,), item_specs(prompt.items),
                      cache_salt="tenant")
    KVCacheManager(8, block_size).update_block_hashes(request)
    assert list(k.block_hashes) == request.block_hashes and len(k.block_hashes) == 4
    assert k.media == (("img-a", 6),)
    other = ProcessedPrompt(None, tokens, [MMItem(IMAGE, 0, 5, 6, 24, 6, "img-b")], cache_salt="tenant")
    k2 = route_keys(other, block_size)
    assert k2.block_hashes[0] == k.block_hashes[0] and k2.block_hashes[1] != k.block_hashes[1]


def test_a_small_shared_prefix_does_not_pull_new_images_to_one_replica():
    """Every prompt starts with the template's same first block: only a hit worth min_hit_fraction of the
    request's work attracts it, so new images spread and a repeated one goes back where it was."""
    lead = b"template-start"
    router = Router(2)

    def ask(image: str) -> RouteKeys:
        return RouteKeys(((image, 64),), (lead, image.encode()), block_size=16, num_tokens=96)

    first = route(router, ask("cat"))
    second = route(router, ask("dog"))  # only the lead block is on `first`: 16 of 160, not worth it
    assert second != first
    decision = router.choose(ask("cat"))
    assert decision.replica == first and decision.reason == "cache_hit"
    with pytest.raises(ValueError, match="min_hit_fraction"):
        RouterConfig(min_hit_fraction=1.5)

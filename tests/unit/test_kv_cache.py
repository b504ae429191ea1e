import pytest

from mmserve.core.kv_cache import FreeBlockQueue, KVBlock, KVCacheManager, block_extra_keys, hash_block
from tests.unit.core_factories import image, make_request


def test_free_queue_is_lru_with_o1_removal():
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3]
    q.append(blocks[2])
    assert q.popleft().block_id == 0
    assert [b.block_id for b in q] == [1, 3, 2] and q.num_free == 3


def test_same_placeholder_ids_with_different_images_hash_differently():
    a = make_request(prompt=[1] * 8, items=(image(0, 2, 4, "img-a"),))
    b = make_request(prompt=[1] * 8, items=(image(0, 2, 4, "img-b"),))
    assert a.prompt_token_ids == b.prompt_token_ids
    kv = KVCacheManager(8, 4)
    kv.update_block_hashes(a)
    kv.update_block_hashes(b)
    assert a.block_hashes[0] != b.block_hashes[0] and a.block_hashes[1] != b.block_hashes[1]


def test_extra_keys_cover_overlapping_items_with_offsets():
    items = (image(0, 2, 4, "x"), image(1, 6, 4, "y"))
    assert block_extra_keys(items, 0, 4) == [("x", -2)]
    assert block_extra_keys(items, 4, 8) == [("x", 2), ("y", -2)]
    assert block_extra_keys(items, 12, 16) == []
    assert hash_block(None, [1, 2], [("x", 0)]) != hash_block(None, [1, 2], [("x", 1)])


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    kv = KVCacheManager(16, 4)
    a = make_request(prompt=list(range(1, 13)))
    assert kv.allocate_slots(a, 12) is not None
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)
    b = make_request(prompt=list(range(1, 13)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8  # 12 tokens: the last block must be recomputed to get logits
    ids = kv.allocate_slots(b, 12 - n, hits)
    assert ids[:2] == kv.block_ids(a.request_id)[:2]
    assert hits[0].ref_cnt == 2
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.num_free_blocks == 16


def test_cached_blocks_evicted_only_when_free_runs_out():
    kv = KVCacheManager(4, 4)
    a = make_request(prompt=list(range(1, 9)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    kv.free(a)
    assert len(kv.cached) == 2
    b = make_request(prompt=list(range(100, 108)))
    kv.allocate_slots(b, 8)  # two never-cached blocks are free: no eviction needed
    assert kv.stats.evictions == 0 and len(kv.cached) == 2
    c = make_request(prompt=list(range(200, 208)))
    kv.allocate_slots(c, 8)
    assert kv.stats.evictions == 2 and not kv.cached
    assert kv.allocate_slots(make_request(prompt=[5] * 4), 4) is None


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(2, 4)
    assert kv.allocate_slots(make_request(prompt=[1] * 12), 12) is None
    assert kv.num_free_blocks == 2
    kv.check_integrity()


@pytest.mark.parametrize("bad", [(0, 4), (4, 0)])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        KVCacheManager(*bad)

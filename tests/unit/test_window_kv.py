"""The window pool: sliding layers keep only their window's blocks (core/window_kv.py), with fake runners."""

from mmserve.core.scheduler import Scheduler, SchedulerLimits
from mmserve.core.window_kv import WindowedKVCacheManager
from tests.unit.core_factories import FakeRunner, make_items, make_request

BS, WINDOW = 4, 6  # a query at q sees keys q-5..q: 2 or 3 blocks


def _computed(kv: WindowedKVCacheManager, request, num: int) -> None:
    """Allocate and 'compute' the request's next `num` tokens."""
    assert kv.allocate_slots(request, num) is not None
    request.num_computed_tokens += num
    kv.cache_full_blocks(request)


def test_a_decoding_request_holds_its_whole_context_in_full_blocks_and_only_its_window_in_window_blocks():
    kv = WindowedKVCacheManager(64, BS, 64, WINDOW)
    r = make_request(prompt=list(range(1, 41)), max_tokens=100)
    for _ in range(5):  # a 40-token prompt in 8-token chunks
        _computed(kv, r, 8)
    for _ in range(20):  # then decodes, one token each
        r.output_token_ids.append(7)
        _computed(kv, r, 1)
        q = r.num_computed_tokens - 1
        held = kv.num_window_blocks_held(r.request_id)
        assert held == q // BS - (q - WINDOW + 1) // BS + 1 <= kv.max_window_blocks(1)  # exactly the window's
        ids = kv.window_block_ids(r.request_id)
        assert len(ids) == len(kv.block_ids(r.request_id)) == -(-(q + 1) // BS)  # aligned with the full table
        lo = kv.window_start(q)
        assert set(ids[:lo]) == {kv.null_block_id} and kv.null_block_id not in ids[lo:]
        kv.check_integrity()
    assert len(kv.block_ids(r.request_id)) == 15  # 60 tokens
    kv.free(r)
    kv.check_integrity()
    assert kv.is_idle()


def test_a_chunk_holds_the_window_before_it_and_its_own_blocks_then_the_window_moves_on():
    kv = WindowedKVCacheManager(64, BS, 64, WINDOW)
    r = make_request(prompt=list(range(1, 41)))
    _computed(kv, r, 16)
    assert kv.allocate_slots(r, 16) is not None  # the chunk [16, 32): keys from 11 on, blocks 2..7
    assert kv.num_window_blocks_held(r.request_id) == 6 <= kv.max_window_blocks(16)
    r.num_computed_tokens = 32
    assert kv.allocate_slots(r, 8) is not None  # [32, 40): keys from 27 on, blocks 6..9
    assert kv.window_block_ids(r.request_id)[:6] == [kv.null_block_id] * 6
    assert kv.num_window_blocks_held(r.request_id) == 4 and kv.window.num_free_blocks == 60


def test_a_window_pool_too_small_refuses_the_allocation_and_takes_nothing():
    kv = WindowedKVCacheManager(64, BS, 3, WINDOW)
    r = make_request(prompt=list(range(1, 41)))
    assert kv.allocate_slots(r, 16) is None  # 4 window blocks in a pool of 3
    assert kv.is_idle() and not kv.req_blocks and not kv.window_tables
    assert kv.allocate_slots(r, 8) is not None  # two of them fit
    kv.check_integrity()


def test_a_prefix_hit_needs_the_window_before_it_and_is_cut_where_the_window_pool_lost_it():
    kv = WindowedKVCacheManager(64, BS, 6, WINDOW)
    prompt = list(range(1, 34))  # 33 tokens: 8 full blocks
    a = make_request(prompt=list(prompt))
    for _ in range(4):
        _computed(kv, a, 8)  # each chunk's window blocks are published, then left behind
    kv.free(a)
    b = make_request(prompt=list(prompt))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32  # the window pool still holds blocks 5..7 (a query at 32 sees 27..32)
    assert kv.allocate_slots(b, 1, hits) is not None
    ids = kv.window_block_ids(b.request_id)
    assert ids[:6] == [kv.null_block_id] * 6 and kv.null_block_id not in ids[6:]
    kv.free(b)
    # a stranger takes the whole window pool: the window blocks of the hit are evicted
    c = make_request(prompt=[90 + i for i in range(24)])
    assert kv.allocate_slots(c, 24) is not None
    kv.free(c)
    d = make_request(prompt=list(prompt))
    hits, num_hit = kv.get_computed_blocks(d)
    assert len(kv.cached) >= 8 and num_hit == 0  # the full blocks are cached, their window is not
    kv.check_integrity()


def test_a_hand_offs_receiver_keeps_only_the_window_of_the_decode_after_the_prompt():
    kv = WindowedKVCacheManager(64, BS, 64, WINDOW)
    r = make_request(prompt=list(range(1, 31)))  # 30 tokens, then the first token from the prefill side
    r.output_token_ids.append(7)
    assert kv.allocate_slots(r, r.num_tokens, first_query=r.num_prompt_tokens) is not None
    ids = kv.window_block_ids(r.request_id)
    assert len(ids) == 8 and ids[:6] == [kv.null_block_id] * 6 and kv.null_block_id not in ids[6:]


def test_served_to_completion_with_chunks_preemption_and_prefix_hits_every_block_returns():
    kv = WindowedKVCacheManager(40, BS, 16, WINDOW)
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=True),
                      kv, make_items())
    runner = FakeRunner()
    tables: dict[str, list[int]] = {}
    shared = list(range(1, 30))
    for i in range(8):
        sched.add_request(make_request(prompt=shared + [100 + i] * (5 + 3 * i), max_tokens=12))
    for _ in range(500):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        for new in out.new_requests:
            tables[new.request_id] = list(new.window_block_ids)
        for cached in out.cached_requests:
            tables[cached.request_id].extend(cached.new_window_block_ids)
        for rid in out.num_scheduled_tokens:  # what the runner would read: the manager's table
            table = kv.window_tables[rid]
            lo = kv.window_start(sched.requests[rid].num_computed_tokens)
            assert tables[rid][lo:] == kv.window_block_ids(rid)[lo:]
            assert all(b is not None for b in table.blocks[lo:])
        sched.update(out, runner.execute(out))
        sched.check_integrity()
    assert not sched.num_unfinished and sched.stats.num_preemptions > 0
    assert kv.stats.prefix_cache_hit_tokens > 0
    assert kv.is_idle()

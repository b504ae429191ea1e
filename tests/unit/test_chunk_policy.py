"""The chunk-boundary policy: with indivisible item spans (Gemma 3) no prefill chunk ends inside a
span, a span is prefilled whole, and a span longer than the token budget lifts the budget at start."""

import logging

import pytest

from mmserve.core.chunk_policy import ChunkBoundaryPolicy, resolve_token_budget
from tests.unit.core_factories import FakeRunner, image, make_request, make_scheduler, run_to_completion


def _chunks(runner, rid):
    """(start, end) of every chunk the runner computed for request rid, in order."""
    out, pos = [], 0
    for h in runner.history:
        pos = next((new.num_computed_tokens for new in h.new_requests if new.request_id == rid), pos)
        n = h.num_scheduled_tokens.get(rid)
        if n:
            out.append((pos, pos + n))
            pos += n
    return out


def _inside(item, end):
    return item.offset < end < item.end


def test_chunks_stop_before_a_span_and_take_it_whole():
    sched, runner = make_scheduler(max_num_batched_tokens=5, indivisible_items=True), FakeRunner()
    span = image(0, 3, 4)  # [3, 7)
    r = make_request(12, items=(span,), max_tokens=1)
    sched.add_request(r)
    run_to_completion(sched, runner)
    chunks = _chunks(runner, r.request_id)
    assert chunks[:3] == [(0, 3), (3, 8), (8, 12)]  # the first chunk stops at the span's start
    assert not any(_inside(span, end) for _, end in chunks)


def test_without_the_policy_the_same_chunk_ends_inside_the_span():
    sched, runner = make_scheduler(max_num_batched_tokens=5), FakeRunner()
    span = image(0, 3, 4)
    r = make_request(12, items=(span,), max_tokens=1)
    sched.add_request(r)
    run_to_completion(sched, runner)
    assert _chunks(runner, r.request_id)[0] == (0, 5)


def test_a_span_waits_for_a_step_with_room_while_others_decode():
    sched, runner = make_scheduler(max_num_batched_tokens=8, indivisible_items=True), FakeRunner()
    a = make_request(4, max_tokens=6)
    b = make_request(16, items=(image(0, 2, 8, "img-b"),), max_tokens=2)  # span [2, 10)
    sched.add_request(a)
    sched.add_request(b)
    run_to_completion(sched, runner)
    for pos_chunk in _chunks(runner, b.request_id):
        assert not _inside(b.items[0], pos_chunk[1])
    assert all(h.total_num_scheduled_tokens <= 8 for h in runner.history)
    assert (2, 10) in _chunks(runner, b.request_id)  # the span, alone in its chunk: 8 tokens
    sched.check_integrity()


def test_prefix_hit_inside_a_span_prefills_the_rest_of_it_in_one_chunk():
    # block size 4: a second request that shares the first 14 tokens (the span [6, 14) included) hits
    # the full blocks [0, 12), which end inside the span; its first chunk must finish the span
    sched, runner = make_scheduler(max_num_batched_tokens=16, block_size=4, indivisible_items=True), FakeRunner()
    prompt = [10 + i for i in range(20)]
    first = make_request(items=(image(0, 6, 8),), prompt=list(prompt), max_tokens=1)
    sched.add_request(first)
    run_to_completion(sched, runner)
    second = make_request(items=(image(0, 6, 8),), prompt=prompt[:14] + [60, 61, 62, 63, 64, 65], max_tokens=1)
    sched.add_request(second)
    run_to_completion(sched, runner)
    assert second.num_cached_tokens == 12
    chunks = _chunks(runner, second.request_id)
    assert chunks[0][1] >= 14 and not _inside(second.items[0], chunks[0][1])


def test_policy_cut_rules():
    policy = ChunkBoundaryPolicy(indivisible_items=True)
    r = make_request(30, items=(image(0, 5, 10), image(1, 20, 4, "img-b")))
    assert policy.cut(r, 0, 8) == 5  # ends inside [5, 15): back to its start
    assert policy.cut(r, 0, 15) == 15 and policy.cut(r, 5, 15) == 15
    assert policy.cut(r, 8, 12) == 8  # began inside the span: nothing until the chunk can finish it
    assert policy.cut(r, 15, 22) == 20
    assert ChunkBoundaryPolicy().cut(r, 0, 8) == 8


def test_budget_lifted_to_the_longest_span_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="mmserve.budget"):
        effective, lines = resolve_token_budget(32, 270, indivisible_items=True)
    assert effective == 270
    assert lines == [record.getMessage() for record in caplog.records]
    assert "configured=32 effective=270 largest_span=270" in lines[0]
    assert resolve_token_budget(32, 270, indivisible_items=False) == (32, [])
    assert resolve_token_budget(512, 270, indivisible_items=True) == (512, [])
    with pytest.raises(ValueError):
        resolve_token_budget(0, 10, True)


def test_a_snapshot_interval_ends_chunks_at_its_multiples_and_at_the_last_full_block():
    r = make_request(1000)
    policy = ChunkBoundaryPolicy(snapshot_block_size=16, snapshot_interval=256)
    assert [policy.cut(r, s, e) for s, e in ((0, 600), (256, 600), (500, 512), (768, 1000), (992, 1000))] == \
        [256, 512, 512, 992, 1000]
    assert ChunkBoundaryPolicy(snapshot_block_size=16).cut(r, 0, 600) == 600  # no interval: chunk ends only

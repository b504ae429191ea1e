"""Items read by cross-attention (Llama 3.2 Vision) in core/, with fake runner outputs: encoded before the
request's first prefill chunk, wherever the image token is, also after a prefix-cache hit past it; keying
every prefix block, those before the image too; and the cross-attention KV byte budget (admission,
waiting, preemption, finish)."""

from __future__ import annotations

import dataclasses

from mmserve.core.cross_kv import CrossKVBook
from mmserve.core.kv_cache import block_extra_keys, hash_block
from mmserve.core.request import ItemSpec, RequestStatus
from tests.unit.core_factories import (
    FakeRunner,
    image,
    make_items,
    make_request,
    make_scheduler,
    run_to_completion,
)

ROWS = 6  # an image's cross-attention rows (its span is one token)


def cross_image(index: int, offset: int, content: str) -> ItemSpec:
    return ItemSpec(index=index, offset=offset, length=1, content_hash=content, encoder_tokens=ROWS * 4,
                    output_rows=ROWS, cross_attention=True)


def cross_request(offset: int = 20, tokens: int = 40, content: str = "img", max_tokens: int = 2,
                  cross_kv_bytes: int = 0, prompt: list[int] | None = None):
    request = make_request(tokens, max_tokens=max_tokens, items=(cross_image(0, offset, content),), prompt=prompt)
    request.cross_kv_bytes = cross_kv_bytes
    return request


def with_book(capacity_bytes: int, **kwargs):
    sched = make_scheduler(**kwargs)
    sched.cross_kv = CrossKVBook(capacity_bytes)
    return sched


def test_the_image_is_encoded_with_the_first_chunk_not_the_one_holding_its_token():
    sched, runner = make_scheduler(max_num_batched_tokens=8), FakeRunner()
    request = cross_request(offset=20)
    sched.add_request(request)
    first = sched.schedule()
    assert first.encoder_items == {request.request_id: (0,)}
    assert first.num_scheduled_tokens[request.request_id] == 8  # tokens 0..7: before the image token
    sched.update(first, runner.execute(first))
    run_to_completion(sched, runner)
    assert runner.encoded == [(request.request_id, 0)]
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_a_first_chunk_waits_for_its_image_when_the_encoder_step_is_full():
    sched, runner = make_scheduler(items=make_items(max_items=1)), FakeRunner()
    a, b = cross_request(content="a"), cross_request(content="b")
    sched.add_request(a)
    sched.add_request(b)
    step = sched.schedule()
    assert step.encoder_items == {a.request_id: (0,)}
    assert b.request_id not in step.num_scheduled_tokens  # its image could not be encoded this step
    sched.update(step, runner.execute(step))
    run_to_completion(sched, runner)
    assert sorted(key for key, _ in runner.encoded) == sorted([a.request_id, b.request_id])


def test_every_block_is_keyed_on_the_image_those_before_it_too():
    tokens = list(range(100, 124))
    cat, dog = cross_image(0, 12, "cat"), cross_image(0, 12, "dog")
    fused = dataclasses.replace(cat, cross_attention=False)
    for start in (0, 4, 16):  # before, ... and after the image token at 12
        assert block_extra_keys((cat,), start, start + 4) == [("cat", start - 12)]
    assert block_extra_keys((fused,), 0, 4) == []  # a fused image keys only the blocks it overlaps

    def hashes(item):
        parent, out = None, []
        for start in range(0, 24, 4):
            parent = hash_block(parent, tokens[start:start + 4], block_extra_keys((item,), start, start + 4))
            out.append(parent)
        return out

    assert all(x != y for x, y in zip(hashes(cat), hashes(dog)))
    assert hashes(cat)[0] != hashes(fused)[0]


def test_same_ids_other_image_no_prefix_hit_same_image_hit_and_still_encoded():
    sched, runner = make_scheduler(block_size=4), FakeRunner()
    prompt = list(range(1, 41))
    for key in ("cat", "dog", "cat"):
        sched.add_request(cross_request(content=key, prompt=list(prompt), max_tokens=1))
        run_to_completion(sched, runner)
    hits = sched.kv.stats.prefix_cache_hit_tokens
    assert hits >= 32  # only the third request hits, for the whole prompt but its last block
    # the third request's image is needed again (its cross-attention K/V is built before any chunk),
    # and found in the encoder cache: two encodes for three requests
    assert [runner.items[rid][i].content_hash for rid, i in runner.encoded] == ["cat", "dog"]
    assert sched.encoder_cache.stats.hits == 1


def test_the_budget_admits_while_bytes_are_free_and_frees_them_at_finish():
    sched, runner = with_book(1000), FakeRunner()
    a, b = cross_request(content="a", cross_kv_bytes=600), cross_request(content="b", cross_kv_bytes=600)
    sched.add_request(a)
    sched.add_request(b)
    step = sched.schedule()
    assert a.request_id in step.num_scheduled_tokens and b.request_id not in step.num_scheduled_tokens
    assert sched.cross_kv.held == {a.request_id: 600}
    sched.update(step, runner.execute(step))
    sched.check_integrity()
    run_to_completion(sched, runner)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert sched.cross_kv.used_bytes == 0 and sched.cross_kv.stats.builds_admitted == 2


def test_a_request_over_the_whole_budget_is_rejected_naming_it():
    sched = with_book(1000)
    too_big = cross_request(cross_kv_bytes=1001)
    error = sched.add_request(too_big)
    assert error is not None and "cross_kv_cache_bytes is 1000" in error and "1001 bytes" in error
    assert too_big.status == RequestStatus.FINISHED_ERROR and sched.num_unfinished == 0


def test_preemption_and_abort_free_the_bytes():
    sched, runner = with_book(10_000, num_blocks=12, block_size=4, max_num_batched_tokens=64), FakeRunner()
    requests = [cross_request(content=f"k{i}", tokens=20, max_tokens=12, cross_kv_bytes=100) for i in range(3)]
    for r in requests:
        sched.add_request(r)
    run_to_completion(sched, runner)
    assert sched.stats.num_preemptions > 0
    assert sched.cross_kv.stats.builds_admitted > 3  # taken again when a preempted request resumed
    assert sched.cross_kv.used_bytes == 0
    late = cross_request(content="late", cross_kv_bytes=100, max_tokens=50)
    sched.add_request(late)
    step = sched.schedule()
    sched.update(step, runner.execute(step))
    assert sched.cross_kv.held == {late.request_id: 100}
    sched.finish_requests([late.request_id], RequestStatus.FINISHED_ABORTED)
    assert sched.cross_kv.used_bytes == 0
    sched.check_integrity()


def test_fused_items_keep_their_span_rules():
    """A fused image is reached only by chunks that overlap it, as before."""
    sched, runner = make_scheduler(max_num_batched_tokens=8), FakeRunner()
    request = make_request(40, items=(image(0, 20, 6, "fused"),))
    sched.add_request(request)
    first = sched.schedule()
    assert first.encoder_items == {}
    sched.update(first, runner.execute(first))
    run_to_completion(sched, runner)
    assert runner.encoded == [(request.request_id, 0)]

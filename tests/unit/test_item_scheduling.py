"""The second scheduling surface with fake runner outputs: budgets, sharing, eviction, faults."""

import pytest

from mmserve.core.budget import EncoderBudget, bytes_per_embedding_row
from mmserve.core.encoder_cache import EntryState
from mmserve.core.request import RequestStatus
from tests.unit.core_factories import (
    BYTES_PER_ROW,
    FakeRunner,
    image,
    make_items,
    make_request,
    make_scheduler,
    run_to_completion,
)


def _img_request(*keys, rows=6, max_tokens=2, text=4):
    items, offset = [], text
    for i, key in enumerate(keys):
        items.append(image(i, offset, rows, key))
        offset += rows + text
    return make_request(offset, max_tokens=max_tokens, items=tuple(items))


def test_eight_requests_two_images_encode_twice():
    sched, runner = make_scheduler(prefix_caching=False), FakeRunner()
    reqs = [_img_request("cat" if i % 2 else "dog") for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, runner)
    assert len(runner.encoded) == 2
    assert sched.encoder_cache.stats.misses == 2 and sched.encoder_cache.stats.hits == 6
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)


def test_unset_budgets_take_the_one_set_of_defaults():
    budget, warnings = EncoderBudget.resolve(max_items_per_step=4, max_encoder_tokens_per_step=None,
                                             output_budget_bytes=None, cache_bytes=None, bytes_per_row=8,
                                             model_atomic_max_tokens=64, model_atomic_max_rows=16)
    assert warnings == []
    assert budget.max_encoder_tokens_per_step == 16384
    assert budget.output_budget_bytes == 256 << 20 and budget.cache_bytes == 2 * budget.output_budget_bytes
    big, _ = EncoderBudget.resolve(max_items_per_step=4, max_encoder_tokens_per_step=None,
                                   output_budget_bytes=None, cache_bytes=None, bytes_per_row=1 << 20,
                                   model_atomic_max_tokens=40000, model_atomic_max_rows=10000)
    assert big.max_encoder_tokens_per_step == 40000  # lifted to the largest item, no warning: none configured
    assert big.output_budget_bytes == 10000 << 20 and big.cache_bytes == 2 * big.output_budget_bytes


def test_one_item_per_step():
    sched, runner = make_scheduler(items=make_items(max_items=1)), FakeRunner()
    reqs = [_img_request("a", "b"), _img_request("c")]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, runner)
    assert all(sum(len(v) for v in h.encoder_items.values()) <= 1 for h in runner.history)
    assert len(runner.encoded) == 3
    # the chunk stopped before the second image's first row until it could be encoded
    first = runner.history[0].num_scheduled_tokens[reqs[0].request_id]
    assert first == reqs[0].items[1].offset


def test_token_budget_below_one_item_is_lifted_with_one_warning_line():
    budget, warnings = EncoderBudget.resolve(max_items_per_step=4, max_encoder_tokens_per_step=10,
                                             output_budget_bytes=None, cache_bytes=None, bytes_per_row=8,
                                             model_atomic_max_tokens=64, model_atomic_max_rows=16)
    assert budget.max_encoder_tokens_per_step == 64
    assert warnings == ["encoder token budget lifted: configured=10 effective=64 model_atomic_max=64"]
    sched, runner = make_scheduler(items=make_items(max_tokens=1, atomic_max=24)), FakeRunner()
    r = _img_request("x", "y")  # 24 encoder tokens per item
    sched.add_request(r)
    run_to_completion(sched, runner)
    assert len(runner.encoded) == 2 and all(len(h.encoder_items.get(r.request_id, ())) <= 1 for h in runner.history)


def test_small_cache_evicts_and_reencodes_within_budget():
    item_bytes = 6 * BYTES_PER_ROW
    items = make_items(output_bytes=2 * item_bytes, cache_bytes=2 * item_bytes, atomic_max=24)
    sched, runner = make_scheduler(items=items, prefix_caching=False), FakeRunner()
    for key in ["a", "b", "c", "a"]:
        sched.add_request(_img_request(key))
        run_to_completion(sched, runner)  # checks cache bytes <= budget after every step
    assert sched.encoder_cache.stats.evictions >= 1
    assert len(runner.encoded) == 4  # "a" was evicted, then encoded again
    assert sched.encoder_cache.used_bytes <= 2 * item_bytes


def test_cache_reuse_across_requests_when_it_fits():
    sched, runner = make_scheduler(prefix_caching=False), FakeRunner()
    for _ in range(3):
        sched.add_request(_img_request("same"))
        run_to_completion(sched, runner)
    assert len(runner.encoded) == 1 and sched.encoder_cache.stats.hits == 2


def test_request_over_output_budget_is_rejected_others_finish():
    sched, runner = make_scheduler(items=make_items(output_bytes=100, atomic_max=24)), FakeRunner()
    big = _img_request("a", "b", rows=6)  # 120 bytes > 100
    ok = _img_request("c", rows=6)
    assert "encoder_output_budget_bytes is 100" in sched.add_request(big)
    assert "120 bytes" in big.error and big.status == RequestStatus.FINISHED_ERROR
    assert sched.add_request(ok) is None
    run_to_completion(sched, runner)
    assert ok.status == RequestStatus.FINISHED_LENGTH and sched.stats.requests_rejected == 1


def test_batch_failure_fails_producers_consumer_gets_a_new_producer():
    sched, runner = make_scheduler(), FakeRunner(fail_batch_steps={0})
    producer, consumer = _img_request("k"), _img_request("k")
    sched.add_request(producer)
    sched.add_request(consumer)
    run_to_completion(sched, runner)
    assert producer.status == RequestStatus.FINISHED_ERROR and "injected" in producer.error
    assert consumer.status == RequestStatus.FINISHED_LENGTH and len(consumer.output_token_ids) == 2
    assert runner.encoded == [(consumer.request_id, 0)]  # re-produced by the consumer


def test_a_good_output_committed_beside_a_bad_one_is_kept_for_reuse():
    sched, runner = make_scheduler(prefix_caching=False), FakeRunner(bad_keys={"bad"})
    producer = _img_request("good", "bad")  # one request produces both keys in one step
    sched.add_request(producer)
    out = sched.schedule()
    assert out.encoder_items == {producer.request_id: (0, 1)}
    sched.update(out, runner.execute(out))
    assert producer.status == RequestStatus.FINISHED_ERROR
    assert sched.encoder_cache.state("good") == EntryState.READY and "good" in sched.encoder_cache.reusable
    assert "good" not in sched.encoder_cache.pending_freed_keys  # the runner keeps its tensor: accounted for
    later = _img_request("good")
    sched.add_request(later)
    run_to_completion(sched, runner)
    assert later.status == RequestStatus.FINISHED_LENGTH
    assert runner.encoded == [(producer.request_id, 0)]  # never encoded again


def test_bad_output_for_one_key_fails_exactly_its_users():
    sched, runner = make_scheduler(), FakeRunner(bad_keys={"bad"})
    users = [_img_request("bad"), _img_request("bad", "fine")]
    other = _img_request("fine")
    for r in (*users, other):
        sched.add_request(r)
    outs = run_to_completion(sched, runner)
    assert all(u.status == RequestStatus.FINISHED_ERROR and "bad output" in u.error for u in users)
    assert other.status == RequestStatus.FINISHED_LENGTH
    assert "bad" not in sched.encoder_cache.entries  # nothing half-written stays
    assert sorted(o.request_id for o in outs if o.finish_reason == "error") == sorted(u.request_id for u in users)


def test_only_reported_commits_become_ready_an_unreported_key_is_produced_again():
    sched, runner = make_scheduler(), FakeRunner()
    runner.lost_keys = {"x"}
    req = _img_request("x")
    sched.add_request(req)
    first = sched.schedule()
    assert first.encoder_items == {req.request_id: (0,)}
    sched.update(first, runner.execute(first))
    assert sched.encoder_cache.state("x").value == "missing" and req.num_computed_tokens == 0
    run_to_completion(sched, runner)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert [h.encoder_items for h in runner.history[:2]] == [{req.request_id: (0,)}] * 2


def test_items_inside_a_prefix_hit_are_not_encoded():
    # the cache holds one item: "p" is evicted by "q", yet the KV prefix still covers p's span
    items = make_items(output_bytes=60, cache_bytes=60, atomic_max=24)
    sched, runner = make_scheduler(block_size=4, items=items), FakeRunner()
    for key in ("p", "q", "p"):
        sched.add_request(make_request(prompt=list(range(1, 25)) if key == "p" else list(range(50, 74)),
                                       items=(image(0, 2, 6, key),), max_tokens=1))
        run_to_completion(sched, runner)
    assert sched.kv.stats.prefix_cache_hit_tokens >= 8
    assert [runner.items[rid][i].content_hash for rid, i in runner.encoded] == ["p", "q"]


def test_bytes_per_row_fallback_chain():
    assert bytes_per_embedding_row(2, declared_dim=64, embedding_weight_shape=(10, 32)) == 128
    assert bytes_per_embedding_row(2, embedding_weight_shape=(10, 32), config={"hidden_size": 16}) == 64
    assert bytes_per_embedding_row(4, config={"hidden_size": 16}) == 64
    assert bytes_per_embedding_row(4, config={"text_config": {"hidden_size": 8}}) == 32
    with pytest.raises(ValueError, match="tried: the model's declared embedding dim, the text embedding weight, "
                                         "config hidden_size"):
        bytes_per_embedding_row(4, config={})

"""Prefill/decode hand-offs in the scheduler (core/handoff.py), with fake runner outputs and fake
transfers: a prefill side parks after the first token and stops admitting at its bound; a decode side
admits by KV capacity, takes the blocks its prefix cache has, refuses what does not fit (backpressure),
and runs a received request from its first token on; aborts release everything on both sides."""

from __future__ import annotations

from mmserve.core.request import RequestStatus
from tests.unit.core_factories import FakeRunner, image, make_request, make_scheduler

BLOCK = 4


def _step(sched, runner):
    out = sched.schedule()
    outputs = sched.update(out, runner.execute(out))
    sched.check_integrity()
    return out, outputs


def _transferred(prompt: list[int], first_token: int = 7, max_tokens: int = 4, items=(), request_id=None):
    request = make_request(prompt=list(prompt), max_tokens=max_tokens, items=items, request_id=request_id)
    request.transferred = True
    request.output_token_ids.append(first_token)
    return request


def test_the_prefill_side_parks_after_the_first_token_and_holds_its_blocks():
    sched, runner = make_scheduler(), FakeRunner()
    a = make_request(10, max_tokens=5)
    a.hand_off = True
    sched.add_request(a)
    _, outputs = _step(sched, runner)
    assert [(o.new_token_ids, o.parked, o.finish_reason) for o in outputs] == [((7,), True, None)]
    assert a.status == RequestStatus.PARKED and sched.num_schedulable() == 0
    held = sched.kv.block_ids(a.request_id)
    assert len(held) == 3  # 10 prompt tokens in blocks of 4
    out, _ = _step(sched, runner)
    assert out.is_empty and sched.kv.block_ids(a.request_id) == held  # not decoded here, blocks kept
    sched.finish_requests([a.request_id], RequestStatus.FINISHED_STOPPED)  # sent
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and len(sched.kv.cached) == 2  # its full blocks stay


def test_a_request_its_first_token_finishes_is_not_parked():
    sched, runner = make_scheduler(), FakeRunner()
    a = make_request(6, max_tokens=1)
    a.hand_off = True
    sched.add_request(a)
    _, outputs = _step(sched, runner)
    assert outputs[0].finish_reason == "length" and not outputs[0].parked and not sched.handoff.parked


def test_at_its_parked_bound_the_prefill_side_admits_no_new_prompt():
    sched, runner = make_scheduler(max_num_seqs=2), FakeRunner()
    parked = [make_request(5, max_tokens=3) for _ in range(2)]
    for r in parked:
        r.hand_off = True
        sched.add_request(r)
    _step(sched, runner)
    assert sched.handoff.is_full
    waiting = make_request(prompt=[60, 61, 62, 63, 64], max_tokens=3)  # nothing of it cached
    sched.add_request(waiting)
    out, _ = _step(sched, runner)
    assert waiting.request_id not in out.num_scheduled_tokens  # backpressure: the decode side is behind
    sched.finish_requests([parked[0].request_id], RequestStatus.FINISHED_STOPPED)
    out, _ = _step(sched, runner)
    assert out.num_scheduled_tokens == {waiting.request_id: 5}


def test_the_decode_side_takes_its_cached_blocks_and_receives_the_rest():
    prompt = [10 + i for i in range(14)]  # 3 full blocks and 2 tokens
    sched, runner = make_scheduler(), FakeRunner()
    first = _transferred(prompt)
    assert sched.admit_transferred(first) == [0, 1, 2, 3]  # nothing cached: every prompt block moves
    assert first.status == RequestStatus.RECEIVING and sched.num_schedulable() == 0
    out, _ = _step(sched, runner)
    assert out.is_empty  # waits for its KV
    sched.transfer_done(first.request_id, 4)
    out, outputs = _step(sched, runner)
    assert [n.request_id for n in out.new_requests] == [first.request_id]
    assert out.new_requests[0].num_computed_tokens == 14 and len(out.new_requests[0].token_ids) == 15
    assert out.num_scheduled_tokens == {first.request_id: 1}  # its first token is the next input
    assert outputs[0].new_token_ids == (7,)
    while sched.num_unfinished:
        _step(sched, runner)
    assert first.output_token_ids == [7] * 4 and first.status == RequestStatus.FINISHED_LENGTH

    # the same 12 leading tokens and a different tail: the three full blocks are already here
    second = _transferred(prompt[:12] + [90, 91, 92])
    assert sched.admit_transferred(second) == [3]
    assert second.num_cached_tokens == 12 and sched.handoff.stats.kv_blocks_deduplicated == 3


def test_blocks_keyed_on_an_image_are_not_shared_with_another_image():
    sched = make_scheduler()
    a = _transferred([0] * 12, items=(image(0, 2, 8, "img-a"),))
    sched.admit_transferred(a)
    sched.transfer_done(a.request_id, 3)
    b = _transferred([0] * 12, items=(image(0, 2, 8, "img-b"),))
    assert sched.admit_transferred(b) == [0, 1, 2]  # same ids, other image: nothing to reuse


def test_the_decode_side_refuses_what_does_not_fit_and_holds_nothing():
    sched = make_scheduler(num_blocks=4)
    big = _transferred(list(range(20)))  # 6 blocks with its first token
    assert sched.admit_transferred(big) is None
    assert sched.kv.num_free_blocks == 4 and big.request_id not in sched.requests
    sched.check_integrity()
    assert sched.admit_transferred(_transferred(list(range(8)))) == [0, 1]


def test_the_decode_side_takes_no_more_sequences_than_it_runs():
    sched = make_scheduler(max_num_seqs=2)
    assert sched.admit_transferred(_transferred([1, 2, 3])) is not None
    assert sched.admit_transferred(_transferred([4, 5, 6])) is not None
    assert sched.admit_transferred(_transferred([7, 8, 9])) is None


def test_aborting_a_receiving_request_releases_its_blocks():
    sched, runner = make_scheduler(), FakeRunner()
    r = _transferred(list(range(9)))
    sched.admit_transferred(r)
    assert sched.kv.num_free_blocks < sched.kv.num_blocks
    sched.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
    _step(sched, runner)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.handoff.holders


def test_preempted_on_the_decode_side_without_its_image_kv_it_fails_clearly():
    sched, runner = make_scheduler(num_blocks=6, prefix_caching=False), FakeRunner()
    r = _transferred([0] * 12, max_tokens=20, items=(image(0, 0, 8, "img-a"),))
    assert sched.admit_transferred(r) is not None
    sched.transfer_done(r.request_id, 3)
    hog = make_request(16, max_tokens=1)
    sched.add_request(hog)
    failures = []
    for _ in range(40):
        if not sched.num_unfinished:
            break
        _, outputs = _step(sched, runner)
        failures += [o for o in outputs if o.finish_reason == "error"]
    assert r.num_preemptions >= 1
    assert [o.request_id for o in failures] == [r.request_id] and "images are not here" in failures[0].error
    assert sched.kv.num_free_blocks == sched.kv.num_blocks

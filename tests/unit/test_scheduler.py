from mmserve.core.request import RequestStatus
from mmserve.core.step import ModelRunnerOutput
from tests.unit.core_factories import FakeRunner, image, make_request, make_scheduler, run_to_completion


def test_prefill_then_decode_to_max_tokens():
    sched, runner = make_scheduler(), FakeRunner()
    r = make_request(10, max_tokens=3)
    sched.add_request(r)
    outs = run_to_completion(sched, runner)
    assert r.output_token_ids == [7, 7, 7] and r.status == RequestStatus.FINISHED_LENGTH
    assert outs[-1].finish_reason == "length"
    assert runner.history[0].num_scheduled_tokens == {r.request_id: 10}
    assert all(h.num_scheduled_tokens == {r.request_id: 1} for h in runner.history[1:])


def test_eos_stops_after_min_tokens():
    sched, runner = make_scheduler(), FakeRunner()
    r = make_request(6, max_tokens=10, min_tokens=0)
    runner.eos_for.add(r.request_id)
    sched.add_request(r)
    run_to_completion(sched, runner)
    assert r.output_token_ids == [2] and r.status == RequestStatus.FINISHED_STOPPED


def test_token_budget_chunks_prefill_and_mixes_decodes():
    sched, runner = make_scheduler(max_num_batched_tokens=8), FakeRunner()
    a, b = make_request(4, max_tokens=5), make_request(20, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    run_to_completion(sched, runner)
    first = runner.history[0].num_scheduled_tokens
    assert first == {a.request_id: 4, b.request_id: 4}
    second = runner.history[1].num_scheduled_tokens
    assert second == {a.request_id: 1, b.request_id: 7}  # a decodes while b prefills
    assert all(h.total_num_scheduled_tokens <= 8 for h in runner.history)


def test_chunk_boundary_inside_an_image_span():
    sched, runner = make_scheduler(max_num_batched_tokens=5), FakeRunner()
    r = make_request(12, items=(image(0, 3, 6),), max_tokens=1)
    sched.add_request(r)
    run_to_completion(sched, runner)
    chunks = [h.num_scheduled_tokens[r.request_id] for h in runner.history]
    assert chunks[:3] == [5, 5, 2]  # boundaries at 5 and 10 fall inside the span [3, 9)
    assert runner.history[0].encoder_items == {r.request_id: (0,)}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    sched, runner = make_scheduler(max_num_batched_tokens=8, chunked=False), FakeRunner()
    a, b = make_request(6, max_tokens=3), make_request(6, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    run_to_completion(sched, runner)
    assert runner.history[0].num_scheduled_tokens == {a.request_id: 6}


def test_max_num_seqs_limits_running():
    sched, runner = make_scheduler(max_num_seqs=2), FakeRunner()
    reqs = [make_request(4, max_tokens=2) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, runner)
    assert all(len(h.num_scheduled_tokens) <= 2 for h in runner.history)


def test_prefix_hit_skips_cached_tokens_and_items():
    sched, runner = make_scheduler(block_size=4), FakeRunner()
    items = (image(0, 2, 8, "same"),)
    a = make_request(prompt=list(range(1, 21)), items=items, max_tokens=1)
    sched.add_request(a)
    run_to_completion(sched, runner)
    b = make_request(prompt=list(range(1, 21)), items=items, max_tokens=1)
    sched.add_request(b)
    run_to_completion(sched, runner)
    assert b.num_cached_tokens == 16
    step = next(h for h in runner.history if any(n.request_id == b.request_id for n in h.new_requests))
    assert step.new_requests[0].num_computed_tokens == 16 and step.num_scheduled_tokens[b.request_id] == 4
    assert b.request_id not in step.encoder_items  # item [2, 10) wholly cached
    assert sched.kv.stats.prefix_cache_hit_tokens == 16


def test_different_image_same_ids_gets_no_prefix_hit():
    sched, runner = make_scheduler(block_size=4), FakeRunner()
    a = make_request(prompt=list(range(1, 21)), items=(image(0, 2, 8, "cat"),), max_tokens=1)
    sched.add_request(a)
    run_to_completion(sched, runner)
    b = make_request(prompt=list(range(1, 21)), items=(image(0, 2, 8, "dog"),), max_tokens=1)
    sched.add_request(b)
    run_to_completion(sched, runner)
    assert b.num_cached_tokens == 0  # block 0 holds tokens 0-3, overlapping the image


def test_preemption_recomputes_and_finishes_everything():
    # 6 blocks of 4 tokens: two 8-token prompts decoding 8 tokens each cannot both fit
    sched, runner = make_scheduler(num_blocks=6, block_size=4), FakeRunner()
    a, b = make_request(8, max_tokens=8), make_request(8, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    run_to_completion(sched, runner)
    assert sched.stats.num_preemptions >= 1
    assert b.num_preemptions >= 1 and a.num_preemptions == 0  # the newest is preempted
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    resumed = [n for h in runner.history for n in h.new_requests if n.request_id == b.request_id][-1]
    assert resumed.num_output_tokens > 0 and len(resumed.token_ids) > 8  # recomputes prompt + outputs
    assert sched.kv.num_free_blocks == 6


def test_abort_frees_everything_at_any_time():
    sched, runner = make_scheduler(max_num_batched_tokens=4), FakeRunner()
    a, b, c = make_request(12, max_tokens=5), make_request(4, max_tokens=5), make_request(4, max_tokens=5)
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    sched.finish_requests([a.request_id, c.request_id], RequestStatus.FINISHED_ABORTED)  # running and waiting
    sched.check_integrity()
    out = sched.schedule()
    assert {a.request_id, c.request_id} <= out.finished_request_ids
    sched.update(out, runner.execute(out))
    run_to_completion(sched, runner)
    assert a.status == c.status == RequestStatus.FINISHED_ABORTED and b.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_abort_during_a_step_ignores_its_results():
    sched, runner = make_scheduler(), FakeRunner()
    r = make_request(4, max_tokens=5)
    sched.add_request(r)
    out = sched.schedule()
    result = runner.execute(out)
    sched.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
    assert sched.update(out, result) == []
    sched.check_integrity()


def test_runner_failure_finishes_only_that_request():
    sched = make_scheduler()
    a, b = make_request(4), make_request(4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    outs = sched.update(out, ModelRunnerOutput(sampled_token_ids={b.request_id: 7},
                                               failed={a.request_id: "encoder exploded"}))
    assert a.status == RequestStatus.FINISHED_ERROR and a.error == "encoder exploded"
    assert b.status == RequestStatus.RUNNING
    assert [o.finish_reason for o in outs] == ["error", None]
    sched.check_integrity()

"""Speculative decoding's pure parts: the n-gram lookup, the draft policy's limits (max_tokens, the context,
disable_by_batch_size, requests that may not speculate), vLLM's counters, the scheduler's steps with drafts
against fake runner outputs (KV and counts follow only the accepted tokens), the config's parsing and which
requests may speculate."""

from __future__ import annotations

import pytest
import torch

from mmserve.core.budget import EncoderBudget
from mmserve.core.drafts import DraftPolicy, lookup
from mmserve.core.encoder_cache import EncoderCacheManager
from mmserve.core.item_scheduler import ItemScheduler
from mmserve.core.kv_cache import KVCacheManager
from mmserve.core.request import Request
from mmserve.core.scheduler import Scheduler, SchedulerLimits
from mmserve.core.step import ModelRunnerOutput
from mmserve.sampling_params import SamplingParams
from mmserve.speculative import SpeculativeConfig, speculates


@pytest.mark.parametrize(("tokens", "k", "expected"), [
    ([1, 2, 3, 9, 1, 2, 3], 2, (9, 1)),  # the 3-gram 1 2 3 occurred before: what followed it
    ([1, 2, 3, 9, 8, 5, 1, 2, 3], 3, (9, 8, 5)),
    ([4, 2, 3, 7, 5, 2, 3, 8, 1, 2, 3], 1, (8,)),  # 1 2 3 never before; 2 3 latest at 5: then 8
    ([5, 5, 5, 5, 5], 2, (5, 5)),  # a run: a match that k tokens follow
    ([1, 2, 3, 4], 2, ()),  # nothing repeats
    ([7], 2, ()),
])
def test_lookup_takes_the_longest_latest_match(tokens, k, expected):
    assert lookup(tokens, 1, 3, k) == expected


def _request(tokens, max_tokens=10, speculate=True, outputs=()):
    request = Request("r", list(tokens), SamplingParams(temperature=0, max_tokens=max_tokens))
    request.output_token_ids = list(outputs)
    request.speculate = speculate
    return request


def test_the_policy_stops_at_max_tokens_the_context_and_busy_batches():
    policy = DraftPolicy(4, 1, 3, max_model_len=100)
    assert policy.drafts(_request([1, 2, 1, 2, 1, 2, 1, 2]), 1) == (1, 2, 1, 2)
    assert policy.drafts(_request([1, 2, 1, 2, 1, 2, 1, 2], speculate=False), 1) == ()
    # 8 of 10 tokens out: the next step's token and one draft reach max_tokens
    assert policy.drafts(_request([1, 2, 1, 2], outputs=[1, 2, 1, 2, 1, 2, 1, 2]), 1) == (1,)
    assert DraftPolicy(4, 1, 3, max_model_len=10).drafts(_request([1, 2, 1, 2, 1, 2, 1, 2]), 1) == (1,)
    assert DraftPolicy(4, 1, 3, 100, disable_by_batch_size=4).drafts(_request([1, 2, 1, 2, 1, 2]), 4) == ()


def test_the_counters_follow_what_verification_accepted():
    policy = DraftPolicy(3, 1, 3, max_model_len=100)
    request = _request([1, 2, 1, 2])
    policy.settled(request, 3, 2)
    policy.settled(request, 2, 0)
    stats = policy.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.accepted_per_position == [1, 1, 0]
    assert (request.num_draft_tokens, request.num_accepted_draft_tokens) == (5, 2)


def test_a_request_whose_acceptance_collapses_stops_drafting():
    policy = DraftPolicy(4, 1, 3, max_model_len=1000)
    request = _request([1, 2, 1, 2, 1, 2, 1, 2], max_tokens=500)
    for _ in range(7):  # 28 draft tokens, 2 accepted: not yet enough to judge
        policy.settled(request, 4, 0 if request.num_draft_tokens else 2)
    assert policy.drafts(request, 1) != ()
    policy.settled(request, 4, 0)  # 32 draft tokens, 2 accepted (6%)
    assert policy.drafts(request, 1) == ()
    healthy = _request([1, 2, 1, 2, 1, 2, 1, 2], max_tokens=500)
    for _ in range(8):
        policy.settled(healthy, 4, 1)  # 25% accepted
    assert policy.drafts(healthy, 1) != ()


def _scheduler(drafter):
    budget = EncoderBudget(16, 1 << 20, 1 << 30, 1 << 30, 1 << 20, 1 << 20)
    return Scheduler(SchedulerLimits(8, 64, True, 128), KVCacheManager(64, 4, True),
                     ItemScheduler(EncoderCacheManager(1 << 30, 1 << 30), budget), drafter=drafter)


def test_a_decode_step_with_drafts_counts_only_the_accepted_tokens():
    scheduler = _scheduler(DraftPolicy(3, 1, 2, max_model_len=128))
    request = _request([1, 2, 3, 1, 2], max_tokens=20)
    scheduler.add_request(request)
    prefill = scheduler.schedule()
    assert prefill.num_scheduled_tokens == {"r": 5} and not prefill.spec_token_ids
    scheduler.update(prefill, ModelRunnerOutput(sampled_token_ids={"r": 3}))  # tokens: 1 2 3 1 2 | 3
    step = scheduler.schedule()
    assert step.spec_token_ids == {"r": (1, 2, 3)}  # after "2 3": what followed it before
    assert step.num_scheduled_tokens == {"r": 4}
    # the runner accepted the first draft and found 7 after it: two tokens out, KV for the last token + 1
    outputs = scheduler.update(step, ModelRunnerOutput(sampled_token_ids={"r": (1, 7)}))
    assert outputs[0].new_token_ids == (1, 7)
    assert request.output_token_ids == [3, 1, 7]
    assert request.num_computed_tokens == 7 and request.num_tokens == 8
    assert scheduler.draft_counts()["spec_decode_num_accepted_tokens"] == 1
    scheduler.finish_requests(["r"], request.status.FINISHED_ABORTED)
    scheduler.check_integrity()


def test_a_draft_models_proposals_are_asked_for_with_kv_reserved_and_used_once():
    scheduler = _scheduler(DraftPolicy(3, 1, 3, max_model_len=128, proposed_by_runner=True))
    request = _request([1, 2, 3, 4], max_tokens=20)
    scheduler.add_request(request)
    prefill = scheduler.schedule()
    # the prompt's step reaches its last token: the runner proposes after it, into slots reserved now
    assert prefill.propose_drafts == {"r": 3} and not prefill.spec_token_ids
    assert len(scheduler.kv.req_blocks["r"]) == 2  # 4 tokens + the sampled one + 2 drafts fed to the drafter
    scheduler.update(prefill, ModelRunnerOutput(sampled_token_ids={"r": 6}, draft_token_ids={"r": (7, 8, 9)}))
    step = scheduler.schedule()
    assert step.spec_token_ids == {"r": (7, 8, 9)} and step.num_scheduled_tokens == {"r": 4}
    assert step.propose_drafts == {"r": 3} and len(scheduler.kv.req_blocks["r"]) == 3  # up to 4 kept + 3 ahead
    scheduler.update(step, ModelRunnerOutput(sampled_token_ids={"r": (7, 5)}))  # no new proposal this time
    assert request.proposed_drafts == ()
    step = scheduler.schedule()
    assert not step.spec_token_ids and step.num_scheduled_tokens == {"r": 1}  # a proposal serves one step
    scheduler.finish_requests(["r"], request.status.FINISHED_ABORTED)
    scheduler.check_integrity()
    # prompt lookup proposes when scheduling: no lookahead; nor past the batch-size cutoff
    assert DraftPolicy(3, 1, 3, 128).lookahead(_request([1, 2]), 1) == 0
    assert DraftPolicy(3, 1, 3, 128, 2, proposed_by_runner=True).lookahead(_request([1, 2]), 2) == 0
    # no more than the next step could verify before max_tokens; none once the step's batch reaches the cutoff
    policy = DraftPolicy(3, 1, 3, 128, 4, proposed_by_runner=True)
    assert policy.lookahead(_request([1, 2], max_tokens=10, outputs=[5] * 6), 1) == 2
    assert policy.lookahead(_request([1, 2], max_tokens=10, outputs=[5] * 8), 1) == 0
    assert policy.still_proposing({"r": 3}, 3) == {"r": 3} and policy.still_proposing({"r": 3}, 4) == {}


def test_the_drafters_progress_moves_past_a_fed_draft_only_once_it_is_kept():
    from mmserve.runner.draft_model import _settle
    from mmserve.runner.state import RunnerRequest

    state = RunnerRequest("r", [1, 2, 3, 4], 2, None, SamplingParams(), [], 3, draft_computed=4, draft_fed=(5, 6))
    state.token_ids += [5, 9]  # the first fed draft kept, the second replaced
    _settle(state)
    assert (state.draft_computed, state.draft_fed) == (5, ())  # 9 is fed next, at position 5
    state = RunnerRequest("r", [1, 2, 3, 4, 5, 6, 7, 8], 2, None, SamplingParams(), [], 7, draft_computed=4,
                          draft_fed=(5, 6))
    _settle(state)  # every fed draft kept and more: the last known token is still fed again
    assert state.draft_computed == 6
    state = RunnerRequest("r", [1, 2, 3, 4, 5], 2, None, SamplingParams(), [], 4, draft_computed=4, draft_fed=(5, 6))
    _settle(state)  # a step decoded one token without verifying the proposal: never past the last token
    assert state.draft_computed == 4


@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "ngram", "num_speculative_tokens": 2, "extra": 1}', "key(s) extra"),
    ({"method": "eagle", "num_speculative_tokens": 1, "model": "x"}, "not supported by mmserve yet"),
    ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 2}, "read by method 'ngram' only"),
    ({"method": "ngram", "num_speculative_tokens": True}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "positive integer"),
    ("[1]", "JSON object"),
])
def test_the_config_refuses_what_mmserve_does_not_do(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(value)


def test_one_lookup_bound_sets_both_and_who_speculates():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    assert config.disable_by_batch_size == 8  # the measured default; null turns the cutoff off
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                    "disable_by_batch_size": None}).disable_by_batch_size is None
    assert speculates(SamplingParams(temperature=0)) and speculates(SamplingParams(temperature=0.7, top_p=0.9))
    # a verification's rows give the raw distribution's logprobs, not the processed one's
    assert speculates(SamplingParams(temperature=0, logprobs=2), "raw_logprobs")
    assert not speculates(SamplingParams(temperature=0, logprobs=2), "processed_logprobs")
    assert not speculates(SamplingParams(temperature=0.7, seed=1))  # a seeded draw per token
    # each row is processed as the sampler would: these speculate
    for taken in (dict(temperature=0, seed=1), dict(temperature=0, min_tokens=2), dict(presence_penalty=0.5),
                  dict(temperature=0, logit_bias={1: 2.0}), dict(temperature=0, bad_words=["x"]),
                  dict(temperature=0, allowed_token_ids=[1, 2]), dict(repetition_penalty=1.3, top_k=5)):
        assert speculates(SamplingParams(**taken)), taken


@pytest.mark.parametrize("options", [dict(presence_penalty=0.5), dict(repetition_penalty=1.2), dict(min_tokens=3),
                                     dict(logit_bias={1: 2.0}), dict(allowed_token_ids=[1, 2]), dict(bad_words=["x"])])
def test_a_verification_skips_processing_only_where_no_stage_changes_a_logit(options):
    from mmserve.runner.sampling_state import RequestSampling, SampledRow, changes_logits, sampling_metadata

    params = SamplingParams(**options)
    bad_words = ((7,),) if params.bad_words else ()
    state = RequestSampling.build(params, [1, 2, 3], 2, 16, torch.device("cpu"))
    row = SampledRow(params, 0, [], (0,), bad_words, state, None)
    assert sampling_metadata([row], torch.device("cpu")).processes_logits
    assert changes_logits(params, bad_words, grammar=False)
    assert not changes_logits(SamplingParams(temperature=0.7, top_k=5), (), grammar=False)

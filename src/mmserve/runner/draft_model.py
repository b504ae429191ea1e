"""Speculative decoding's draft model: a smaller checkpoint proposes each request's next tokens greedily.

Role: `DraftModelProposer.propose(requests, wanted)` runs after a step, for the requests whose step reached
their last token and that the scheduler asked drafts of: first one batched forward over every token of each
request its drafter has not computed yet (the whole prompt after admission or a preemption, else the one or
two tokens the last verification settled), then `k - 1` batched one-token forwards, each feeding the last
greedy draft. The drafter keeps its own paged KV cache, indexed by the target's block tables (the same block
ids, its own layers), so it spends no blocks of its own; the scheduler reserves the slots its drafts write.
A request's drafter progress (`RunnerRequest.draft_computed`) moves past a fed draft only when the
verification kept it, so a rejected draft's drafter KV is overwritten, never read. The drafter reads a
prompt's text: media rows enter it as their placeholder tokens, causal, at the target's positions.
What it does not know: scheduling, verification (runner/speculation.py), any family.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from mmserve.models.spec import FamilyModel
from mmserve.runner.attention import PagedAttentionBackend
from mmserve.runner.batch import BatchBuilder
from mmserve.runner.sampler import greedy_argmax
from mmserve.runner.state import RunnerRequest
from mmserve.sampling_params import SamplingParams

DRAFT_PARAMS = SamplingParams(temperature=0.0)  # what a drafter's view of a request asks of the batch builder


class DraftModelProposer:
    reads_hidden = False  # it reads tokens only, not the target's hidden states

    def __init__(self, model: FamilyModel, attention: PagedAttentionBackend, device: torch.device,
                 forward_reads_token_ids: bool = False) -> None:
        self.model = model
        self.forward_reads_token_ids = forward_reads_token_ids  # the drafter's FamilySpec says
        self.attention = attention
        self.device = device
        self.num_forwards = 0  # the drafter's batched forwards over its life

    @torch.inference_mode()
    def propose(self, requests: Mapping[str, RunnerRequest], wanted: Mapping[str, int],
                step: object = None) -> dict[str, tuple[int, ...]]:
        """Each wanted request's `wanted[rid]` greedy drafts after its last known token (`step`: unused)."""
        states = [requests[rid] for rid in wanted if rid in requests]
        if not states:
            return {}
        for state in states:
            _settle(state)
        builder = self._builder()
        for state in states:  # everything the drafter has not computed, up to the last known token
            builder.add(drafter_view(state, state.draft_computed, state.token_ids), len(state.token_ids) - state.draft_computed,
                        [], {})
            state.draft_computed = len(state.token_ids)
        drafts = {state.request_id: [token] for state, token in zip(states, self._greedy(builder))}
        while True:
            active = [s for s in states if len(drafts[s.request_id]) < wanted[s.request_id]]
            if not active:
                break
            builder = self._builder()
            for state in active:  # the last draft, fed at the position after the one it was drafted from
                tokens = state.token_ids + drafts[state.request_id]
                builder.add(drafter_view(state, len(tokens) - 1, tokens), 1, [], {})
            for state, token in zip(active, self._greedy(builder)):
                drafts[state.request_id].append(token)
        for state in states:  # fed to the drafter: valid in its cache once verification keeps them
            state.draft_fed = tuple(drafts[state.request_id][:-1])
        return {rid: tuple(tokens) for rid, tokens in drafts.items()}

    def _builder(self) -> BatchBuilder:
        return BatchBuilder(self.attention.block_size, self.device, self.attention.cpu_plan)

    def _greedy(self, builder: BatchBuilder) -> list[int]:
        """The drafter's greedy token after each sequence of the batch."""
        batch = builder.build()
        ids = {"token_ids": batch.input_ids} if self.forward_reads_token_ids else {}
        hidden = self.model(self.model.embed(batch.input_ids), batch.positions, self.attention, batch.attn, None,
                            **ids)
        self.num_forwards += 1
        return greedy_argmax(self.model.compute_logits(hidden[batch.sample_index])).tolist()


def _settle(state: RunnerRequest) -> None:
    """Advance the drafter's progress over the drafts it was fed that are now the request's tokens, never to
    the last known token (which the next forward feeds, for the logits after it)."""
    computed, kept = state.draft_computed, 0
    for i, token in enumerate(state.draft_fed):
        if computed + i >= len(state.token_ids) or state.token_ids[computed + i] != token:
            break
        kept += 1
    state.draft_computed = min(computed + kept, len(state.token_ids) - 1)
    state.draft_fed = ()


def drafter_view(state: RunnerRequest, start: int, tokens: list[int]) -> RunnerRequest:
    """The request as a drafter computes it (a draft model, an MTP head): `tokens` from `start`, text only,
    causal, plain sampling, at the request's positions and blocks."""
    prompt = replace(state.prompt, attention_spans=(), cross_spans=(), bad_words_token_ids=())
    return replace(state, token_ids=tokens, num_computed_tokens=start, prompt=prompt, sampling_params=DRAFT_PARAMS,
                   mm=None, sampling=None, cross=None, state_slot=None, pooled=None)

"""Speculative decoding's method "mtp": the target checkpoint's own multi-token-prediction head drafts.

Role: `MtpProposer.propose(requests, wanted, step)` runs after every step over the rows the target computed
and kept (`StepHidden`: each request's first row in the step's hidden states and how many of its rows are
valid): the head reads, at each position t, the target's hidden state there and the token after it, so its
own KV cache follows the target's over prompts and answers alike (for every request, drafting or not). For
the requests the scheduler asked drafts of (whose step reached their last token), the head's guess after the
last row is the first draft; each further one feeds the previous draft with the head's own hidden state,
one batched one-token forward per draft. The head's KV (one layer) lives in the target's blocks, its own
layer of them; the scheduler reserves the slots the drafts write. A rejected draft's KV is overwritten by
the next step's pass over the kept rows.
What it does not know: scheduling, verification (runner/speculation.py), the head's family (an `MtpHead`:
`forward(token_embeds, target_hidden, positions, backend, meta)`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mmserve.models.spec import FamilyModel
from mmserve.runner.attention import PagedAttentionBackend
from mmserve.runner.batch import BatchBuilder
from mmserve.runner.draft_model import drafter_view
from mmserve.runner.sampler import greedy_argmax
from mmserve.runner.state import RunnerRequest


@dataclass(frozen=True)
class StepHidden:
    """A step's final hidden states (num_tokens, hidden) and, per request, (first row, rows kept)."""

    hidden: torch.Tensor
    rows: dict[str, tuple[int, int]]


class MtpProposer:
    reads_hidden = True  # the runner hands it each step's hidden states

    def __init__(self, head: nn.Module, target: FamilyModel, attention: PagedAttentionBackend,
                 device: torch.device) -> None:
        self.head, self.target, self.attention, self.device = head, target, attention, device
        self.num_forwards = 0

    @torch.inference_mode()
    def propose(self, requests: Mapping[str, RunnerRequest], wanted: Mapping[str, int],
                step: StepHidden | None) -> dict[str, tuple[int, ...]]:
        """Each wanted request's `wanted[rid]` drafts; the head's KV filled over every kept row of the step."""
        if step is None:
            return {}
        kept = [(requests[rid], first, num) for rid, (first, num) in step.rows.items() if rid in requests and num]
        if not kept:
            return {}
        builder, inputs = self._builder(), []
        for state, first, num in kept:  # position t reads token t + 1: the request's tokens shifted by one
            start = state.num_computed_tokens - num
            builder.add(drafter_view(state, start, state.token_ids[1:]), num, [], {})
            inputs.append(step.hidden[first:first + num])
        guesses, last = self._forward(builder, torch.cat(inputs))
        ends = [state for state, _, _ in kept if state.num_computed_tokens == len(state.token_ids) - 1]
        drafts = {s.request_id: [g] for s, g in zip(ends, guesses) if s.request_id in wanted}
        hidden = {s.request_id: last[i:i + 1] for i, s in enumerate(ends)}
        while True:
            active = [requests[rid] for rid in drafts if len(drafts[rid]) < wanted[rid]]
            if not active:
                break
            builder = self._builder()
            for state in active:  # the last draft, at the position after the last known token's
                tokens = state.token_ids + drafts[state.request_id]
                builder.add(drafter_view(state, len(tokens) - 2, tokens[1:]), 1, [], {})
            guesses, last = self._forward(builder, torch.cat([hidden[s.request_id] for s in active]))
            for i, (state, guess) in enumerate(zip(active, guesses)):
                drafts[state.request_id].append(guess)
                hidden[state.request_id] = last[i:i + 1]
        return {rid: tuple(tokens) for rid, tokens in drafts.items()}

    def _builder(self) -> BatchBuilder:
        return BatchBuilder(self.attention.block_size, self.device, self.attention.cpu_plan)

    def _forward(self, builder: BatchBuilder, target_hidden: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """The head over the batch: its greedy guess after each sequence that reaches its end, and the head's
        hidden state at those rows (fed to the next draft)."""
        batch = builder.build()
        out = self.head(self.target.embed(batch.input_ids), target_hidden, batch.positions, self.attention, batch.attn)
        self.num_forwards += 1
        last = out[batch.sample_index]
        return greedy_argmax(self.target.compute_logits(last)).tolist(), last

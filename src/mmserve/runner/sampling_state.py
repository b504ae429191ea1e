"""What the sampler needs of each request besides its options, kept between steps.

Role: `RequestSampling` holds a request's device-side sampling state, built on its first sampled row from
the tokens the runner holds (so a preempted, recomputed request rebuilds the same state) and kept up to
date one token at a time: its generated-token counts and the tokens its prompt or output hold (for
penalties), and its allowed-token mask. `sampling_metadata` turns one step's sampled rows into the
sampler's `SamplingMetadata`: per-row options as columns, the penalty rows stacked, the banned tokens
(stop ids before `min_tokens`, and each bad word's last token where the output ends in the tokens before
it); `verification_metadata` the same for a speculative verification's rows, each as if the drafts
before it were generated. Requests that use none of it get no state and cost nothing.
What it does not know: the model, the batch layout, scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmserve.runner.sampler import PenaltyBatch, SamplingMetadata, to_device
from mmserve.sampling_params import SamplingParams


@dataclass
class RequestSampling:
    """A request's sampling state on the device (each part None when its options do not need it)."""

    output_counts: torch.Tensor | None  # (vocab,) float32: how often each token was generated
    seen: torch.Tensor | None  # (vocab,) bool: tokens in the prompt or the output
    allowed_mask: torch.Tensor | None  # (vocab,) bool: allowed_token_ids

    @classmethod
    def build(cls, params: SamplingParams, token_ids: Sequence[int], num_prompt_tokens: int, vocab_size: int,
              device: torch.device) -> RequestSampling:
        counts = seen = allowed = None
        if params.needs_penalties:
            ids = torch.tensor([t for t in token_ids if t < vocab_size], dtype=torch.long, device=device)
            seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            seen[ids] = True
            outputs = torch.tensor([t for t in token_ids[num_prompt_tokens:] if t < vocab_size], dtype=torch.long,
                                   device=device)
            counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            counts.index_add_(0, outputs, torch.ones(len(outputs), dtype=torch.float32, device=device))
        if params.allowed_token_ids is not None:
            allowed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = [t for t in params.allowed_token_ids if t < vocab_size]
            allowed[torch.tensor(ids, dtype=torch.long, device=device)] = True
        return cls(counts, seen, allowed)

    def record(self, token_id: int) -> None:
        """A token was generated."""
        if self.output_counts is not None and token_id < self.output_counts.shape[0]:
            self.output_counts[token_id] += 1
            self.seen[token_id] = True

def bad_word_bans(bad_words_token_ids: Sequence[tuple[int, ...]], output_ids: Sequence[int]) -> tuple[int, ...]:
    """The tokens a row must not produce next: each bad word's last token where the output already ends
    in the word's other tokens (a one-token word: always)."""
    bans = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output_ids) >= len(prefix) and tuple(output_ids[-len(prefix):]) == prefix):
            bans.append(word[-1])
    return tuple(bans)

@dataclass(frozen=True)
class SampledRow:
    """What `sampling_metadata` reads of one sampled row's request."""

    params: SamplingParams
    num_output_tokens: int
    output_ids: Sequence[int]
    stop_token_ids: tuple[int, ...]
    bad_words_token_ids: tuple[tuple[int, ...], ...]
    state: RequestSampling | None
    generator: torch.Generator | None
    token_bitmask: torch.Tensor | None = None  # (ceil(vocab / 32),) int32: the grammar's allowed tokens

def sampling_metadata(rows: Sequence[SampledRow], device: torch.device) -> SamplingMetadata:
    params = [r.params for r in rows]
    banned = []
    for r in rows:
        # a grammar decides where its output may end: min_tokens does not hold it open past that
        ids = r.stop_token_ids if r.num_output_tokens < r.params.min_tokens and r.token_bitmask is None else ()
        if r.bad_words_token_ids:
            ids = ids + bad_word_bans(r.bad_words_token_ids, r.output_ids)
        banned.append(ids)
    penalty_rows = [i for i, r in enumerate(rows) if r.state is not None and r.state.output_counts is not None]
    penalties = None
    if penalty_rows:
        def column(values: list[float]) -> torch.Tensor:
            return to_device(values, device).to(torch.float32).unsqueeze(1)
        penalties = PenaltyBatch(
            rows=to_device(penalty_rows, device),
            output_counts=torch.stack([rows[i].state.output_counts for i in penalty_rows]),
            seen=torch.stack([rows[i].state.seen for i in penalty_rows]),
            presence=column([params[i].presence_penalty for i in penalty_rows]),
            frequency=column([params[i].frequency_penalty for i in penalty_rows]),
            repetition=column([params[i].repetition_penalty for i in penalty_rows]))
    wants_logprobs = any(p.logprobs is not None for p in params)
    grammar_rows = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
    token_bitmask = None
    if grammar_rows:
        packed = torch.stack([rows[i].token_bitmask for i in grammar_rows])
        token_bitmask = (grammar_rows, packed.pin_memory().to(device, non_blocking=True) if device.type == "cuda"
                         else packed.to(device))
    return SamplingMetadata(
        temperatures=[p.temperature for p in params],
        top_ks=[p.top_k for p in params],
        top_ps=[p.top_p for p in params],
        min_ps=[p.min_p for p in params],
        generators=[r.generator for r in rows],
        banned_token_ids=banned,
        allowed_masks=[(i, r.state.allowed_mask) for i, r in enumerate(rows)
                       if r.state is not None and r.state.allowed_mask is not None],
        token_bitmask=token_bitmask,
        logit_bias=[(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias],
        penalties=penalties,
        num_logprobs=[p.logprobs for p in params] if wants_logprobs else None,
    )

def verification_metadata(row: SampledRow, drafts: Sequence[int], bitmasks: torch.Tensor | None,
                          device: torch.device) -> SamplingMetadata:
    """The metadata of a verification's k + 1 rows for a request whose `row` is as of its last known token:
    row i as if drafts[:i] were already generated (their counts in the penalties, bad words and min_tokens
    seen through them, the grammar's mask `bitmasks[i]` after them)."""
    rows, state = [], row.state
    for i in range(len(drafts) + 1):
        if i and state is not None and state.output_counts is not None:
            state = RequestSampling(state.output_counts.clone(), state.seen.clone(), state.allowed_mask)
            state.record(drafts[i - 1])
        rows.append(SampledRow(row.params, row.num_output_tokens + i, [*row.output_ids, *drafts[:i]],
                               row.stop_token_ids, row.bad_words_token_ids, state, None,
                               None if bitmasks is None else bitmasks[i]))
    return sampling_metadata(rows, device)


def changes_logits(params: SamplingParams, bad_words: Sequence[tuple[int, ...]], grammar: bool) -> bool:
    """Does any stage before temperature (`sampler.processed_logits`) change this request's logits?"""
    return bool(grammar or params.needs_penalties or params.logit_bias or params.min_tokens or bad_words
                or params.allowed_token_ids is not None)


def needs_state(params: SamplingParams) -> bool:
    """Does a request with these options keep device-side sampling state?"""
    return params.needs_penalties or params.allowed_token_ids is not None

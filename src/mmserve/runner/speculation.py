"""Speculative decoding's verification in the runner: a decoding request's drafts checked in one forward.

Role: a request with drafts runs its last known token and the drafts as one chunk; the logits at each of
those positions give the distribution of the token that follows it. Greedy: the drafts are accepted while
each equals the greedy token before it, and the first greedy token that differs (or, all accepted, the one
after the last draft) is emitted with them — exactly the tokens one-at-a-time decoding produces
(`greedy_argmax`, the sampler's own pick, on the raw logits). Sampled: rejection sampling (Leviathan et al.,
Chen et al.) with the drafter's distribution a point mass on each draft: a draft is accepted with the target
probability of it, a rejected one is replaced by a draw from the target with the draft's mass removed
(`residual`), and all accepted, one more token is drawn from the last row — so every emitted token has the
target distribution (temperature, top-k, top-p, min-p as the sampler applies them).
A request whose options change logits (a grammar, penalties, bans, logit bias, allowed tokens) has each row
processed as the sampler would, as if the drafts before it were generated (the engine walked its grammar
through the drafts). Requests that ask for logprobs get each emitted token's entry from its row's raw logits, as a decode step
reports it (mmserve/speculative.py admits only raw logprob modes, and only requests whose logits nothing
else changes).
On a hybrid model the verification's linear-attention layers record the recurrent state after each token;
`roll_back_states` puts back the one after the last kept token, so a rejected draft leaves no state behind.
What it does not know: how drafts are proposed, scheduling, any family.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mmserve.core.step import TokenLogprobs
from mmserve.models.spec import FamilyModel
from mmserve.runner.logprob_entries import token_logprobs
from mmserve.runner.sampler import (
    SamplingMetadata,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_argmax,
    processed_logits,
    sampled_logprobs,
    to_device,
)
from mmserve.runner.state import RunnerRequest
from mmserve.runner.state_storage import LinearStateStorage
from mmserve.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams


@dataclass(frozen=True)
class DraftRows:
    """A request's rows in the step's batch: its last known token's row, then one per draft."""

    request_id: str
    first_row: int
    drafts: tuple[int, ...]
    params: SamplingParams
    sequence: int = 0  # its index among the step's sequences
    state_slot: int | None = None  # a hybrid model's: the recurrent-state slot its verification wrote


@dataclass
class Verified:
    """Each verified request's emitted tokens (the drafts accepted, then one more), and for those that asked,
    each emitted token's logprob entry, as a decode step reports it."""

    tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)


def verify(model: FamilyModel, hidden: torch.Tensor, wanted: Sequence[DraftRows], normalize: bool = True,
           processing: Mapping[str, SamplingMetadata] | None = None) -> Verified:
    """`normalize`: logprob entries are log-softmaxed logits (raw_logprobs), else the logits (raw_logits).
    `processing`: per request whose options change logits (a grammar, penalties, bans, bias, allowed tokens),
    its rows' metadata (`verification_metadata`), each row processed as the sampler would."""
    out = Verified()
    if not wanted:
        return out
    index = [row for w in wanted for row in range(w.first_row, w.first_row + len(w.drafts) + 1)]
    logits = model.compute_logits(hidden[to_device(index, hidden.device)])  # (rows, vocab)
    best = greedy_argmax(logits).tolist()
    position = 0
    for w in wanted:
        num = len(w.drafts) + 1
        rows, meta = logits[position:position + num], (processing or {}).get(w.request_id)
        if meta is not None and meta.processes_logits:  # each position's logits as the sampler makes them
            rows = processed_logits(rows, meta)
        else:
            meta = None
        if _greedy(w.params):
            chosen = best[position:position + num] if meta is None else greedy_argmax(rows).tolist()
            tokens = _accept_greedy(chosen, w.drafts)
        else:
            tokens = _accept_sampled(target_probs(rows, w.params), w.drafts)
        out.tokens[w.request_id] = tokens
        k = w.params.logprobs
        if k is not None:  # the rows before each emitted token give its distribution, as a decode's row does
            rows = logits[position:position + len(tokens)]
            entries = sampled_logprobs(rows, to_device(list(tokens), rows.device), [k] * len(tokens), normalize)
            out.logprobs[w.request_id] = tuple(token_logprobs(entries, [k] * len(tokens)))
        position += num
    return out


def _greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE_EPS or params.top_k == 1


def _accept_greedy(chosen: list[int], drafts: tuple[int, ...]) -> tuple[int, ...]:
    tokens = []
    for i, token in enumerate(chosen):
        tokens.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return tuple(tokens)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(rows, vocab) float32 probabilities the sampler draws from (unnormalised after min-p)."""
    rows, vocab = logits.shape
    logits = logits.to(torch.float32, copy=True).div_(params.temperature)
    if 0 < params.top_k < vocab:
        apply_top_k(logits, [params.top_k] * rows)
    if params.top_p < 1.0:
        apply_top_p(logits, to_device([params.top_p] * rows, logits.device))
    probs = logits.softmax(dim=-1)
    if params.min_p > 0.0:
        apply_min_p(probs, to_device([params.min_p] * rows, logits.device))
    return probs


def residual(probs: torch.Tensor, draft: int) -> torch.Tensor:
    """The distribution a rejected draft is replaced from: the target's with the draft's mass removed
    (max(0, p - q) for a drafter whose q is a point mass on the draft)."""
    out = probs.clone()
    out[draft] = 0.0
    return out


def _accept_sampled(probs: torch.Tensor, drafts: tuple[int, ...]) -> tuple[int, ...]:
    k = len(drafts)
    mass = probs.sum(dim=-1)  # (k + 1,)
    chance = (probs[torch.arange(k), torch.tensor(drafts)] / mass[:k]).tolist()
    uniforms = torch.rand(k).tolist()
    tokens: list[int] = []
    for i, draft in enumerate(drafts):
        if uniforms[i] < chance[i]:
            tokens.append(draft)
            continue
        rest = residual(probs[i], draft)
        # a draft of probability one within rounding leaves no mass: it is accepted
        tokens.append(int(torch.multinomial(rest, 1)) if float(rest.sum()) > 0.0 else draft)
        return tuple(tokens)
    tokens.append(int(torch.multinomial(probs[k], 1)))
    return tuple(tokens)


def accept(state: RunnerRequest, num_drafts: int, tokens: tuple[int, ...]) -> int:
    """The verified tokens in place of the drafts; the tokens whose KV is now valid (the last known token's
    and the accepted drafts'): the step's count of computed tokens for this request."""
    del state.token_ids[len(state.token_ids) - num_drafts:]
    state.token_ids.extend(tokens)
    return len(tokens)


def roll_back_states(storage: LinearStateStorage, recorded: Mapping[tuple[int, int], tuple[torch.Tensor, torch.Tensor]],
                     rows: DraftRows, kept: int) -> None:
    """A hybrid model's verification wrote every draft into the request's recurrent state: put back the state
    after its `kept` valid tokens (the last known token and the accepted drafts), as the layers recorded it."""
    if rows.state_slot is None or kept == len(rows.drafts) + 1:
        return
    for (layer, sequence), (convs, states) in recorded.items():
        if sequence == rows.sequence:
            conv, recurrent = storage.layer(layer)
            conv[rows.state_slot].copy_(convs[kept - 1])
            recurrent[rows.state_slot].copy_(states[kept - 1])

"""Speculative decoding's verification in the runner: a decoding request's drafts checked in one forward.

Role: a request with drafts runs its last known token and the drafts as one chunk; the logits at each of
those positions give the greedy token that follows it. The drafts are accepted while each equals the greedy
token before it, and the first greedy token that differs (or, all accepted, the one after the last draft)
is emitted with them: exactly the tokens one-at-a-time greedy decoding would have produced
(`greedy_argmax`, the sampler's own greedy pick, on the raw logits: mmserve/speculative.py admits only
requests whose logits nothing changes).
What it does not know: how drafts are proposed, scheduling, any family.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmserve.models.spec import FamilyModel
from mmserve.runner.sampler import greedy_argmax, to_device
from mmserve.runner.state import RunnerRequest


@dataclass(frozen=True)
class DraftRows:
    """A request's rows in the step's batch: its last known token's row, then one per draft."""

    request_id: str
    first_row: int
    drafts: tuple[int, ...]


def verify_greedy(model: FamilyModel, hidden: torch.Tensor, wanted: Sequence[DraftRows]
                  ) -> dict[str, tuple[int, ...]]:
    """Each request's emitted tokens: the drafts accepted, then one greedy token."""
    if not wanted:
        return {}
    index = [row for w in wanted for row in range(w.first_row, w.first_row + len(w.drafts) + 1)]
    best = greedy_argmax(model.compute_logits(hidden[to_device(index, hidden.device)])).tolist()
    out, position = {}, 0
    for w in wanted:
        chosen = best[position:position + len(w.drafts) + 1]
        position += len(chosen)
        tokens = []
        for i, token in enumerate(chosen):
            tokens.append(token)
            if i == len(w.drafts) or token != w.drafts[i]:
                break
        out[w.request_id] = tuple(tokens)
    return out


def accept(state: RunnerRequest, num_drafts: int, tokens: tuple[int, ...]) -> int:
    """The verified tokens in place of the drafts; the tokens whose KV is now valid (the last known token's
    and the accepted drafts'): the step's count of computed tokens for this request."""
    del state.token_ids[len(state.token_ids) - num_drafts:]
    state.token_ids.extend(tokens)
    return len(tokens)

"""Logprob entries as the engine reports them: sampled tokens' and prompt tokens'.

Role: `token_logprobs` turns the sampler's logprob tensors into plain `TokenLogprobs` values, one per row;
`prompt_logprobs` computes a step's prompt-logprob rows a few at a time (each row's logits are a
vocabulary wide) as the raw distribution's logprob, rank and top k of each prompt token.
What it does not know: scheduling, sampling options besides the counts asked for, any family.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mmserve.core.step import TokenLogprobs
from mmserve.models.spec import FamilyModel
from mmserve.runner.sampler import SampledLogprobs, sampled_logprobs, to_device
from mmserve.runner.state import PromptLogprobRows

PROMPT_LOGPROB_ROWS = 64  # prompt rows whose logits are materialized at once (each a vocabulary wide)


def prompt_logprobs(model: FamilyModel, hidden: torch.Tensor, wanted: list[PromptLogprobRows]
                    ) -> dict[str, tuple[int, tuple[TokenLogprobs, ...]]]:
    """Each asking request's chunk rows, as logprobs of the prompt token after each row (the raw
    distribution, float32), with its rank and the request's top k."""
    out = {}
    for rows in wanted:
        state, k = rows.state, rows.state.sampling_params.prompt_logprobs
        entries: list[TokenLogprobs] = []
        # a few rows at a time: a whole chunk's (rows, vocab) logits would be far larger than a step's
        for first in range(0, rows.num, PROMPT_LOGPROB_ROWS):
            num = min(PROMPT_LOGPROB_ROWS, rows.num - first)
            logits = model.compute_logits(hidden[rows.offset + first:rows.offset + first + num])
            start = rows.start + first
            ids = state.token_ids[start + 1:start + 1 + num]
            vocab = logits.shape[1]
            # a prompt token the head cannot produce (Llama 3.2 Vision's <|image|>, an embedding row past
            # the logits): probability 0, ranked after every token the head scores
            targets = to_device([t if t < vocab else 0 for t in ids], hidden.device)
            entries += [e if t < vocab else replace(e, logprob=float("-inf"), rank=vocab + 1) for t, e in
                        zip(ids, token_logprobs(sampled_logprobs(logits, targets, [k] * num), [k] * num))]
        out[state.request_id] = (rows.start, tuple(entries))
    return out


def token_logprobs(logprobs: SampledLogprobs, num_logprobs: list[int | None]) -> list[TokenLogprobs]:
    """The sampler's logprob tensors as plain values, one per row of `logprobs.rows` (each row's own top k)."""
    values, ranks = logprobs.logprobs.tolist(), logprobs.ranks()
    top_ids, top_values = logprobs.top_ids.tolist(), logprobs.top_logprobs.tolist()
    return [TokenLogprobs(values[i], ranks[i], tuple(top_ids[i][:num_logprobs[row]]),
                          tuple(top_values[i][:num_logprobs[row]])) for i, row in enumerate(logprobs.rows)]

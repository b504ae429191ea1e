"""The pooling runner's step: a prompt's hidden states become one vector instead of a sampled token.

Role: after a step's forward, for each request whose chunk this step computed, fold its rows into its
pooled state (MEAN: a float32 running sum over every chunk; CLS: the first prompt row; LAST: nothing until
its last row) and, for a request whose prompt this step finished, return the vector: the pooled hidden
state, or for a reranker its "yes" logit minus its "no" logit (what vLLM's `from_2_way_softmax` scores).
A request restarted after a preemption recomputes from its first token, so its sum starts again.
What it does not know: scheduling, the request's per-request options (dimensions, normalization: applied
by the caller, mmserve/pooling.py), any family (logits come from the model's `compute_logits`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmserve.models.spec import FamilyModel
from mmserve.runner.state import RunnerRequest


class StepPooler:
    def __init__(self, model: FamilyModel, pooling_type: str, classifier_token_ids: tuple[int, int] | None) -> None:
        """`classifier_token_ids`: a reranker's (no, yes) token ids; None: an embedding model."""
        self.model = model
        self.pooling_type = pooling_type
        self.classifier_token_ids = classifier_token_ids

    def pool(self, hidden: torch.Tensor, chunks: Sequence[tuple[RunnerRequest, int]]) -> dict[str, tuple[float, ...]]:
        """`hidden`: (num_tokens, hidden) of the step, the chunks' rows in order; `chunks`: (request, tokens
        this step), each request's `num_computed_tokens` not yet advanced. The vectors of the requests whose
        prompt ends in this step."""
        finished: list[tuple[str, torch.Tensor]] = []
        offset = 0
        for state, num in chunks:
            rows = hidden[offset:offset + num]
            offset += num
            start = state.num_computed_tokens
            if self.pooling_type == "MEAN":
                total = rows.float().sum(0)
                state.pooled = total if state.pooled is None else state.pooled + total
            elif self.pooling_type == "CLS" and start == 0:
                state.pooled = rows[0].float()
            if start + num < state.num_prompt_tokens:
                continue
            if self.pooling_type == "LAST":
                vector = rows[-1].float()
            elif self.pooling_type == "MEAN":
                vector = state.pooled / state.num_prompt_tokens
            else:
                vector = state.pooled
            finished.append((state.request_id, vector))
        if not finished:
            return {}
        vectors = torch.stack([v for _, v in finished])
        if self.classifier_token_ids is not None:
            # the head's rows in the model's own dtype, as transformers computes the logits
            logits = self.model.compute_logits(vectors.to(hidden.dtype)).float()
            no, yes = self.classifier_token_ids
            vectors = (logits[:, yes] - logits[:, no]).unsqueeze(1)
        values = vectors.cpu().tolist()
        return {rid: tuple(v) for (rid, _), v in zip(finished, values)}

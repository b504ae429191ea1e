"""Requests with n > 1 choices: one request in, n independent sequences inside, one output out.

Role: `ChoiceGroups` splits a request asking for `n` choices into `n` requests of one choice each (the
engine runs them like any other: preemption, chunked prefill, abort and stop strings need nothing new)
and folds their outputs back into the request's: `outputs[i]` is choice `i`, `delta_text` and
`delta_index` say which choice an output moved. Choice `i` gets seed `seed + i` (so each choice is
reproducible and they differ), and choices 1.. wait for choice 0's prompt to be computed, so the prompt is
prefilled once (they find its full blocks in the prefix cache and its items in the encoder cache; each
computes only the tokens after the last full block).
What it does not know: scheduling, tensors, how outputs are made.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mmserve.outputs import CompletionOutput, RequestOutput
from mmserve.sampling_params import SEED_RANGE, SamplingParams


def _seed(seed: int) -> int:
    """`seed` within what SamplingParams takes (a generator takes it modulo 2**64 anyway)."""
    return seed - 2**64 if seed >= SEED_RANGE[1] else seed


@dataclass(frozen=True)
class Choice:
    request_id: str  # the engine's id of this choice's sequence
    params: SamplingParams  # n = 1, its own seed
    prefill_after: str | None  # the choice whose prompt it waits for


@dataclass
class _Group:
    n: int
    outputs: list[CompletionOutput]
    live: set[str]
    error: str | None = None
    internal_error: bool = False
    prompt_logprobs: list | None = None  # choice 0's


@dataclass
class ChoiceGroups:
    groups: dict[str, _Group] = field(default_factory=dict)  # the request's id -> its choices
    parent: dict[str, tuple[str, int]] = field(default_factory=dict)  # a choice's id -> (request id, index)

    def split(self, request_id: str, params: SamplingParams, share_prompt: bool) -> list[Choice]:
        """The choices of a request with params.n > 1 (`share_prompt`: the prefix cache is on)."""
        ids = [f"{request_id}#{i}" for i in range(params.n)]
        # the prompt's logprobs are choice 0's: the others need not compute the prompt for them
        choices = [Choice(cid, replace(params, n=1, seed=None if params.seed is None else _seed(params.seed + i),
                                       prompt_logprobs=params.prompt_logprobs if i == 0 else None),
                          ids[0] if share_prompt and i > 0 else None) for i, cid in enumerate(ids)]
        self.groups[request_id] = _Group(params.n, [CompletionOutput(i, "", []) for i in range(params.n)], set(ids))
        for i, cid in enumerate(ids):
            self.parent[cid] = (request_id, i)
        return choices

    def forget(self, request_id: str) -> None:
        """Drop a request's group (its choices were never all added)."""
        group = self.groups.pop(request_id, None)
        for cid in [] if group is None else [c for c, (rid, _) in self.parent.items() if rid == request_id]:
            del self.parent[cid]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def choice_ids(self, request_id: str) -> list[str]:
        """The live choices of a request (empty for a request of one choice)."""
        group = self.groups.get(request_id)
        return [] if group is None else sorted(group.live)

    def fold(self, output: RequestOutput) -> RequestOutput:
        """A choice's output as its request's output (a request of one choice: unchanged)."""
        if output.request_id not in self.parent:
            return output
        request_id, index = self.parent[output.request_id]
        group = self.groups[request_id]
        group.outputs[index] = replace(output.outputs[0], index=index)
        if index == 0:
            group.prompt_logprobs = output.prompt_logprobs
        if output.error is not None and group.error is None:
            group.error, group.internal_error = output.error, output.internal_error
        if output.finished:
            group.live.discard(output.request_id)
            del self.parent[output.request_id]
        finished = not group.live
        if finished:
            del self.groups[request_id]
        return replace(output, request_id=request_id, outputs=list(group.outputs), finished=finished,
                       error=group.error, internal_error=group.internal_error, delta_index=index,
                       prompt_logprobs=group.prompt_logprobs)

    def check_integrity(self, live_request_ids: set[str]) -> None:
        grouped = {cid for group in self.groups.values() for cid in group.live}
        assert grouped == set(self.parent), "a choice without its group"
        assert grouped <= live_request_ids, "a group keeps a choice the engine finished"

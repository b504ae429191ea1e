"""Draft tokens for speculative decoding, proposed by prompt lookup (n-gram) or by a draft model in the
runner, and their counters.

Role: `DraftPolicy.drafts(request, num_running)`: for a decoding request that may speculate, the tokens that
followed the latest earlier occurrence of its last n tokens (n from the largest lookup size down to the
smallest, the longest match winning, as vLLM's n-gram proposer picks) — or, with a draft model, what the
runner proposed after the request's last step (`Request.proposed_drafts`) — at most
`num_speculative_tokens`, never past its `max_tokens` or the context; none while `disable_by_batch_size`
requests run, nor for a request whose acceptance collapsed (under 10% of its first 32 draft tokens or
more). `lookahead`: with a draft model, how many drafts the runner should propose after a step that reaches
the request's last token (the KV slots its drafter writes are reserved with the step's). `settled` counts
what a verification accepted, per request and in vLLM's spec_decode counters (per position too).
What it does not know: tensors, how drafts are proposed by a model or verified (the runner), sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.core.request import Request

# a request whose drafts were accepted at under this rate over at least this many draft tokens takes no more
COLLAPSE_ACCEPTANCE = 0.1
COLLAPSE_AFTER_DRAFT_TOKENS = 32


@dataclass
class DraftStats:
    """vLLM's spec_decode counters: drafts proposed, their tokens, the tokens accepted (and at each position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class DraftPolicy:
    num_speculative_tokens: int
    lookup_min: int
    lookup_max: int
    max_model_len: int
    disable_by_batch_size: int | None = None
    proposed_by_runner: bool = False  # a draft model's proposals (else prompt lookup here)
    stats: DraftStats = field(default_factory=DraftStats)

    def __post_init__(self) -> None:
        self.stats.accepted_per_position = [0] * self.num_speculative_tokens

    def drafts(self, request: Request, num_running: int) -> tuple[int, ...]:
        """The tokens to verify after this request's next one (empty: it decodes one token)."""
        proposed, request.proposed_drafts = request.proposed_drafts, ()  # a proposal serves one step at most
        if not self._may_draft(request, num_running):
            return ()
        tokens = request.all_token_ids
        # the step computes the last known token plus the drafts; each draft it accepts becomes an output
        room = min(self.num_speculative_tokens,
                   request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
                   self.max_model_len - len(tokens) - 1)
        if room <= 0:
            return ()
        if self.proposed_by_runner:
            return proposed[:room]
        return lookup(tokens, self.lookup_min, self.lookup_max, room)

    def lookahead(self, request: Request, num_running: int) -> int:
        """With a draft model, the drafts to propose after a step that reaches this request's last token
        (0: none, also for prompt lookup, which proposes when the step is scheduled): no more than the next
        step could verify before `max_tokens`."""
        if not self.proposed_by_runner or not self._may_draft(request, num_running):
            return 0
        # this step yields at least one token, the next its own and the drafts before it
        room = request.sampling_params.max_tokens - len(request.output_token_ids) - 2
        return max(0, min(self.num_speculative_tokens, room))

    def still_proposing(self, wanted: dict[str, int], num_running: int) -> dict[str, int]:
        """The proposals to ask for once the step's batch is known (none at or past the batch-size cutoff)."""
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return {}
        return wanted

    def _may_draft(self, request: Request, num_running: int) -> bool:
        return request.speculate and not _collapsed(request) and (self.disable_by_batch_size is None
                                                                 or num_running < self.disable_by_batch_size)

    def settled(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """A verification's outcome: the request's counts and the engine's."""
        request.num_draft_tokens += num_drafted
        request.num_accepted_draft_tokens += num_accepted
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1


def _collapsed(request: Request) -> bool:
    """Has the request's acceptance collapsed? Its drafts then stop for good: each costs a longer step."""
    return (request.num_draft_tokens >= COLLAPSE_AFTER_DRAFT_TOKENS
            and request.num_accepted_draft_tokens < COLLAPSE_ACCEPTANCE * request.num_draft_tokens)


def lookup(tokens: list[int], lookup_min: int, lookup_max: int, k: int) -> tuple[int, ...]:
    """Up to `k` tokens after the latest earlier occurrence of the longest suffix of `tokens` of a length in
    [lookup_min, lookup_max] that `k` tokens follow (else after the latest occurrence: in a run of one
    token the latest match overlaps the suffix and only one token follows it); () when none occurs."""
    length = len(tokens)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = tokens[length - n:]
        first, latest = suffix[0], None
        # candidate starts, latest first; an occurrence must start before the suffix itself does
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == suffix:
                if start + n + k <= length:
                    return tuple(tokens[start + n:start + n + k])
                latest = start if latest is None else latest
        if latest is not None:
            return tuple(tokens[latest + n:latest + n + k])
    return ()

"""The typed step contract between the scheduler and the model runner.

Nothing else crosses that boundary. The scheduler sends diffs: a request's full state once
(when it is first scheduled, or rescheduled after preemption), then only what changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.core.request import ItemSpec
from mmserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """Everything the runner needs to start (or restart, after preemption) a request."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt plus any output so far: a resumed request recomputes both
    num_prompt_tokens: int  # positions past this use the decode rope delta
    items: tuple[ItemSpec, ...]
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]  # prefix hits first
    num_computed_tokens: int  # tokens already in the KV cache (prefix hit)
    num_output_tokens: int  # outputs so far, so per-token seeds continue where they were
    state_slot: int | None = None  # a hybrid model's recurrent-state slot: None for other models
    state_restore: int | None = None  # the state snapshot its prefix hit resumes from (None: zero state)
    # a model whose sliding layers keep only their window (core/window_kv.py): their blocks, entry i logical
    # block i as in block_ids (the window pool's null block where the window has none); () for other models
    window_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: only the new blocks."""

    request_id: str
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    new_window_block_ids: tuple[int, ...] = ()  # the window table's entries for the new blocks


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # tokens to compute this step per request, in batch order (prefill chunks and decodes together)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # items each request must encode this step, by item index (the engine sends their payloads to the
    # runner keyed by content key; pixels never enter core/)
    encoder_items: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # requests finished, aborted or preempted since the last step: the runner drops their state
    finished_request_ids: set[str] = field(default_factory=set)
    # encoder-cache keys evicted or abandoned since the last step: the runner frees their tensors
    free_encoder_keys: list[str] = field(default_factory=list)
    # a hybrid model's requests whose state this step ends at a snapshotted block boundary: request id ->
    # the snapshot id to save it into after the step
    state_snapshots: dict[str, int] = field(default_factory=dict)
    # speculative decoding: a decoding request's draft tokens, computed after its last known token this step
    # (its scheduled tokens are 1 + the drafts); the runner answers with the tokens the drafts verified
    spec_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # a draft model's: requests whose step reaches their last token -> how many drafts to propose after it
    # (KV slots for them are reserved: the drafter writes its own cache there)
    propose_drafts: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class ModelRunnerOutput:
    # the sampled token of each request whose scheduled tokens reached its end (decode or last prefill chunk),
    # or a tuple of k tokens (speculative decoding): the scheduler checks stops token by token
    sampled_token_ids: dict[str, int | tuple[int, ...]] = field(default_factory=dict)
    # of those, the requests that asked for logprobs: the sampled token's and the top ones (one per token)
    sampled_logprobs: dict[str, TokenLogprobs | tuple[TokenLogprobs, ...]] = field(default_factory=dict)
    # requests that asked for prompt logprobs: (first prompt position, one entry per prompt token from
    # the one after it) for the prompt tokens this step's chunk predicts
    prompt_logprobs: dict[str, tuple[int, tuple[TokenLogprobs, ...]]] = field(default_factory=dict)
    # requests that failed in the runner, with the reason; they finish with an error
    failed: dict[str, str] = field(default_factory=dict)
    # encoder outputs validated and committed to the runner's store this step: only these become READY
    encoder_committed_keys: list[str] = field(default_factory=list)
    # encoder outputs that failed validation, by key: every request using the key fails
    encoder_failed_keys: dict[str, str] = field(default_factory=dict)
    # an encoder batch failure not attributable to one item: only this step's producers fail
    encoder_batch_error: str | None = None
    # keys handed to encoder workers whose outputs have not arrived yet: they stay PENDING
    encoder_in_flight_keys: set[str] = field(default_factory=set)
    # requests whose scheduled tokens were not computed (an item they needed failed): no progress
    skipped: set[str] = field(default_factory=set)
    # a pooling runner's requests whose prompt this step finished: their pooled vector (instead of a token)
    pooled: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # a draft model's proposals (SchedulerOutput.propose_drafts), to verify in a later step
    draft_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's logprob under the model's raw distribution, its rank (1: the most likely), and
    the `k` most likely tokens with theirs, most likely first."""

    logprob: float
    rank: int
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class EngineCoreOutput:
    """What one step did to one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_token_id: int | None = None
    error: str | None = None
    new_logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token, when the request asked for logprobs
    parked: bool = False  # its first token: now parked, its KV held for a decode replica (core/handoff.py)
    pooled: tuple[float, ...] | None = None  # a pooling runner's vector: the request finished with it

"""What a caller gets back for a request: vLLM-compatible output dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the model's raw distribution (float32), its rank in that
    distribution (1: the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # with SamplingParams.logprobs: one dict per token of token_ids (the sampled token and the top ones)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # the sum of the sampled tokens' logprobs (with logprobs)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # the latest step that gave the request tokens
    finish_time: float | None = None
    num_preemptions: int = 0
    max_tokens: int | None = None  # the request's max_tokens (vLLM's max_tokens_param)
    # the time between consecutive steps that gave the request tokens (vLLM's inter-token latencies: one per
    # step, whatever number of tokens it gave); filled at the finish, empty before
    inter_token_latencies_s: list[float] = field(default_factory=list)
    # speculative decoding: the draft tokens verified for the request, and those accepted (filled at the finish)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the request failed, when finish_reason is "error"
    delta_text: str = field(default="", repr=False)  # text new since the previous output (streaming)
    delta_index: int = field(default=0, repr=False)  # the choice (outputs[i]) delta_text belongs to
    internal_error: bool = False  # the error is the server's (a fault in a model step), not the request's
    num_mm_items: int = 0  # media items in the prompt (images; a video's items)
    # of those, items the encoder did not run for this request: found in the encoder cache (ready, or being
    # encoded for another request) at admission, and items wholly inside the KV prefix-cache hit
    # (num_cached_tokens) — an item can be both
    num_encoder_cached_mm_items: int = 0
    num_prefix_cached_mm_items: int = 0
    # a prefill replica's first output of a request it hands off: it holds the prompt's KV for a decode
    # replica, which sends the rest (cluster/)
    kv_parked: bool = False
    # with SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which nothing
    # predicts); complete once the prompt is computed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # a pooling engine's vector (float32 values): the prompt's pooled hidden state, or a reranker's "yes" logit
    # minus its "no" logit; mmserve/pooling.py makes it an embedding or a score
    pooled: list[float] | None = None


@dataclass
class BeamSearchSequence:
    """One hypothesis of a beam search (vLLM's shape): `tokens` are the prompt's then the generated ones."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]  # one entry per generated token: the top candidates of its step
    cum_logprob: float  # the generated tokens' summed logprobs
    score: float  # cum_logprob / generated_tokens ** length_penalty (the ranking, as transformers')
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS id) or "length"
    stop_reason: int | None = None  # the EOS id that ended it


@dataclass
class BeamSearchOutput:
    """The best `beam_width` hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's `LLM.embed` result: one prompt's embedding."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's `LLM.score` result: one (query, document) pair's score."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True

"""One live request's output state, as the output processor keeps it (engine/output_processor.py).

Role: the detokenizer, the output tokens kept so far, logprob entries, prompt logprobs, the cumulative
logprob, why it stopped, its metrics and (when traced) its timeline. One per sequence: each choice of
an n > 1 request has its own. Mutable, and private to the engine's output side: what leaves it is a
`RequestOutput`.
What it does not know: scheduling, tensors, the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.core.request import Request
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.engine.timeline import RequestTimeline
from mmserve.outputs import Logprob, RequestMetrics


@dataclass
class RequestState:
    request: Request  # the engine's request (core/request.py): its prompt, its counts of cached tokens and items
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    # output tokens kept: a step's tokens after the one that finished the request are dropped
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None  # one per output token, when the request asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # one per prompt token computed so far
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    internal_error: bool = False  # failed by a fault in a model step, not by its input
    pooled: list[float] | None = None  # a pooling engine's vector, once its prompt is computed
    timeline: RequestTimeline | None = None  # only when traced
    # seconds between consecutive steps that gave tokens; into the metrics at the finish (not sent every step)
    inter_token_latencies_s: list[float] = field(default_factory=list)

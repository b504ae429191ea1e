"""How a request's sampled tokens finish it, checked one token at a time.

Role: `stop_status` says whether the token just appended finishes the request: a stop id (once
`min_tokens` are out), `max_tokens`, or the context length. `per_token` reads a runner's per-request
result, one value (a token, its logprobs) or k of them (speculative decoding), as a tuple. The scheduler
walks a step's tokens with them and drops the ones after the finishing token.
What it does not know: text and stop strings (the engine's output processor), KV blocks, tensors.
"""

from __future__ import annotations

from typing import Any

from mmserve.core.request import Request, RequestStatus


def stop_status(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The status `token` (just appended to the request's outputs) finishes the request with, or None."""
    params = request.sampling_params
    num_out = len(request.output_token_ids)
    if token in request.stop_token_ids and num_out >= params.min_tokens:
        return RequestStatus.FINISHED_STOPPED
    if num_out >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def per_token(value: Any) -> tuple[Any, ...]:
    """A runner's per-request result as a tuple: () for none, one value, or the k values it sent."""
    if value is None:
        return ()
    return value if isinstance(value, tuple) else (value,)

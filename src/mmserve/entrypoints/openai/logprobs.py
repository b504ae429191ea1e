"""Logprobs in OpenAI's two wire shapes, from the engine's per-token entries.

Role: `chat_logprobs` makes chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`, the `k` most
likely tokens per position in rank order; `completion_logprobs` makes the legacy completions shape
(`tokens`, `token_logprobs`, `top_logprobs` — the `k` most likely and the sampled one, as OpenAI has it —
and `text_offset`). Both take a slice of a request's entries, so a stream sends each chunk's own.
What it does not know: the engine, requests, streaming.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmserve.entrypoints.openai.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from mmserve.outputs import Logprob

# OpenAI's floor for a logprob on the wire: JSON has no -Infinity
MIN_WIRE_LOGPROB = -9999.0


def _wire(value: float) -> float:
    return max(value, MIN_WIRE_LOGPROB)


def _text(logprob: Logprob) -> str:
    return logprob.decoded_token or ""


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)[:k]


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        sampled = entry[token_id]
        top = [TopLogprob(token=_text(lp), logprob=_wire(lp.logprob), bytes=list(_text(lp).encode()))
               for lp in _top(entry, k)]
        content.append(TokenLogprob(token=_text(sampled), logprob=_wire(sampled.logprob),
                                    bytes=list(_text(sampled).encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int,
                        text_offset: int = 0) -> CompletionLogprobs:
    """`text_offset`: where the first of these tokens starts in the choice's text."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        sampled = entry[token_id]
        out.tokens.append(_text(sampled))
        out.token_logprobs.append(_wire(sampled.logprob))
        top = {_text(lp): _wire(lp.logprob) for lp in _top(entry, k)}
        top.setdefault(_text(sampled), _wire(sampled.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(_text(sampled))
    return out

"""Logprobs in OpenAI's two wire shapes, from the engine's per-token entries.

Role: `chat_logprobs` makes chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`, the `k` most
likely tokens per position in rank order; `completion_logprobs` makes the legacy completions shape
(`tokens`, `token_logprobs`, `top_logprobs` — the `k` most likely and the sampled one, as OpenAI has it —
and `text_offset`; `echo_logprobs` the same for an echoed prompt, its first token without one);
`prompt_logprobs` makes vLLM's `prompt_logprobs` field; `named_by_id` names tokens by their ids. The first two take a slice of a request's entries, so a stream sends each chunk's own.
What it does not know: the engine, requests, streaming.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from mmserve.entrypoints.openai.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)
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
        # the token itself is always among its position's top logprobs (OpenAI's k + 1), with its own logprob
        # even where another token of the k decodes to the same text (a prompt token echoed, a byte piece)
        top[_text(sampled)] = _wire(sampled.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(_text(sampled))
    return out


def echo_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None], k: int,
                  first_token: str) -> CompletionLogprobs:
    """The legacy shape for an echoed prompt: its first token (text `first_token`) has no logprob."""
    out = completion_logprobs(token_ids[1:], entries[1:], k, len(first_token))
    out.tokens.insert(0, first_token)
    out.token_logprobs.insert(0, None)
    out.top_logprobs.insert(0, None)
    out.text_offset.insert(0, 0)
    return out


def joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """`second`'s tokens after `first`'s (their text offsets moved past `first`'s text)."""
    shift = first.text_offset[-1] + len(first.tokens[-1]) if first.tokens else 0
    return CompletionLogprobs(tokens=first.tokens + second.tokens,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=first.top_logprobs + second.top_logprobs,
                              text_offset=first.text_offset + [o + shift for o in second.text_offset])


def prompt_logprobs(entries: Sequence[dict[int, Logprob] | None]) -> PromptLogprobs:
    return [None if entry is None else {token_id: PromptLogprob(logprob=_wire(lp.logprob), rank=lp.rank,
                                                                decoded_token=lp.decoded_token)
                                        for token_id, lp in entry.items()} for entry in entries]


def named_by_id(entries: Sequence[dict[int, Logprob] | None]) -> list[dict[int, Logprob] | None]:
    """The entries with each token named "token_id:N" (vLLM's --return-tokens-as-token-ids)."""
    return [None if entry is None else {t: replace(lp, decoded_token=f"token_id:{t}") for t, lp in entry.items()}
            for entry in entries]

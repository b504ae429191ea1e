"""Incremental detokenization and stop-string matching for one request.

Role: turn a growing list of generated token ids into text, step by step, in O(total tokens):
each step decodes only a short window of recent ids (the prefix_offset / read_offset technique)
and never emits half of a multi-byte character, since byte-level BPE decodes an incomplete
UTF-8 sequence to U+FFFD. It also finds stop strings, truncates the text at the earliest one and
holds back a streamed tail that could still turn into a stop string, so a stop string never
leaks into a delta. What it does not know: stop token ids, eos, max_tokens, or how a request
finishes; the caller decides that and says so through `take_delta(finished=True)`.
"""

from __future__ import annotations

from typing import Protocol

# How many prompt ids seed the decode window: decoders that strip a leading space at the start
# of the decoded text (Metaspace) need some preceding context to keep the first output space.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """The one tokenizer method used here (mmserve.inputs.tokenizer.TextTokenizer has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text of one request's generated tokens, with stop strings applied.

    Call `update` with each step's new ids, then `take_delta(finished)` for the text to stream.
    After a stop string is hit, or after `take_delta(finished=True)`, `update` ignores new ids.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._max_stop_chars = max((len(s) for s in self._stop), default=0)
        # The decode window: ids[prefix_offset:read_offset] were already turned into text;
        # ids[read_offset:] are not yet (they end in an incomplete character, or are new).
        self._window_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._window_ids)
        self._text = ""
        self._sent_chars = 0  # len of the text already returned by take_delta
        self._stop_hit: str | None = None
        self._closed = False

    @property
    def output_text(self) -> str:
        """The text so far; once a stop string is hit, cut before it (or after it, if included)."""
        return self._text

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stop_hit

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append new ids; return the stop string if this made one appear, else None."""
        if self._closed or self._stop_hit is not None or not new_token_ids:
            return None
        self._window_ids.extend(new_token_ids)
        new_text = self._decode_window(allow_incomplete=False)
        if not new_text:
            return None
        previous_chars = len(self._text)
        self._text += new_text
        return self._check_stop(previous_chars)

    def take_delta(self, finished: bool) -> str:
        """Text not yet returned. Unless finished, hold back a tail that may start a stop string."""
        if finished and not self._closed:
            self._closed = True
            if self._stop_hit is None:
                # Emit what is still pending at the end even if it is an incomplete character,
                # so the final text equals decode(all ids).
                self._text += self._decode_window(allow_incomplete=True)
        end = len(self._text)
        if not finished and self._stop_hit is None:
            end -= self._stop_prefix_tail_chars()
        if end <= self._sent_chars:
            return ""
        delta = self._text[self._sent_chars:end]
        self._sent_chars = end
        return delta

    def _decode_window(self, allow_incomplete: bool) -> str:
        """Decode the text that ids[read_offset:] add, advance the offsets, return that text."""
        if self._read_offset == len(self._window_ids):
            return ""
        decode, skip = self._tokenizer.decode, self._skip_special_tokens
        prefix_text = decode(self._window_ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        full_text = decode(self._window_ids[self._prefix_offset:], skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text) and not allow_incomplete:
            return ""  # e.g. a skipped special token, or bytes that do not make a character yet
        if full_text.endswith(_REPLACEMENT_CHAR) and not allow_incomplete:
            return ""  # wait for the rest of the character
        new_text = full_text[len(prefix_text):]
        # The just-read ids become the next window's context; older ids are never needed again,
        # so drop them to keep each decode (and memory) proportional to the window.
        del self._window_ids[:self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._window_ids)
        return new_text

    def _check_stop(self, previous_chars: int) -> str | None:
        """Find the earliest stop string that the text after previous_chars could have completed."""
        if not self._stop:
            return None
        # A match that ends in the new text starts at most max_stop_chars - 1 chars before it.
        search_from = max(0, previous_chars - self._max_stop_chars + 1)
        best: tuple[int, int, str] | None = None  # (start, length, stop): earliest, then shortest
        for stop in self._stop:
            start = self._text.find(stop, search_from)
            if start >= 0 and (best is None or (start, len(stop)) < best[:2]):
                best = (start, len(stop), stop)
        if best is None:
            return None
        start, length, stop = best
        self._text = self._text[:start + length] if self._include_stop else self._text[:start]
        self._stop_hit = stop
        return stop

    def _stop_prefix_tail_chars(self) -> int:
        """Length of the longest suffix of the unsent text that is a proper prefix of a stop string."""
        if not self._stop:
            return 0
        unsent_chars = len(self._text) - self._sent_chars
        longest = min(self._max_stop_chars - 1, unsent_chars)
        for tail_chars in range(longest, 0, -1):
            tail = self._text[-tail_chars:]
            if any(len(stop) > tail_chars and stop.startswith(tail) for stop in self._stop):
                return tail_chars
        return 0

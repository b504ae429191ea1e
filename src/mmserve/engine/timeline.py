"""What one traced request went through in the engine, as plain records: the stuff of its spans.

Role: while a request runs, the engine notes here each step that computed it — a prefill chunk (with
its positions), a decode step, an item's encode from the step that scheduled it to the step that found
its output ready — and at the finish `tracing.py` turns the records into OpenTelemetry spans. Kept
only for requests that are traced, so an engine without tracing records nothing.
What it does not know: OpenTelemetry, the scheduler, tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmserve.tracing import SpanRecord


@dataclass
class RequestTimeline:
    trace_parent: str | None  # the W3C traceparent the request's spans hang under; None: they start a trace
    received_s: float  # when the engine took the request (its arrival, as a server counts it, may be earlier)
    spans: list[SpanRecord] = field(default_factory=list)
    encoding_since_s: dict[int, float] = field(default_factory=dict)  # item index -> step that scheduled it
    encoded: set[int] = field(default_factory=set)  # items this request ran the encoder for
    decode_start_s: float | None = None
    decode_end_s: float | None = None
    decode_steps: int = 0

    def prefill_chunk(self, start_s: float, end_s: float, first_position: int, num_tokens: int) -> None:
        self.spans.append(SpanRecord("prefill", start_s, end_s, {
            "mmserve.prefill.first_position": first_position, "mmserve.prefill.tokens": num_tokens}))

    def decode_step(self, start_s: float, end_s: float) -> None:
        """Decode steps fold into one span: a span per token would cost more than the token."""
        if self.decode_start_s is None:
            self.decode_start_s = start_s
        self.decode_end_s = end_s
        self.decode_steps += 1

    def encode_scheduled(self, index: int, start_s: float) -> None:
        self.encoding_since_s.setdefault(index, start_s)

    def encode_ready(self, index: int, end_s: float, attributes: dict[str, Any]) -> None:
        start_s = self.encoding_since_s.pop(index)
        self.encoded.add(index)
        self.spans.append(SpanRecord("encode", start_s, end_s, {"mmserve.encoder.cache_hit": False, **attributes}))

    def finish(self, first_scheduled_s: float | None, end_s: float, items: dict[int, dict[str, Any]],
               prefix_cached_items: set[int]) -> list[SpanRecord]:
        """Every child span of the request, in time order. `items`: the attributes of each media item;
        `prefix_cached_items`: those wholly inside the request's prefix-cache hit."""
        spans = list(self.spans)
        scheduled_s = first_scheduled_s if first_scheduled_s is not None else end_s
        spans.append(SpanRecord("queue", self.received_s, scheduled_s))
        for index, attributes in items.items():
            if index in self.encoding_since_s:  # the request ended first (aborted, failed) or the encode failed
                spans.append(SpanRecord("encode", self.encoding_since_s[index], end_s, {
                    "mmserve.encoder.cache_hit": False, "mmserve.encoder.completed": False, **attributes}))
            elif index not in self.encoded:  # found in the encoder cache, or not needed past the prefix hit
                found_in = "prefix_cache" if index in prefix_cached_items else "encoder_cache"
                spans.append(SpanRecord("encode", scheduled_s, scheduled_s, {
                    "mmserve.encoder.cache_hit": True, "mmserve.encoder.found_in": found_in, **attributes}))
        if self.decode_start_s is not None and self.decode_end_s is not None:
            spans.append(SpanRecord("decode", self.decode_start_s, self.decode_end_s,
                                    {"mmserve.decode.steps": self.decode_steps}))
        return sorted(spans, key=lambda s: (s.start_s, s.end_s))

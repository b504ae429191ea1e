"""A traced request's records, noted as steps run and turned into spans when it finishes.

Role: `note_computed` notes what a step computed for each traced request (a prefill chunk, a decode
step, an item's encode scheduled), `note_encoded` closes the encode records of items whose outputs are
now ready, and `record_finished` hands `tracing.py` the request's span with its children
(engine/timeline.py) and its attributes (tokens, cache hits, preemptions).
What it does not know: OpenTelemetry, the scheduler's books, tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mmserve.core.request import ItemSpec
from mmserve.core.step import SchedulerOutput
from mmserve.engine.request_state import RequestState


def note_computed(states: Mapping[str, RequestState], sched: SchedulerOutput, start_s: float, end_s: float) -> None:
    """What the step computed for each traced request (before the scheduler's `update` moves its progress)."""
    for rid, indices in sched.encoder_items.items():
        state = states.get(rid)
        if state is not None and state.timeline is not None:
            for i in indices:
                state.timeline.encode_scheduled(i, start_s)
    for rid, num in sched.num_scheduled_tokens.items():
        state = states.get(rid)
        if state is None or state.timeline is None:
            continue
        request = state.request
        start = request.num_computed_tokens
        if num == 1 and start >= request.num_prompt_tokens and start == request.num_tokens - 1:
            state.timeline.decode_step(start_s, end_s)
        else:  # a prompt's chunk, or a preempted request's recompute
            state.timeline.prefill_chunk(start_s, end_s, start, num)


def note_encoded(states: Mapping[str, RequestState], is_ready: Callable[[str], bool], by_workers: bool,
                 now_s: float) -> None:
    """Close the encode records of items whose outputs are now ready (`is_ready(content key)`): this step's,
    or an encoder worker's."""
    for state in states.values():
        timeline = state.timeline
        if timeline is None or not timeline.encoding_since_s:
            continue
        for i in list(timeline.encoding_since_s):
            item = state.request.items[i]
            if is_ready(item.content_hash):
                timeline.encode_ready(i, now_s, item_attributes(item, by_workers))


def record_finished(tracing: Any, state: RequestState, finish: str, error: str | None) -> None:
    """Write a finished traced request's span and its children to `tracing` (a `mmserve.tracing.Tracing`)."""
    request, metrics, timeline = state.request, state.metrics, state.timeline
    assert timeline is not None and metrics.finish_time is not None
    cached = max(request.num_cached_tokens, 0)
    media = [item for item in request.items if item.output_rows > 0]
    children = timeline.finish(metrics.first_scheduled_time, metrics.finish_time,
                               {item.index: item_attributes(item, False) for item in media},
                               {item.index for item in media if not item.needed_after(cached)})
    attributes: dict[str, Any] = {
        "gen_ai.request.id": request.request_id,
        "gen_ai.usage.prompt_tokens": request.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": len(state.token_ids),
        "gen_ai.response.finish_reasons": [finish],
        "mmserve.prefix_cached_tokens": cached,
        "mmserve.mm_items": request.num_mm_items,
        "mmserve.encoder_cache_hit_items": request.num_encoder_cached_items,
        "mmserve.num_preemptions": request.num_preemptions,
    }
    if metrics.first_token_time is not None:
        attributes["gen_ai.latency.time_to_first_token"] = metrics.first_token_time - metrics.arrival_time
    tracing.record_request(timeline.trace_parent, timeline.received_s, metrics.finish_time, attributes,
                           children, error if finish == "error" else None)


def item_attributes(item: ItemSpec, by_workers: bool) -> dict[str, Any]:
    attributes: dict[str, Any] = {"mmserve.item.index": item.index, "mmserve.item.content_key": item.content_hash,
                                  "mmserve.item.encoder_tokens": item.encoder_tokens,
                                  "mmserve.item.output_rows": item.output_rows}
    if by_workers:
        attributes["mmserve.encoder.workers"] = True
    return attributes

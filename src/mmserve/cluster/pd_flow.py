"""Prefill/decode disaggregation in the server: a request's hand-off from its prefill replica to a decode replica.

Role: `hand_off` runs once a prefill replica's first output of a request says it parked (`kv_parked`;
the client has that first token already). It picks a decode replica (the decode replicas' own
router: by the prompt blocks and media it likely holds, balanced by load), asks it to admit the
request (`admit_transferred`: it answers which prompt blocks it lacks, or that it has no room now),
asks again every HANDOFF_RETRY_S while no decode replica has room — the prefill replica holds the KV
meanwhile — and gives up after HANDOFF_TIMEOUT_S with a clear error (the prefill side's blocks are
released). Then the request's flight moves to the decode replica, the prefill replica sends the
blocks (`send_kv` into the connector) and the decode replica is told where they are (`ReceiveKV`); its
outputs then come as any replica's. `merged` gives those outputs the prefill side's figures (cached
tokens, prompt logprobs, time to first token). A replica dying on either side: `HandOffLost`, and the
replica set starts the request over if its client has seen nothing, else ends the stream with an error.
What it does not know: HTTP, the engine's internals, how the bytes move (cluster/kv_connector.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from typing import Any

from mmserve.cluster.protocol import AbortRequest, ReceiveKV
from mmserve.engine.async_engine import EngineDeadError
from mmserve.outputs import RequestOutput

logger = logging.getLogger("mmserve.replicas")
HANDOFF_TIMEOUT_S = 30.0  # how long a prefill replica holds a request's KV for a decode replica with room
HANDOFF_RETRY_S = 0.02
LATENCIES_KEPT = 1024


class HandOffLost(Exception):
    """A replica on either side died, or could not send, during the hand-off."""


class TransferLatencies:
    """Hand-off latencies (decode replica chosen to KV sent), the latest LATENCIES_KEPT of them."""

    def __init__(self) -> None:
        self.count = 0
        self._recent: deque[float] = deque(maxlen=LATENCIES_KEPT)

    def add(self, seconds: float) -> None:
        self.count += 1
        self._recent.append(seconds)

    def stats(self) -> dict[str, Any]:
        recent = sorted(self._recent)
        if not recent:
            return {"kv_transfers": 0}
        pick = lambda q: round(recent[min(len(recent) - 1, int(q * len(recent)))] * 1000, 3)  # noqa: E731
        return {"kv_transfers": self.count, "kv_transfer_ms_p50": pick(0.5), "kv_transfer_ms_p99": pick(0.99)}


async def hand_off(replicas: Any, flight: Any, first: RequestOutput) -> None:
    """Move `flight` (parked on its prefill replica after `first`) to a decode replica; raises
    `EngineDeadError` when no decode replica had room in time, `HandOffLost` when a replica fails."""
    rid, prefill, prefill_generation = flight.request_id, flight.replica, flight.generation
    prompt = flight.prompt.without_payloads()
    args = (rid, prompt, flight.params, first.outputs[0], flight.arrival_time, flight.trace_parent)
    started_s = time.time()
    started = time.monotonic()
    while True:
        decision = replicas.decode_router.choose(flight.keys)
        if decision is not None:
            decode = replicas._slots[replicas.num_prefill + decision.replica]
            try:
                needed = await replicas._query(decode.index, "admit_transferred", args=args)
            except RuntimeError as exc:  # it died meanwhile, or refused: another, or later
                logger.warning("request %s: decode replica %d could not admit it: %s", rid, decode.index, exc)
                needed = None
            except asyncio.CancelledError:  # the client left: what the decode replica may have admitted goes
                replicas._send(decode.index, decode.generation, AbortRequest(rid))
                raise
            if needed is not None:
                break
        if time.monotonic() - started > HANDOFF_TIMEOUT_S:
            replicas._send(prefill, prefill_generation, AbortRequest(rid))
            replicas._uncount(flight)
            raise EngineDeadError(f"no decode replica had room for the request's KV within {HANDOFF_TIMEOUT_S:g} s")
        await asyncio.sleep(HANDOFF_RETRY_S)
    # the flight is the decode replica's before the prefill replica sends: its last output of the request
    # (finish reason "handoff") is then not taken for the answer
    replicas._uncount(flight)
    replicas.decode_router.dispatched(decision, flight.keys)
    flight.replica, flight.generation, flight.counted = decode.index, decode.generation, True
    sent_at = time.monotonic()
    sending = asyncio.ensure_future(replicas._query(prefill, "send_kv", args=(rid, needed),
                                                    generation=prefill_generation))
    try:
        flight.transfer = await asyncio.shield(sending)
    except asyncio.CancelledError:  # the client left: the transfer, once made, is nobody's
        sending.add_done_callback(_discard_when_sent(replicas))
        raise
    except RuntimeError as exc:
        replicas._send(decode.index, decode.generation, AbortRequest(rid))
        replicas._uncount(flight)
        raise HandOffLost(f"prefill replica {prefill} could not send the request's KV: {exc}") from None
    replicas.transfer_latencies.add(time.monotonic() - sent_at)
    if replicas.tracing is not None and flight.trace_parent is not None:
        replicas.tracing.record("kv_handoff", flight.trace_parent, started_s, time.time(), {
            "mmserve.handoff.prefill_replica": prefill, "mmserve.handoff.decode_replica": decode.index,
            "mmserve.handoff.blocks": len(needed), "mmserve.handoff.bytes": flight.transfer.nbytes})
    logger.debug("request %s: %d block(s) from replica %d to %d", rid, len(needed), prefill, decode.index)
    replicas._send(decode.index, decode.generation, ReceiveKV(rid, flight.transfer))


def _discard_when_sent(replicas: Any) -> Any:
    def discard(sending: asyncio.Future) -> None:
        if not sending.cancelled() and sending.exception() is None:
            replicas.discard(sending.result())
    return discard


def merged(first: RequestOutput, output: RequestOutput) -> RequestOutput:
    """A decode replica's output of a request with what its prefill replica measured: the prompt's
    cached tokens and logprobs, its media counts and its time to first token."""
    metrics = output.metrics
    if metrics is not None and first.metrics is not None:
        metrics = dataclasses.replace(metrics, arrival_time=first.metrics.arrival_time,
                                      first_scheduled_time=first.metrics.first_scheduled_time,
                                      first_token_time=first.metrics.first_token_time)
    return dataclasses.replace(
        output, metrics=metrics, num_cached_tokens=first.num_cached_tokens, num_mm_items=first.num_mm_items,
        num_encoder_cached_mm_items=first.num_encoder_cached_mm_items,
        num_prefix_cached_mm_items=first.num_prefix_cached_mm_items,
        prompt_logprobs=output.prompt_logprobs if output.prompt_logprobs is not None else first.prompt_logprobs)

"""Prefill/decode disaggregation in the server: a request's hand-off from its prefill replica to a decode replica.

Role: `HandOff` (the replica set's collaborator, given the few operations it needs as `HandOffPeers`)
runs once a prefill replica's first output of a request says it parked (`kv_parked`;
the client has that first token already). It picks a decode replica (the decode replicas' own
router: by the prompt blocks and media it likely holds, balanced by load), asks it to admit the
request (`AdmitTransferred`: it answers which prompt blocks it lacks, or that it has no room now),
asks again every HANDOFF_RETRY_S while no decode replica has room — the prefill replica holds the KV
meanwhile — and gives up after HANDOFF_TIMEOUT_S with a clear error (the prefill side's blocks are
released). Then the request's flight moves to the decode replica, the prefill replica sends the
blocks (`SendKV` into the connector) and the decode replica is told where they are (`ReceiveKV`); its
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
from collections.abc import Callable
from typing import Any, Protocol

from mmserve.cluster.flights import Flight
from mmserve.cluster.protocol import AbortRequest, AdmitTransferred, Question, ReceiveKV, SendKV
from mmserve.cluster.router import RouteDecision, Router
from mmserve.engine.client import EngineDeadError
from mmserve.outputs import RequestOutput

logger = logging.getLogger("mmserve.replicas")
HANDOFF_TIMEOUT_S = 30.0  # how long a prefill replica holds a request's KV for a decode replica with room
HANDOFF_RETRY_S = 0.02
LATENCIES_KEPT = 1024


class HandOffLost(Exception):
    """A replica on either side died, or could not send, during the hand-off."""


class HandOffPeers(Protocol):
    """What a hand-off asks of the replicas around it (the replica set implements it)."""

    @property
    def decode_router(self) -> Router: ...

    def decode_replica(self, choice: int) -> tuple[int, int]:
        """The decode replica the decode router's `choice` names: (its replica index, its generation)."""
        ...

    async def ask(self, replica: int, question: Question, generation: int | None = None) -> Any:
        """`question`'s answer from `replica` (of `generation`, by default its current one); raises
        RuntimeError with its error, or when it dies first."""
        ...

    def send(self, replica: int | None, generation: int, message: Any) -> None:
        """`message` to `replica` if it still is that generation (else nothing)."""
        ...

    def uncount(self, flight: Flight) -> None:
        """The router no longer counts `flight` in flight on its replica."""
        ...

    def discard(self, transfer: Any) -> None:
        """A transfer nobody will receive: its bytes go."""
        ...


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


class HandOff:
    """Moves parked requests from prefill to decode replicas; keeps their transfer latencies."""

    def __init__(self, peers: HandOffPeers, tracing: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.peers, self.tracing, self.clock = peers, tracing, clock
        self.latencies = TransferLatencies()

    async def __call__(self, flight: Flight, first: RequestOutput) -> None:
        """Move `flight` (parked on its prefill replica after `first`) to a decode replica; raises
        `EngineDeadError` when no decode replica had room in time, `HandOffLost` when a replica fails."""
        started_s = time.time()
        decision, decode, needed = await self._admission(flight, first)
        peers, rid, prefill, prefill_generation = self.peers, flight.request_id, flight.replica, flight.generation
        assert prefill is not None
        # the flight is the decode replica's before the prefill replica sends: its last output of the
        # request (finish reason "handoff") is then not taken for the answer
        peers.uncount(flight)
        peers.decode_router.dispatched(decision, flight.keys)
        flight.replica, flight.generation, flight.counted = decode[0], decode[1], True
        sent_at = self.clock()
        sending = asyncio.ensure_future(peers.ask(prefill, SendKV(rid, tuple(needed)), generation=prefill_generation))
        try:
            flight.transfer = await asyncio.shield(sending)
        except asyncio.CancelledError:  # the client left: the transfer, once made, is nobody's
            sending.add_done_callback(self._discard_when_sent)
            raise
        except RuntimeError as exc:
            peers.send(*decode, AbortRequest(rid))
            peers.uncount(flight)
            raise HandOffLost(f"prefill replica {prefill} could not send the request's KV: {exc}") from None
        self.latencies.add(self.clock() - sent_at)
        if self.tracing is not None and flight.trace_parent is not None:
            self.tracing.record("kv_handoff", flight.trace_parent, started_s, time.time(), {
                "mmserve.handoff.prefill_replica": prefill, "mmserve.handoff.decode_replica": decode[0],
                "mmserve.handoff.blocks": len(needed), "mmserve.handoff.bytes": flight.transfer.nbytes})
        logger.debug("request %s: %d block(s) from replica %d to %d", rid, len(needed), prefill, decode[0])
        peers.send(*decode, ReceiveKV(rid, flight.transfer))

    async def _admission(self, flight: Flight, first: RequestOutput) -> tuple[RouteDecision, tuple[int, int], list]:
        """A decode replica that admitted the request: (the route, (its index, its generation), the
        block indices it needs), asking again while none has room, up to HANDOFF_TIMEOUT_S."""
        peers, rid = self.peers, flight.request_id
        admit = AdmitTransferred(rid, flight.prompt.without_payloads(), flight.params, first.outputs[0],
                                 flight.arrival_time, flight.trace_parent)
        started = self.clock()
        while True:
            decision = peers.decode_router.choose(flight.keys)
            if decision is not None:
                decode = peers.decode_replica(decision.replica)
                try:
                    needed = await peers.ask(decode[0], admit)
                except RuntimeError as exc:  # it died meanwhile, or refused: another, or later
                    logger.warning("request %s: decode replica %d could not admit it: %s", rid, decode[0], exc)
                    needed = None
                except asyncio.CancelledError:  # the client left: what the decode replica may have admitted goes
                    peers.send(*decode, AbortRequest(rid))
                    raise
                if needed is not None:
                    return decision, decode, needed
            if self.clock() - started > HANDOFF_TIMEOUT_S:
                peers.send(flight.replica, flight.generation, AbortRequest(rid))
                peers.uncount(flight)
                raise EngineDeadError(f"no decode replica had room for the request's KV within {HANDOFF_TIMEOUT_S:g} s")
            await asyncio.sleep(HANDOFF_RETRY_S)

    def _discard_when_sent(self, sending: asyncio.Future) -> None:
        if not sending.cancelled() and sending.exception() is None:
            self.peers.discard(sending.result())


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

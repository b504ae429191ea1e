"""Many engine replicas behind one API server: their processes or actors, dispatch, and surviving a dead one.

Role: `ReplicaSet` is what the server talks to in place of one `AsyncEngine` (the same methods:
process, process_chat, generate, stats, abort_all, start, shutdown). It holds a `Frontend` (the
processor and spec, no weights) as `.frontend`, so prompts are processed, hashed and routed here,
then sent to a replica process (cluster/replica_worker.py) over the messages of
cluster/protocol.py. A replica is a local process (`mp`, the default) or a Ray actor (`ray`,
cluster/ray_replicas.py). Each has its own torch threads (the cores divided between replicas) and
its own queues per generation (a replica killed mid-send can only spoil its own).

Its collaborators: `ReplicaSlots` (cluster/replica_slots.py: the replicas' processes or actors,
their readers, questions and restarts), `HandOff` (cluster/pd_flow.py: P/D, through the few
operations of `HandOffPeers` this set implements) and `summed_stats` (cluster/replica_stats.py).
Here: routing, sending, the requests in flight (cluster/flights.py) and their outputs.

Faults: the dead replica's requests that have sent no token to their client (any non-streamed one:
its client sees only the finished answer) are routed again and answered elsewhere; a stream under
way fails with `EngineDeadError` (an error event, then `[DONE]`); its slot restarts it with back-off.
What it does not know: HTTP, OpenAI's protocol, the engine's internals (it sees only what the
protocol carries).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from mmserve.cluster.flights import Flight, ReplicaLost
from mmserve.cluster.keys import route_keys
from mmserve.cluster.kv_connector import SharedMemoryConnector
from mmserve.cluster.pd_flow import HandOff, HandOffLost, merged
from mmserve.cluster.protocol import (
    AbortRequest,
    AddRequest,
    AskIntegrity,
    AskStats,
    Outputs,
    Question,
    RequestFailed,
    RequestLost,
    RequestRefused,
    Stats,
)
from mmserve.cluster.replica_slots import STOP_TIMEOUT_S, ReplicaSlot, ReplicaSlots
from mmserve.cluster.replica_stats import summed_stats
from mmserve.cluster.replica_worker import replica_main
from mmserve.cluster.router import RouteDecision, Router, RouterConfig
from mmserve.config import EngineConfig
from mmserve.engine.client import EncodedObserver, EngineDeadError, OutputObserver, StepObserver
from mmserve.engine.frontend import Frontend
from mmserve.errors import InvalidInputError
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams
from mmserve.supervisor.launch import ProcessLauncher

logger = logging.getLogger("mmserve.replicas")
REPLICA_BACKENDS = ("mp", "ray")
NO_REPLICA_WAIT_S = 60.0  # how long a request waits for a replica to come back when none is alive


class ReplicaSet:
    def __init__(self, config: EngineConfig, num_replicas: int, router: RouterConfig | None = None,
                 threads_per_replica: int | None = None, start_timeout_s: float = 600.0,
                 backend: str = "mp", ray_address: str | None = None, decode_replicas: int = 0) -> None:
        """`backend`: "mp" (local processes) or "ray" (Ray actors; `ray_address` joins a cluster, else a
        local Ray is started and stopped with the set). `decode_replicas` > 0: prefill/decode
        disaggregation — the `num_replicas` replicas prefill and hand each request's KV to one of
        these, which decodes it (cluster/pd_flow.py)."""
        if num_replicas < 1 or decode_replicas < 0:
            raise ValueError(f"need at least one replica, got {num_replicas} (and {decode_replicas} decode replicas)")
        if backend not in REPLICA_BACKENDS:
            raise ValueError(f"unknown replica backend {backend!r}; use one of {', '.join(REPLICA_BACKENDS)}")
        self.config = config
        self.backend = backend
        self.frontend = Frontend(config)  # the server reads its processor and spec (EngineClient)
        self.router = Router(num_replicas, router)
        self.num_prefill = num_replicas
        self._decode_router = Router(decode_replicas, router) if decode_replicas else None
        cores = len(os.sched_getaffinity(0))
        self.threads_per_replica = threads_per_replica or max(1, cores // (num_replicas + decode_replicas))
        self.on_output: Callable[[RequestOutput], None] | None = None  # finished outputs (the server's metrics)
        self.block_size = config.cache.block_size
        launcher, self._connector = _launcher(backend, ray_address, num_replicas + decode_replicas,
                                              self.threads_per_replica)
        roles = ["both"] * num_replicas if not decode_replicas else ["prefill"] * num_replicas + ["decode"] * decode_replicas
        self._replicas = ReplicaSlots(config, roles, self.threads_per_replica, launcher, start_timeout_s)
        self._flights: dict[str, Flight] = {}
        self._any_alive: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # the server's spans (the request's, routing); each replica writes its own to the same endpoint
        self.tracing: Any = None
        if config.otlp_traces_endpoint is not None:
            from mmserve.tracing import Tracing

            self.tracing = Tracing.to_endpoint(config.otlp_traces_endpoint, "mmserve")
        self._hand_off = HandOff(self, self.tracing)
        self._on_message: dict[type, Callable[[ReplicaSlot, Any], None]] = {  # a replica's message -> its handler
            Outputs: self._on_outputs, Stats: self._on_stats, RequestRefused: self._on_request_ended,
            RequestLost: self._on_request_ended, RequestFailed: self._on_request_ended}

    # ---- lifecycle --------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start every replica and wait until each has loaded its model (blocking; before serving).
        Raises RuntimeError naming the replica that could not start."""
        try:
            self._replicas.launch()
        except RuntimeError:
            self._close()
            raise
        slots = self._replicas.slots
        for slot in slots:
            self._set_alive(slot, True)
        self.frontend.max_model_len = slots[0].state.stats["_max_model_len"]
        layouts = {(s.state.stats["_block_size"], s.state.stats["kv_cache_dtype"], s.state.stats["kv_bytes_per_token"])
                   for s in slots}
        if len(layouts) > 1:  # a hand-off moves blocks as stored: both sides must store them alike
            self.shutdown()
            raise RuntimeError(f"the replicas' KV layouts differ (block size, KV dtype, bytes per token): {layouts}")

    def start(self) -> None:
        """Begin delivering the replicas' messages to the running event loop (the server's lifespan)."""
        if self._any_alive is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._any_alive = asyncio.Event()
        if any(s.ready for s in self._replicas.slots):
            self._any_alive.set()
        self._replicas.start(self)

    def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every replica and wait for its process to exit (killed past `timeout_s`)."""
        self._replicas.shutdown(timeout_s)
        self._close()

    def _close(self) -> None:
        self.frontend.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    def abort_all(self, error: BaseException) -> int:
        """Fail every request in flight with `error` and abort it on its replica (the server's shutdown
        timeout; called on the loop's thread or another). Returns how many were cut off."""
        assert self._loop is not None
        count = len(self._flights)
        self._loop.call_soon_threadsafe(self._fail_all, error)
        return count

    def _fail_all(self, error: BaseException) -> None:
        for flight in self._flights.values():
            flight.outputs.put_nowait(error)
            self.send(flight.replica, flight.generation, AbortRequest(flight.request_id))

    @property
    def is_running(self) -> bool:
        return not self._replicas.closed and any(s.ready for s in self._replicas.slots)

    def replica_pids(self) -> dict[int, int | None]:
        """Each replica's process id (None while it restarts): for tests and logs."""
        return {s.index: s.pid if s.ready else None for s in self._replicas.slots}

    def observe(self, on_output: OutputObserver | None = None, on_encoded: EncodedObserver | None = None,
                on_step: StepObserver | None = None) -> None:
        """The server's metrics see every finished output (a replica's encoder workers report in its own stats;
        its steps stay in its process: no step is observed here)."""
        self.on_output = on_output

    # ---- the caller's side ------------------------------------------------------------------------
    async def process_chat(self, messages: list[dict[str, Any]], mm_processor_kwargs: dict[str, Any] | None = None,
                           **template_kwargs: Any) -> ProcessedPrompt:
        return await self.frontend.process_chat_off_loop(messages, mm_processor_kwargs, **template_kwargs)

    async def process(self, raw_prompt: Any, mm_processor_kwargs: dict[str, Any] | None = None,
                      item_params: dict[str, list[str]] | None = None) -> ProcessedPrompt:
        return await self.frontend.process_off_loop(raw_prompt, mm_processor_kwargs, item_params)

    async def generate(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                       arrival_time: float | None = None, restartable: bool = False,
                       trace_parent: str | None = None) -> AsyncIterator[RequestOutput]:
        """Route the request, send it, and yield its outputs. `restartable`: the caller shows the client
        only the finished output, so the request may start over on another replica even after tokens.
        `trace_parent`: the W3C traceparent of the server's span (routing and the replica's spans go under it)."""
        if request_id in self._flights:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        flight = Flight(request_id, prompt, params, arrival_time or time.time(),
                        route_keys(prompt, self.block_size), restartable, trace_parent)
        self._flights[request_id] = flight
        finished, first = False, None
        try:
            await self._dispatch(flight)
            while not finished:
                item = await flight.outputs.get()
                if isinstance(item, ReplicaLost):
                    self._lost_transfer(flight)
                    if flight.sent_tokens and not flight.restartable:
                        raise EngineDeadError(f"the replica serving this request died: {item.message}")
                    logger.warning("request %s: %s; routing it again", request_id, item.message)
                    first = None
                    await self._dispatch(flight)
                    continue
                if isinstance(item, BaseException):
                    raise item
                flight.sent_tokens = flight.sent_tokens or any(c.token_ids for c in item.outputs)
                finished = item.finished
                if first is not None:  # decoded by the decode replica: the prefill replica's figures
                    item = merged(first, item)
                yield item
                if item.kv_parked:  # its KV goes to a decode replica, which sends the rest
                    first = item
                    try:
                        await self._hand_off(flight, item)
                    except HandOffLost as exc:
                        flight.outputs.put_nowait(ReplicaLost(str(exc)))
        finally:
            self._flights.pop(request_id, None)
            if not finished:
                self._lost_transfer(flight)
            if not finished and flight.counted:  # the caller left early: the replica stops computing it
                self.uncount(flight)
                self.send(flight.replica, flight.generation, AbortRequest(request_id))

    async def _dispatch(self, flight: Flight) -> None:
        assert self._any_alive is not None, "start() the replica set on the server's loop first"
        started_s = time.time()
        decision = self.router.choose(flight.keys)
        if decision is None:
            self._any_alive.clear()
            try:
                await asyncio.wait_for(self._any_alive.wait(), NO_REPLICA_WAIT_S)
            except TimeoutError:
                raise EngineDeadError(f"no replica has been alive for {NO_REPLICA_WAIT_S:g} s") from None
            decision = self.router.choose(flight.keys)
            if decision is None:
                raise EngineDeadError("no replica is alive")
        slot = self._replicas.slots[decision.replica]
        self._log_route(flight, decision)
        if self.tracing is not None and flight.trace_parent is not None:
            self._trace_route(flight, decision, started_s)
        self.router.dispatched(decision, flight.keys)
        flight.replica, flight.generation, flight.counted = decision.replica, slot.generation, True
        self.send(decision.replica, slot.generation,
                  AddRequest(flight.request_id, flight.prompt, flight.params, flight.arrival_time, flight.trace_parent,
                             time.time(), hand_off=self._decode_router is not None))

    def _lost_transfer(self, flight: Flight) -> None:
        """A transfer its decode replica will not receive: its bytes go (a shared-memory segment would stay)."""
        if flight.transfer is not None:
            self.discard(flight.transfer)
            flight.transfer = None

    def _trace_route(self, flight: Flight, decision: RouteDecision, started_s: float) -> None:
        self.tracing.record("route", flight.trace_parent, started_s, time.time(), {
            "mmserve.route.policy": self.router.config.policy, "mmserve.route.replica": decision.replica,
            "mmserve.route.reason": decision.reason, "mmserve.route.again": flight.replica is not None,
            "mmserve.route.expected_encoder_cache_hits": decision.expected_media_hits,
            "mmserve.route.expected_prefix_cached_tokens": decision.expected_prefix_tokens})

    def _log_route(self, flight: Flight, decision: RouteDecision) -> None:
        logger.debug("request %s -> replica %d (%s; expected %d item(s), %d prefix tokens cached)",
                     flight.request_id, decision.replica, decision.reason, decision.expected_media_hits,
                     decision.expected_prefix_tokens)

    def _router_of(self, slot: ReplicaSlot) -> tuple[Router, int]:
        """The router that routes to `slot`, and the slot's index there."""
        if slot.state.role == "decode":
            assert self._decode_router is not None
            return self._decode_router, slot.index - self.num_prefill
        return self.router, slot.index

    def _set_alive(self, slot: ReplicaSlot, alive: bool) -> None:
        router, index = self._router_of(slot)
        router.set_alive(index, alive)

    # ---- HandOffPeers: what a P/D hand-off asks of the set ----------------------------------------
    @property
    def decode_router(self) -> Router:
        assert self._decode_router is not None, "no decode replicas: nothing hands off"
        return self._decode_router

    def decode_replica(self, choice: int) -> tuple[int, int]:
        slot = self._replicas.slots[self.num_prefill + choice]
        return slot.index, slot.generation

    async def ask(self, replica: int, question: Question, generation: int | None = None) -> Any:
        return await self._replicas.ask(replica, question, generation)

    def send(self, replica: int | None, generation: int, message: Any) -> None:
        self._replicas.send(replica, generation, message)

    def uncount(self, flight: Flight) -> None:
        if flight.counted and flight.replica is not None:
            flight.counted = False
            router, index = self._router_of(self._replicas.slots[flight.replica])
            router.finished(index)

    def discard(self, transfer: Any) -> None:
        self._connector.discard(transfer)

    # ---- ReplicaEvents: what the slots report, on the loop ----------------------------------------
    def replica_ready(self, slot: ReplicaSlot) -> None:
        self._set_alive(slot, True)
        if self._any_alive is not None:
            self._any_alive.set()

    def replica_message(self, slot: ReplicaSlot, message: Any) -> None:
        handler = self._on_message.get(type(message))
        if handler is None:  # not of this protocol: logged, the replica's other messages still flow
            logger.error("replica %d: a message of unknown type %s ignored", slot.index, type(message).__name__)
            return
        handler(slot, message)

    def _on_outputs(self, slot: ReplicaSlot, message: Outputs) -> None:
        for output in message.outputs:
            self._deliver(slot, output)

    def _on_stats(self, slot: ReplicaSlot, message: Stats) -> None:
        slot.state.stats.update(message.stats)
        router, index = self._router_of(slot)
        router.evicted(index, message.evicted_media_keys, message.evicted_block_hashes)

    def _on_request_ended(self, slot: ReplicaSlot, message: RequestRefused | RequestLost | RequestFailed) -> None:
        flight = self._flights.get(message.request_id)
        if isinstance(message, RequestLost):  # its engine died: the process exits next, routes go elsewhere
            self._set_alive(slot, False)
        if flight is not None and flight.replica == slot.index:
            self.uncount(flight)
            flight.outputs.put_nowait(InvalidInputError(message.message, param=message.param)
                                      if isinstance(message, RequestRefused) else ReplicaLost(message.message))

    def replica_died(self, slot: ReplicaSlot, what: str) -> None:
        self._set_alive(slot, False)
        for flight in self._flights.values():
            if flight.replica == slot.index and flight.generation == slot.generation:
                flight.counted = False
                flight.outputs.put_nowait(ReplicaLost(f"replica {slot.index} {what}"))

    def _deliver(self, slot: ReplicaSlot, output: RequestOutput) -> None:
        flight = self._flights.get(output.request_id)
        if flight is None or flight.replica != slot.index:
            return
        if output.finished:
            self.uncount(flight)
            if self.on_output is not None:
                self.on_output(output)
        flight.outputs.put_nowait(output)

    # ---- stats and checks -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters summed over the live replicas, settings from the first, and `replicas` and `router`
        with each replica's own and the routing counters."""
        return summed_stats(self._replicas.slots, self.backend, self.router, self._hand_off.latencies.stats())

    async def current_stats(self) -> dict[str, Any]:
        """`stats()` after asking every live replica for its counters now."""
        live = [s for s in self._replicas.slots if s.ready]
        answers = await asyncio.gather(*(self.ask(s.index, AskStats()) for s in live), return_exceptions=True)
        for slot, answer in zip(live, answers, strict=False):
            if isinstance(answer, dict):
                slot.state.stats.update(answer)
        return self.stats()

    async def check_integrity(self) -> None:
        """Every live replica's `Engine.check_integrity()`; raises AssertionError naming the replica."""
        for slot in [s for s in self._replicas.slots if s.ready]:
            try:
                await self.ask(slot.index, AskIntegrity())
            except RuntimeError as exc:
                raise AssertionError(f"replica {slot.index}: {exc}") from None


def _launcher(backend: str, ray_address: str | None, num_replicas: int, threads: int) -> tuple[Any, Any]:
    """The backend's launcher, and the KV connector with which the server discards what a dead replica left."""
    if backend == "mp":
        return ProcessLauncher(replica_main, "mmserve-replica"), SharedMemoryConnector()
    from mmserve.cluster.ray_replicas import RayLauncher

    launcher = RayLauncher(ray_address, num_replicas, threads)
    return launcher, launcher.connector

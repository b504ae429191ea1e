"""Many engine replicas behind one API server: their processes or actors, dispatch, and surviving a dead one.

Role: `ReplicaSet` is what the server talks to in place of one `AsyncEngine` (the same methods:
process, process_chat, generate, stats, abort_all, start, shutdown). It holds a `Frontend` (the
processor and spec, no weights) as `.frontend`, so prompts are processed, hashed and routed here,
then sent to a replica process (cluster/replica_worker.py) over the messages of
cluster/protocol.py. A replica is a local process (`mp`, the default) or a Ray actor (`ray`,
cluster/ray_replicas.py). Each has its own torch threads (the cores divided between replicas) and
its own queues per generation (a replica killed mid-send can only spoil its own).

Faults: a reader thread per replica hands its messages to the event loop and notices, within
POLL_S, that its process died. The dead replica's requests that have sent no token to their client
(any non-streamed one: its client sees only the finished answer) are routed again and answered
elsewhere; a stream under way fails with `EngineDeadError` (an error event, then `[DONE]`). The slot
starts a new replica at once, then, while it keeps dying, after a delay that doubles up to
MAX_BACKOFF_S, with a log line each time.
What it does not know: HTTP, OpenAI's protocol, the engine's internals (it sees only what the
protocol carries).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch.multiprocessing as mp

from mmserve.cluster.keys import route_keys
from mmserve.cluster.kv_connector import SharedMemoryConnector
from mmserve.cluster.pd_flow import HandOffLost, TransferLatencies, hand_off, merged
from mmserve.cluster.protocol import (
    AbortRequest,
    AddRequest,
    Answer,
    Outputs,
    Query,
    Ready,
    RequestFailed,
    RequestLost,
    RequestRefused,
    StartFailed,
    Stats,
    Stop,
)
from mmserve.cluster.replica_worker import replica_main
from mmserve.cluster.router import RouteDecision, RouteKeys, Router, RouterConfig
from mmserve.config import EngineConfig
from mmserve.engine.async_engine import EngineDeadError
from mmserve.engine.client import EncodedObserver, OutputObserver
from mmserve.engine.frontend import Frontend
from mmserve.errors import InvalidInputError
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger("mmserve.replicas")
POLL_S = 0.5  # how long a reader waits for a message before checking that its replica still runs
RESTART_WINDOW_S = 60.0  # deaths within this long of each other count as "keeps dying"
MAX_BACKOFF_S = 60.0
REPLICA_BACKENDS = ("mp", "ray")
NO_REPLICA_WAIT_S = 60.0  # how long a request waits for a replica to come back when none is alive
STOP_TIMEOUT_S = 10.0


class _ReplicaLost:
    """Put in a request's queue when its replica died holding it."""

    def __init__(self, message: str) -> None:
        self.message = message


@dataclass
class _Slot:
    index: int
    generation: int = 0
    process: Any = None
    inbox: Any = None
    outbox: Any = None
    pid: int | None = None
    alive: bool = False
    role: str = "both"  # or "prefill" / "decode" (P/D)
    stats: dict[str, Any] = field(default_factory=dict)
    deaths: deque = field(default_factory=deque)  # times of recent deaths
    restarts: int = 0


@dataclass
class _Flight:
    """A request the server holds: enough to send it again."""

    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    arrival_time: float
    keys: RouteKeys
    restartable: bool
    trace_parent: str | None = None
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    replica: int | None = None
    generation: int = -1
    counted: bool = False  # the router counts it in flight on `replica`
    sent_tokens: bool = False
    transfer: Any = None  # P/D: its KV's transfer handle, once the prefill replica has sent it


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
        self.decode_router = Router(decode_replicas, router) if decode_replicas else None
        self.transfer_latencies = TransferLatencies()
        cores = len(os.sched_getaffinity(0))
        self.threads_per_replica = threads_per_replica or max(1, cores // (num_replicas + decode_replicas))
        self.start_timeout_s = start_timeout_s
        self.on_output: Callable[[RequestOutput], None] | None = None  # finished outputs (the server's metrics)
        self.block_size = config.cache.block_size
        self._launcher: Any = _ProcessLauncher() if backend == "mp" else _ray_launcher(
            ray_address, num_replicas, self.threads_per_replica)
        roles = ["both"] * num_replicas if not decode_replicas else ["prefill"] * num_replicas + ["decode"] * decode_replicas
        self._slots = [_Slot(i, role=role) for i, role in enumerate(roles)]
        self._query_slots: dict[int, int] = {}  # query id -> the slot asked (its death fails the query)
        self._flights: dict[str, _Flight] = {}
        self._answers: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._any_alive: asyncio.Event | None = None
        self._closed = False
        # the server's spans (the request's, routing); each replica writes its own to the same endpoint
        self.tracing: Any = None
        if config.otlp_traces_endpoint is not None:
            from mmserve.tracing import Tracing

            self.tracing = Tracing.to_endpoint(config.otlp_traces_endpoint, "mmserve")

    # ---- lifecycle --------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start every replica and wait until each has loaded its model (blocking; before serving).
        Raises RuntimeError naming the replica that could not start."""
        for slot in self._slots:
            self._spawn(slot)
        for slot in self._slots:
            try:
                message = slot.outbox.get(timeout=self.start_timeout_s)
            except queue.Empty:
                self.shutdown()
                raise RuntimeError(f"replica {slot.index} did not start within {self.start_timeout_s:g} s") from None
            if isinstance(message, StartFailed):
                self.shutdown()
                raise RuntimeError(f"replica {slot.index} could not start: {message.error}")
            self._ready(slot, message)
        self.frontend.max_model_len = self._slots[0].stats["_max_model_len"]
        layouts = {(s.stats["_block_size"], s.stats["kv_cache_dtype"], s.stats["kv_bytes_per_token"]) for s in self._slots}
        if len(layouts) > 1:  # a hand-off moves blocks as stored: both sides must store them alike
            self.shutdown()
            raise RuntimeError(f"the replicas' KV layouts differ (block size, KV dtype, bytes per token): {layouts}")

    def start(self) -> None:
        """Begin delivering the replicas' messages to the running event loop (the server's lifespan)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._any_alive = asyncio.Event()
        if any(s.alive for s in self._slots):
            self._any_alive.set()
        for slot in self._slots:
            self._start_reader(slot)

    def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every replica and wait for its process to exit (killed past `timeout_s`)."""
        self._closed = True
        for slot in self._slots:
            if slot.process is not None and slot.process.is_alive():
                with contextlib.suppress(Exception):
                    slot.inbox.put(Stop())
        deadline = time.monotonic() + timeout_s
        for slot in self._slots:
            if slot.process is None:
                continue
            slot.process.join(max(0.0, deadline - time.monotonic()))
            if slot.process.is_alive():
                slot.process.kill()
                slot.process.join(timeout_s)
            slot.alive = False
            self._launcher.abandon(slot.inbox, slot.outbox)
        self._launcher.close()
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
            self._send(flight.replica, flight.generation, AbortRequest(flight.request_id))

    @property
    def is_running(self) -> bool:
        return not self._closed and any(s.alive for s in self._slots)

    def replica_pids(self) -> dict[int, int | None]:
        """Each replica's process id (None while it restarts): for tests and logs."""
        return {s.index: s.pid if s.alive else None for s in self._slots}

    def observe(self, on_output: OutputObserver | None = None, on_encoded: EncodedObserver | None = None) -> None:
        """The server's metrics see every finished output (a replica's encoder workers report in its own stats)."""
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
        flight = _Flight(request_id, prompt, params, arrival_time or time.time(),
                         route_keys(prompt, self.block_size), restartable, trace_parent)
        self._flights[request_id] = flight
        finished, first = False, None
        try:
            await self._dispatch(flight)
            while not finished:
                item = await flight.outputs.get()
                if isinstance(item, _ReplicaLost):
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
                        await hand_off(self, flight, item)
                    except HandOffLost as exc:
                        flight.outputs.put_nowait(_ReplicaLost(str(exc)))
        finally:
            self._flights.pop(request_id, None)
            if not finished:
                self._lost_transfer(flight)
            if not finished and flight.counted:  # the caller left early: the replica stops computing it
                self._uncount(flight)
                self._send(flight.replica, flight.generation, AbortRequest(request_id))

    async def _dispatch(self, flight: _Flight) -> None:
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
        slot = self._slots[decision.replica]
        self._log_route(flight, decision)
        if self.tracing is not None and flight.trace_parent is not None:
            self._trace_route(flight, decision, started_s)
        self.router.dispatched(decision, flight.keys)
        flight.replica, flight.generation, flight.counted = decision.replica, slot.generation, True
        self._send(decision.replica, slot.generation,
                   AddRequest(flight.request_id, flight.prompt, flight.params, flight.arrival_time, flight.trace_parent,
                              time.time(), hand_off=self.decode_router is not None))

    def _lost_transfer(self, flight: _Flight) -> None:
        """A transfer its decode replica will not receive: its bytes go (a shared-memory segment would stay)."""
        if flight.transfer is not None:
            self.discard(flight.transfer)
            flight.transfer = None

    def discard(self, transfer: Any) -> None:
        self._launcher.connector.discard(transfer)

    def _trace_route(self, flight: _Flight, decision: RouteDecision, started_s: float) -> None:
        self.tracing.record("route", flight.trace_parent, started_s, time.time(), {
            "mmserve.route.policy": self.router.config.policy, "mmserve.route.replica": decision.replica,
            "mmserve.route.reason": decision.reason, "mmserve.route.again": flight.replica is not None,
            "mmserve.route.expected_encoder_cache_hits": decision.expected_media_hits,
            "mmserve.route.expected_prefix_cached_tokens": decision.expected_prefix_tokens})

    def _log_route(self, flight: _Flight, decision: RouteDecision) -> None:
        logger.debug("request %s -> replica %d (%s; expected %d item(s), %d prefix tokens cached)",
                     flight.request_id, decision.replica, decision.reason, decision.expected_media_hits,
                     decision.expected_prefix_tokens)

    def _uncount(self, flight: _Flight) -> None:
        if flight.counted and flight.replica is not None:
            flight.counted = False
            router, index = self._router_of(self._slots[flight.replica])
            router.finished(index)

    def _router_of(self, slot: _Slot) -> tuple[Router, int]:
        """The router that routes to `slot`, and the slot's index there."""
        if slot.role == "decode":
            assert self.decode_router is not None
            return self.decode_router, slot.index - self.num_prefill
        return self.router, slot.index

    def _set_alive(self, slot: _Slot, alive: bool) -> None:
        router, index = self._router_of(slot)
        router.set_alive(index, alive)

    def _send(self, replica: int | None, generation: int, message: Any) -> None:
        slot = self._slots[replica] if replica is not None else None
        if slot is not None and slot.alive and slot.generation == generation:
            with contextlib.suppress(Exception):  # a queue of a replica that just died
                slot.inbox.put(message)

    # ---- stats and checks -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters summed over the live replicas, settings from the first, and `replicas` and `router`
        with each replica's own and the routing counters."""
        total: dict[str, Any] = {}
        for slot in self._slots:
            if not slot.alive:
                continue
            for key, value in slot.stats.items():
                if key.startswith("_"):
                    continue
                if isinstance(value, str):
                    total.setdefault(key, value)
                elif isinstance(value, int | float):
                    total[key] = total.get(key, 0) + value
        total["replica_backend"] = self.backend
        total["replicas_total"] = len(self._slots)
        total["replicas_alive"] = sum(s.alive for s in self._slots)
        total["replica_restarts"] = sum(s.restarts for s in self._slots)
        total.update(self.transfer_latencies.stats())
        total["replicas"] = [{"replica": s.index, "role": s.role, "alive": s.alive, "pid": s.pid if s.alive else None,
                              "restarts": s.restarts,
                              **{k: v for k, v in s.stats.items() if not k.startswith("_")}} for s in self._slots]
        r = self.router.stats
        total["router"] = {"policy": self.router.config.policy,
                           "routed": [{"policy": p, "reason": reason, "requests": n}
                                      for (p, reason), n in sorted(r.routed.items())],
                           "expected_encoder_cache_hits": r.expected_media_hits,
                           "expected_prefix_cache_tokens": r.expected_prefix_tokens}
        return total

    async def current_stats(self) -> dict[str, Any]:
        """`stats()` after asking every live replica for its counters now."""
        answers = await asyncio.gather(*(self._query(s.index, "stats") for s in self._slots if s.alive),
                                       return_exceptions=True)
        live = [s for s in self._slots if s.alive]
        for slot, answer in zip(live, answers, strict=False):
            if isinstance(answer, dict):
                slot.stats.update(answer)
        return self.stats()

    async def check_integrity(self) -> None:
        """Every live replica's `Engine.check_integrity()`; raises AssertionError naming the replica."""
        for slot in [s for s in self._slots if s.alive]:
            try:
                await self._query(slot.index, "check_integrity")
            except RuntimeError as exc:
                raise AssertionError(f"replica {slot.index}: {exc}") from None

    async def _query(self, replica: int, what: str, timeout_s: float = 30.0, args: tuple = (),
                     generation: int | None = None) -> Any:
        """Ask one replica (of `generation`, by default its current one); raises RuntimeError with its
        error, or when it dies first."""
        slot = self._slots[replica]
        if not slot.alive or (generation is not None and generation != slot.generation):
            raise RuntimeError(f"replica {replica} is not the one that held the request")
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._answers[query_id], self._query_slots[query_id] = future, replica
        try:
            self._send(replica, slot.generation, Query(query_id, what, args))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._answers.pop(query_id, None)
            self._query_slots.pop(query_id, None)

    # ---- processes --------------------------------------------------------------------------------
    def _spawn(self, slot: _Slot) -> None:
        slot.generation += 1
        slot.process, slot.inbox, slot.outbox = self._launcher.start(self.config, self.threads_per_replica)

    def _ready(self, slot: _Slot, ready: Ready) -> None:
        slot.pid, slot.alive = ready.pid, True
        slot.stats = {**ready.stats, "_max_model_len": ready.max_model_len, "_block_size": ready.block_size}
        self._set_alive(slot, True)
        if self._any_alive is not None:
            self._any_alive.set()
        logger.info("replica %d ready (pid %d)", slot.index, ready.pid)

    def _start_reader(self, slot: _Slot) -> None:
        reader = threading.Thread(target=self._read, args=(slot, slot.generation, slot.process, slot.outbox),
                                  name=f"mmserve-replica-{slot.index}-reader", daemon=True)
        reader.start()

    def _read(self, slot: _Slot, generation: int, process: Any, outbox: Any) -> None:
        """A reader thread: hand each message to the loop; when the process is gone, say so once."""
        assert self._loop is not None
        while not self._closed:
            try:
                message = outbox.get(timeout=POLL_S)
            except queue.Empty:
                if process.is_alive():
                    continue
                message = None
            except Exception:  # the pipe or the queue's actor is gone: so is the replica (or the set is closing)
                if self._closed:
                    return
                message = None
            try:
                self._loop.call_soon_threadsafe(self._receive, slot, generation, message)
            except RuntimeError:  # the loop has closed: the server is gone
                return
            if message is None or isinstance(message, StartFailed):
                return

    def _receive(self, slot: _Slot, generation: int, message: Any) -> None:
        """On the loop: one message of `slot`'s replica of `generation` (None: it died)."""
        if generation != slot.generation or self._closed:
            return
        if message is None or isinstance(message, StartFailed):
            self._died(slot, message.error if isinstance(message, StartFailed) else None)
        elif isinstance(message, Outputs):
            for output in message.outputs:
                self._deliver(slot, output)
        elif isinstance(message, Ready):
            self._ready(slot, message)
        elif isinstance(message, Stats):
            slot.stats.update(message.stats)
            router, index = self._router_of(slot)
            router.evicted(index, message.evicted_media_keys, message.evicted_block_hashes)
        elif isinstance(message, Answer):
            future = self._answers.get(message.query_id)
            if future is not None and not future.done():
                if message.error is None:
                    future.set_result(message.value)
                else:
                    future.set_exception(RuntimeError(message.error))
        elif isinstance(message, RequestRefused | RequestLost | RequestFailed):
            flight = self._flights.get(message.request_id)
            if isinstance(message, RequestLost):  # its engine died: the process exits next, routes go elsewhere
                self._set_alive(slot, False)
            if flight is not None and flight.replica == slot.index:
                self._uncount(flight)
                flight.outputs.put_nowait(InvalidInputError(message.message, param=message.param)
                                          if isinstance(message, RequestRefused) else _ReplicaLost(message.message))

    def _deliver(self, slot: _Slot, output: RequestOutput) -> None:
        flight = self._flights.get(output.request_id)
        if flight is None or flight.replica != slot.index:
            return
        if output.finished:
            self._uncount(flight)
            if self.on_output is not None:
                self.on_output(output)
        flight.outputs.put_nowait(output)

    def _died(self, slot: _Slot, error: str | None) -> None:
        was_alive, slot.alive, slot.pid = slot.alive, False, None
        self._launcher.abandon(slot.inbox, slot.outbox)
        self._set_alive(slot, False)
        for query_id, asked in list(self._query_slots.items()):  # its answers will not come
            future = self._answers.get(query_id)
            if asked == slot.index and future is not None and not future.done():
                future.set_exception(RuntimeError(f"replica {slot.index} died"))
        exitcode = slot.process.exitcode if slot.process is not None else None
        what = f"could not start: {error}" if error else f"died (exit code {exitcode})"
        for flight in self._flights.values():
            if flight.replica == slot.index and flight.generation == slot.generation:
                flight.counted = False
                flight.outputs.put_nowait(_ReplicaLost(f"replica {slot.index} {what}"))
        now = time.monotonic()
        slot.deaths.append(now)
        while slot.deaths and now - slot.deaths[0] > RESTART_WINDOW_S:
            slot.deaths.popleft()
        delay_s = 0.0 if len(slot.deaths) <= 1 else min(MAX_BACKOFF_S, 2.0 ** (len(slot.deaths) - 1))
        logger.error("replica %d %s%s; restarting it %s", slot.index, what, "" if was_alive else " before it was ready",
                     "now" if delay_s == 0 else f"in {delay_s:g} s ({len(slot.deaths)} deaths in the last "
                                                 f"{RESTART_WINDOW_S:g} s)")
        assert self._loop is not None
        self._loop.call_later(delay_s, self._restart, slot)

    def _restart(self, slot: _Slot) -> None:
        if self._closed:
            return
        if slot.process is not None:
            slot.process.join(0)
        slot.restarts += 1
        self._spawn(slot)
        self._start_reader(slot)



class _ProcessLauncher:
    """The `mp` backend: a replica is a local process started by spawn, its messages through pipes."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self.connector = SharedMemoryConnector()  # the server only discards what a dead replica left

    def start(self, config: EngineConfig, threads: int) -> tuple[Any, Any, Any]:
        inbox, outbox = self._ctx.Queue(), self._ctx.Queue()
        process = self._ctx.Process(target=replica_main, name="mmserve-replica", args=(config, threads, inbox, outbox))
        process.start()
        return process, inbox, outbox

    def abandon(self, *queues: Any) -> None:
        """Give up on a stopped replica's queues: what is still buffered for it must not hold this
        process's exit (a queue's feeder thread blocks on a pipe nobody reads)."""
        for q in queues:
            if q is not None:
                q.cancel_join_thread()

    def close(self) -> None:
        pass


def _ray_launcher(ray_address: str | None, num_replicas: int, threads: int) -> Any:
    from mmserve.cluster.ray_replicas import RayLauncher

    return RayLauncher(ray_address, num_replicas, threads)

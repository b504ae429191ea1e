"""One replica process: today's engine, unchanged, behind the messages of cluster/protocol.py.

Role: `replica_main` (the spawn target) builds an `Engine` with its share of the cores, wraps it in
an `AsyncEngine` on an event loop of its own, sends `Ready`, then serves each message by its type
(a dispatch table, message type -> handler): an `AddRequest` becomes a task that iterates `generate`
and sends every output; `AbortRequest` cancels that task (which aborts the request in the engine); a
`Query`'s question (stats, an integrity check, P/D's admission and sending of KV) is answered from the
engine's thread, by its public calls only; every STATS_INTERVAL_S it sends its counters and what its
caches evicted. It exits on `Stop`
or when the API server's process is gone, so a replica never outlives its server.
What it does not know: HTTP, routing, the other replicas.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from mmserve.cluster.protocol import (
    STATS_INTERVAL_S,
    AbortRequest,
    AddRequest,
    AdmitTransferred,
    Answer,
    AskIntegrity,
    AskStats,
    Outputs,
    Query,
    Ready,
    ReceiveKV,
    RequestFailed,
    RequestLost,
    RequestRefused,
    SendKV,
    StartFailed,
    Stats,
    Stop,
)
from mmserve.config import EngineConfig
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.client import EngineDeadError
from mmserve.engine.llm_engine import Engine
from mmserve.errors import InvalidInputError

logger = logging.getLogger("mmserve.replicas")
PARENT_CHECK_S = 1.0  # how often a replica with nothing to read checks that its server still runs


def replica_main(config: EngineConfig, threads: int, inbox: Any, outbox: Any, connector: str = "shm") -> None:
    """`connector`: how this replica moves KV in a P/D hand-off ("shm" or "ray", cluster/kv_connector.py)."""
    import torch

    torch.set_num_threads(threads)
    tracing = None
    try:
        if config.otlp_traces_endpoint is not None:  # the replica's spans, under the server's request spans
            from mmserve.tracing import Tracing

            tracing = Tracing.to_endpoint(config.otlp_traces_endpoint, "mmserve-replica")
        engine = Engine(config, tracing=tracing)
    except Exception as exc:  # a checkpoint that does not load: the server reports it and gives up
        outbox.put(StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    async_engine = AsyncEngine(engine)
    from mmserve.cluster.kv_connector import RayConnector, SharedMemoryConnector

    kv_connector = RayConnector() if connector == "ray" else SharedMemoryConnector()
    try:
        asyncio.run(_Replica(async_engine, inbox, outbox, kv_connector).serve())
    finally:
        async_engine.shutdown()
        if tracing is not None:
            tracing.shutdown()
        # what is still buffered for a server that stopped reading must not hold the exit (a pipe's;
        # Ray's queues have no feeder thread)
        if hasattr(outbox, "cancel_join_thread"):
            outbox.cancel_join_thread()


class _Replica:
    def __init__(self, engine: AsyncEngine, inbox: Any, outbox: Any, connector: Any) -> None:
        self.engine = engine
        self.connector = connector
        self.inbox, self.outbox = inbox, outbox
        self.tasks: dict[str, asyncio.Task] = {}
        self.stopped: asyncio.Event | None = None
        self._handlers: dict[type, Callable[[Any], None]] = {
            AddRequest: self._add, ReceiveKV: self._receive_kv, AbortRequest: self._abort, Query: self._query,
            Stop: self._stop}
        self._answerers: dict[type, Callable[[Any], Awaitable[Any]]] = {
            AskStats: self._stats, AskIntegrity: self._integrity, AdmitTransferred: self._admit, SendKV: self._send_kv}

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.stopped = asyncio.Event()
        self.engine.start()
        frontend = self.engine.frontend
        self.outbox.put(Ready(os.getpid(), frontend.max_model_len, frontend.config.cache.block_size,
                              self.engine.stats()))
        reader = threading.Thread(target=self._read, args=(loop,), name="mmserve-replica-inbox", daemon=True)
        reader.start()
        ticker = asyncio.create_task(self._tick())
        await self.stopped.wait()
        crashed = not self.engine.is_running
        ticker.cancel()
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), ticker, return_exceptions=True)
        if crashed:
            raise SystemExit(1)

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        parent = multiprocessing.parent_process()
        while True:
            try:
                message = self.inbox.get(timeout=PARENT_CHECK_S)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    message = Stop()
                else:
                    continue
            handler = self._handlers.get(type(message))
            if handler is None:  # not of this protocol: this reader must outlive it to obey Stop
                logger.error("replica: a message of unknown type %s ignored", type(message).__name__)
                continue
            loop.call_soon_threadsafe(handler, message)
            if isinstance(message, Stop):
                return

    # ---- the handlers (on the loop) ---------------------------------------------------------------
    def _add(self, add: AddRequest) -> None:
        self.tasks[add.request_id] = asyncio.create_task(self._run(add))

    def _receive_kv(self, message: ReceiveKV) -> None:
        self.tasks[message.request_id] = asyncio.create_task(self._receive(message))

    def _abort(self, message: AbortRequest) -> None:
        task = self.tasks.get(message.request_id)
        if task is not None:
            task.cancel()
        elif self.engine.is_running:  # admitted for a hand-off, its KV not sent yet
            asyncio.create_task(self.engine.call(partial(Engine.abort_request, request_ids=[message.request_id])))

    def _query(self, query: Query) -> None:
        asyncio.create_task(self._answer(query))

    def _stop(self, message: Stop) -> None:
        assert self.stopped is not None
        self.stopped.set()

    async def _run(self, add: AddRequest) -> None:
        tracing = self.engine.tracing
        if tracing is not None and add.trace_parent is not None:  # from the server's send to this replica's loop
            tracing.record("handoff", add.trace_parent, add.sent_s, time.time(), {"mmserve.handoff.to": "replica"})
        try:
            async for output in self.engine.generate(add.request_id, add.prompt, add.params, add.arrival_time,
                                                     trace_parent=add.trace_parent, hand_off=add.hand_off):
                self.outbox.put(Outputs((output,)))
        except InvalidInputError as exc:
            self.outbox.put(RequestRefused(add.request_id, str(exc), exc.param))
        except EngineDeadError as exc:
            self.outbox.put(RequestLost(add.request_id, str(exc)))
        finally:
            self.tasks.pop(add.request_id, None)

    async def _receive(self, message: ReceiveKV) -> None:
        """A transferred request: its KV into the engine's storage (on the engine thread), then its outputs."""
        rid = message.request_id
        try:
            async for output in self.engine.adopt(rid, partial(_receive_into, self.connector, message)):
                self.outbox.put(Outputs((output,)))
        except EngineDeadError as exc:
            self.outbox.put(RequestLost(rid, str(exc)))
        except Exception as exc:  # noqa: BLE001 - its KV did not arrive: the request fails, the replica serves on
            self.outbox.put(RequestFailed(rid, f"the request's KV did not arrive: {type(exc).__name__}: {exc}"))
        finally:
            self.tasks.pop(rid, None)

    # ---- the questions (each answered from the engine's thread) -----------------------------------
    async def _answer(self, query: Query) -> None:
        try:
            value = await self._answerers[type(query.question)](query.question)
            self.outbox.put(Answer(query.query_id, value))
        except Exception as exc:  # an integrity assertion included: the server raises it to its caller
            self.outbox.put(Answer(query.query_id, error=f"{type(exc).__name__}: {exc}"))

    async def _stats(self, question: AskStats) -> Any:
        if not self.engine.is_running:
            return self.engine.stats()
        return await self.engine.call(Engine.get_stats)  # exact: between steps

    async def _integrity(self, question: AskIntegrity) -> None:
        if not self.engine.is_running:
            raise RuntimeError("the replica's engine is not running")
        await self.engine.call(Engine.check_integrity)

    async def _admit(self, q: AdmitTransferred) -> list[int] | None:
        return await self.engine.call(partial(Engine.admit_transferred, request_id=q.request_id, prompt=q.prompt,
                                              params=q.params, first=q.first, arrival_time=q.arrival_time,
                                              trace_parent=q.trace_parent))

    async def _send_kv(self, q: SendKV) -> Any:
        return await self.engine.call(partial(Engine.send_kv, request_id=q.request_id,
                                              block_indices=list(q.block_indices), connector=self.connector))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            if not self.engine.is_running:  # its step raised: exit, and the server starts a new replica
                assert self.stopped is not None
                self.stopped.set()
                return
            media, blocks = await self.engine.call(Engine.take_evictions)
            self.outbox.put(Stats(self.engine.stats(), media, blocks))


def _receive_into(connector: Any, message: ReceiveKV, engine: Engine) -> None:
    """On the engine's thread: a transferred request's KV, from the connector into the engine's storage."""
    connector.receive(message.transfer, partial(engine.receive_kv, message.request_id))

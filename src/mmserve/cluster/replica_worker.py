"""One replica process: today's engine, unchanged, behind the messages of cluster/protocol.py.

Role: `replica_main` (the spawn target) builds an `Engine` with its share of the cores, wraps it in
an `AsyncEngine` on an event loop of its own, sends `Ready`, then serves: each `AddRequest` becomes
a task that iterates `generate` and sends every output; `AbortRequest` cancels that task (which
aborts the request in the engine); `Query` answers stats or an integrity check run on the engine
thread; every STATS_INTERVAL_S it sends its counters and what its caches evicted. It exits on `Stop`
or when the API server's process is gone, so a replica never outlives its server.
What it does not know: HTTP, routing, the other replicas.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import threading
import time
from typing import Any

from mmserve.cluster.protocol import (
    STATS_INTERVAL_S,
    AbortRequest,
    AddRequest,
    Answer,
    Outputs,
    Query,
    Ready,
    ReceiveKV,
    RequestFailed,
    RequestLost,
    RequestRefused,
    StartFailed,
    Stats,
    Stop,
)
from mmserve.config import EngineConfig

PARENT_CHECK_S = 1.0  # how often a replica with nothing to read checks that its server still runs


def replica_main(config: EngineConfig, threads: int, inbox: Any, outbox: Any, connector: str = "shm") -> None:
    """`connector`: how this replica moves KV in a P/D hand-off ("shm" or "ray", cluster/kv_connector.py)."""
    import torch

    torch.set_num_threads(threads)
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.engine.llm_engine import Engine

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
    def __init__(self, engine: Any, inbox: Any, outbox: Any, connector: Any) -> None:
        self.engine = engine
        self.connector = connector
        self.inbox, self.outbox = inbox, outbox
        self.tasks: dict[str, asyncio.Task] = {}
        self.stopped: asyncio.Event | None = None

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
            loop.call_soon_threadsafe(self._handle, message)
            if isinstance(message, Stop):
                return

    def _handle(self, message: Any) -> None:
        if isinstance(message, AddRequest):
            self.tasks[message.request_id] = asyncio.create_task(self._run(message))
        elif isinstance(message, ReceiveKV):
            self.tasks[message.request_id] = asyncio.create_task(self._receive(message))
        elif isinstance(message, AbortRequest):
            task = self.tasks.get(message.request_id)
            if task is not None:
                task.cancel()
            elif self.engine.is_running:  # admitted for a hand-off, its KV not sent yet
                rid = message.request_id
                asyncio.create_task(self.engine.call(lambda engine: engine.abort_request([rid])))
        elif isinstance(message, Query):
            asyncio.create_task(self._answer(message))
        elif isinstance(message, Stop):
            assert self.stopped is not None
            self.stopped.set()

    async def _run(self, add: AddRequest) -> None:
        from mmserve.engine.async_engine import EngineDeadError
        from mmserve.errors import InvalidInputError

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
        from mmserve.engine.async_engine import EngineDeadError

        rid, transfer, connector = message.request_id, message.transfer, self.connector
        try:
            async for output in self.engine.adopt(rid, lambda engine: connector.receive(
                    transfer, lambda parts: engine.receive_kv(rid, parts))):
                self.outbox.put(Outputs((output,)))
        except EngineDeadError as exc:
            self.outbox.put(RequestLost(rid, str(exc)))
        except Exception as exc:  # noqa: BLE001 - its KV did not arrive: the request fails, the replica serves on
            self.outbox.put(RequestFailed(rid, f"the request's KV did not arrive: {type(exc).__name__}: {exc}"))
        finally:
            self.tasks.pop(rid, None)

    async def _answer(self, query: Query) -> None:
        try:
            if query.what == "stats":  # exact: read on the engine thread, between steps
                value: Any = (await self.engine.call(lambda engine: engine.get_stats()) if self.engine.is_running
                              else self.engine.stats())
            elif query.what == "check_integrity":
                if not self.engine.is_running:
                    raise RuntimeError("the replica's engine is not running")
                value = await self.engine.call(lambda engine: engine.check_integrity())
            elif query.what == "admit_transferred":  # (request id, prompt without payloads, params, first output)
                args = query.args
                value = await self.engine.call(lambda engine: engine.admit_transferred(*args))
            elif query.what == "send_kv":  # (request id, block indices)
                rid, indices = query.args
                value = await self.engine.call(lambda engine: engine.send_kv(rid, indices, self.connector))
            else:
                raise ValueError(f"unknown query {query.what!r}")
            self.outbox.put(Answer(query.query_id, value))
        except Exception as exc:  # an integrity assertion included: the server raises it to its caller
            self.outbox.put(Answer(query.query_id, error=f"{type(exc).__name__}: {exc}"))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            if not self.engine.is_running:  # its step raised: exit, and the server starts a new replica
                assert self.stopped is not None
                self.stopped.set()
                return
            media, blocks = await self.engine.call(lambda engine: engine.take_evictions())
            self.outbox.put(Stats(self.engine.stats(), media, blocks))

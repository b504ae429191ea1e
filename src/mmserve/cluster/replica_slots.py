"""The replicas' processes or actors: started, read, asked, restarted with back-off, stopped.

Role: `ReplicaSlots` is the replica set's supervisor, built on mmserve/supervisor/ (the same slot
type, restart policy and reader as the encoder workers'). `launch` starts a child per slot (through
the backend's launcher: local processes, or cluster/ray_replicas.py's actors) and waits for each
`Ready`; `start` gives each child an `OutboxReader` that hands its messages to the event loop, where
answers settle their questions (`ask`) and the rest goes to the owner (`ReplicaEvents`). A child
found gone (its reader says so within POLL_S) fails the questions asked of it, is reported, and its
slot starts a new one as REPLICA_RESTART_POLICY says: at once, then, while it keeps dying, after a
delay that doubles up to a minute, with a log line each time (never giving up).
What it does not know: requests, routing, outputs (it hands them on), HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from mmserve.cluster.protocol import Answer, Query, Question, Ready, StartFailed, Stop
from mmserve.config import EngineConfig
from mmserve.supervisor.reader import CHILD_GONE, OutboxReader
from mmserve.supervisor.restarts import RestartPolicy
from mmserve.supervisor.slot import ChildSlot

logger = logging.getLogger("mmserve.replicas")
POLL_S = 0.5  # how long a reader waits for a message before checking that its replica still runs
STOP_TIMEOUT_S = 10.0
QUERY_TIMEOUT_S = 30.0  # a hang guard: a live replica answers between two engine steps
REPLICA_RESTART_POLICY = RestartPolicy(window_s=60.0, first_backoff_s=2.0, max_backoff_s=60.0)


@dataclass
class ReplicaBook:
    """A replica slot's own book (its `ChildSlot.state`); the slot's `ready` is the replica being alive."""

    role: str = "both"  # or "prefill" / "decode" (P/D)
    stats: dict[str, Any] = field(default_factory=dict)


ReplicaSlot = ChildSlot[ReplicaBook]


class ReplicaEvents(Protocol):
    """What the slots tell their owner, on the event loop."""

    def replica_ready(self, slot: ReplicaSlot) -> None: ...

    def replica_message(self, slot: ReplicaSlot, message: Any) -> None:
        """Outputs, stats, a request refused, lost or failed: anything but readiness and answers."""
        ...

    def replica_died(self, slot: ReplicaSlot, what: str) -> None: ...


class ReplicaSlots:
    def __init__(self, config: EngineConfig, roles: list[str], threads_per_replica: int, launcher: Any,
                 start_timeout_s: float, policy: RestartPolicy = REPLICA_RESTART_POLICY) -> None:
        """`launcher`: `start(config, threads) -> (handle, inbox, outbox)`, `abandon(*queues)`, `close()`."""
        self.config, self.threads_per_replica, self.start_timeout_s = config, threads_per_replica, start_timeout_s
        self.launcher, self.policy = launcher, policy
        self.slots = [ReplicaSlot(i, ReplicaBook(role)) for i, role in enumerate(roles)]
        self._answers: dict[int, tuple[asyncio.Future, int]] = {}  # query id -> (its answer, the slot asked)
        self._query_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: ReplicaEvents | None = None
        self.closed = False

    # ---- lifecycle --------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start every replica and wait until each has loaded its model (blocking). Raises RuntimeError
        naming the replica that could not start (the others are stopped)."""
        for slot in self.slots:
            self._spawn(slot)
        for slot in self.slots:
            try:
                message = slot.outbox.get(timeout=self.start_timeout_s)
            except queue.Empty:
                self.shutdown()
                raise RuntimeError(f"replica {slot.index} did not start within {self.start_timeout_s:g} s") from None
            if isinstance(message, StartFailed):
                self.shutdown()
                raise RuntimeError(f"replica {slot.index} could not start: {message.error}")
            self._ready(slot, message)

    def start(self, events: ReplicaEvents) -> None:
        """Deliver the replicas' messages to the running loop from now on."""
        self._loop, self._events = asyncio.get_running_loop(), events
        for slot in self.slots:
            self._start_reader(slot)

    def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every replica and wait for its process to exit (killed past `timeout_s`)."""
        self.closed = True
        for slot in self.slots:
            if slot.reader is not None:
                slot.reader.stop()
            if slot.handle is not None and slot.handle.is_alive():
                with contextlib.suppress(Exception):
                    slot.inbox.put(Stop())
        deadline = time.monotonic() + timeout_s
        for slot in [s for s in self.slots if s.handle is not None]:
            slot.handle.join(max(0.0, deadline - time.monotonic()))
            if slot.handle.is_alive():
                slot.handle.kill()
                slot.handle.join(timeout_s)
            slot.ready = False
            self.launcher.abandon(slot.inbox, slot.outbox)
        self.launcher.close()

    # ---- talking to a replica ---------------------------------------------------------------------
    def send(self, replica: int | None, generation: int, message: Any) -> None:
        """`message` to `replica` if it is alive and still of `generation` (else nothing)."""
        slot = self.slots[replica] if replica is not None else None
        if slot is not None and slot.ready and slot.generation == generation:
            with contextlib.suppress(Exception):  # a queue of a replica that just died
                slot.inbox.put(message)

    async def ask(self, replica: int, question: Question, generation: int | None = None,
                  timeout_s: float = QUERY_TIMEOUT_S) -> Any:
        """`question`'s answer from one replica (of `generation`, by default its current one); raises
        RuntimeError with its error, or when it dies first."""
        slot = self.slots[replica]
        if not slot.ready or (generation is not None and generation != slot.generation):
            raise RuntimeError(f"replica {replica} is not the one that held the request")
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._answers[query_id] = (future, replica)
        try:
            self.send(replica, slot.generation, Query(query_id, question))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._answers.pop(query_id, None)

    # ---- children ---------------------------------------------------------------------------------
    def _spawn(self, slot: ReplicaSlot) -> None:
        slot.next_generation()
        slot.handle, slot.inbox, slot.outbox = self.launcher.start(self.config, self.threads_per_replica)

    def _ready(self, slot: ReplicaSlot, ready: Ready) -> None:
        slot.pid, slot.ready = ready.pid, True
        slot.state.stats = {**ready.stats, "_max_model_len": ready.max_model_len, "_block_size": ready.block_size}
        logger.info("replica %d ready (pid %d)", slot.index, ready.pid)
        if self._events is not None:
            self._events.replica_ready(slot)

    def _start_reader(self, slot: ReplicaSlot) -> None:
        assert self._loop is not None
        loop, generation = self._loop, slot.generation

        def deliver(message: Any) -> bool:
            try:
                loop.call_soon_threadsafe(self._receive, slot, generation, message)
            except RuntimeError:  # the loop has closed: the server is gone
                return False
            return not isinstance(message, StartFailed)

        slot.reader = OutboxReader(f"mmserve-replica-{slot.index}-reader", slot.outbox, deliver, POLL_S,
                                   is_alive=slot.handle.is_alive)

    def _receive(self, slot: ReplicaSlot, generation: int, message: Any) -> None:
        """On the loop: one message of `slot`'s replica of `generation` (CHILD_GONE: it died)."""
        if generation != slot.generation or self.closed:
            return
        assert self._events is not None
        if message is CHILD_GONE or isinstance(message, StartFailed):
            self._died(slot, message.error if isinstance(message, StartFailed) else None)
        elif isinstance(message, Ready):
            self._ready(slot, message)
        elif isinstance(message, Answer):
            future = self._answers.get(message.query_id, (None, None))[0]
            if future is not None and not future.done():
                if message.error is None:
                    future.set_result(message.value)
                else:
                    future.set_exception(RuntimeError(message.error))
        else:
            self._events.replica_message(slot, message)

    def _died(self, slot: ReplicaSlot, error: str | None) -> None:
        was_alive, slot.ready, slot.pid = slot.ready, False, None
        self.launcher.abandon(slot.inbox, slot.outbox)
        for future, asked in list(self._answers.values()):  # its answers will not come
            if asked == slot.index and not future.done():
                future.set_exception(RuntimeError(f"replica {slot.index} died"))
        exitcode = slot.handle.exitcode if slot.handle is not None else None
        what = f"could not start: {error}" if error else f"died (exit code {exitcode})"
        assert self._events is not None and self._loop is not None
        self._events.replica_died(slot, what)
        delay_s = slot.restarts.decide(self.policy, time.monotonic())
        assert delay_s is not None, "a replica's slot never gives up"
        logger.error("replica %d %s%s; restarting it %s", slot.index, what, "" if was_alive else " before it was ready",
                     "now" if delay_s == 0 else f"in {delay_s:g} s ({len(slot.restarts.recent_s)} "
                                                f"restarts in the last {self.policy.window_s:g} s)")
        self._loop.call_later(delay_s, self._restart, slot)

    def _restart(self, slot: ReplicaSlot) -> None:
        if self.closed:
            return
        if slot.handle is not None:
            slot.handle.join(0)
        self._spawn(slot)
        self._start_reader(slot)

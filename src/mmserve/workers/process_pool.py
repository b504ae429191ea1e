"""The `process` encoder backend: encoder workers as local processes, tensors through shared memory.

Role: `ProcessEncoderPool` implements `EncoderPool` with `num_workers` processes started by the
spawn start method (never fork: the engine's process has torch threads). Each worker has its own
job queue and result queue (torch.multiprocessing queues, so tensors travel as shared-memory
handles; `process_worker` holds the worker's loop and the wire format). `submit` moves a payload's
arrays into shared memory once and queues the job on the live worker with the fewest items in
flight; a worker still loading its model simply finds the jobs queued. `poll` returns what has
arrived, then tends the workers: a dead one's in-flight items go to the others, and its slot gets
a new worker (a new generation, with new queues) as its `RestartPolicy` allows (by default
`WORKER_RESTART_POLICY`: at once, at most `MAX_RESTARTS_PER_MINUTE` times in 60 s). While no worker
is live, jobs wait in the pool. Slots, restarts, readers and process starts are the supervisor's
(mmserve/supervisor/): the same as the replicas'.

Each worker's result queue is read by a thread of the pool's (an `OutboxReader`): taking a tensor off
a torch queue is a socket handshake with the sending process for its file descriptor, and a busy
worker answers only when it gets its GIL (an idle worker at once, one running Python many times
later). The readers only hand arrivals to `poll` through a thread-safe queue, so
`poll` never waits on a worker; everything else happens on the caller's one thread.

Queues are per worker generation so that a worker killed mid-send can only spoil its own queues
(and their cross-process locks). An output whose worker died before its memory was fetched is lost
with the worker; its item is still held and is encoded again elsewhere. The first outcome to arrive
for a held key is the one returned, whichever worker sent it.

By default an output is copied out of shared memory on arrival: the engine's encoder cache keeps
outputs for long, and a shared-memory tensor holds an open file descriptor and /dev/shm space for
as long as it lives. `keep_shared_outputs=True` hands over the shared tensors as they arrive.

What it does not know: requests, scheduling, budgets, what a payload holds, whether an output has
the right shape (the runner validates before committing).
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.runner.encoder.pool import ItemOutcome, PoolStats
from mmserve.runner.encoder.runner import EncodeJob
from mmserve.supervisor.launch import ProcessLauncher
from mmserve.supervisor.reader import OutboxReader
from mmserve.supervisor.restarts import RestartPolicy
from mmserve.supervisor.slot import ChildSlot
from mmserve.workers.process_worker import (
    ItemDone,
    ItemFailed,
    JobMessage,
    ReadyMessage,
    StartFailed,
    StopMessage,
    to_shared,
    worker_main,
)
from mmserve.workers.spec import WORKER_RESTART_POLICY, WorkerSpec

logger = logging.getLogger("mmserve.process_pool")

STOP_WAIT_S = 5.0  # shutdown lets a worker finish its batch this long before terminating it
KILL_WAIT_S = 2.0  # after SIGTERM, then after SIGKILL
READER_WAKE_S = 0.1  # how often a result reader looks whether it should stop
READY_CHECK_S = 0.02  # wait_ready's sleep between looks

# a worker slot's own book: the keys queued to or being encoded by its worker
_Slot = ChildSlot[set[str]]


@dataclass(frozen=True)
class _Arrival:
    slot: int
    generation: int
    message: Any  # ReadyMessage | StartFailed | ItemDone | ItemFailed
    arrived_s: float  # time.monotonic() when the reader had it


@dataclass
class _Held:
    """A job the pool holds until its outcome is polled."""

    job: EncodeJob
    wire_payload: Any  # the payload with its arrays in shared memory: made once, resent on redispatch
    submitted_s: float  # time.monotonic() at submit
    slot: int | None = None  # the worker slot holding it; None while it waits for a live worker


class ProcessEncoderPool:
    """Not thread-safe: call it from one thread (the engine's step loop)."""

    def __init__(self, spec: WorkerSpec, num_workers: int, keep_shared_outputs: bool = False,
                 restart_policy: RestartPolicy = WORKER_RESTART_POLICY) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        # daemon: should this process exit without shutdown(), multiprocessing still ends the workers
        self._launcher = ProcessLauncher(worker_main, "mmserve-encoder", daemon=True)
        self._spec = spec
        self._keep_shared_outputs = keep_shared_outputs
        self._policy = restart_policy
        self._stop = self._launcher.shared_flag()  # lock-free: see worker_main
        self._slots = [_Slot(i, set()) for i in range(num_workers)]
        self._inbox: queue.SimpleQueue[_Arrival] = queue.SimpleQueue()  # filled by the readers
        self._retired: list[OutboxReader] = []  # readers of dead workers, finishing on their own
        self._held: dict[str, _Held] = {}  # key -> job, in submit order, until its outcome is polled
        self._arrived: list[ItemOutcome] = []  # taken from the inbox, not yet returned by poll
        self._items_redispatched = 0
        self._no_worker_since_s: float | None = None
        self._closed = False
        for slot in self._slots:
            self._start(slot)

    # ---- EncoderPool ------------------------------------------------------------------------
    def submit(self, jobs: Sequence[EncodeJob]) -> None:
        if self._closed:
            raise RuntimeError("the encoder pool is shut down")
        repeated, seen = [], set()
        for job in jobs:
            if job.key in self._held or job.key in seen:
                repeated.append(job.key[:12])
            seen.add(job.key)
        if repeated:  # the engine never sends a key twice while it is in flight (EncoderPool's contract)
            raise ValueError(f"items already in the encoder pool: {repeated}")
        now = time.monotonic()
        for job in jobs:
            held = _Held(job, to_shared(job.payload), now)
            self._held[job.key] = held
            self._dispatch(held)

    def poll(self) -> list[ItemOutcome]:
        if self._closed:
            return []
        self._drain()
        self._tend()
        arrived, self._arrived = self._arrived, []
        return arrived

    def stats(self) -> PoolStats:
        alive = sum(s.handle is not None and s.handle.is_alive() for s in self._slots)
        restarts = sum(s.restarts.num_restarts for s in self._slots)
        return PoolStats(workers_alive=alive, worker_restarts=restarts,
                         items_redispatched=self._items_redispatched, items_in_flight=len(self._held))

    def seconds_without_workers(self) -> float:
        """Seconds since the pool last had a live worker and could not start one: the clock starts
        when every worker is dead and no slot may restart; a restarted worker stops it only once its
        encoder is built (one that dies while loading does not reset it). 0 after shutdown."""
        if self._closed:
            return 0.0
        self._drain()
        self._tend()
        return 0.0 if self._no_worker_since_s is None else time.monotonic() - self._no_worker_since_s

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.value = True
        live = [s for s in self._slots if s.handle is not None]
        for slot in live:
            if slot.ready:
                slot.inbox.put(StopMessage())  # wakes a worker blocked on its queue
            else:
                slot.handle.terminate()  # still loading its model: nothing to finish, no need to wait
        deadline_s = time.monotonic() + STOP_WAIT_S
        for slot in live:
            slot.handle.join(max(0.0, deadline_s - time.monotonic()))
        for stopper in ("terminate", "kill"):
            stragglers = [s for s in live if s.handle.is_alive()]
            for slot in stragglers:
                logger.warning("encoder worker %d did not stop; sending %s", slot.index, stopper)
                getattr(slot.handle, stopper)()
            for slot in stragglers:
                slot.handle.join(KILL_WAIT_S)
        for slot in live:
            self._close_slot(slot)
        for reader in self._retired:
            reader.join(READER_WAKE_S * 10)
        self._retired.clear()
        self._held.clear()
        self._arrived.clear()

    # ---- extras (tests, logs) ---------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> bool:
        """Block until every slot's worker has built its encoder (True) or timeout_s passed (False).
        Outcomes that arrive meanwhile are kept for the next poll."""
        deadline_s = time.monotonic() + timeout_s
        while not self._closed:
            self._drain()
            self._tend()
            if all(s.handle is not None and s.ready for s in self._slots):
                return True
            if time.monotonic() >= deadline_s:
                return False
            time.sleep(READY_CHECK_S)
        return False

    def worker_pids(self) -> dict[int, int]:
        """Slot -> process id of its current worker (started, not necessarily ready)."""
        return {s.index: s.handle.pid for s in self._slots if s.handle is not None}

    def __enter__(self) -> ProcessEncoderPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ---- workers ----------------------------------------------------------------------------
    def _start(self, slot: _Slot) -> None:
        generation = slot.next_generation()
        try:
            slot.handle, slot.inbox, results = self._launcher.start(self._spec, generation, os.getpid(), self._stop,
                                                                    name=f"mmserve-encoder-{slot.index}")
        except OSError as exc:  # out of processes or memory: the slot counts as dead and retries later
            logger.error("could not start encoder worker %d: %s", slot.index, exc)
            return
        copy_outputs = not self._keep_shared_outputs

        def deliver(message: Any) -> bool:
            if copy_outputs and isinstance(message, ItemDone):
                message = ItemDone(message.key, message.output.clone())  # frees the segment and its fd
            self._inbox.put(_Arrival(slot.index, generation, message, time.monotonic()))
            return True

        # the pool watches its workers itself (_tend): the reader only reads, until stopped
        slot.reader = OutboxReader(f"mmserve-encoder-{slot.index}-results", results, deliver, READER_WAKE_S,
                                   close_outbox=True)

    def _tend(self) -> None:
        """Bury dead workers, restart their slots if allowed, place waiting jobs, note liveness."""
        now = time.monotonic()
        for slot in self._slots:
            if slot.handle is not None and not slot.handle.is_alive():
                self._bury(slot)
        for slot in self._slots:
            if slot.handle is None and not self._closed and slot.due_for_restart(self._policy, now):
                self._start(slot)
        for held in [h for h in self._held.values() if h.slot is None]:  # oldest first
            self._dispatch(held)
        alive = [s for s in self._slots if s.handle is not None]
        if any(s.ready for s in alive):
            self._no_worker_since_s = None
        elif not alive and self._no_worker_since_s is None:
            self._no_worker_since_s = now
        self._retired = [r for r in self._retired if r.is_alive()]

    def _bury(self, slot: _Slot) -> None:
        orphans = [self._held[k] for k in slot.state if k in self._held]
        logger.warning("encoder worker %d (generation %d, pid %s) died with exit code %s; %d in-flight "
                       "items go to other workers", slot.index, slot.generation, slot.handle.pid,
                       slot.handle.exitcode, len(orphans))
        for held in orphans:
            held.slot = None
        self._items_redispatched += len(orphans)
        slot.state.clear()
        self._close_slot(slot)

    def _close_slot(self, slot: _Slot) -> None:
        if slot.inbox is not None:
            slot.inbox.cancel_join_thread()  # its reader is gone: never wait to flush jobs to it
            slot.inbox.close()
        if slot.reader is not None:
            # it still delivers what it has read (a dead worker's errors, outputs already fetched)
            slot.reader.stop()
            self._retired.append(slot.reader)
        if slot.handle is not None:
            try:
                slot.handle.close()  # frees its sentinel; refuses (ValueError) if it still runs
            except ValueError:
                logger.error("encoder worker %d (pid %s) outlived SIGKILL", slot.index, slot.handle.pid)
        slot.handle = slot.inbox = slot.reader = None
        slot.ready = False

    # ---- jobs and results -------------------------------------------------------------------
    def _dispatch(self, held: _Held) -> None:
        live = [s for s in self._slots if s.handle is not None]
        if not live:
            held.slot = None  # waits for a worker; _tend places it
            return
        slot = min(live, key=lambda s: (len(s.state), s.index))
        held.slot = slot.index
        slot.state.add(held.job.key)
        slot.inbox.put(JobMessage(held.job.key, held.wire_payload))  # buffered: a feeder thread sends it

    def _drain(self) -> None:
        while True:
            try:
                arrival = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._receive(arrival)

    def _receive(self, arrival: _Arrival) -> None:
        slot, message = self._slots[arrival.slot], arrival.message
        if isinstance(message, ReadyMessage):
            if arrival.generation == slot.generation:  # not a late word from a worker since replaced
                slot.ready = True
        elif isinstance(message, StartFailed):
            logger.warning("encoder worker %d (generation %d) could not start: %s", slot.index,
                           arrival.generation, message.error)
        elif isinstance(message, (ItemDone, ItemFailed)):
            held = self._held.pop(message.key, None)
            if held is None:
                return  # already returned: an item redispatched after its first worker's output left
            if held.slot is not None:
                self._slots[held.slot].state.discard(message.key)
            output = message.output if isinstance(message, ItemDone) else None
            error = message.error if isinstance(message, ItemFailed) else None
            self._arrived.append(ItemOutcome(message.key, output, error, slot.index,
                                             arrival.arrived_s - held.submitted_s))

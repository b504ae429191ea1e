"""The `process` encoder backend: encoder workers as local processes, tensors through shared memory.

Role: `ProcessEncoderPool` implements `EncoderPool` with `num_workers` processes started by the
spawn start method (never fork: the engine's process has torch threads). Each worker has its own
job queue and result queue (torch.multiprocessing queues, so tensors travel as shared-memory
handles; `process_worker` holds the worker's loop and the wire format). `submit` moves a payload's
arrays into shared memory once and queues the job on the live worker with the fewest items in
flight; a worker still loading its model simply finds the jobs queued. `poll` returns what has
arrived, then tends the workers: a dead one's in-flight items go to the others, and its slot gets
a new worker (a new generation, with new queues) unless it restarted `MAX_RESTARTS_PER_MINUTE`
times in the last 60 s. While no worker is live, jobs wait in the pool.

Each worker's result queue is read by a thread of the pool's (`_ResultReader`): taking a tensor off
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

import ctypes
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.multiprocessing as mp

from mmserve.runner.encoder.pool import ItemOutcome, PoolStats
from mmserve.runner.encoder.runner import EncodeJob
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
from mmserve.workers.spec import MAX_RESTARTS_PER_MINUTE, WorkerSpec

logger = logging.getLogger("mmserve.process_pool")

RESTART_WINDOW_S = 60.0
STOP_WAIT_S = 5.0  # shutdown lets a worker finish its batch this long before terminating it
KILL_WAIT_S = 2.0  # after SIGTERM, then after SIGKILL
READER_WAKE_S = 0.1  # how often a result reader looks whether it should stop
READY_CHECK_S = 0.02  # wait_ready's sleep between looks


@dataclass(frozen=True)
class _Arrival:
    slot: int
    generation: int
    message: Any  # ReadyMessage | StartFailed | ItemDone | ItemFailed
    arrived_s: float  # time.monotonic() when the reader had it


class _ResultReader:
    """A thread reading one worker generation's result queue into the pool's inbox. It owns the
    queue: only it closes it, after it stopped reading (closing under a reader could hand it a
    reused file descriptor)."""

    def __init__(self, slot: int, generation: int, results: Any, inbox: queue.SimpleQueue,
                 copy_outputs: bool) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(slot, generation, results, inbox, copy_outputs),
                                        name=f"mmserve-encoder-{slot}-results", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self, slot: int, generation: int, results: Any, inbox: queue.SimpleQueue,
             copy_outputs: bool) -> None:
        try:
            while not self._stop.is_set():
                try:
                    message = results.get(timeout=READER_WAKE_S)
                except queue.Empty:
                    continue
                except Exception as exc:  # noqa: BLE001 - the thread must outlive one bad message
                    # typically an output whose worker died before its memory was fetched
                    logger.debug("unreadable message from encoder worker %d: %s", slot, exc)
                    self._stop.wait(0.001)  # should the error repeat, never spin
                    continue
                if copy_outputs and isinstance(message, ItemDone):
                    message = ItemDone(message.key, message.output.clone())  # frees the segment and its fd
                inbox.put(_Arrival(slot, generation, message, time.monotonic()))
        finally:
            results.close()


@dataclass
class _Held:
    """A job the pool holds until its outcome is polled."""

    job: EncodeJob
    wire_payload: Any  # the payload with its arrays in shared memory: made once, resent on redispatch
    submitted_s: float  # time.monotonic() at submit
    slot: int | None = None  # the worker slot holding it; None while it waits for a live worker


@dataclass
class _Slot:
    index: int
    generation: int = -1
    process: Any = None  # this generation's process; None while the slot has no live worker
    jobs: Any = None  # this generation's job queue, dropped with it
    reader: _ResultReader | None = None
    ready: bool = False  # its encoder is built
    in_flight: set[str] = field(default_factory=set)  # keys queued to or being encoded by it
    restarts_s: deque[float] = field(default_factory=deque)  # monotonic times of recent restarts


class ProcessEncoderPool:
    """Not thread-safe: call it from one thread (the engine's step loop)."""

    def __init__(self, spec: WorkerSpec, num_workers: int, keep_shared_outputs: bool = False) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self._ctx = mp.get_context("spawn")
        self._spec = spec
        self._keep_shared_outputs = keep_shared_outputs
        self._stop = self._ctx.RawValue(ctypes.c_bool, False)  # lock-free: see worker_main
        self._slots = [_Slot(i) for i in range(num_workers)]
        self._inbox: queue.SimpleQueue[_Arrival] = queue.SimpleQueue()  # filled by the readers
        self._retired: list[_ResultReader] = []  # readers of dead workers, finishing on their own
        self._held: dict[str, _Held] = {}  # key -> job, in submit order, until its outcome is polled
        self._arrived: list[ItemOutcome] = []  # taken from the inbox, not yet returned by poll
        self._worker_restarts = 0
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
        alive = sum(s.process is not None and s.process.is_alive() for s in self._slots)
        return PoolStats(workers_alive=alive, worker_restarts=self._worker_restarts,
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
        live = [s for s in self._slots if s.process is not None]
        for slot in live:
            if slot.ready:
                slot.jobs.put(StopMessage())  # wakes a worker blocked on its queue
            else:
                slot.process.terminate()  # still loading its model: nothing to finish, no need to wait
        deadline_s = time.monotonic() + STOP_WAIT_S
        for slot in live:
            slot.process.join(max(0.0, deadline_s - time.monotonic()))
        for stopper in ("terminate", "kill"):
            stragglers = [s for s in live if s.process.is_alive()]
            for slot in stragglers:
                logger.warning("encoder worker %d did not stop; sending %s", slot.index, stopper)
                getattr(slot.process, stopper)()
            for slot in stragglers:
                slot.process.join(KILL_WAIT_S)
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
            if all(s.process is not None and s.ready for s in self._slots):
                return True
            if time.monotonic() >= deadline_s:
                return False
            time.sleep(READY_CHECK_S)
        return False

    def worker_pids(self) -> dict[int, int]:
        """Slot -> process id of its current worker (started, not necessarily ready)."""
        return {s.index: s.process.pid for s in self._slots if s.process is not None}

    def __enter__(self) -> ProcessEncoderPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ---- workers ----------------------------------------------------------------------------
    def _start(self, slot: _Slot) -> None:
        slot.generation += 1
        slot.ready = False
        slot.jobs, results = self._ctx.Queue(), self._ctx.Queue()
        # daemon: should this process exit without shutdown(), multiprocessing still ends the worker
        slot.process = self._ctx.Process(
            target=worker_main, name=f"mmserve-encoder-{slot.index}", daemon=True,
            args=(self._spec, slot.generation, os.getpid(), slot.jobs, results, self._stop))
        try:
            slot.process.start()
        except OSError as exc:  # out of processes or memory: the slot counts as dead and retries later
            logger.error("could not start encoder worker %d: %s", slot.index, exc)
            slot.process = None  # never started: nothing to close
            results.close()
            self._close_slot(slot)
            return
        slot.reader = _ResultReader(slot.index, slot.generation, results, self._inbox,
                                    copy_outputs=not self._keep_shared_outputs)

    def _tend(self) -> None:
        """Bury dead workers, restart their slots if allowed, place waiting jobs, note liveness."""
        now = time.monotonic()
        for slot in self._slots:
            if slot.process is not None and not slot.process.is_alive():
                self._bury(slot)
        for slot in self._slots:
            if slot.process is None and self._may_restart(slot, now):
                slot.restarts_s.append(now)
                self._worker_restarts += 1
                self._start(slot)
        for held in [h for h in self._held.values() if h.slot is None]:  # oldest first
            self._dispatch(held)
        alive = [s for s in self._slots if s.process is not None]
        if any(s.ready for s in alive):
            self._no_worker_since_s = None
        elif not alive and self._no_worker_since_s is None:
            self._no_worker_since_s = now
        self._retired = [r for r in self._retired if r.is_alive()]

    def _bury(self, slot: _Slot) -> None:
        orphans = [self._held[k] for k in slot.in_flight if k in self._held]
        logger.warning("encoder worker %d (generation %d, pid %s) died with exit code %s; %d in-flight "
                       "items go to other workers", slot.index, slot.generation, slot.process.pid,
                       slot.process.exitcode, len(orphans))
        for held in orphans:
            held.slot = None
        self._items_redispatched += len(orphans)
        slot.in_flight.clear()
        self._close_slot(slot)

    @staticmethod
    def _may_restart(slot: _Slot, now: float) -> bool:
        while slot.restarts_s and now - slot.restarts_s[0] >= RESTART_WINDOW_S:
            slot.restarts_s.popleft()
        return len(slot.restarts_s) < MAX_RESTARTS_PER_MINUTE

    def _close_slot(self, slot: _Slot) -> None:
        if slot.jobs is not None:
            slot.jobs.cancel_join_thread()  # its reader is gone: never wait to flush jobs to it
            slot.jobs.close()
        if slot.reader is not None:
            # it still delivers what it has read (a dead worker's errors, outputs already fetched)
            slot.reader.stop()
            self._retired.append(slot.reader)
        if slot.process is not None:
            try:
                slot.process.close()  # frees its sentinel; refuses (ValueError) if it still runs
            except ValueError:
                logger.error("encoder worker %d (pid %s) outlived SIGKILL", slot.index, slot.process.pid)
        slot.process = slot.jobs = slot.reader = None
        slot.ready = False

    # ---- jobs and results -------------------------------------------------------------------
    def _dispatch(self, held: _Held) -> None:
        live = [s for s in self._slots if s.process is not None]
        if not live:
            held.slot = None  # waits for a worker; _tend places it
            return
        slot = min(live, key=lambda s: (len(s.in_flight), s.index))
        held.slot = slot.index
        slot.in_flight.add(held.job.key)
        slot.jobs.put(JobMessage(held.job.key, held.wire_payload))  # buffered: a feeder thread sends it

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
                self._slots[held.slot].in_flight.discard(message.key)
            output = message.output if isinstance(message, ItemDone) else None
            error = message.error if isinstance(message, ItemFailed) else None
            self._arrived.append(ItemOutcome(message.key, output, error, slot.index,
                                             arrival.arrived_s - held.submitted_s))

"""The `ray` encoder backend: encoder workers as Ray actors, payloads and outputs in the object store.

Role: `RayEncoderPool` implements `EncoderPool` on a Ray cluster. Each worker slot holds one actor
(placed by Ray's scheduler with `num_cpus_per_worker` / `num_gpus_per_worker`) that builds its
encoder once with `build_encoder`. `submit` puts each payload in the object store and sends small
batches to the least loaded live actor; `poll` collects the batches that finished without waiting.
When an actor dies, its in-flight items go to another live actor and its slot gets a new actor as
its `RestartPolicy` allows (by default `WORKER_RESTART_POLICY`: at once, at most
`MAX_RESTARTS_PER_MINUTE` per slot per 60 s); jobs wait while no actor is live. Slots, restarts and
Ray's start are the supervisor's (mmserve/supervisor/), the same as the replicas'.

Ray is joined when `ray_address` is given, used as is when this process already initialised it, and
otherwise started locally; only a Ray the pool initialised is shut down with it. Ray is an optional
extra, imported when a pool is built. On a cluster, every node needs mmserve installed and the
checkpoint at `spec.model_dir`.

Use from one thread (the engine's step loop); nothing here is locked.

What it does not know: requests, scheduling, budgets, what a payload holds, whether an output has
the right shape (the runner validates before committing).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmserve.runner.encoder.pool import ItemOutcome, PoolStats
from mmserve.runner.encoder.runner import EncodeJob
from mmserve.supervisor.ray_support import init_ray, summary
from mmserve.supervisor.restarts import RestartPolicy
from mmserve.supervisor.slot import ChildSlot
from mmserve.workers.spec import WORKER_RESTART_POLICY, WorkerSpec, build_encoder

logger = logging.getLogger("mmserve.ray_pool")

# Small batches: an actor runs its batches in order, so several small ones spread over the actors
# and arrive one by one; a batch that raises fails only its own items.
MAX_ITEMS_PER_BATCH = 4
SHUTDOWN_WAIT_S = 10.0  # how long shutdown waits to see its killed actors reported dead


@dataclass(frozen=True)
class _WireTensor:
    """A tensor as raw bytes: numpy has no bfloat16, and a numpy array crosses the object store
    without a pickle copy."""

    data: np.ndarray  # uint8, the tensor's bytes in C order
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, "float32", "bfloat16", ...

    @staticmethod
    def of(tensor: torch.Tensor) -> _WireTensor:
        t = tensor.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return _WireTensor(raw, tuple(t.shape), str(t.dtype).removeprefix("torch."))

    def tensor(self) -> torch.Tensor:
        # a copy: a zero-copy view would pin the object store's shared memory for as long as the
        # engine's encoder cache keeps the output, outside the bytes that cache accounts for
        dtype = getattr(torch, self.dtype)
        if self.data.size == 0:  # an empty array's stride cannot be viewed as another dtype
            return torch.empty(self.shape, dtype=dtype)
        raw = torch.from_numpy(np.array(self.data, copy=True))
        return raw.view(dtype).reshape(self.shape)


@dataclass(frozen=True)
class _BatchReply:
    outputs: list[_WireTensor]  # one per payload, in order; empty when error is set
    error: str | None


class _EncoderWorker:
    """The actor's body (made a Ray actor class by the pool): one encoder, built once."""

    def __init__(self, spec: WorkerSpec, first_generation: bool) -> None:
        # the test hook only fires in the slot's first actor, so its replacement encodes the item
        self._die_on_key = spec.die_on_key if first_generation else None
        self._encode = build_encoder(spec)

    def ready(self) -> int:
        return os.getpid()

    def encode(self, keys: list[str], *payloads: Any) -> _BatchReply:
        # payloads are top-level arguments so Ray resolves their object refs before the call
        if self._die_on_key is not None and self._die_on_key in keys:
            os._exit(1)  # a hard death, as a crash or the OOM killer would cause
        try:
            outputs = self._encode(payloads)
        except Exception as exc:  # the batch as a whole failed; the pool reports it per item
            return _BatchReply([], f"{type(exc).__name__}: {exc}")
        return _BatchReply([_WireTensor.of(o) for o in outputs], None)


@dataclass
class _Job:
    key: str
    payload_ref: Any  # ray.ObjectRef of the payload, kept until the outcome is polled
    submitted_s: float  # time.monotonic() at submit


@dataclass
class _Batch:
    jobs: list[_Job]
    slot: int
    generation: int  # the slot's actor generation that runs it


@dataclass
class _ActorBook:
    """A slot's own book (its `ChildSlot.state`); the slot's `handle` is its live actor."""

    ready_ref: Any = None  # the actor's start-up, until it is seen finished
    in_flight_items: int = 0


_Slot = ChildSlot[_ActorBook]


class RayEncoderPool:
    def __init__(self, spec: WorkerSpec, num_workers: int, ray_address: str | None = None,
                 num_cpus_per_worker: float = 1, num_gpus_per_worker: float = 0,
                 restart_policy: RestartPolicy = WORKER_RESTART_POLICY) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self._ray, self._started_ray = ray, _ = init_ray(ray_address, num_workers * num_cpus_per_worker)
        self._spec = spec
        self._policy = restart_policy
        # max_restarts=0: the pool, not Ray, restarts actors, so it can move their items elsewhere
        self._actor_class = ray.remote(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker,
                                       max_restarts=0)(_EncoderWorker)
        self._slots = [_Slot(i, _ActorBook()) for i in range(num_workers)]
        self._batches: dict[Any, _Batch] = {}  # encode task's ObjectRef -> its batch, in submit order
        self._waiting: deque[_Job] = deque()  # jobs no actor holds yet
        self._held_keys: set[str] = set()  # every job submitted whose outcome has not been polled
        self._items_redispatched = 0
        self._no_worker_since_s: float | None = None
        self._closed = False
        for slot in self._slots:
            self._start_actor(slot)

    # ---- EncoderPool ------------------------------------------------------------------------
    def submit(self, jobs: Sequence[EncodeJob]) -> None:
        if self._closed:
            raise RuntimeError("the encoder pool is shut down")
        keys = [job.key for job in jobs]
        repeated = [k[:12] for k in keys if k in self._held_keys]
        if repeated or len(set(keys)) != len(keys):  # the engine never sends a key twice in flight
            raise ValueError(f"items already in the encoder pool: {repeated or 'repeated in one submit'}")
        now = time.monotonic()
        for job in jobs:
            self._waiting.append(_Job(job.key, self._ray.put(job.payload), now))
        self._held_keys.update(keys)
        self._dispatch()

    def poll(self) -> list[ItemOutcome]:
        if self._closed:
            return []
        ray = self._ray
        starting = {s.state.ready_ref: s for s in self._slots if s.state.ready_ref is not None}
        refs = list(self._batches) + list(starting)
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        for ref in ready & starting.keys():
            self._check_started(starting[ref], ref)
        now = time.monotonic()
        outcomes: list[ItemOutcome] = []
        # submit order: a dead actor's batches that finished before it died are read first
        for ref in [r for r in self._batches if r in ready]:
            batch = self._batches.get(ref)
            if batch is not None:  # not already handed on because its actor died
                outcomes.extend(self._collect(ref, batch, now))
        self._held_keys.difference_update(o.key for o in outcomes)
        self._tend(now)
        return outcomes

    def stats(self) -> PoolStats:
        in_flight = sum(len(b.jobs) for b in self._batches.values()) + len(self._waiting)
        return PoolStats(workers_alive=sum(s.handle is not None for s in self._slots),
                         worker_restarts=sum(s.restarts.num_restarts for s in self._slots),
                         items_redispatched=self._items_redispatched, items_in_flight=in_flight)

    def seconds_without_workers(self) -> float:
        """Seconds since every actor was found dead with no slot allowed to restart (as the `process`
        backend): an actor still loading its model does not stop the clock, so a model that can
        never load does not reset it with each retry. 0 after shutdown; updated by poll."""
        if self._closed or self._no_worker_since_s is None:
            return 0.0
        return time.monotonic() - self._no_worker_since_s

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        actors = [s.handle for s in self._slots if s.handle is not None]
        for actor in actors:
            ray.kill(actor, no_restart=True)
        # a call made after the kill fails once Ray has the actor dead: waiting on those is waiting
        # for the workers to be gone
        probes = [a.ready.remote() for a in actors]
        if probes:
            ray.wait(probes, num_returns=len(probes), timeout=SHUTDOWN_WAIT_S)
        for slot in self._slots:
            slot.handle = slot.state.ready_ref = None
        self._batches.clear()
        self._waiting.clear()
        self._held_keys.clear()
        if self._started_ray:
            ray.shutdown()

    # ---- extras (tests, logs) ---------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> bool:
        """Block until every slot's actor has built its encoder (True) or timeout_s passed (False).
        Outcomes are left for the next poll."""
        deadline_s = time.monotonic() + timeout_s
        while not self._closed:
            self._tend(time.monotonic())
            if all(s.handle is not None and s.ready for s in self._slots):
                return True
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                return False
            starting = {s.state.ready_ref: s for s in self._slots if s.state.ready_ref is not None}
            if not starting:  # a slot is dead and may not restart yet
                time.sleep(min(left_s, 0.1))
                continue
            done, _ = self._ray.wait(list(starting), num_returns=1, timeout=left_s)
            for ref in done:
                self._check_started(starting[ref], ref)
        return False

    def worker_pids(self, timeout_s: float = 60.0) -> dict[int, int]:
        """Slot -> process id of its live actor (blocks until they have started; for tests and logs)."""
        live = [s for s in self._slots if s.handle is not None]
        pids = self._ray.get([s.handle.ready.remote() for s in live], timeout=timeout_s)
        return {s.index: pid for s, pid in zip(live, pids)}

    def __enter__(self) -> RayEncoderPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ---- actors -----------------------------------------------------------------------------
    def _start_actor(self, slot: _Slot) -> None:
        slot.handle = self._actor_class.remote(self._spec, slot.next_generation() == 0)
        slot.state.ready_ref = slot.handle.ready.remote()  # also how an actor that cannot start is noticed
        slot.state.in_flight_items = 0

    def _check_started(self, slot: _Slot, ref: Any) -> None:
        slot.state.ready_ref = None
        try:
            self._ray.get(ref)
        except self._ray.exceptions.RayActorError as exc:
            self._actor_died(slot, exc)
        else:
            slot.ready = True

    def _actor_died(self, slot: _Slot, exc: BaseException) -> None:
        """Hand the actor's in-flight items to the waiting queue (at its front: they are the oldest)."""
        logger.warning("encoder worker %d (generation %d) died: %s", slot.index, slot.generation,
                       summary(exc))
        self._ray.kill(slot.handle, no_restart=True)  # if it is only unreachable, make sure it is gone
        orphans = [ref for ref, b in self._batches.items()
                   if b.slot == slot.index and b.generation == slot.generation]
        jobs = [job for ref in orphans for job in self._batches.pop(ref).jobs]
        self._items_redispatched += len(jobs)
        self._waiting.extendleft(reversed(jobs))
        slot.handle = slot.state.ready_ref = None
        slot.ready = False
        slot.state.in_flight_items = 0

    def _tend(self, now: float) -> None:
        """Restart dead slots if allowed, place waiting jobs, note liveness."""
        self._restart_dead_slots(now)
        self._dispatch()
        self._note_liveness(now)

    def _restart_dead_slots(self, now: float) -> None:
        for slot in self._slots:
            if slot.handle is None and slot.due_for_restart(self._policy, now):
                self._start_actor(slot)

    def _note_liveness(self, now: float) -> None:
        if any(s.handle is not None and s.ready for s in self._slots):
            self._no_worker_since_s = None  # an actor with its encoder built
        elif all(s.handle is None for s in self._slots) and self._no_worker_since_s is None:
            self._no_worker_since_s = now

    # ---- batches ----------------------------------------------------------------------------
    def _dispatch(self) -> None:
        live = [s for s in self._slots if s.handle is not None]
        if not live or not self._waiting:
            return
        batch_items = min(MAX_ITEMS_PER_BATCH, math.ceil(len(self._waiting) / len(live)))
        while self._waiting:
            jobs = [self._waiting.popleft() for _ in range(min(batch_items, len(self._waiting)))]
            slot = min(live, key=lambda s: (self._load(s), s.index))
            ref = slot.handle.encode.remote([j.key for j in jobs], *[j.payload_ref for j in jobs])
            self._batches[ref] = _Batch(jobs, slot.index, slot.generation)
            slot.state.in_flight_items += len(jobs)

    @staticmethod
    def _load(slot: _Slot) -> int:
        # an actor still loading its model counts as one batch busy: a dead actor's items go to a
        # warm actor with room rather than wait for the replacement, yet at start-up, when every
        # actor is loading, items spread evenly
        return slot.state.in_flight_items + (MAX_ITEMS_PER_BATCH if slot.state.ready_ref is not None else 0)

    def _collect(self, ref: Any, batch: _Batch, now: float) -> list[ItemOutcome]:
        slot = self._slots[batch.slot]
        try:
            reply: _BatchReply = self._ray.get(ref)
        except self._ray.exceptions.RayActorError as exc:
            self._actor_died(slot, exc)  # takes this batch too
            return []
        except self._ray.exceptions.RayError as exc:  # e.g. a payload that could not be read
            reply = _BatchReply([], f"{type(exc).__name__}: {summary(exc)}")
        del self._batches[ref]
        slot.state.in_flight_items -= len(batch.jobs)
        if reply.error is None and len(reply.outputs) != len(batch.jobs):
            reply = _BatchReply([], f"encoder returned {len(reply.outputs)} outputs for "
                                    f"{len(batch.jobs)} items")
        if reply.error is not None:
            return [ItemOutcome(j.key, None, reply.error, batch.slot, now - j.submitted_s)
                    for j in batch.jobs]
        return [ItemOutcome(j.key, out.tensor(), None, batch.slot, now - j.submitted_s)
                for j, out in zip(batch.jobs, reply.outputs)]

"""The boundary to encoder workers: items go out, (streams, rows, width) outputs come back, later.

Role: an `EncoderPool` takes `EncodeJob`s without waiting (`submit`) and hands back whatever has
arrived (`poll`), per item: its output tensor or why it failed. A pool owns its workers' lives:
it notices a worker that died, gives that worker's in-flight items to another one, restarts it
(a bounded number of times per minute), and says how long it has had no live worker. Two
backends implement it, in `workers/`: `process` (local processes, tensors through shared memory)
and `ray` (Ray actors, the object store).

Validation and commit stay with the runner (`EncoderRunner.commit`), exactly as for
inline encoding; the engine's encoder cache stays the one place an output lives, so a pool never
sees a key twice while it is in flight or cached.

What it does not know: requests, scheduling, budgets, what a payload holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mmserve.runner.encoder.runner import EncodeJob


@dataclass(frozen=True)
class ItemOutcome:
    """One item back from a worker: its output or why it failed."""

    key: str
    output: torch.Tensor | None  # (streams, rows, width), on the CPU
    error: str | None
    worker: int  # the worker slot that encoded it
    latency_s: float  # submit to arrival


@dataclass(frozen=True)
class PoolStats:
    workers_alive: int
    worker_restarts: int  # over the pool's life
    items_redispatched: int  # in-flight items given to another worker after theirs died
    items_in_flight: int


class EncoderPool(Protocol):
    def submit(self, jobs: Sequence[EncodeJob]) -> None:
        """Hand items to the workers; returns at once. The pool keeps each job until its outcome is
        polled (a worker that dies mid-item does not lose it)."""
        ...

    def poll(self) -> list[ItemOutcome]:
        """The outcomes that arrived since the last poll; returns at once. Also where dead workers are
        noticed, their items redispatched and the workers restarted."""
        ...

    def stats(self) -> PoolStats: ...

    def seconds_without_workers(self) -> float:
        """How long the pool has had no live worker and could not start one (0 while one is alive)."""
        ...

    def shutdown(self) -> None:
        """Stop every worker and wait for them; the pool takes no more work."""
        ...

"""Encoding on workers, seen from the runner: submit this step's items, commit what has arrived.

Role: hand each step's `EncodeJob`s to an `EncoderPool` without waiting, and each step collect
the outcomes that arrived, validate and commit them through the `EncoderRunner` (the same checks
as inline encoding). Keys freed by the scheduler while in flight are not committed when they
arrive; a key still in flight is not sent twice. When the pool has had no live worker for
`timeout_s`, every key waiting on it fails with a clear error (only the requests using those
keys fail).

What it does not know: requests, scheduling, what a payload holds, how workers run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mmserve.runner.encoder.pool import EncoderPool, ItemOutcome
from mmserve.runner.encoder.runner import EncodeJob, EncodeResult, EncoderRunner


@dataclass
class AsyncStepResult:
    result: EncodeResult
    in_flight: set[str] = field(default_factory=set)  # keys submitted whose outcome has not arrived
    outcomes: list[ItemOutcome] = field(default_factory=list)  # what arrived (for latency metrics)


class AsyncEncoder:
    def __init__(self, pool: EncoderPool, runner: EncoderRunner, timeout_s: float) -> None:
        self.pool = pool
        self.runner = runner
        self.timeout_s = timeout_s
        self.jobs: dict[str, EncodeJob] = {}  # key -> its job, while wanted and not committed
        self.submitted: set[str] = set()  # keys the pool holds (outcome not yet polled)

    def free(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.jobs.pop(key, None)  # an outcome that arrives later is dropped

    def step(self, jobs: Sequence[EncodeJob]) -> AsyncStepResult:
        fresh = []
        for job in jobs:
            self.jobs[job.key] = job
            if job.key not in self.submitted:
                fresh.append(job)
                self.submitted.add(job.key)
        if fresh:
            self.pool.submit(fresh)
        outcomes = self.pool.poll()
        pairs, result = [], EncodeResult()
        for outcome in outcomes:
            self.submitted.discard(outcome.key)
            job = self.jobs.pop(outcome.key, None)
            if job is None:
                continue  # freed while in flight
            if outcome.error is not None:
                result.failed_keys[outcome.key] = f"encoder worker failed: {outcome.error}"
            else:
                pairs.append((job, outcome.output))
        self.runner.commit(pairs, result)
        waiting = set(self.jobs)
        if waiting and self.pool.seconds_without_workers() > self.timeout_s:
            reason = (f"no encoder worker has been available for {self.timeout_s:g} s "
                      f"(encoder_timeout_s); the item could not be encoded")
            for key in waiting:
                result.failed_keys[key] = reason
                self.jobs.pop(key)
            waiting = set()
        return AsyncStepResult(result, waiting, outcomes)

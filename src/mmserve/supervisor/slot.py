"""The one slot type: a place for one child (a process or an actor), generation after generation.

Role: `ChildSlot` holds what every supervisor of children keeps per slot — the generation (bumped at
each start, so a late word from a replaced child is recognised), the child's handle, its queues and
reader, whether it said it is ready, its pid, its restart history — and `state`, the owner's own book
for the slot (an encoder worker's items in flight, a replica's role and counters).
What it does not know: what the child runs, how it is started, what its messages mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from mmserve.supervisor.reader import OutboxReader
from mmserve.supervisor.restarts import RestartHistory, RestartPolicy

StateT = TypeVar("StateT")


@dataclass
class ChildSlot(Generic[StateT]):
    index: int
    state: StateT
    generation: int = -1  # -1: never started; the first child is generation 0
    handle: Any = None  # this generation's process or actor (or its process-like handle); None: no child
    inbox: Any = None  # this generation's queue to the child
    outbox: Any = None  # this generation's queue from the child
    reader: OutboxReader | None = None
    ready: bool = False  # the child said it is ready (its model is loaded)
    pid: int | None = None
    restarts: RestartHistory = field(default_factory=RestartHistory)
    restart_at_s: float | None = None  # a restart decided: when it is due (monotonic)

    def next_generation(self) -> int:
        """A new child takes the slot: its generation; the last child's readiness and pid are gone."""
        self.generation += 1
        self.ready, self.pid = False, None
        return self.generation

    def due_for_restart(self, policy: RestartPolicy, now_s: float) -> bool:
        """For an owner that tends its slots now and then: whether this empty slot should get a new child
        now (a restart is decided by `policy` once, then due after its back-off; given up, asked again)."""
        if self.restart_at_s is None:
            delay_s = self.restarts.decide(policy, now_s)
            if delay_s is None:
                return False
            self.restart_at_s = now_s + delay_s
        if now_s < self.restart_at_s:
            return False
        self.restart_at_s = None
        return True

"""The books of a hybrid model's per-request recurrent state: one slot per running request (pure Python).

Role: a linear-attention layer (Gated DeltaNet) keeps a fixed-size state per request instead of KV that grows
with the prompt: a short convolution state and a recurrent matrix per head, the same bytes at 10 tokens and at
100k. The runner holds that memory as `num_slots` rows of one tensor per layer; these books say which row
belongs to which request. A slot holds every linear-attention layer's state of its request (the layers are
always used together), so one id per request is enough. The scheduler takes a slot when it admits a request
and gives it back when the request finishes or is preempted (preemption recomputes: the state is rebuilt from
the prompt, as its KV is). Slots are memory inside the one KV budget resolved at start-up (`bytes_per_slot`
says how much each costs); `check_integrity()` says whether every slot is free or owned exactly once.

What it does not know: tensors, layers, devices, prefix snapshots of the state, scheduling policy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StateSlotLayout:
    """What one slot costs (every linear-attention layer's conv and recurrent state of one request), how many
    requests hold one, and how many snapshots of a state the prefix cache keeps (core/state_snapshots.py)."""

    num_slots: int
    bytes_per_slot: int
    num_snapshots: int = 0

    def __post_init__(self) -> None:
        if self.num_slots < 1 or self.bytes_per_slot < 1 or self.num_snapshots < 0:
            raise ValueError(f"a state pool needs at least one slot of at least one byte, got {self}")

    @property
    def total_bytes(self) -> int:
        return (self.num_slots + self.num_snapshots) * self.bytes_per_slot


class StateSlotPool:
    """Slot ids 0 .. num_slots - 1; the lowest free id first (the runner's rows stay dense at low load)."""

    def __init__(self, layout: StateSlotLayout) -> None:
        self.layout = layout
        self._free = list(range(layout.num_slots - 1, -1, -1))  # a stack: pop() gives the lowest id
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def slot_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def can_allocate(self, num_requests: int = 1) -> bool:
        return len(self._free) >= num_requests

    def allocate(self, request_id: str) -> int:
        """The request's slot: a fresh one (its state starts at zero: the runner clears it), or the one it holds."""
        if request_id in self._owner:
            return self._owner[request_id]
        if not self._free:
            raise RuntimeError(f"no free state slot for {request_id!r} ({self.layout.num_slots} in all): "
                               "the scheduler admits only what fits")
        slot = self._free.pop()
        self._owner[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        """Give the request's slot back (nothing if it holds none)."""
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort(reverse=True)

    def owners(self) -> dict[str, int]:
        return dict(self._owner)

    def check_integrity(self, live_request_ids: set[str] | None = None) -> None:
        """Every slot free or owned by exactly one request; with `live_request_ids`, only live requests own
        one (a finished or preempted request that still held a slot would leak it)."""
        owned = list(self._owner.values())
        every = sorted(owned + self._free)
        if every != list(range(self.layout.num_slots)):
            raise AssertionError(f"state slots: {len(owned)} owned + {len(self._free)} free do not partition "
                                 f"0..{self.layout.num_slots - 1} (a slot lost or held twice)")
        if live_request_ids is not None:
            stale = sorted(set(self._owner) - live_request_ids)
            if stale:
                raise AssertionError(f"state slots held by requests that are not running: {stale}")

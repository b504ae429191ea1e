"""A hybrid model's recurrent state at block boundaries, cached beside the prefix blocks (pure Python).

Role: a prefix-cache hit gives a request the KV of its first blocks, but a linear-attention layer also needs
its state at the hit's end, which no block holds. These books keep copies of request states ("snapshots",
rows of the runner's state tensors) keyed by the hash of the block that ends where the state was taken
(the same media-aware block hashes as the KV prefix cache: DESIGN invariant 14). A later request resumes
from the deepest snapshot among its hit blocks and computes the rest; without one, it takes no hit.

Which boundaries are snapshotted (`HybridStates`):
- the end of each prompt's last full block: the prefill chunk that would cross it is cut there
  (`ChunkBoundaryPolicy.snapshot_block_size`), so the state is taken exactly at the boundary (a repeated
  prompt, a sibling choice of n > 1, a shared system prompt); and the end of any other prefill chunk that
  falls on a block boundary (a long prompt's chunks: a later prompt sharing only its start resumes there);
  with `state_snapshot_interval` k, chunks also end at every multiple of k, each snapshotted (a prompt that
  shares any part of an earlier one resumes within k tokens of where they part: more snapshots, shorter
  chunks; benchmarks/engine/hybrid_state.py measures the trade);
- while decoding, every block boundary the request crosses, each replacing the request's previous decode
  snapshot: when it finishes, its deepest boundary stays cached (the next turn of a chat resumes there).
Snapshots are bounded (`max_snapshots`, from the bytes resolved at start), least recently used first out;
a snapshot whose block the KV cache evicts goes with it. A full book takes no new snapshot: fewer
snapshots, never a wrong one.

What it does not know: tensors, layers, which request owns which row of the runner (it hands out ids).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from mmserve.core.kv_cache import KVBlock
from mmserve.core.request import Request
from mmserve.core.state_slots import StateSlotPool


@dataclass
class _Pending:
    snapshot_id: int
    block_hash: bytes
    in_prompt: bool


@dataclass
class SnapshotBook:
    """Snapshot ids 0 .. max_snapshots - 1, each saved under one block hash."""

    max_snapshots: int
    by_hash: OrderedDict[bytes, int] = field(default_factory=OrderedDict)  # LRU: least recent first
    held: set[bytes] = field(default_factory=set)  # hashes a running request's decode chain still points at
    _free: list[int] = field(default_factory=list)
    _pending: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._free = list(range(self.max_snapshots - 1, -1, -1))

    def reserve(self) -> int | None:
        """An id to save a state into: a free one, or the least recently used snapshot's; None when full."""
        if not self._free:
            victim = next((h for h in self.by_hash if h not in self.held), None)
            if victim is None:
                return None
            self._free.append(self.by_hash.pop(victim))
        snapshot_id = self._free.pop()
        self._pending.add(snapshot_id)
        return snapshot_id

    def commit(self, snapshot_id: int, block_hash: bytes) -> None:
        self._pending.discard(snapshot_id)
        old = self.by_hash.pop(block_hash, None)
        if old is not None:  # the same boundary again: the newer copy replaces it (same state)
            self._free.append(old)
        self.by_hash[block_hash] = snapshot_id

    def cancel(self, snapshot_id: int) -> None:
        self._pending.discard(snapshot_id)
        self._free.append(snapshot_id)

    def drop(self, block_hash: bytes) -> None:
        snapshot_id = self.by_hash.pop(block_hash, None)
        if snapshot_id is not None:
            self._free.append(snapshot_id)

    def lookup(self, block_hash: bytes) -> int | None:
        snapshot_id = self.by_hash.get(block_hash)
        if snapshot_id is not None:
            self.by_hash.move_to_end(block_hash)
        return snapshot_id

    def check_integrity(self) -> None:
        every = sorted([*self.by_hash.values(), *self._free, *self._pending])
        if every != list(range(self.max_snapshots)):
            raise AssertionError(f"state snapshots: {len(self.by_hash)} saved + {len(self._pending)} pending + "
                                 f"{len(self._free)} free do not partition 0..{self.max_snapshots - 1}")


class HybridStates:
    """The scheduler's hooks for a hybrid model: a slot per running request, snapshots at block boundaries."""

    def __init__(self, slots: StateSlotPool, max_snapshots: int, block_size: int) -> None:
        self.slots = slots
        self.book = SnapshotBook(max_snapshots) if max_snapshots > 0 else None
        self.block_size = block_size
        self.pending: dict[str, _Pending] = {}  # request id -> the snapshot this step saves
        self.decode_snapshot: dict[str, bytes] = {}  # request id -> the hash of its latest decode snapshot
        self.restores: dict[str, int] = {}  # request id -> the snapshot its admission resumes from

    def usable_hit(self, request: Request, hits: list[KVBlock]) -> tuple[list[KVBlock], int]:
        """The part of a prefix hit a state snapshot covers: up to the deepest hit block with a snapshot."""
        self.restores.pop(request.request_id, None)
        if self.book is not None:
            for depth in range(len(hits), 0, -1):
                snapshot_id = self.book.lookup(request.block_hashes[depth - 1])
                if snapshot_id is not None:
                    self.restores[request.request_id] = snapshot_id
                    return hits[:depth], depth * self.block_size
        return [], 0

    def plan(self, request: Request, start: int, num_new: int) -> int | None:
        """The snapshot id this step saves the request's state into (its chunk ends on a boundary worth one)."""
        end = start + num_new
        if self.book is None or num_new == 0 or end % self.block_size or len(request.block_hashes) < end // self.block_size:
            return None
        in_prompt = end <= request.num_prompt_tokens  # a prefill chunk's end (kept), else a decode's (replaced)
        snapshot_id = self.book.reserve()
        if snapshot_id is not None:
            self.pending[request.request_id] = _Pending(snapshot_id, request.block_hashes[end // self.block_size - 1],
                                                        in_prompt)
        return snapshot_id

    def commit(self, skipped: set[str]) -> None:
        """After the step: the snapshots of the requests it computed are saved, the others' given back."""
        for rid, p in self.pending.items():
            if rid in skipped:
                self.book.cancel(p.snapshot_id)
                continue
            self.book.commit(p.snapshot_id, p.block_hash)
            if not p.in_prompt:  # a decode snapshot replaces the request's previous one
                previous = self.decode_snapshot.pop(rid, None)
                if previous is not None and previous != p.block_hash:
                    self.book.held.discard(previous)
                    self.book.drop(previous)
                self.decode_snapshot[rid] = p.block_hash
                self.book.held.add(p.block_hash)
        self.pending.clear()

    def release(self, request_id: str) -> None:
        """A request finished or was preempted: its slot goes back; its snapshots stay cached."""
        self.slots.free(request_id)
        self.restores.pop(request_id, None)
        held = self.decode_snapshot.pop(request_id, None)
        if held is not None and self.book is not None:
            self.book.held.discard(held)
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            self.book.cancel(pending.snapshot_id)

    def evicted(self, block_hash: bytes) -> None:
        """The KV cache evicted this block: a snapshot saved at its end goes with it."""
        if self.book is not None and block_hash not in self.book.held:
            self.book.drop(block_hash)

    def check_integrity(self, running_ids: set[str]) -> None:
        self.slots.check_integrity(running_ids)
        if self.book is not None:
            self.book.check_integrity()
            if self.pending:
                raise AssertionError(f"state snapshots pending outside a step: {sorted(self.pending)}")

"""Encoder-output cache bookkeeping: bytes, per-request references, lazy LRU eviction.

Role: the scheduler's side of the encoder cache. It knows, per content key, how many bytes the
encoder output takes, which live requests reference it, and whether it is ready, being produced
this step, or missing. Entries no request references stay cached for reuse and are evicted LRU
only when space is needed; evicted keys are handed to the runner, which holds the tensors.

Bytes are accounted when an entry is reserved (before encoding), so the pool never overcommits:
`used_bytes <= capacity_bytes` and `referenced_bytes <= output_budget_bytes` always hold.

What it does not know: tensors, devices, scheduling order.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from mmserve.core.kv_cache import EVICTIONS_KEPT


class EntryState(enum.Enum):
    PENDING = "pending"  # reserved; a producer encodes it this step
    READY = "ready"  # committed by the runner
    MISSING = "missing"  # referenced but not encoded (its producer failed); a consumer will produce it


@dataclass
class CacheEntry:
    key: str
    num_bytes: int
    state: EntryState
    refs: set[str] = field(default_factory=set)
    producer: str | None = None


@dataclass
class EncoderCacheStats:
    hits: int = 0  # an item found ready or already being produced
    misses: int = 0  # an item that had to be encoded
    evictions: int = 0


class EncoderCacheManager:
    def __init__(self, capacity_bytes: int, output_budget_bytes: int) -> None:
        if output_budget_bytes > capacity_bytes:
            raise ValueError("the output budget must fit in the cache pool")
        self.capacity_bytes = capacity_bytes
        self.output_budget_bytes = output_budget_bytes
        self.entries: dict[str, CacheEntry] = {}
        self.reusable: OrderedDict[str, None] = OrderedDict()  # zero-ref READY keys, oldest first
        self.used_bytes = 0
        self.referenced_bytes = 0
        self.stats = EncoderCacheStats()
        self._freed: list[str] = []
        # keys evicted since the last take_evicted(), newest last (a router forgets them); bounded
        self._evicted: deque[str] = deque(maxlen=EVICTIONS_KEPT)

    # ---- queries --------------------------------------------------------------------------------
    def state(self, key: str) -> EntryState | None:
        entry = self.entries.get(key)
        return entry.state if entry else None

    def holds(self, request_id: str, key: str) -> bool:
        entry = self.entries.get(key)
        return entry is not None and request_id in entry.refs

    def take_evicted(self) -> tuple[str, ...]:
        """Keys evicted since the last call (at most the latest EVICTIONS_KEPT)."""
        evicted = tuple(self._evicted)
        self._evicted.clear()
        return evicted

    # ---- changes --------------------------------------------------------------------------------
    def reference(self, request_id: str, key: str) -> None:
        """Add a request's reference to an existing entry (a hit)."""
        entry = self.entries[key]
        if request_id in entry.refs:
            return
        if not entry.refs:
            self.referenced_bytes += entry.num_bytes
            self.reusable.pop(key, None)
        entry.refs.add(request_id)
        self.stats.hits += 1

    def reserve_missing(self, request_id: str, key: str, num_bytes: int) -> None:
        """Account a new entry at admission: bytes held, referenced by `request_id`, not encoded yet."""
        self._evict_for(num_bytes)
        self.entries[key] = CacheEntry(key, num_bytes, EntryState.MISSING, {request_id})
        self.used_bytes += num_bytes
        self.referenced_bytes += num_bytes

    def produce(self, request_id: str, key: str) -> None:
        """`request_id` (a holder of the MISSING entry) encodes it this step."""
        entry = self.entries[key]
        entry.state, entry.producer = EntryState.PENDING, request_id
        self.stats.misses += 1

    def _evict_for(self, num_bytes: int) -> None:
        while self.used_bytes + num_bytes > self.capacity_bytes and self.reusable:
            key, _ = self.reusable.popitem(last=False)
            entry = self.entries.pop(key)
            self.used_bytes -= entry.num_bytes
            self.stats.evictions += 1
            self._freed.append(key)
            self._evicted.append(key)
        if self.used_bytes + num_bytes > self.capacity_bytes:
            raise RuntimeError("encoder cache overcommitted: reserved more bytes than the pool can free")

    def commit(self, key: str) -> None:
        """The output is in the runner's store. MISSING too: a worker's output can arrive after its producer
        left (its other users still want it)."""
        entry = self.entries.get(key)
        if entry is not None and entry.state in (EntryState.PENDING, EntryState.MISSING):
            entry.state, entry.producer = EntryState.READY, None

    def fail(self, key: str) -> None:
        """The producer could not encode it: consumers keep their refs, a later step re-produces."""
        entry = self.entries.get(key)
        if entry is not None and entry.state == EntryState.PENDING:
            entry.state, entry.producer = EntryState.MISSING, None

    def users(self, key: str) -> set[str]:
        entry = self.entries.get(key)
        return set(entry.refs) if entry else set()

    def release(self, request_id: str, keys: set[str] | None = None) -> None:
        """Drop the request's references (all of them, or `keys`)."""
        for key in list(keys if keys is not None else self.entries):
            entry = self.entries.get(key)
            if entry is None or request_id not in entry.refs:
                continue
            entry.refs.discard(request_id)
            if entry.producer == request_id:
                entry.state, entry.producer = EntryState.MISSING, None
            if entry.refs:
                continue
            self.referenced_bytes -= entry.num_bytes
            if entry.state == EntryState.READY:
                self.reusable[key] = None  # most recently used goes last
            else:  # nobody wants an unfinished entry
                del self.entries[key]
                self.used_bytes -= entry.num_bytes
                self._freed.append(key)

    @property
    def pending_freed_keys(self) -> tuple[str, ...]:
        """Keys freed since the last step, not yet handed to the runner."""
        return tuple(self._freed)

    def take_freed_keys(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed

    # ---- invariants -----------------------------------------------------------------------------
    def check_integrity(self, live_request_ids: set[str]) -> None:
        used = sum(e.num_bytes for e in self.entries.values())
        referenced = sum(e.num_bytes for e in self.entries.values() if e.refs)
        assert used == self.used_bytes <= self.capacity_bytes, f"encoder cache bytes {used} over budget or miscounted"
        assert referenced == self.referenced_bytes <= self.output_budget_bytes, "referenced bytes miscounted"
        for key, entry in self.entries.items():
            assert entry.refs <= live_request_ids, f"entry {key[:12]} referenced by finished requests"
            assert (not entry.refs) == (key in self.reusable), f"entry {key[:12]} LRU membership wrong"
            assert entry.refs or entry.state == EntryState.READY, f"unreferenced entry {key[:12]} not ready"

"""Per-item encoder scheduling: the policy object beside the scheduler (docs/architecture.md §5).

Role: at admission, reserve the bytes of every item of a request (referencing cached or shared
entries, reserving new ones as MISSING) so an admitted request can always progress, also after
preemption; each
step, pick the MISSING items a prefill chunk reaches under the three step budgets (items, encoder
tokens, output bytes), each item whole, and cut the chunk before the first placeholder row whose
item cannot be encoded this step. Items wholly covered by a KV prefix hit are never encoded.

What it does not know: tensors, KV blocks, token budgets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.core.budget import EncoderBudget
from mmserve.core.encoder_cache import EncoderCacheManager, EntryState
from mmserve.core.request import ItemSpec, Request


@dataclass
class EncoderStep:
    """What this step's encoder batch already holds."""

    num_items: int = 0
    num_tokens: int = 0
    num_bytes: int = 0
    items: dict[str, list[int]] = field(default_factory=dict)  # request id -> item indices to encode


class ItemScheduler:
    def __init__(self, cache: EncoderCacheManager, budget: EncoderBudget, outputs_arrive_later: bool = False) -> None:
        """outputs_arrive_later: items are encoded by workers, so an item dispatched (or in flight) is not
        ready this step: a chunk stops before its first row, as before any item not yet encoded."""
        self.cache = cache
        self.budget = budget
        self.outputs_arrive_later = outputs_arrive_later

    def item_bytes(self, item: ItemSpec) -> int:
        return item.output_rows * self.budget.bytes_per_row

    def _unique_items(self, request: Request, from_token: int) -> dict[str, ItemSpec]:
        """The request's items still to compute, one per content key."""
        out: dict[str, ItemSpec] = {}
        for item in request.items:
            if item.needed_after(from_token) and item.output_rows > 0:
                out.setdefault(item.content_hash, item)
        return out

    def admission_error(self, request: Request) -> str | None:
        """Why the request can never run under the budgets, or None."""
        items = self._unique_items(request, 0)
        total = sum(self.item_bytes(i) for i in items.values())
        if total > self.budget.output_budget_bytes:
            sizes = ", ".join(f"{self.item_bytes(i)}" for i in items.values())
            return (f"request needs {total} bytes of encoder outputs (items: {sizes} bytes) but "
                    f"encoder_output_budget_bytes is {self.budget.output_budget_bytes}")
        too_big = [i for i in items.values() if i.encoder_tokens > self.budget.max_encoder_tokens_per_step]
        if too_big:
            return (f"item of {too_big[0].encoder_tokens} encoder tokens exceeds max_encoder_tokens_per_step="
                    f"{self.budget.max_encoder_tokens_per_step}")
        return None

    def try_reserve(self, request: Request, num_computed: int) -> bool:
        """Reference or reserve every item the request still needs; all or nothing."""
        rid, cache = request.request_id, self.cache
        todo = {k: i for k, i in self._unique_items(request, num_computed).items() if not cache.holds(rid, k)}
        fresh = sum(self.item_bytes(i) for k, i in todo.items() if k not in cache.entries)
        revived = [k for k in todo if k in cache.entries and not cache.entries[k].refs]
        revived_bytes = sum(cache.entries[k].num_bytes for k in revived)
        # entries we are about to reference stop being evictable
        evictable = sum(cache.entries[k].num_bytes for k in cache.reusable if k not in todo)
        if cache.used_bytes - evictable + fresh > cache.capacity_bytes:
            return False
        if cache.referenced_bytes + fresh + revived_bytes > cache.output_budget_bytes:
            return False
        for key in todo:  # reference first, so reserving below cannot evict what we need
            if key in cache.entries:
                cache.reference(rid, key)
        for key, item in todo.items():
            if not cache.holds(rid, key):
                cache.reserve_missing(rid, key, self.item_bytes(item))
        return True

    def waits_for_output(self, request: Request, token: int) -> bool:
        """Does the request's prefill stop at `token` only for an item that workers are encoding?"""
        return self.outputs_arrive_later and any(
            item.reaches(token, token + 1) and self.cache.state(item.content_hash) == EntryState.PENDING
            for item in request.items)

    def plan_chunk(self, request: Request, start: int, end: int, step: EncoderStep) -> int:
        """Schedule the MISSING items tokens [start, end) reach; return the (possibly cut) end."""
        rid = request.request_id
        for item in request.items:
            if not item.reaches(start, end) or item.output_rows == 0:
                continue
            state = self.cache.state(item.content_hash)
            if state == EntryState.READY or (state == EntryState.PENDING and not self.outputs_arrive_later):
                continue
            if state == EntryState.PENDING:  # in flight on a worker
                return max(start, item.needed_from)
            assert state == EntryState.MISSING and self.cache.holds(rid, item.content_hash), (
                f"{rid}: item {item.index} reached without a reservation")
            cost = self.item_bytes(item)
            fits = (step.num_items + 1 <= self.budget.max_items_per_step
                    and step.num_tokens + item.encoder_tokens <= self.budget.max_encoder_tokens_per_step
                    and step.num_bytes + cost <= self.budget.output_budget_bytes)
            if not fits:
                return max(start, item.needed_from)
            self.cache.produce(rid, item.content_hash)
            step.num_items += 1
            step.num_tokens += item.encoder_tokens
            step.num_bytes += cost
            step.items.setdefault(rid, []).append(item.index)
            if self.outputs_arrive_later:
                return max(start, item.needed_from)
        return end

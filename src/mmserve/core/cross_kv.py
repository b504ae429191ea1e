"""The cross-attention KV book: bytes of per-request image K/V, a pool with a budget of its own.

Role: a family that reads images through cross-attention layers (Llama 3.2 Vision) keeps, per running
request, the keys and values of every cross-attention layer over its images' rows. They never grow
with decode, and an image's are as large as thousands of text tokens' self-attention KV, so they are
budgeted: a request takes its bytes when it is admitted (and again when it resumes after a
preemption), waits while they are not free, and gives them back when it finishes, is aborted or is
preempted. A request whose bytes exceed the whole pool is rejected at admission, naming the budget.

What it does not know: tensors (the runner holds them; this book only counts), blocks, items.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.core.request import Request


@dataclass
class CrossKVStats:
    builds_admitted: int = 0  # admissions that took cross-attention KV bytes (resumptions included)


class CrossKVBook:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"cross_kv_cache_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.held: dict[str, int] = {}
        self.stats = CrossKVStats()

    @property
    def used_bytes(self) -> int:
        return sum(self.held.values())

    def admission_error(self, request: Request) -> str | None:
        """Why the request can never run under the budget, or None."""
        if request.cross_kv_bytes > self.capacity_bytes:
            return (f"request needs {request.cross_kv_bytes} bytes of cross-attention KV for its "
                    f"{request.num_mm_items} image(s) but cross_kv_cache_bytes is {self.capacity_bytes}")
        return None

    def try_take(self, request: Request) -> bool:
        """Hold the request's bytes if they are free; True also when it needs none or holds them already."""
        if request.cross_kv_bytes == 0 or request.request_id in self.held:
            return True
        if self.used_bytes + request.cross_kv_bytes > self.capacity_bytes:
            return False
        self.held[request.request_id] = request.cross_kv_bytes
        self.stats.builds_admitted += 1
        return True

    def free(self, request_id: str) -> None:
        self.held.pop(request_id, None)

    def check_integrity(self, holders: set[str]) -> None:
        assert set(self.held) <= holders, f"cross-attention KV held by requests not running: {set(self.held) - holders}"
        assert self.used_bytes <= self.capacity_bytes, "cross-attention KV over its budget"

"""The scheduler's books for prefill/decode hand-offs: requests parked on a prefill replica, requests
receiving their KV on a decode replica (pure Python, no torch).

Role: on the prefill side a request that asked for a hand-off leaves the running batch after its first
token and is *parked*: it holds its KV blocks (already published to the prefix cache) and nothing else —
its encoder references go, the KV has what its images contributed — until the KV is sent or the
request is failed. A bound on parked requests is the prefill side's backpressure: at the bound it admits
no new prompt. On the decode side a transferred request is admitted by KV capacity alone: blocks for
its prompt and first token, its leading full blocks taken from the prefix cache where they are there
(only the others are sent), and it waits, *receiving*, until its KV arrives; then it runs as a request
whose prompt is computed and whose first token is its next input.
What it does not know: tensors, transports, which replica is on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.core.kv_cache import KVCacheManager
from mmserve.core.request import Request, RequestStatus


@dataclass
class HandOffStats:
    requests_parked: int = 0
    requests_handed_off: int = 0
    kv_blocks_sent: int = 0
    requests_received: int = 0
    kv_blocks_received: int = 0  # blocks the decode side took from the other replica
    kv_blocks_deduplicated: int = 0  # blocks it already held (prefix-cache hits): not sent


@dataclass
class HandOffBook:
    max_parked: int  # parked requests the prefill side holds before it admits no new prompt
    parked: dict[str, Request] = field(default_factory=dict)
    receiving: dict[str, Request] = field(default_factory=dict)
    adopted: list[Request] = field(default_factory=list)  # KV arrived: the runner learns of them next step
    stats: HandOffStats = field(default_factory=HandOffStats)

    @property
    def is_full(self) -> bool:
        return len(self.parked) >= self.max_parked

    def park(self, request: Request) -> None:
        request.status = RequestStatus.PARKED
        self.parked[request.request_id] = request
        self.stats.requests_parked += 1

    def handed_off(self, request_id: str, num_blocks: int) -> None:
        self.stats.requests_handed_off += 1
        self.stats.kv_blocks_sent += num_blocks

    def receive(self, request: Request, kv: KVCacheManager) -> list[int] | None:
        """Allocate a transferred request's blocks (prefix-cache hits first); returns the indices of the
        prompt blocks to be sent, or None if they do not fit now (the other side holds them and asks again)."""
        hits, num_hit = kv.get_computed_blocks(request)
        num_prompt_blocks = -(-request.num_prompt_tokens // kv.block_size)
        # its first computation here is the decode after its prompt: a window pool keeps only that one's window
        if kv.allocate_slots(request, request.num_tokens - num_hit, hits,
                             first_query=request.num_prompt_tokens) is None:
            return None
        request.status = RequestStatus.RECEIVING
        request.num_cached_tokens = num_hit
        self.receiving[request.request_id] = request
        self.stats.kv_blocks_deduplicated += len(hits)
        return list(range(len(hits), num_prompt_blocks))

    def received(self, request_id: str, num_blocks: int) -> Request:
        request = self.receiving.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self.adopted.append(request)
        self.stats.requests_received += 1
        self.stats.kv_blocks_received += num_blocks
        return request

    def forget(self, request_id: str) -> None:
        """A request finished (aborted, failed, handed off) while parked or receiving."""
        self.parked.pop(request_id, None)
        self.receiving.pop(request_id, None)
        self.adopted = [r for r in self.adopted if r.request_id != request_id]

    @property
    def holders(self) -> set[str]:
        return set(self.parked) | set(self.receiving)

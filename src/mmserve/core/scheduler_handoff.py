"""The scheduler's hand-off calls (a mixin): P/D's requests that arrive with their KV from a prefill replica.

Role: admit such a request by the blocks it needs (or not yet: backpressure), finish a parked request
whose blocks were sent, and start a received one decoding. The books are the scheduler's own
(core/handoff.py's HandOffBook, the KV cache manager); this only groups the calls.
What it does not know: transfers, connectors, replicas.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from mmserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from mmserve.core.handoff import HandOffBook
    from mmserve.core.kv_cache import KVCacheManager


class HandOffCalls:
    """Mixed into the Scheduler, whose attributes these are."""

    requests: dict[str, Request]
    running: list[Request]
    handoff: HandOffBook
    kv: KVCacheManager
    limits: Any  # core/scheduler.py's SchedulerLimits (its max_num_seqs)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus, error: str | None = None) -> None:
        raise NotImplementedError  # the Scheduler's

    def admit_transferred(self, request: Request) -> list[int] | None:
        """Take a request whose prompt's KV comes from a prefill replica (its first token in `output_token_ids`):
        the indices of the prompt blocks to send, or None while blocks or a sequence slot are not free."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if len(self.running) + len(self.handoff.receiving) >= self.limits.max_num_seqs:
            return None
        needed = self.handoff.receive(request, self.kv)
        if needed is not None:  # its prompt was counted where it was computed
            self.requests[request.request_id] = request
        return needed

    def hand_off_sent(self, request_id: str, num_blocks: int) -> None:
        """A parked request's blocks went to a decode replica: it finishes here (its blocks stay cached)."""
        self.handoff.handed_off(request_id, num_blocks)
        self.finish_requests([request_id], RequestStatus.FINISHED_STOPPED)

    def transfer_done(self, request_id: str, num_blocks: int) -> None:
        """Its KV is in its blocks: it runs from its first token on."""
        request = self.handoff.received(request_id, num_blocks)
        self.running.append(request)
        self.kv.cache_full_blocks(request)

"""The scheduler: one token budget shared by prefill chunks and decodes, FCFS admission,
preemption by recompute.

Role: each step, move every running request's `num_computed_tokens` toward its prompt-plus-output
length under `max_num_batched_tokens` and `max_num_seqs`, then admit waiting requests (with their
prefix-cache hits) while budget and KV blocks last. When KV blocks run out, the newest running
request goes back to waiting and will recompute. A chunk boundary may fall anywhere, also inside
an image's placeholder span.

What it does not know: tensors, pixels, text, stop strings (the engine finishes those).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from mmserve.core.kv_cache import KVBlock, KVCacheManager
from mmserve.core.request import Request, RequestStatus
from mmserve.core.step import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 32768


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    prompt_tokens_computed: int = 0  # prompt tokens actually run through the model
    generation_tokens: int = 0
    encoder_items_scheduled: int = 0


@dataclass
class _StepPlan:
    out: SchedulerOutput = field(default_factory=SchedulerOutput)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager) -> None:
        self.limits = limits
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_since_step: set[str] = set()

    # ---- lifecycle ------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus, error: str | None = None) -> None:
        """Finish requests now (abort, stop string, error); frees their KV blocks."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            self._finish(request, status, error)

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        request.status = status
        request.error = error
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_step.add(request.request_id)
        self.stats.requests_finished += 1

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- schedule -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan()
        budget = self._schedule_running(plan, self.limits.max_num_batched_tokens)
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        plan.out.finished_request_ids = self._finished_since_step | {r.request_id for r in plan.preempted}
        self._finished_since_step = set()
        return plan.out

    def _schedule_running(self, plan: _StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_ids = self.kv.allocate_slots(request, num_new)
            while new_ids is None:
                victim = self.running.pop()
                self._preempt(victim, plan)
                if victim is request:
                    break
                new_ids = self.kv.allocate_slots(request, num_new)
            if new_ids is None:
                break
            plan.out.num_scheduled_tokens[request.request_id] = num_new
            plan.out.cached_requests.append(
                CachedRequestData(request.request_id, tuple(new_ids), request.num_computed_tokens))
            budget -= num_new
            i += 1
        return budget

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted.append(request)

    def _schedule_waiting(self, plan: _StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            request = self.waiting[0]
            hits, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.limits.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if self._admit(request, hits, num_hit, num_new) is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            plan.out.num_scheduled_tokens[request.request_id] = num_new
            plan.out.new_requests.append(self._new_request_data(request, plan))
            budget -= num_new

    def _admit(self, request: Request, hits: list[KVBlock], num_hit: int, num_new: int) -> list[int] | None:
        request.num_computed_tokens = 0
        new_ids = self.kv.allocate_slots(request, num_new, hits)
        if new_ids is None:
            return None
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        if request.num_cached_tokens < 0:  # first admission: count the prompt once
            request.num_cached_tokens = num_hit
            self.stats.prompt_tokens += request.num_prompt_tokens
        return new_ids

    def _new_request_data(self, request: Request, plan: _StepPlan) -> NewRequestData:
        # inline encoding: every item not wholly covered by the KV prefix is encoded now
        todo = tuple(it.index for it in request.items if it.end > request.num_computed_tokens)
        if todo:
            plan.out.encoder_items[request.request_id] = todo
            self.stats.encoder_items_scheduled += len(todo)
        return NewRequestData(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            items=request.items,
            sampling_params=request.sampling_params,
            block_ids=tuple(self.kv.block_ids(request.request_id)),
            num_computed_tokens=request.num_computed_tokens,
            num_output_tokens=len(request.output_token_ids),
        )

    # ---- update ---------------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        for rid, num in sched.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            start = request.num_computed_tokens
            request.num_computed_tokens += num
            self.stats.prompt_tokens_computed += max(0, min(request.num_computed_tokens, request.num_prompt_tokens)
                                                     - start)
            if rid in result.failed:
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_ERROR, result.failed[rid])
                outputs.append(EngineCoreOutput(rid, (), "error", error=result.failed[rid]))
                continue
            token = result.sampled_token_ids.get(rid)
            if token is None:
                self.kv.cache_full_blocks(request)
                continue
            request.output_token_ids.append(token)
            self.stats.generation_tokens += 1
            self.kv.cache_full_blocks(request)
            status = self._check_stop(request, token)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            outputs.append(EngineCoreOutput(rid, (token,), status.finish_reason if status else None,
                                            token if status == RequestStatus.FINISHED_STOPPED else None))
        return outputs

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_out = len(request.output_token_ids)
        if token in request.stop_token_ids and num_out >= params.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if num_out >= params.max_tokens or request.num_tokens >= self.limits.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- invariants -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.kv.check_integrity()
        owners = set(self.kv.req_blocks)
        assert owners <= {r.request_id for r in self.running}, f"blocks held by non-running requests: {owners}"
        for r in self.running:
            held = len(self.kv.req_blocks.get(r.request_id, []))
            assert held * self.kv.block_size >= r.num_computed_tokens, f"{r.request_id} computed past its blocks"
        if not self.requests:
            assert self.kv.num_free_blocks == self.kv.num_blocks, "idle engine holds KV blocks"

"""The scheduler: one token budget for prefill chunks and decodes, FCFS admission, preemption by recompute.

Role: each step, move every running request's `num_computed_tokens` toward its prompt-plus-output
length under `max_num_batched_tokens` and `max_num_seqs`, then admit waiting requests (with their
prefix-cache hits) while budget and KV blocks last. When KV blocks run out, the newest running
request goes back to waiting and will recompute. A chunk boundary may fall anywhere, also inside
an image's placeholder span, unless the family's `ChunkBoundaryPolicy` makes item spans indivisible.
Encoder work is the second surface: at admission a request's items are reserved in the encoder
cache (`ItemScheduler`), and each prefill chunk runs only up to the first placeholder row whose
item is neither ready nor encodable this step. `update` takes any number of sampled tokens per
request: stop ids and `max_tokens` are checked token by token, the surplus dropped. The engine
reads the scheduler only through methods and frozen snapshots (core/snapshots.py).
What it does not know: tensors, pixels, text, stop strings (engine/output_processor.py finishes those).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from mmserve.core import snapshots
from mmserve.core.chunk_policy import ChunkBoundaryPolicy
from mmserve.core.cross_kv import CrossKVBook
from mmserve.core.drafts import DraftPolicy
from mmserve.core.encoder_cache import EntryState
from mmserve.core.encoder_results import apply_encoder_results
from mmserve.core.handoff import HandOffBook
from mmserve.core.invariants import check_scheduler_books
from mmserve.core.item_scheduler import EncoderStep, ItemScheduler
from mmserve.core.kv_cache import KVBlock, KVCacheManager
from mmserve.core.request import Request, RequestStatus
from mmserve.core.scheduler_handoff import HandOffCalls
from mmserve.core.scheduler_views import SchedulerViews
from mmserve.core.state_snapshots import HybridStates
from mmserve.core.step import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from mmserve.core.stops import per_token, stop_status


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 32768


@dataclass
class _StepPlan:
    out: SchedulerOutput = field(default_factory=SchedulerOutput)
    preempted: list[Request] = field(default_factory=list)
    encoder: EncoderStep = field(default_factory=EncoderStep)


class Scheduler(SchedulerViews, HandOffCalls):
    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager, items: ItemScheduler,
                 chunking: ChunkBoundaryPolicy | None = None, cross_kv: CrossKVBook | None = None,
                 states: HybridStates | None = None, drafter: DraftPolicy | None = None) -> None:
        """`cross_kv`: the cross-attention KV budget of a family that cross-attends to its images; `states`: a
        hybrid family's state slots (one per running request) and snapshots (a prefix hit resumes from one)."""
        self.limits = limits
        self.cross_kv = cross_kv
        self.states = states  # told of evicted blocks by `kv.on_evict` (assembly wires it)
        self.drafter = drafter  # speculative decoding's draft tokens (None: one token per decode step)
        self.kv = kv
        self.items = items
        self.chunking = chunking or ChunkBoundaryPolicy()
        self.encoder_cache = items.cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = snapshots.SchedulerStats()
        self._finished_since_step: set[str] = set()
        self.handoff = HandOffBook(max_parked=limits.max_num_seqs)
        self._failed_in_schedule: list[EngineCoreOutput] = []  # reported by the next update

    # ---- lifecycle ------------------------------------------------------------------------------
    def add_request(self, request: Request) -> str | None:
        """Queue a request, or reject it (returns why) if its items can never fit the budgets."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        error = self.items.admission_error(request)
        if error is None and self.cross_kv is not None:
            error = self.cross_kv.admission_error(request)
        if error is not None:
            request.status, request.error = RequestStatus.FINISHED_ERROR, error
            self.stats.requests_rejected += 1
            return error
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return None

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus, error: str | None = None) -> None:
        """Finish requests now (abort, stop string, error); frees their KV blocks."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            self._dequeue(request)
            self._finish(request, status, error)

    def drop_tokens(self, request_id: str, num_tokens: int) -> None:
        """A stop string ended the request before the step's last token: uncount (and drop) the rest."""
        self.stats.generation_tokens -= num_tokens
        request = self.requests.get(request_id)
        if request is not None:
            del request.output_token_ids[-num_tokens:]

    def _dequeue(self, request: Request) -> None:
        for queue in (self.running, self.waiting):
            if request in queue:
                queue.remove(request)

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        request.status, request.error = status, error
        self.handoff.forget(request.request_id)
        self._free_kv(request)
        self.encoder_cache.release(request.request_id)
        del self.requests[request.request_id]
        self._finished_since_step.add(request.request_id)
        self.stats.requests_finished += 1

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def num_schedulable(self) -> int:
        """Requests a step may compute: not parked for a hand-off, not waiting for their KV."""
        return len(self.requests) - len(self.handoff.parked) - len(self.handoff.receiving)

    # ---- schedule -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan()
        adopted, self.handoff.adopted = self.handoff.adopted, []
        plan.out.new_requests.extend(self._new_request_data(r) for r in adopted)  # before any block they get now
        budget = self._schedule_running(plan, self.limits.max_num_batched_tokens)
        if plan.preempted:  # one adopted this step and preempted at once: the runner never sees it
            gone = {r.request_id for r in plan.preempted}
            plan.out.new_requests = [n for n in plan.out.new_requests if n.request_id not in gone]
        else:
            self._schedule_waiting(plan, budget)
        if self.drafter is not None:  # the cutoff counts the batch as admitted (no drafter work it would not use)
            plan.out.propose_drafts = self.drafter.still_proposing(plan.out.propose_drafts, len(self.running))
        plan.out.finished_request_ids = self._finished_since_step | {r.request_id for r in plan.preempted}
        self._finished_since_step = set()
        plan.out.encoder_items = {rid: tuple(idx) for rid, idx in plan.encoder.items.items()}
        plan.out.free_encoder_keys = self.encoder_cache.take_freed_keys()
        self.stats.encoder_items_scheduled += plan.encoder.num_items
        self.stats.encoder_tokens_scheduled += plan.encoder.num_tokens
        return plan.out

    def _schedule_running(self, plan: _StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            num_new = self.chunking.cut(request, start, start + min(request.num_tokens - start, budget)) - start
            drafts = () if self.drafter is None or request.num_tokens - start != 1 else \
                self.drafter.drafts(request, len(self.running))[:budget - 1]
            lookahead = self._lookahead(request, start + num_new, len(self.running))
            num_new += len(drafts)  # a decode verifies its drafts in the same forward
            if num_new == 0:  # its next span does not fit what is left of the budget: next step
                i += 1
                continue
            new_ids = self.kv.allocate_slots(request, num_new + lookahead)
            while new_ids is None:
                victim = self.running.pop()
                self._preempt(victim, plan)  # keeps its encoder references: it resumes first
                if victim is request:
                    break
                new_ids = self.kv.allocate_slots(request, num_new + lookahead)
            if new_ids is None:
                break
            cut = self.items.plan_chunk(request, start, start + num_new, plan.encoder) - start
            if lookahead and cut == num_new:  # not cut short by the encoder budget: it reaches its last token
                plan.out.propose_drafts[request.request_id] = lookahead
            num_new = cut
            # blocks allocated for a cut chunk are used by later chunks; the runner learns of them now
            rid = request.request_id
            plan.out.cached_requests.append(CachedRequestData(rid, tuple(new_ids), request.num_computed_tokens,
                                                              self.kv.last_window_block_ids(rid, len(new_ids))))
            if drafts:
                plan.out.spec_token_ids[request.request_id] = drafts
            if num_new > 0:
                plan.out.num_scheduled_tokens[request.request_id] = num_new
                # where a verification's state ends depends on what it accepts: no snapshot then
                self._plan_snapshot(request, start, 0 if drafts else num_new, plan)
                budget -= num_new
            i += 1
        return budget

    def _lookahead(self, request: Request, end: int, num_running: int) -> int:
        """A draft model proposes after a step that reaches the last token, into slots reserved past it."""
        return 0 if self.drafter is None or end != request.num_tokens else self.drafter.lookahead(request, num_running)

    def _free_kv(self, request: Request, blocks: bool = True) -> None:
        """Free a request's cross-attention KV bytes, and its KV blocks unless `blocks` is False."""
        if blocks:
            self.kv.free(request)
        if self.cross_kv is not None:
            self.cross_kv.free(request.request_id)
        if self.states is not None:
            self.states.release(request.request_id)

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        self._free_kv(request)  # the runner drops the tensors with the request's state; rebuilt on resume
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted.append(request)

    def _waits_for_sibling(self, request: Request) -> bool:
        """A choice of an n > 1 request waits while its sibling's prompt is not computed yet: then it finds
        the prompt's blocks in the prefix cache, and its items in the encoder cache."""
        sibling = self.requests.get(request.prefill_after) if request.prefill_after else None
        return sibling is not None and sibling.num_computed_tokens < sibling.num_prompt_tokens

    def _schedule_waiting(self, plan: _StepPlan, budget: int) -> None:
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.limits.max_num_seqs \
                and not self.handoff.is_full:
            request = self.waiting[i]
            if self._waits_for_sibling(request):
                i += 1  # the requests behind it go first: its sibling is ahead of it and will be computed
                continue
            # prompt logprobs need every prompt position computed: no prefix-cache hit for such a request
            hits, num_hit = ([], 0) if request.sampling_params.prompt_logprobs is not None \
                else self.kv.get_computed_blocks(request)
            if self.states is not None:
                hits, num_hit = self.states.usable_hit(request, hits)
            if request.transferred and any(item.end > num_hit for item in request.items if item.output_rows > 0):
                del self.waiting[i]  # preempted after its KV came: its images' KV is gone, and their pixels too
                self._failed_in_schedule.append(self._fail(request, "preempted on the decode replica after its image KV was "
                                                       "evicted; the images are not here to compute it again"))
                continue
            num_new = request.num_tokens - num_hit
            if not self.limits.enable_chunked_prefill and num_new > budget:
                break
            num_new = self.chunking.cut(request, num_hit, num_hit + min(num_new, budget)) - num_hit
            if num_new == 0:
                break
            lookahead = self._lookahead(request, num_hit + num_new, len(self.running) + 1)
            num_new, admitted = self._admit(request, hits, num_hit, num_new, plan, lookahead)
            if not admitted:
                break
            del self.waiting[i]
            self.running.append(request)
            if num_new:  # 0: admitted to wait for an item its workers are encoding
                if lookahead and num_hit + num_new == request.num_tokens:
                    plan.out.propose_drafts[request.request_id] = lookahead
                plan.out.num_scheduled_tokens[request.request_id] = num_new
                self._plan_snapshot(request, num_hit, num_new, plan)
            plan.out.new_requests.append(self._new_request_data(request))
            budget -= num_new

    def _admit(self, request: Request, hits: list[KVBlock], num_hit: int, num_new: int,
               plan: _StepPlan, lookahead: int = 0) -> tuple[int, bool]:
        """Take KV blocks (`lookahead` slots more, for a draft model's drafts) and encoder reservations;
        returns (tokens scheduled, admitted). Not admitted: undone. Admitted with 0 tokens: its first
        uncomputed token is an item encoder workers are encoding (it waits in running, holding its reservations)."""
        request.num_computed_tokens = 0
        if self.states is not None and not self.states.slots.can_allocate():
            return 0, False
        if self.cross_kv is not None and not self.cross_kv.try_take(request):
            return 0, False
        if self.kv.allocate_slots(request, num_new + lookahead, hits) is None:
            self._free_kv(request, blocks=False)
            return 0, False
        held = {k for k in self.encoder_cache.entries if self.encoder_cache.holds(request.request_id, k)}
        # counted before reserving (once, at the first admission): an entry found ready, or being encoded for
        # another request, is a hit
        found = 0 if request.num_cached_tokens >= 0 else sum(
            1 for item in request.items if item.output_rows > 0
            and self.encoder_cache.state(item.content_hash) in (EntryState.READY, EntryState.PENDING))
        # every item is referenced, also those inside the prefix hit: a preempted request may need them
        if not self.items.try_reserve(request, 0):
            self._free_kv(request)
            return 0, False
        end = self.items.plan_chunk(request, num_hit, num_hit + num_new, plan.encoder)
        if end <= num_hit and not self.items.waits_for_output(request, num_hit):
            # the encoder step is full: undo, retry next step
            plan.encoder.items.pop(request.request_id, None)
            new_refs = {k for k in self.encoder_cache.entries if self.encoder_cache.holds(request.request_id, k)}
            self.encoder_cache.release(request.request_id, new_refs - held)
            self._free_kv(request)
            return 0, False
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        if self.states is not None:
            self.states.slots.allocate(request.request_id)
        self.kv.record_lookup(request.num_tokens, num_hit)
        if request.num_cached_tokens < 0:  # first admission: count the prompt once
            request.num_cached_tokens = num_hit
            request.num_encoder_cached_items = found
            request.num_prefix_cached_items = sum(1 for item in request.items
                                                  if item.output_rows > 0 and not item.needed_after(num_hit))
            self.stats.prompt_tokens += request.num_prompt_tokens
        return max(0, end - num_hit), True

    def _plan_snapshot(self, request: Request, start: int, num_new: int, plan: _StepPlan) -> None:
        """A hybrid model's request whose chunk ends on a boundary worth a state snapshot: save it there."""
        if self.states is not None:
            self.kv.update_block_hashes(request)
            if (snapshot_id := self.states.plan(request, start, num_new)) is not None:
                plan.out.state_snapshots[request.request_id] = snapshot_id

    def _new_request_data(self, request: Request) -> NewRequestData:
        rid, states = request.request_id, self.states
        return NewRequestData(rid, tuple(request.all_token_ids), request.num_prompt_tokens, request.items,
                              request.sampling_params, tuple(self.kv.block_ids(rid)), request.num_computed_tokens,
                              len(request.output_token_ids), None if states is None else states.slots.slot_of(rid),
                              None if states is None else states.restores.pop(rid, None),
                              tuple(self.kv.window_block_ids(rid)))

    # ---- update ---------------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._failed_in_schedule = self._failed_in_schedule, []
        if self.states is not None:  # the state snapshots of the requests the step computed are saved
            self.states.commit(result.skipped | set(result.failed))
        outputs += apply_encoder_results(self.encoder_cache, self.requests, sched, result, self._fail)
        for rid, num in sched.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING or rid in result.skipped:
                continue  # finished (aborted, failed) while the step ran, or not computed
            start = request.num_computed_tokens
            drafts = sched.spec_token_ids.get(rid, ())
            tokens = per_token(result.sampled_token_ids.get(rid))
            request.proposed_drafts = result.draft_token_ids.get(rid, ())
            if drafts and rid not in result.failed:  # KV holds the last token and the accepted drafts only
                num = len(tokens)
                self.drafter.settled(request, len(drafts), len(tokens) - 1)
            request.num_computed_tokens += num
            self.stats.prompt_tokens_computed += max(0, min(request.num_computed_tokens, request.num_prompt_tokens)
                                                     - start)
            if rid in result.failed:
                outputs.append(self._fail(request, result.failed[rid]))
                continue
            self.kv.cache_full_blocks(request)
            if rid in result.pooled:  # a pooling runner's request ends with its prompt: no token
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                outputs.append(EngineCoreOutput(rid, (), "stop", pooled=result.pooled[rid]))
                continue
            if tokens:
                outputs.append(self._take_tokens(request, tokens, per_token(result.sampled_logprobs.get(rid))))
        for rid, error in result.failed.items():  # failed without tokens this step (a faulted step's waiting requests)
            if rid not in sched.num_scheduled_tokens and rid in self.requests:
                outputs.append(self._fail(self.requests[rid], error))
        return outputs

    def _fail(self, request: Request, error: str) -> EngineCoreOutput:
        self._dequeue(request)
        self._finish(request, RequestStatus.FINISHED_ERROR, error)
        return EngineCoreOutput(request.request_id, (), "error", error=error)

    def _take_tokens(self, request: Request, tokens: tuple[int, ...],
                     logprobs: tuple[TokenLogprobs, ...]) -> EngineCoreOutput:
        """Append a step's new tokens (one today; k with speculative decoding) one by one, checking stop ids,
        `min_tokens`/`max_tokens` and the context length after each: the tokens after the one that finishes
        the request are dropped. Stop strings are the engine's (engine/output_processor.py)."""
        status, num_taken = None, 0
        for token in tokens:
            request.output_token_ids.append(token)
            num_taken += 1
            status = stop_status(request, token, self.limits.max_model_len)
            if status is not None:
                break
        self.stats.generation_tokens += num_taken
        self.kv.cache_full_blocks(request)
        # its first tokens: a request to hand off parks, its KV waiting for a decode replica
        parked = status is None and request.hand_off and len(request.output_token_ids) == num_taken
        if status is not None:
            self.running.remove(request)
            self._finish(request, status)
        elif parked:  # its encoder references are no longer needed
            self.running.remove(request)
            self.encoder_cache.release(request.request_id)
            self._free_kv(request, blocks=False)
            self.handoff.park(request)
        return EngineCoreOutput(request.request_id, tokens[:num_taken], status.finish_reason if status else None,
                                tokens[num_taken - 1] if status == RequestStatus.FINISHED_STOPPED else None,
                                new_logprobs=logprobs[:num_taken], parked=parked)

    # ---- invariants -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        check_scheduler_books(self.kv, self.encoder_cache, self.cross_kv, self.handoff, self.running,
                              set(self.requests))
        if self.states is not None:
            self.states.check_integrity({r.request_id for r in self.running})


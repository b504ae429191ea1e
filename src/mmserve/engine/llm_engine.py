"""The engine: composes the processor, the scheduler (core/) and the model runner (runner/).

Role: build the model family's pieces from the registry (model, processor, `FamilySpec`) and size
the KV cache and encoder budgets from the spec; `add_request` turns user input into a
`ProcessedPrompt`, hands the scheduler a torch-free `Request` and keeps the items' payloads; `step`
runs schedule -> execute -> update, sending the runner each new request's prompt and the payloads
of the items to encode (keyed by content key), releases payloads once encoded, detokenizes, applies
stop strings and returns `RequestOutput`s; `abort_request` finishes requests at any time.
This is the only module that holds both core/ and runner/. It knows no family.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from mmserve.config import EngineConfig
from mmserve.core.chunk_policy import ChunkBoundaryPolicy, resolve_token_budget
from mmserve.core.cross_kv import CrossKVBook
from mmserve.core.encoder_cache import EncoderCacheManager, EntryState
from mmserve.core.item_scheduler import ItemScheduler
from mmserve.core.kv_cache import KVCacheManager
from mmserve.core.request import ItemSpec, Request, RequestStatus, item_specs
from mmserve.core.scheduler import Scheduler, SchedulerLimits
from mmserve.core.step import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from mmserve.engine.choices import ChoiceGroups
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.engine.frontend import Frontend
from mmserve.engine.graph_settings import resolve_runner_graphs
from mmserve.engine.inspection import EngineInspection
from mmserve.engine.prompts import truncated_token_ids
from mmserve.engine.sizing import (
    resolve_cross_kv_bytes,
    resolve_encoder_budget,
    resolve_max_model_len,
    resolve_num_kv_blocks,
)
from mmserve.engine.timeline import RequestTimeline
from mmserve.errors import InvalidInputError, at_param
from mmserve.faults import FaultPlan
from mmserve.inputs.items import ProcessedPrompt
from mmserve.inputs.placeholders import embed_runs
from mmserve.models.loader import (
    checkpoint_quantization,
    load_model,
    parse_dtype,
)
from mmserve.models.quantization import weight_bytes
from mmserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from mmserve.runner.attention import PagedAttentionBackend
from mmserve.runner.cpu.layout import prepare_for_cpu
from mmserve.runner.encoder.pool import EncoderPool, ItemOutcome
from mmserve.runner.encoder.runner import EncodeJob
from mmserve.runner.kv_quant import kv_format
from mmserve.runner.kv_storage import PagedKVStorage
from mmserve.runner.model_runner import ModelRunner
from mmserve.runner.state import RunnerPrompt, StepInputs
from mmserve.sampling_params import SamplingParams
from mmserve.workers.factory import make_pool
from mmserve.workers.spec import WorkerSpec

logger = logging.getLogger("mmserve.engine")
IDLE_POLL_S = 0.002  # a step with nothing to compute but outputs due from encoder workers waits this long


@dataclass
class _Tracked:
    """Engine-side view of a live request: what its outputs need."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    runner_prompt: RunnerPrompt
    payloads: dict[int, Any]  # item index -> the family's encoder input, until the item is encoded and held
    stop_reason: int | str | None = None
    internal_error: bool = False  # failed by a fault in a model step, not by its input
    logprobs: list[dict[int, Logprob]] | None = None  # one per output token, when the request asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # one per prompt token computed so far
    cumulative_logprob: float = 0.0
    timeline: RequestTimeline | None = None  # only when traced
    transfer_indices: list[int] | None = None  # a decode replica's request: the prompt blocks it receives


class Engine:
    def __init__(self, config: EngineConfig, faults: FaultPlan | None = None, tracing: Any = None) -> None:
        """`faults`: what a test plants (mmserve/faults.py); None in production. `tracing`: a
        `mmserve.tracing.Tracing` to write request spans to (shared with a server); None: one of the
        engine's own when config.otlp_traces_endpoint is set, else no tracing."""
        self.config = config
        self._owns_tracing = tracing is None and config.otlp_traces_endpoint is not None
        if self._owns_tracing:
            from mmserve.tracing import Tracing

            tracing = Tracing.to_endpoint(config.otlp_traces_endpoint, "mmserve")
        self.tracing = tracing
        self.faults = faults or FaultPlan()
        if self.faults.encoder_pool is not None and not config.encoder.encoder_workers:
            raise ValueError("FaultPlan.encoder_pool replaces encoder workers: set encoder_workers too")
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device)
        self.dtype = parse_dtype(config.dtype)
        self.model = load_model(config.model, self.dtype, self.device, config.quantization)
        self.cpu_preparation = prepare_for_cpu(self.model)  # layouts the CPU's kernels want
        self.quantization = config.quantization or checkpoint_quantization(config.model) or "none"
        self.weight_bytes = weight_bytes(self.model)  # as laid out for the kernels
        self.frontend = Frontend(config, self.model.config)
        self.processor, self.spec = self.frontend.processor, self.frontend.spec
        spec = self.spec
        self.kv_format = kv_format(config.cache.kv_cache_dtype, self.dtype)
        self.kv_bytes_per_token = PagedKVStorage.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                                                 self.kv_format)
        num_blocks = resolve_num_kv_blocks(config.cache, self.kv_bytes_per_token)
        self.max_model_len = resolve_max_model_len(config.scheduler.max_model_len, spec.max_position_embeddings,
                                                   num_blocks * config.cache.block_size)
        self.frontend.max_model_len = self.max_model_len
        self.budget = resolve_encoder_budget(config.encoder, spec, self.dtype)
        graphs = resolve_runner_graphs(config, encoder_tokens_per_step=self.budget.max_encoder_tokens_per_step,
                                       encoder_items_per_step=self.budget.max_items_per_step,
                                       num_kv_blocks=num_blocks, max_model_len=self.max_model_len,
                                       num_position_rows=spec.num_position_rows)
        # decode graphs' padding rows write to a scratch block after the ones the KV manager hands out
        self.kv_storage = PagedKVStorage(spec.num_layers, num_blocks + graphs.num_scratch_blocks,
                                         config.cache.block_size, spec.num_kv_heads, spec.head_dim, self.kv_format,
                                         self.device)
        kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        enc = config.encoder
        self.encoder_pool = self._start_encoder_pool() if enc.encoder_workers else None
        items = ItemScheduler(EncoderCacheManager(self.budget.cache_bytes, self.budget.output_budget_bytes),
                              self.budget, outputs_arrive_later=self.encoder_pool is not None)
        sched = config.scheduler
        chunking = ChunkBoundaryPolicy(indivisible_items=spec.bidirectional_media)
        max_batched, _ = resolve_token_budget(sched.max_num_batched_tokens, spec.max_item_span,
                                              chunking.indivisible_items)
        cross_kv_bytes = resolve_cross_kv_bytes(config.cache, spec, self.dtype)
        # bytes of one item row's cross-attention K/V (the model dtype), for a family that cross-attends
        self.cross_kv_bytes_per_row = 0 if spec.cross_attention is None else spec.cross_attention.bytes_per_row(
            torch.empty((), dtype=self.dtype).element_size())
        self.scheduler = Scheduler(SchedulerLimits(sched.max_num_seqs, max_batched, sched.enable_chunked_prefill,
                                                   self.max_model_len), kv, items, chunking,
                                   None if cross_kv_bytes is None else CrossKVBook(cross_kv_bytes))
        self.runner = ModelRunner(self.model, spec, PagedAttentionBackend(self.kv_storage), self.device,
                                  self.encoder_pool, enc.encoder_timeout_s, graphs.encoder, graphs.decode,
                                  self.faults, config.logprobs_mode)
        self.eos_token_ids = self.frontend.eos_token_ids
        self.tracked: dict[str, _Tracked] = {}  # by the id of each sequence (a choice, for n > 1)
        self.choices = ChoiceGroups()
        # one token's text, as logprob entries name it: decoded once per id (at most the vocabulary)
        self._token_texts: dict[int, str] = {}
        self._pending_outputs: list[RequestOutput] = []  # rejected at admission, returned by the next step
        self.structured = self.frontend.structured

    def _start_encoder_pool(self) -> EncoderPool:
        """Encoder workers: the cores are split evenly between the workers and the engine's own step."""
        enc = self.config.encoder
        if self.faults.encoder_pool is not None:
            return self.faults.encoder_pool()
        cores = len(os.sched_getaffinity(0))
        spec = WorkerSpec(self.config.model, self.config.dtype, self.config.device,
                          threads=max(1, cores // (enc.encoder_workers + 1)),
                          die_on_key=self.faults.encoder_worker_dies_on_key)
        return make_pool(enc.encoder_backend, spec, enc.encoder_workers, enc.ray_address)

    def shutdown(self) -> None:
        """Stop the encoder workers (if any) and a background compile; the engine takes no more work afterwards."""
        self.runner.shutdown()
        if self.encoder_pool is not None:
            self.encoder_pool.shutdown()
        self.frontend.close()
        if self._owns_tracing:
            self.tracing.shutdown()

    # ---- input ----------------------------------------------------------------------------------
    def process(self, raw_prompt: Any, mm_processor_kwargs: dict[str, Any] | None = None,
                item_params: dict[str, list[str]] | None = None) -> ProcessedPrompt:
        """`item_params`: the request fields the media items came from (errors name them)."""
        return self.frontend.process(raw_prompt, mm_processor_kwargs, item_params)

    def process_chat(self, messages: list[dict[str, Any]], mm_processor_kwargs: dict[str, Any] | None = None,
                     **template_kwargs: Any) -> ProcessedPrompt:
        return self.frontend.process_chat(messages, mm_processor_kwargs, **template_kwargs)

    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                    arrival_time: float | None = None, trace_parent: str | None = None,
                    hand_off: bool = False) -> None:
        """`trace_parent`: the W3C traceparent the request's spans go under (with tracing on; without a
        parent a traced request starts its own trace). `hand_off` (a prefill replica): after its first
        token the request parks, holding its KV for `send_kv` (a request of n > 1 choices or with a grammar
        decodes here: its first output says whether it parked, `kv_parked`)."""
        cut = truncated_token_ids(prompt, params.truncate_prompt_tokens, self.max_model_len)
        if cut is not None:  # processed again as token ids, keeping its cache salt
            salt = prompt.cache_salt
            prompt = self.process({"prompt_token_ids": cut})
            prompt.cache_salt = salt
        if prompt.num_tokens == 0:
            raise InvalidInputError("the prompt is empty", param="prompt")
        if prompt.num_tokens + 1 > self.max_model_len:
            raise InvalidInputError(f"the prompt has {prompt.num_tokens} tokens; the model's context is "
                                    f"{self.max_model_len} tokens", param="prompt")
        if request_id in self.tracked or request_id in self.choices:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        self._check_token_ids(params)
        with at_param("bad_words"):  # checked before any choice is added: nothing below refuses a request
            bad_words = self.processor.tokenizer.bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None:  # compiled (or refused) before any choice is added
            self.structured.compiled(params.structured_outputs)
        if params.n == 1:
            self._add_one(request_id, prompt, params, arrival_time, bad_words, trace_parent=trace_parent,
                          hand_off=hand_off and params.structured_outputs is None and not _cross_attends(prompt))
            return
        arrival_time = arrival_time or time.time()
        choices = self.choices.split(request_id, params, self.config.cache.enable_prefix_caching)
        try:
            for choice in choices:
                self._add_one(choice.request_id, prompt, choice.params, arrival_time, bad_words, choice.prefill_after,
                              trace_parent)
        except BaseException:  # none of the request runs: the choices added are aborted, the group dropped
            self.abort_request([request_id])
            self.choices.forget(request_id)
            raise

    def _add_one(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, arrival_time: float | None,
                 bad_words: tuple[tuple[int, ...], ...], prefill_after: str | None = None,
                 trace_parent: str | None = None, hand_off: bool = False) -> None:
        tracked = self._tracked(request_id, prompt, params, arrival_time, bad_words, prefill_after, trace_parent)
        tracked.request.hand_off = hand_off
        if params.structured_outputs is not None:
            self.structured.start(request_id, params.structured_outputs, tracked.request.prompt_token_ids)
        rejection = self.scheduler.add_request(tracked.request)
        if rejection is not None:  # can never fit the encoder budgets: finish now, others run on
            self._pending_outputs.append(self._make_output(tracked, "error", rejection))
            return
        self.tracked[request_id] = tracked

    def _tracked(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, arrival_time: float | None,
                 bad_words: tuple[tuple[int, ...], ...], prefill_after: str | None = None,
                 trace_parent: str | None = None) -> _Tracked:
        """A request and the engine's view of it, before the scheduler has it."""
        items = item_specs(prompt.items)
        request = Request(request_id, list(prompt.prompt_token_ids), params, self.eos_token_ids, items,
                          arrival_time or time.time(), prefill_after=prefill_after, cache_salt=prompt.cache_salt,
                          cross_kv_bytes=self.cross_kv_bytes_per_row * sum(
                              i.output_rows for i in prompt.items if i.cross_attention is not None))
        detok = IncrementalDetokenizer(self.processor.tokenizer, request.prompt_token_ids,
                                       params.skip_special_tokens, params.stop, params.include_stop_str_in_output)
        spans = embed_runs(prompt.embed_mask) if self.spec.bidirectional_media and prompt.items else ()
        runner_prompt = RunnerPrompt(prompt.positions, prompt.embed_mask, prompt.embed_cumsum,
                                     tuple(i.content_hash for i in prompt.items),
                                     tuple(i.output_rows for i in prompt.items), tuple(sorted(request.stop_token_ids)),
                                     spans, bad_words,
                                     tuple(i.cross_attention for i in prompt.items if i.cross_attention is not None))
        tracked = _Tracked(request, prompt.prompt, detok, RequestMetrics(request.arrival_time), runner_prompt,
                           {i: it.payload for i, it in enumerate(prompt.items)},
                           logprobs=None if params.logprobs is None else [],
                           prompt_logprobs=None if params.prompt_logprobs is None else [None],
                           timeline=None if self.tracing is None else RequestTimeline(trace_parent, time.time()))
        return tracked

    # ---- hand-offs: prefill on one replica, decode on another (core/handoff.py, cluster/) ----------
    def send_kv(self, request_id: str, block_indices: list[int], connector: Any) -> Any:
        """A parked request's prompt blocks at `block_indices` (of its block list) into `connector`
        (`connector.send(request_id, part_shapes, num_blocks, fill)`, which returns a transfer handle);
        the request then finishes here (finish reason "handoff"), its blocks staying in the prefix cache."""
        tracked, request = self.tracked.get(request_id), self.scheduler.requests.get(request_id)
        if tracked is None or request is None or request.status != RequestStatus.PARKED:
            raise ValueError(f"request {request_id!r} is not parked for a hand-off")
        owned = self.scheduler.kv.block_ids(request_id)
        block_ids = [owned[i] for i in block_indices]
        transfer = connector.send(request_id, self.kv_storage.block_part_shapes(), len(block_ids),
                                  lambda outs: self.kv_storage.read_blocks(block_ids, outs))
        self.scheduler.handoff.handed_off(request_id, len(block_ids))
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_STOPPED)
        self._pending_outputs.append(self._make_output(tracked, "handoff"))
        return transfer

    def admit_transferred(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                          first: CompletionOutput, arrival_time: float | None = None,
                          trace_parent: str | None = None) -> list[int] | None:
        """Take a request a prefill replica computed, `first` its first output there (one token, its
        logprobs): the indices of its prompt blocks to send (those this replica's prefix cache lacks), or
        None while there is no room (ask again later). `prompt` needs no media payloads: nothing is
        encoded here. Its KV then comes through `receive_kv`; until then it holds its blocks."""
        if params.n != 1 or params.structured_outputs is not None or len(first.token_ids) != 1:
            raise ValueError("a hand-off carries one choice without a grammar, after exactly one token")
        if request_id in self.tracked:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        with at_param("bad_words"):
            bad_words = self.processor.tokenizer.bad_words_token_ids(params.bad_words)
        tracked = self._tracked(request_id, prompt, params, arrival_time, bad_words, trace_parent=trace_parent)
        request = tracked.request
        request.transferred, tracked.payloads = True, {}
        request.output_token_ids.append(first.token_ids[0])
        tracked.detokenizer.update(list(first.token_ids))
        tracked.detokenizer.take_delta(False)  # the prefill replica sent that text
        if tracked.logprobs is not None and first.logprobs:
            tracked.logprobs.extend(first.logprobs)
            tracked.cumulative_logprob = first.cumulative_logprob or 0.0
        needed = self.scheduler.admit_transferred(request)
        if needed is not None:
            self.tracked[request_id] = tracked
            tracked.transfer_indices = needed
        return needed

    def receive_kv(self, request_id: str, parts: list[torch.Tensor]) -> None:
        """The blocks `admit_transferred` asked for, as the prefill replica's `send_kv` read them: the
        request decodes from its first token on."""
        tracked = self.tracked[request_id]
        owned = self.scheduler.kv.block_ids(request_id)
        self.kv_storage.write_blocks([owned[i] for i in tracked.transfer_indices], parts)
        self.scheduler.transfer_done(request_id, len(tracked.transfer_indices))

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids a request names must be in the model's vocabulary."""
        vocab_size = self.spec.vocab_size
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise InvalidInputError(f"{name} names token id {outside[0]}, outside the vocabulary "
                                        f"(ids 0..{vocab_size - 1})", param=name)

    # ---- stepping -------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """Requests a step computes, or outputs due (a parked request, or one receiving its KV, waits for
        a call from outside)."""
        return self.scheduler.num_schedulable > 0 or bool(self._pending_outputs)

    def step(self) -> list[RequestOutput]:
        pending, self._pending_outputs = self._pending_outputs, []
        sched = self.scheduler.schedule()
        waiting_on_workers = self.runner.num_encoder_items_in_flight > 0
        if sched.is_empty and not (sched.encoder_items or sched.free_encoder_keys or sched.finished_request_ids
                                   or waiting_on_workers):
            return pending  # nothing to run, and nothing the runner must drop
        if sched.is_empty and not sched.encoder_items and waiting_on_workers:
            time.sleep(IDLE_POLL_S)  # only waiting for workers' outputs: do not spin on the CPU they need
        now = time.time()
        for new in sched.new_requests:
            tracked = self.tracked[new.request_id]
            tracked.metrics.first_scheduled_time = tracked.metrics.first_scheduled_time or now
        try:
            result = self.runner.execute(sched, self._step_inputs(sched))
        except Exception as exc:  # noqa: BLE001 - a fault in one step must not take the engine down
            result = self._step_fault(sched, exc)
        self._record_prompt_logprobs(result.prompt_logprobs)
        if self.tracing is not None:
            self._trace_computed(sched, now, time.time())
        core_outputs = self.scheduler.update(sched, result)
        if self.tracing is not None:
            self._trace_encoded(time.time())
        self._drop_encoded_payloads(set(sched.num_scheduled_tokens) | set(sched.encoder_items))
        return pending + [self._output(o) for o in core_outputs]

    def _step_fault(self, sched: SchedulerOutput, exc: Exception) -> ModelRunnerOutput:
        """The model step raised: the requests it computed fail with an internal error, whatever the runner
        made of them is dropped (their state, the encoder outputs it produced), and the engine goes on with
        the others. Encoder keys produced in the step go back to MISSING (nothing reports them committed)."""
        logger.exception("the model step failed; its requests fail, the engine serves on")
        message = f"internal error in the model step ({type(exc).__name__}: {exc}); the request was not completed"
        # every request the runner may have touched: its state there is no longer trusted
        rids = (set(sched.num_scheduled_tokens) | set(sched.encoder_items) | {n.request_id for n in sched.new_requests}
                | {c.request_id for c in sched.cached_requests})
        for rid in rids:
            self.runner.release(rid)
            if rid in self.tracked:
                self.tracked[rid].internal_error = True
        produced = [self.scheduler.requests[rid].items[i].content_hash for rid, indices in sched.encoder_items.items()
                    if rid in self.scheduler.requests for i in indices]
        self.runner.free_encoder_outputs(produced)
        return ModelRunnerOutput(failed={rid: message for rid in rids})

    def _step_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """The prompts of new (or resumed) requests and the payloads of this step's items, by content key."""
        inputs = StepInputs({n.request_id: self.tracked[n.request_id].runner_prompt for n in sched.new_requests},
                            token_bitmasks=self.structured.fill(list(sched.num_scheduled_tokens)))
        for rid, indices in sched.encoder_items.items():
            tracked = self.tracked[rid]
            for i in indices:
                spec = tracked.request.items[i]
                if i not in tracked.payloads:  # dropped only once encoded and held: a bookkeeping bug
                    raise RuntimeError(f"{rid}: item {i} is scheduled for encoding but its payload was released")
                inputs.encoder_jobs.append(EncodeJob(spec.content_hash, tracked.payloads[i], spec.output_rows,
                                                     spec.encoder_tokens))
        return inputs

    def _drop_encoded_payloads(self, request_ids: set[str]) -> None:
        """Release the pixels of items that are encoded and referenced by their request: the cache keeps
        a referenced entry until the request finishes, so they are never needed again."""
        cache = self.scheduler.encoder_cache
        for rid in request_ids:
            tracked = self.tracked.get(rid)
            if tracked is None or not tracked.payloads:
                continue
            for i in list(tracked.payloads):
                key = tracked.request.items[i].content_hash
                # READY: encoded and held; PENDING: a worker has it (the pool keeps it until its outcome)
                if cache.state(key) in (EntryState.READY, EntryState.PENDING) and cache.holds(rid, key):
                    del tracked.payloads[i]

    def _trace_computed(self, sched: SchedulerOutput, start_s: float, end_s: float) -> None:
        """Note what the step computed for each traced request (before `update` moves its progress)."""
        for rid, indices in sched.encoder_items.items():
            tracked = self.tracked.get(rid)
            if tracked is not None and tracked.timeline is not None:
                for i in indices:
                    tracked.timeline.encode_scheduled(i, start_s)
        for rid, num in sched.num_scheduled_tokens.items():
            tracked = self.tracked.get(rid)
            if tracked is None or tracked.timeline is None:
                continue
            request = tracked.request
            start = request.num_computed_tokens
            if num == 1 and start >= request.num_prompt_tokens and start == request.num_tokens - 1:
                tracked.timeline.decode_step(start_s, end_s)
            else:  # a prompt's chunk, or a preempted request's recompute
                tracked.timeline.prefill_chunk(start_s, end_s, start, num)

    def _trace_encoded(self, now_s: float) -> None:
        """Close the encode spans of items whose outputs are now ready (this step's, or a worker's)."""
        cache = self.scheduler.encoder_cache
        for tracked in self.tracked.values():
            timeline = tracked.timeline
            if timeline is None or not timeline.encoding_since_s:
                continue
            for i in list(timeline.encoding_since_s):
                item = tracked.request.items[i]
                if cache.state(item.content_hash) == EntryState.READY:
                    timeline.encode_ready(i, now_s, _item_attributes(item, self.encoder_pool is not None))

    def _trace_finished(self, tracked: _Tracked, finish: str, error: str | None) -> None:
        request, metrics, timeline = tracked.request, tracked.metrics, tracked.timeline
        assert timeline is not None and metrics.finish_time is not None
        cached = max(request.num_cached_tokens, 0)
        media = [item for item in request.items if item.output_rows > 0]
        children = timeline.finish(metrics.first_scheduled_time, metrics.finish_time,
                                   {item.index: _item_attributes(item, False) for item in media},
                                   {item.index for item in media if not item.needed_after(cached)})
        attributes: dict[str, Any] = {
            "gen_ai.request.id": request.request_id,
            "gen_ai.usage.prompt_tokens": request.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": len(request.output_token_ids),
            "gen_ai.response.finish_reasons": [finish],
            "mmserve.prefix_cached_tokens": cached,
            "mmserve.mm_items": request.num_mm_items,
            "mmserve.encoder_cache_hit_items": request.num_encoder_cached_items,
            "mmserve.num_preemptions": request.num_preemptions,
        }
        if metrics.first_token_time is not None:
            attributes["gen_ai.latency.time_to_first_token"] = metrics.first_token_time - metrics.arrival_time
        self.tracing.record_request(timeline.trace_parent, timeline.received_s, metrics.finish_time, attributes,
                                    children, error if finish == "error" else None)

    def _output(self, core: EngineCoreOutput) -> RequestOutput:
        tracked = self.tracked[core.request_id]
        now = time.time()
        if core.new_token_ids and tracked.metrics.first_token_time is None:
            tracked.metrics.first_token_time = now
        finish = core.finish_reason
        if tracked.logprobs is not None:
            for token_id, logprobs in zip(core.new_token_ids, core.new_logprobs):
                tracked.logprobs.append(self._logprob_entry(token_id, logprobs))
                tracked.cumulative_logprob += logprobs.logprob
        error = core.error
        if core.new_token_ids and not self.structured.accept(core.request_id, list(core.new_token_ids)):
            # the mask allowed only tokens the grammar accepts: a refusal is the engine's fault
            logger.error("%s: the grammar refused a sampled token", core.request_id)
            if finish is None:
                self.scheduler.finish_requests([core.request_id], RequestStatus.FINISHED_ABORTED)
            finish, error, tracked.internal_error = "error", "internal error: the grammar refused a sampled token", True
        if core.new_token_ids:
            stop_string = tracked.detokenizer.update(list(core.new_token_ids))
            if stop_string is not None and finish is None:
                self.scheduler.finish_requests([core.request_id], RequestStatus.FINISHED_STOPPED)
                finish, tracked.stop_reason = "stop", stop_string
        if core.stop_token_id is not None:
            tracked.stop_reason = core.stop_token_id
        output = self._make_output(tracked, finish, error)
        output.kv_parked = core.parked and finish is None
        return output

    def _record_prompt_logprobs(self, computed: dict[str, tuple[int, tuple[TokenLogprobs, ...]]]) -> None:
        """Append each request's new prompt logprobs (a prompt recomputed after a preemption has them)."""
        for rid, (start, entries) in computed.items():
            tracked = self.tracked.get(rid)
            if tracked is None or tracked.prompt_logprobs is None:
                continue
            prompt = tracked.request.prompt_token_ids
            for position, logprobs in enumerate(entries, start=start + 1):
                if position == len(tracked.prompt_logprobs):
                    tracked.prompt_logprobs.append(self._logprob_entry(prompt[position], logprobs))

    def _logprob_entry(self, token_id: int, logprobs: TokenLogprobs) -> dict[int, Logprob]:
        """The sampled token first, then the top ones (the sampled one among them keeps its entry)."""
        entry = {token_id: Logprob(logprobs.logprob, logprobs.rank, self._token_text(token_id))}
        for rank, (top_id, value) in enumerate(zip(logprobs.top_token_ids, logprobs.top_logprobs), start=1):
            if top_id not in entry:
                entry[top_id] = Logprob(value, rank, self._token_text(top_id))
        return entry

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.processor.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _make_output(self, tracked: _Tracked, finish: str | None, error: str | None = None) -> RequestOutput:
        request = tracked.request
        finished = finish is not None
        if finished:
            tracked.metrics.finish_time = time.time()
            tracked.metrics.num_preemptions = request.num_preemptions
            if tracked.timeline is not None:
                self._trace_finished(tracked, finish, error)
            self.tracked.pop(request.request_id, None)
            self.runner.release(request.request_id)
            self.structured.release(request.request_id)
        delta = tracked.detokenizer.take_delta(finished)
        completion = CompletionOutput(0, tracked.detokenizer.output_text, list(request.output_token_ids), finish,
                                      tracked.stop_reason if finish == "stop" else None,
                                      None if tracked.logprobs is None else list(tracked.logprobs),
                                      None if tracked.logprobs is None else tracked.cumulative_logprob)
        return self.choices.fold(RequestOutput(
            request.request_id, tracked.prompt, request.prompt_token_ids, [completion], finished,
            max(request.num_cached_tokens, 0), tracked.metrics, error, delta, internal_error=tracked.internal_error,
            num_mm_items=request.num_mm_items, num_encoder_cached_mm_items=request.num_encoder_cached_items,
            num_prefix_cached_mm_items=request.num_prefix_cached_items,
            prompt_logprobs=None if tracked.prompt_logprobs is None else list(tracked.prompt_logprobs)))

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests (a request of n choices: all of them)."""
        outputs = []
        for rid in [cid for asked in request_ids for cid in (self.choices.choice_ids(asked) or [asked])]:
            tracked = self.tracked.get(rid)
            if tracked is None:
                continue
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            outputs.append(self._make_output(tracked, "abort"))
        return outputs

    # ---- introspection --------------------------------------------------------------------------
    def get_stats(self) -> dict[str, int | float | str]:
        s, kv, cache = self.scheduler.stats, self.scheduler.kv, self.scheduler.encoder_cache
        encoder = self.runner.encoder_counts()
        return {
            # a request handed off to a decode replica finishes there, and is counted there
            "requests_finished": s.requests_finished - self.scheduler.handoff.stats.requests_handed_off,
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "prompt_tokens": s.prompt_tokens,
            "prompt_tokens_computed": s.prompt_tokens_computed,
            "prefix_cache_hit_tokens": kv.stats.prefix_cache_hit_tokens,
            "generation_tokens": s.generation_tokens,
            "num_preemptions": s.num_preemptions,
            "grammars_compiled": self.structured.num_compiled,
            "grammar_matchers": len(self.structured.matchers),
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            "kv_cache_dtype": self.config.cache.kv_cache_dtype,
            "quantization": self.quantization,
            "cpu_decode_compile": self.runner.cpu_decode_compile_state(),
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_capacity_tokens": kv.num_blocks * kv.block_size,
            "kv_cache_evictions": kv.stats.evictions,
            "encoder_items_encoded": encoder.items_encoded,
            "encoder_tokens_encoded": encoder.tokens_encoded,
            "encoder_cache_hits": cache.stats.hits,
            "encoder_cache_misses": cache.stats.misses,
            "encoder_cache_evictions": cache.stats.evictions,
            "encoder_cache_bytes_used": cache.used_bytes,
            "encoder_cache_bytes_referenced": cache.referenced_bytes,  # held by live requests; 0 when idle
            "encoder_cache_bytes_total": cache.capacity_bytes,
            "requests_rejected": s.requests_rejected,
            **self._handoff_stats(),
            **self._cross_kv_stats(),
            "budget_max_encoder_items_per_step": self.budget.max_items_per_step,
            "budget_max_encoder_tokens_per_step": self.budget.max_encoder_tokens_per_step,
            "budget_encoder_output_bytes": self.budget.output_budget_bytes,
            "budget_encoder_cache_bytes": self.budget.cache_bytes,
            "budget_bytes_per_embedding_row": self.budget.bytes_per_row,
            **self._worker_stats(),
        }

    def _handoff_stats(self) -> dict[str, int]:
        h = self.scheduler.handoff
        block_bytes = self.kv_bytes_per_token * self.scheduler.kv.block_size
        return {"requests_parked": len(h.parked), "requests_receiving_kv": len(h.receiving),
                "requests_handed_off": h.stats.requests_handed_off, "requests_received": h.stats.requests_received,
                "kv_blocks_sent": h.stats.kv_blocks_sent, "kv_blocks_transferred": h.stats.kv_blocks_received,
                "kv_bytes_transferred": h.stats.kv_blocks_received * block_bytes,
                "kv_blocks_deduplicated": h.stats.kv_blocks_deduplicated}

    def _cross_kv_stats(self) -> dict[str, int]:
        book = self.scheduler.cross_kv
        if book is None:
            return {}
        return {"cross_kv_bytes_used": book.used_bytes, "cross_kv_bytes_total": book.capacity_bytes,
                "cross_kv_builds": self.runner.cross_kv_builds}

    def wait_for_compiled_decode(self, timeout_s: float | None = None) -> bool:
        """Block until the CPU's decode step, compiled in the background, replays (True), or it is not
        compiled, failed, or `timeout_s` passed (False). Serving never needs this: for benchmarks and tests."""
        return self.runner.cpu_decode_compile_state() != "off" and self.runner.wait_for_decode_graphs(timeout_s)

    def _worker_stats(self) -> dict[str, int]:
        if self.encoder_pool is None:
            return {}
        pool = self.encoder_pool.stats()
        return {"encoder_workers_alive": pool.workers_alive, "encoder_worker_restarts": pool.worker_restarts,
                "encoder_items_redispatched": pool.items_redispatched,
                "encoder_items_in_flight": self.runner.num_encoder_items_in_flight}

    def take_evictions(self) -> tuple[tuple[str, ...], tuple[bytes, ...]]:
        """(encoder content keys, KV prefix-block hashes) evicted since the last call: what a router in
        front of this engine should forget."""
        return self.scheduler.encoder_cache.take_evicted(), self.scheduler.kv.take_evicted()

    def take_encoder_outcomes(self) -> list[ItemOutcome]:
        """What arrived from encoder workers in the last step, unless already taken (for latency metrics)."""
        return self.runner.take_outcomes()

    def inspect(self) -> EngineInspection:
        """Read-only views of the engine's state for tests and benchmarks (engine/inspection.py)."""
        return EngineInspection(self.runner.request_views(), self.runner.encoder_outputs(),
                                {rid: len(t.payloads) for rid, t in self.tracked.items()},
                                self.runner.graph_stats(), self.kv_storage, self.runner.last_step_timing())

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        live = set(self.scheduler.requests)
        assert set(self.tracked) == live, "engine and scheduler disagree on live requests"
        self.choices.check_integrity(live)
        assert self.structured.tracked_ids() <= live, "a grammar matcher outlived its request"
        assert set(self.runner.request_views()) <= live, "runner holds state of finished requests"
        holders = set(self.scheduler.cross_kv.held) if self.scheduler.cross_kv is not None else set()
        assert self.runner.cross_kv_holders() <= holders, "the runner holds cross-attention KV the budget lost"
        cache = self.scheduler.encoder_cache
        ready = {k for k, e in cache.entries.items() if e.state == EntryState.READY}
        stored = set(self.runner.encoder_outputs())
        assert ready <= stored, "a ready encoder entry has no tensor in the runner"
        # the runner holds only tensors the cache accounts for (or has freed and will hand over next step)
        assert stored <= ready | set(cache.pending_freed_keys), "the runner holds an encoder output the cache lost"


def _cross_attends(prompt: ProcessedPrompt) -> bool:
    """Does the prompt have images read by cross-attention? Such a request decodes where it prefilled: its
    images' K/V is not in the KV blocks a hand-off moves, and no pixel moves."""
    return any(item.cross_attention is not None for item in prompt.items)


def _item_attributes(item: ItemSpec, by_workers: bool) -> dict[str, Any]:
    attributes: dict[str, Any] = {"mmserve.item.index": item.index, "mmserve.item.content_key": item.content_hash,
                                  "mmserve.item.encoder_tokens": item.encoder_tokens,
                                  "mmserve.item.output_rows": item.output_rows}
    if by_workers:
        attributes["mmserve.encoder.workers"] = True
    return attributes

"""The engine: the step loop over the processor, the scheduler (core/) and the model runner (runner/).

Role: `engine/assembly.py` builds the parts from the config (model, frontend, KV cache, budgets,
scheduler, runner); the engine composes them. `add_request` checks a processed prompt, hands the
scheduler a torch-free `Request` (n > 1 choices: one per choice, engine/choices.py), keeps the items'
payloads and the runner's view of the prompt (engine/request_inputs.py) and the request's output state
(engine/output_processor.py). `step` runs schedule -> execute -> update, sending the runner each new
request's prompt and the payloads of the items to encode, releases payloads once encoded, and hands the
scheduler's results to the output processor, which makes the `RequestOutput`s (stop strings, logprobs,
text); requests it finishes are finished in the scheduler. `abort_request` finishes requests at any
time; prefill/decode hand-offs move a parked request's KV between engines. Stats come from snapshots
(engine/stats.py). The engine reads the scheduler and the runner only through their methods.
This is the only module that holds both core/ and runner/ at run time. It knows no family.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from mmserve.config import EngineConfig
from mmserve.core.encoder_cache import EntryState
from mmserve.core.request import RequestStatus
from mmserve.core.step import ModelRunnerOutput, SchedulerOutput
from mmserve.engine.assembly import assemble
from mmserve.engine.choices import ChoiceGroups
from mmserve.engine.inspection import EngineInspection
from mmserve.engine.output_processor import OutputProcessor
from mmserve.engine.prompts import check_prompt_fits, check_token_ids, truncated_token_ids
from mmserve.engine.request_inputs import RequestInputs, new_request, runner_prompt
from mmserve.engine.request_spans import note_computed, note_encoded
from mmserve.engine.stats import EngineSizes, engine_stats
from mmserve.errors import InvalidInputError, at_param
from mmserve.faults import FaultPlan
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import CompletionOutput, RequestOutput
from mmserve.runner.encoder.pool import ItemOutcome
from mmserve.sampling_params import SamplingParams
from mmserve.speculative import speculates

logger = logging.getLogger("mmserve.engine")
IDLE_POLL_S = 0.002  # a step with nothing to compute but outputs due from encoder workers waits this long


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
        parts = assemble(config, self.faults)
        loaded = parts.model
        self.model, self.device, self.dtype = loaded.model, loaded.device, loaded.dtype
        self.cpu_preparation, self.quantization, self.weight_bytes = (loaded.cpu_preparation, loaded.quantization,
                                                                      loaded.weight_bytes)
        self.frontend = parts.frontend
        self.processor, self.spec, self.structured = self.frontend.processor, self.frontend.spec, self.frontend.structured
        self.eos_token_ids = self.frontend.eos_token_ids
        self.kv_format, self.kv_bytes_per_token = parts.kv_format, parts.kv_bytes_per_token
        self.max_model_len, self.budget, self.kv_storage = parts.max_model_len, parts.budget, parts.kv_storage
        self.encoder_pool, self.cross_kv_bytes_per_row = parts.encoder_pool, parts.cross_kv_bytes_per_row
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self.sizes = EngineSizes(config.cache.kv_cache_dtype, self.quantization, self.weight_bytes,
                                 self.kv_bytes_per_token, self.budget)
        self.choices = ChoiceGroups()  # by the id of each request of n > 1 choices
        self.inputs = RequestInputs()  # by the id of each sequence (a choice, for n > 1)
        self.output_processor = OutputProcessor(self.processor.tokenizer, self.structured, self.choices, tracing,
                                                self._release)
        self._pending_outputs: list[RequestOutput] = []  # rejected at admission, returned by the next step

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
        token the request parks, holding its KV for `send_kv` (a request of n > 1 choices, with a grammar, or of
        a hybrid model, whose recurrent state no hand-off moves, decodes here: its first output says whether it
        parked, `kv_parked`)."""
        cut = truncated_token_ids(prompt, params.truncate_prompt_tokens, self.max_model_len,
                                params.truncation_side)
        if cut is not None:  # processed again as token ids, keeping its cache salt
            salt = prompt.cache_salt
            prompt = self.process({"prompt_token_ids": cut})
            prompt.cache_salt = salt
        check_prompt_fits(prompt, self.max_model_len)
        if request_id in self.output_processor or request_id in self.choices:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        check_token_ids(params, self.spec.vocab_size)
        with at_param("bad_words"):  # checked before any choice is added: nothing below refuses a request
            bad_words = self.processor.tokenizer.bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None:  # compiled (or refused) before any choice is added
            self.structured.compiled(params.structured_outputs)
        if params.n == 1:
            self._add_one(request_id, prompt, params, arrival_time, bad_words, trace_parent=trace_parent,
                          hand_off=hand_off and params.structured_outputs is None and not _cross_attends(prompt)
                          and self.spec.linear_state is None)
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
        request = new_request(request_id, prompt, params, self.eos_token_ids, arrival_time,
                              self.cross_kv_bytes_per_row, prefill_after)
        request.hand_off = hand_off
        self.output_processor.add(request, prompt.prompt, trace_parent)
        self.inputs.add(request, runner_prompt(prompt, request, self.spec.bidirectional_spans(prompt), bad_words),
                        {i: it.payload for i, it in enumerate(prompt.items)})
        if params.structured_outputs is not None:
            self.structured.start(request_id, params.structured_outputs, request.prompt_token_ids)
        # a grammar checks each draft, except while a reasoning model may still open its thought
        request.speculate = (self.config.speculative_config is not None and speculates(params, self.config.logprobs_mode)
                             and not self.structured.tracks_thought(request_id))
        rejection = self.scheduler.add_request(request)
        if rejection is not None:  # can never fit the encoder budgets: finish now, others run on
            self._pending_outputs.append(self.output_processor.finish(request_id, "error", rejection))

    # ---- hand-offs: prefill on one replica, decode on another (core/handoff.py, cluster/) ----------
    def send_kv(self, request_id: str, block_indices: list[int], connector: Any) -> Any:
        """A parked request's prompt blocks at `block_indices` (of its block list) into `connector`
        (`connector.send(request_id, part_shapes, num_blocks, fill)`, which returns a transfer handle);
        the request then finishes here (finish reason "handoff"), its blocks staying in the prefix cache."""
        if request_id not in self.output_processor or not self.scheduler.is_parked(request_id):
            raise ValueError(f"request {request_id!r} is not parked for a hand-off")
        block_ids, window_ids = self.scheduler.blocks_at(request_id, block_indices)
        transfer = connector.send(request_id, self.kv_storage.block_part_shapes(), len(block_ids),
                                  lambda outs: self.kv_storage.read_blocks(block_ids, outs, window_ids))
        self.scheduler.hand_off_sent(request_id, len(block_ids))
        self._pending_outputs.append(self.output_processor.finish(request_id, "handoff"))
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
        if request_id in self.output_processor:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        with at_param("bad_words"):
            bad_words = self.processor.tokenizer.bad_words_token_ids(params.bad_words)
        request = new_request(request_id, prompt, params, self.eos_token_ids, arrival_time,
                              self.cross_kv_bytes_per_row)
        request.transferred = True
        request.output_token_ids.append(first.token_ids[0])
        needed = self.scheduler.admit_transferred(request)
        if needed is not None:
            self.output_processor.add(request, prompt.prompt, trace_parent, first)
            self.inputs.add(request, runner_prompt(prompt, request, self.spec.bidirectional_spans(prompt), bad_words), {},
                            needed)
        return needed

    def receive_kv(self, request_id: str, parts: list[torch.Tensor]) -> None:
        """The blocks `admit_transferred` asked for, as the prefill replica's `send_kv` read them: the
        request decodes from its first token on."""
        indices = self.inputs.transfer_indices(request_id)
        block_ids, window_ids = self.scheduler.blocks_at(request_id, indices)
        self.kv_storage.write_blocks(block_ids, parts, window_ids)
        self.scheduler.transfer_done(request_id, len(indices))

    # ---- stepping -------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """Requests a step computes, or outputs due (a parked request, or one receiving its KV, waits for
        a call from outside)."""
        return self.scheduler.num_schedulable() > 0 or bool(self._pending_outputs)

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
        self.output_processor.scheduled([new.request_id for new in sched.new_requests], now)
        try:
            masks = self.structured.fill(list(sched.num_scheduled_tokens), sched.spec_token_ids)
            result = self.runner.execute(sched, self.inputs.step_inputs(sched, masks))
        except Exception as exc:  # noqa: BLE001 - a fault in one step must not take the engine down
            result = self._step_fault(sched, exc)
        self.output_processor.record_prompt_logprobs(result.prompt_logprobs)
        if self.tracing is not None:
            note_computed(self.output_processor.traced(), sched, now, time.time())
        core_outputs = self.scheduler.update(sched, result)
        if self.tracing is not None:
            note_encoded(self.output_processor.traced(),
                         lambda key: self.scheduler.encoder_entry_state(key) == EntryState.READY,
                         self.encoder_pool is not None, time.time())
        self.inputs.drop_encoded(set(sched.num_scheduled_tokens) | set(sched.encoder_items),
                                 self.scheduler.encoder_entry_state, self.scheduler.holds_encoder_entry)
        outputs, cuts = self.output_processor.process(core_outputs)
        for rid, cut in cuts.items():  # a stop string, a refused token: its KV is freed now
            if cut.num_dropped_tokens:
                self.scheduler.drop_tokens(rid, cut.num_dropped_tokens)
            if cut.status is not None:
                self.scheduler.finish_requests([rid], cut.status)
        return pending + outputs

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
        self.output_processor.mark_internal_error(rids)
        self.runner.free_encoder_outputs(self.inputs.produced_keys(sched))
        return ModelRunnerOutput(failed={rid: message for rid in rids})

    def _release(self, request_id: str) -> None:
        """A sequence finished (the output processor says so): drop its runner state and its payloads."""
        self.runner.release(request_id)
        self.inputs.release(request_id)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests (a request of n choices: all of them)."""
        ids = [cid for asked in request_ids for cid in (self.choices.choice_ids(asked) or [asked])]
        live = [rid for rid in ids if rid in self.output_processor]
        self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(live)

    # ---- introspection --------------------------------------------------------------------------
    def get_stats(self) -> dict[str, int | float | str]:
        return {**engine_stats(self.scheduler.snapshot(), self.sizes, self.runner, self.encoder_pool, self.structured),
                **self.scheduler.draft_counts()}

    def wait_for_compiled_decode(self, timeout_s: float | None = None) -> bool:
        """Block until the CPU's decode step, compiled in the background, replays (True), or it is not
        compiled, failed, or `timeout_s` passed (False). Serving never needs this: for benchmarks and tests."""
        return self.runner.cpu_decode_compile_state() != "off" and self.runner.wait_for_decode_graphs(timeout_s)

    def take_evictions(self) -> tuple[tuple[str, ...], tuple[bytes, ...]]:
        """(encoder content keys, KV prefix-block hashes) evicted since the last call: what a router in
        front of this engine should forget."""
        return self.scheduler.take_evictions()

    def take_encoder_outcomes(self) -> list[ItemOutcome]:
        """What arrived from encoder workers in the last step, unless already taken (for latency metrics)."""
        return self.runner.take_outcomes()

    def inspect(self) -> EngineInspection:
        """Read-only views of the engine's state for tests and benchmarks (engine/inspection.py)."""
        return EngineInspection(self.runner.request_views(), self.runner.encoder_outputs(), self.inputs.num_payloads(),
                                self.runner.graph_stats(), self.kv_storage, self.runner.last_step_timing())

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        owned = self.scheduler.ownership()
        live = set(owned.live_request_ids)
        assert self.output_processor.live_ids() == live, "engine and scheduler disagree on live requests"
        assert self.inputs.live_ids() == live, "the engine keeps inputs of finished requests"
        self.choices.check_integrity(live)
        assert self.structured.tracked_ids() <= live, "a grammar matcher outlived its request"
        assert set(self.runner.request_views()) <= live, "runner holds state of finished requests"
        assert self.runner.cross_kv_holders() <= owned.cross_kv_holder_ids, \
            "the runner holds cross-attention KV the budget lost"
        ready, stored = owned.ready_encoder_keys, set(self.runner.encoder_outputs())
        assert ready <= stored, "a ready encoder entry has no tensor in the runner"
        # the runner holds only tensors the cache accounts for (or has freed and will hand over next step)
        assert stored <= ready | owned.pending_freed_encoder_keys, "the runner holds an encoder output the cache lost"


def _cross_attends(prompt: ProcessedPrompt) -> bool:
    """Does the prompt have images read by cross-attention? Such a request decodes where it prefilled: its
    images' K/V is not in the KV blocks a hand-off moves, and no pixel moves."""
    return any(item.cross_attention is not None for item in prompt.items)

"""The engine: composes the processor, the scheduler (core/) and the model runner (runner/).

Role: `add_request` turns user input into a `ProcessedPrompt`, hands the scheduler a torch-free
`Request` and the runner the payload; `step` runs schedule -> execute -> update, detokenizes,
applies stop strings and returns `RequestOutput`s; `abort_request` finishes requests at any time.
This is the only module that holds both core/ and runner/.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mmserve.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from mmserve.core.kv_cache import KVCacheManager
from mmserve.core.request import ItemSpec, Request, RequestStatus
from mmserve.core.scheduler import Scheduler, SchedulerLimits
from mmserve.core.step import EngineCoreOutput
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.engine.prompts import parse_prompt
from mmserve.errors import InvalidInputError
from mmserve.inputs.items import ProcessedPrompt
from mmserve.models.loader import generation_eos_ids, load_model, parse_dtype
from mmserve.models.qwen2_vl.processor import Qwen2VLProcessor
from mmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mmserve.runner.attention import PagedKVCache
from mmserve.runner.model_runner import ModelRunner
from mmserve.sampling_params import SamplingParams


@dataclass
class _Tracked:
    """Engine-side view of a live request: what its outputs need."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    stop_reason: int | str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device)
        self.dtype = parse_dtype(config.dtype)
        self.model = load_model(config.model, self.dtype, self.device)
        self.processor = Qwen2VLProcessor(config.model, self.model.config, config.media)
        text = self.model.config.text
        self.max_model_len = config.scheduler.max_model_len or text.max_position_embeddings
        num_blocks = self._num_kv_blocks()
        self.kv_cache = PagedKVCache(text.num_hidden_layers, num_blocks, config.cache.block_size,
                                     text.num_key_value_heads, text.head_dim, self.dtype, self.device)
        kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        sched = config.scheduler
        self.scheduler = Scheduler(SchedulerLimits(sched.max_num_seqs, sched.max_num_batched_tokens,
                                                   sched.enable_chunked_prefill, self.max_model_len), kv)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        eos = set(self.model.config.eos_token_ids) | set(generation_eos_ids(config.model))
        if self.processor.tokenizer.eos_token_id is not None:
            eos.add(self.processor.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.tracked: dict[str, _Tracked] = {}

    def _num_kv_blocks(self) -> int:
        cache, text = self.config.cache, self.model.config.text
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = PagedKVCache.bytes_per_block(text.num_hidden_layers, cache.block_size,
                                                 text.num_key_value_heads, text.head_dim, self.dtype)
        num = (cache.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // per_block
        if num < 1:
            raise ValueError(f"kv_cache_bytes={cache.kv_cache_bytes} is smaller than one block ({per_block} bytes)")
        return int(num)

    # ---- input ----------------------------------------------------------------------------------
    def process(self, raw_prompt: Any, mm_processor_kwargs: dict[str, Any] | None = None) -> ProcessedPrompt:
        p = parse_prompt(raw_prompt, mm_processor_kwargs)
        return self.processor.process(p.prompt, p.prompt_token_ids, p.images, p.videos, p.mm_processor_kwargs)

    def process_chat(self, messages: list[dict[str, Any]], mm_processor_kwargs: dict[str, Any] | None = None,
                     **template_kwargs: Any) -> ProcessedPrompt:
        chat = self.processor.render_chat(messages, **template_kwargs)
        return self.processor.process(chat.prompt, None, chat.images, chat.videos, mm_processor_kwargs)

    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if prompt.num_tokens == 0:
            raise InvalidInputError("the prompt is empty")
        if prompt.num_tokens + 1 > self.max_model_len:
            raise InvalidInputError(f"the prompt has {prompt.num_tokens} tokens; the model's context is "
                                    f"{self.max_model_len} tokens")
        if request_id in self.tracked:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        items = tuple(ItemSpec(i, it.offset, it.length, it.content_hash, it.encoder_tokens, it.output_rows)
                      for i, it in enumerate(prompt.items))
        request = Request(request_id, list(prompt.prompt_token_ids), params, self.eos_token_ids, items,
                          arrival_time or time.time())
        detok = IncrementalDetokenizer(self.processor.tokenizer, request.prompt_token_ids,
                                       params.skip_special_tokens, params.stop, params.include_stop_str_in_output)
        self.tracked[request_id] = _Tracked(request, prompt.prompt, detok, RequestMetrics(request.arrival_time))
        self.runner.add_prompt(request_id, prompt, tuple(sorted(request.stop_token_ids)))
        self.scheduler.add_request(request)

    # ---- stepping -------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.time()
        for new in sched.new_requests:
            tracked = self.tracked[new.request_id]
            tracked.metrics.first_scheduled_time = tracked.metrics.first_scheduled_time or now
        result = self.runner.execute(sched)
        core_outputs = self.scheduler.update(sched, result)
        return [self._output(o) for o in core_outputs]

    def _output(self, core: EngineCoreOutput) -> RequestOutput:
        tracked = self.tracked[core.request_id]
        now = time.time()
        if core.new_token_ids and tracked.metrics.first_token_time is None:
            tracked.metrics.first_token_time = now
        finish = core.finish_reason
        if core.new_token_ids:
            stop_string = tracked.detokenizer.update(list(core.new_token_ids))
            if stop_string is not None and finish is None:
                self.scheduler.finish_requests([core.request_id], RequestStatus.FINISHED_STOPPED)
                finish, tracked.stop_reason = "stop", stop_string
        if core.stop_token_id is not None:
            tracked.stop_reason = core.stop_token_id
        return self._make_output(tracked, finish, core.error)

    def _make_output(self, tracked: _Tracked, finish: str | None, error: str | None = None) -> RequestOutput:
        request = tracked.request
        finished = finish is not None
        if finished:
            tracked.metrics.finish_time = time.time()
            tracked.metrics.num_preemptions = request.num_preemptions
            self.tracked.pop(request.request_id, None)
            self.runner.drop_prompt(request.request_id)
        delta = tracked.detokenizer.take_delta(finished)
        completion = CompletionOutput(0, tracked.detokenizer.output_text, list(request.output_token_ids), finish,
                                      tracked.stop_reason if finish == "stop" else None)
        return RequestOutput(request.request_id, tracked.prompt, request.prompt_token_ids, [completion], finished,
                             max(request.num_cached_tokens, 0), tracked.metrics, error, delta)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for rid in request_ids:
            tracked = self.tracked.get(rid)
            if tracked is None:
                continue
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            outputs.append(self._make_output(tracked, "abort"))
        return outputs

    # ---- introspection --------------------------------------------------------------------------
    def get_stats(self) -> dict[str, int | float]:
        s, kv = self.scheduler.stats, self.scheduler.kv
        return {
            "requests_finished": s.requests_finished,
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "prompt_tokens": s.prompt_tokens,
            "prompt_tokens_computed": s.prompt_tokens_computed,
            "prefix_cache_hit_tokens": kv.stats.prefix_cache_hit_tokens,
            "generation_tokens": s.generation_tokens,
            "num_preemptions": s.num_preemptions,
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            "kv_cache_evictions": kv.stats.evictions,
            "encoder_items_encoded": self.runner.num_items_encoded,
        }

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        live = set(self.scheduler.requests)
        assert set(self.tracked) == live, "engine and scheduler disagree on live requests"
        assert set(self.runner.prompts) <= live, "runner holds payloads of finished requests"

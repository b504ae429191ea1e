"""The model runner: execute one `SchedulerOutput` on the device, return sampled tokens.

Role: keep per-request device-side state (token ids, block table, M-RoPE positions, encoder
outputs), encode the items the scheduler asked for, build the flattened ragged batch (token ids,
positions, KV slots, fusion indices) on the CPU, ship it with non_blocking copies, run the model
and the sampler. One host sync per step: the sampled token ids.

What it does not know: scheduling policy, budgets, text. Pixels arrive through `add_prompt`
(registered by the engine, keyed by request) and never cross the scheduler boundary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.core.step import ModelRunnerOutput, NewRequestData, SchedulerOutput
from mmserve.inputs.items import ProcessedPrompt
from mmserve.models.qwen2_vl.model import Qwen2VLForConditionalGeneration
from mmserve.runner.attention import PagedAttentionMetadata, PagedKVCache
from mmserve.runner.batch import BatchBuilder
from mmserve.runner.encoder_runner import EncodeJob, EncoderRunner
from mmserve.runner.fusion import ChunkPiece, MultimodalRuntimeData
from mmserve.runner.sampler import Sampler, SamplingMetadata
from mmserve.sampling_params import SamplingParams


@dataclass
class StepTiming:
    """Wall time of the last step, and of the part spent in the model forward (incl. logits)."""

    total_s: float = 0.0
    forward_s: float = 0.0
    num_tokens: int = 0


@dataclass
class RunnerRequest:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    prompt: ProcessedPrompt
    sampling_params: SamplingParams
    stop_token_ids: tuple[int, ...]
    block_ids: list[int]
    num_computed_tokens: int
    mm: MultimodalRuntimeData | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def position_columns(self, start: int, end: int) -> np.ndarray:
        """(3, end - start) M-RoPE positions of tokens [start, end)."""
        p = self.num_prompt_tokens
        cols = [self.prompt.mrope_positions[:, start:min(end, p)]]
        if end > p:
            row = np.arange(max(start, p), end, dtype=np.int64) + self.prompt.rope_delta
            cols.append(np.broadcast_to(row, (3, row.size)))
        return cols[0] if len(cols) == 1 else np.concatenate(cols, axis=1)


class ModelRunner:
    def __init__(self, model: Qwen2VLForConditionalGeneration, kv: PagedKVCache, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.sampler = Sampler()
        self.prompts: dict[str, tuple[ProcessedPrompt, tuple[int, ...]]] = {}
        self.requests: dict[str, RunnerRequest] = {}
        dtype = next(model.parameters()).dtype
        self.encoder = EncoderRunner(model.encode_items, model.config.vision.out_hidden_size, dtype, device)
        self.last_step = StepTiming()

    # ---- payloads -------------------------------------------------------------------------------
    def add_prompt(self, request_id: str, prompt: ProcessedPrompt, stop_token_ids: tuple[int, ...]) -> None:
        self.prompts[request_id] = (prompt, stop_token_ids)

    def drop_prompt(self, request_id: str) -> None:
        self.prompts.pop(request_id, None)
        self.requests.pop(request_id, None)

    # ---- step -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        started = time.perf_counter()
        self.last_step = StepTiming(num_tokens=sched.total_num_scheduled_tokens)
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
        self.encoder.free(sched.free_encoder_keys)
        for new in sched.new_requests:
            self.requests[new.request_id] = self._start(new)
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            assert state.num_computed_tokens == cached.num_computed_tokens, "runner and scheduler disagree"
        result = ModelRunnerOutput()
        self._encode(sched, result)
        # each prefill chunk's fusion pieces, planned once: to check its rows are ready, then to fuse them
        plans = {rid: self._plan(rid, n) for rid, n in sched.num_scheduled_tokens.items()}
        result.skipped = {rid for rid, pieces in plans.items() if not self._rows_ready(rid, pieces)}
        scheduled = {rid: n for rid, n in sched.num_scheduled_tokens.items()
                     if rid not in result.failed and rid not in result.skipped}
        if scheduled:
            self._forward(scheduled, plans, result)
        self.last_step.total_s = time.perf_counter() - started
        return result

    def _start(self, new: NewRequestData) -> RunnerRequest:
        prompt, stop_ids = self.prompts[new.request_id]
        mm = None
        if prompt.items:
            mm = MultimodalRuntimeData(prompt.embed_mask, prompt.embed_cumsum, [i.output_rows for i in prompt.items])
        return RunnerRequest(new.request_id, list(new.token_ids), new.num_prompt_tokens, prompt,
                             new.sampling_params, stop_ids, list(new.block_ids), new.num_computed_tokens, mm)

    def _encode(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Encode this step's items as one batch; validate, then commit to the store."""
        jobs = []
        for rid, indices in sched.encoder_items.items():
            for i in indices:
                item = self.requests[rid].prompt.items[i]
                if item.pixel_values is None:
                    result.failed[rid] = f"{item.modality} {item.index}: pixels were released before encoding"
                    continue
                jobs.append(EncodeJob(item.content_hash, item.pixel_values, item.grid_thw, item.output_rows))
        outcome = self.encoder.forward_items(jobs)
        result.encoder_failed_keys = outcome.failed_keys
        result.encoder_batch_error = outcome.batch_error
        for rid in sched.encoder_items:  # lifecycle: once every item is ready, drop the raw pixels
            items = self.requests[rid].prompt.items
            if all(it.content_hash in self.encoder.store for it in items):
                for it in items:
                    it.pixel_values = None

    def _plan(self, rid: str, num: int) -> list[ChunkPiece]:
        """The encoder rows this request's next `num` tokens fuse (none outside a multimodal prefill)."""
        state = self.requests[rid]
        if state.mm is None or state.num_computed_tokens >= state.num_prompt_tokens:
            return []
        return state.mm.plan_chunk(state.num_computed_tokens, state.num_computed_tokens + num)

    def _rows_ready(self, rid: str, pieces: list[ChunkPiece]) -> bool:
        """Are the encoder rows this request's chunk fuses all in the store?"""
        items = self.requests[rid].prompt.items
        return all(items[p.item_index].content_hash in self.encoder.store for p in pieces)

    def _forward(self, scheduled: dict[str, int], plans: dict[str, list[ChunkPiece]],
                 result: ModelRunnerOutput) -> None:
        builder = BatchBuilder(self.block_size, self.device)
        for rid, num in scheduled.items():
            state, pieces = self.requests[rid], plans[rid]
            outputs = {p.item_index: self.encoder.store[state.prompt.items[p.item_index].content_hash]
                       for p in pieces}
            builder.add(state, num, pieces, outputs)
        batch = builder.build()
        embeds = self.model.embed(batch.input_ids)
        for rows, positions in batch.fusion:
            embeds.index_copy_(0, positions, rows.to(embeds.dtype))
        forward_started = time.perf_counter()
        hidden = self.model(embeds, batch.positions, self.kv, batch.attn)
        if batch.sample_rows:
            logits = self.model.compute_logits(hidden[batch.sample_index])
            if logits.is_cuda:
                torch.cuda.synchronize()  # only so the timing below is honest
            self.last_step.forward_s = time.perf_counter() - forward_started
            tokens = self.sampler(logits, self._sampling_metadata(batch.sample_rows)).tolist()
            for state, token in zip(batch.sample_rows, tokens):
                state.token_ids.append(token)
                result.sampled_token_ids[state.request_id] = token
        for rid, num in scheduled.items():
            self.requests[rid].num_computed_tokens += num

    def _sampling_metadata(self, rows: list[RunnerRequest]) -> SamplingMetadata:
        params = [r.sampling_params for r in rows]
        return SamplingMetadata(
            temperatures=[p.temperature for p in params],
            top_ks=[p.top_k for p in params],
            top_ps=[p.top_p for p in params],
            min_ps=[p.min_p for p in params],
            generators=[self._generator(r) for r in rows],
            banned_token_ids=[r.stop_token_ids if r.num_output_tokens < r.sampling_params.min_tokens else ()
                              for r in rows],
        )

    def _generator(self, state: RunnerRequest) -> torch.Generator | None:
        seed = state.sampling_params.seed
        if seed is None:
            return None
        # seeded per (seed, output index): the same tokens whatever the batch, also after preemption
        gen = torch.Generator(device=self.device)
        gen.manual_seed((seed * 1_000_003 + state.num_output_tokens) % 2**63)
        return gen


__all__ = ["ModelRunner", "PagedAttentionMetadata", "RunnerRequest"]

"""The model runner: execute one `SchedulerOutput` on the device, return sampled tokens (a pooling runner:
vectors, runner/pooler.py).

Role: keep per-request device-side state (token ids, block table, positions, the fusion map),
encode the items the scheduler asked for (their payloads arrive keyed by content key with the
step), build the flattened ragged batch (token ids, positions, KV slots, fusion indices) on the
CPU, ship it with non_blocking copies, run the model and the sampler. One host sync per step: the
sampled token ids. Reports which encoder keys it committed and which failed. For a family that
cross-attends to its images, a request's cross-attention K/V is built from its items' encoder outputs
the first time one of its chunks runs (models/layers/cross_attention.py), and each step's sequences carry
their cross-attention inputs in the attention metadata. With captured graphs
(runner/graphs/) the encoder replays a bucket's graph and a decode-only step replays a (batch,
width) graph; anything no graph holds runs eagerly. The engine talks to it through its methods only:
`execute`, `release`, `free_encoder_outputs`, `take_outcomes` and the views and counters
(`encoder_outputs`, `request_views`, `encoder_counts`, `graph_stats`, `last_step_timing`,
`num_encoder_items_in_flight`).

What it does not know: scheduling policy, budgets, text, any family (the model is a
`FamilyModel`; its facts come from the `FamilySpec`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

import torch

from mmserve.core.step import ModelRunnerOutput, NewRequestData, SchedulerOutput
from mmserve.faults import FaultPlan
from mmserve.models.layers.attention import CrossAttentionInputs
from mmserve.models.layers.cross_attention import CrossKV, step_inputs
from mmserve.models.spec import FamilyModel, FamilySpec
from mmserve.runner.attention import PagedAttentionBackend
from mmserve.runner.batch import Batch, BatchBuilder
from mmserve.runner.draft_model import DraftModelProposer
from mmserve.runner.encoder.async_dispatch import AsyncEncoder
from mmserve.runner.encoder.pool import EncoderPool, ItemOutcome
from mmserve.runner.encoder.runner import EncoderRunner, OutputShape
from mmserve.runner.fusion import ChunkPiece, MultimodalRuntimeData
from mmserve.runner.graphs.decode_graphs import DecodeGraphRunner, DecodeGraphSettings
from mmserve.runner.graphs.encoder_graphs import (
    EncoderGraphSettings,
    build_encoder_graphs,
    graphed_encode_fn,
)
from mmserve.runner.logprob_entries import prompt_logprobs, token_logprobs
from mmserve.runner.mtp import MtpProposer, StepHidden
from mmserve.runner.pooler import StepPooler
from mmserve.runner.reports import EncoderCounts, GraphStats, RunnerRequestView, StepTiming
from mmserve.runner.sampler import Sampler, SamplingMetadata, make_generator, sampled_logprobs
from mmserve.runner.sampling_state import (
    RequestSampling,
    SampledRow,
    changes_logits,
    needs_state,
    sampling_metadata,
    verification_metadata,
)
from mmserve.runner.speculation import DraftRows, accept, roll_back_states, verify
from mmserve.runner.state import RunnerPrompt, RunnerRequest, StepInputs


class ModelRunner:
    def __init__(self, model: FamilyModel, spec: FamilySpec, attention: PagedAttentionBackend,
                 device: torch.device, pool: EncoderPool | None = None, encoder_timeout_s: float = 30.0,
                 encoder_graphs: EncoderGraphSettings | None = None,
                 decode_graphs: DecodeGraphSettings | None = None, faults: FaultPlan | None = None,
                 logprobs_mode: str = "raw_logprobs", pooler: StepPooler | None = None,
                 drafter: DraftModelProposer | MtpProposer | None = None) -> None:
        """`logprobs_mode` (config.LOGPROBS_MODES): what sampled tokens' logprob entries report; `pooler`: a
        pooling runner's (each finished prompt's vector instead of a sampled token); `drafter`: speculative
        decoding's drafter, a draft model or an MTP head (proposes after a step what the next verifies)."""
        self.pooler, self.drafter = pooler, drafter
        self._step_hidden: StepHidden | None = None  # the last step's hidden states, for an MTP drafter
        self.model = model
        self.spec = spec
        self.attention = attention
        self.device = device
        self.block_size = attention.block_size
        self.sampler = Sampler()
        self.logprobs_processed = logprobs_mode.startswith("processed")
        self.logprobs_normalized = logprobs_mode.endswith("logprobs")
        self.requests: dict[str, RunnerRequest] = {}
        dtype = next(model.parameters()).dtype
        # captured graphs (None: eager, as always on the CPU unless asked for)
        self.encoder_graphs = None if encoder_graphs is None else build_encoder_graphs(model, encoder_graphs, device)
        encode = model.encode_items if self.encoder_graphs is None else graphed_encode_fn(self.encoder_graphs,
                                                                                          model.encode_items)
        faults = faults or FaultPlan()
        if faults.wrap_encode is not None:
            encode = faults.wrap_encode(encode)
        self.encoder = EncoderRunner(encode, OutputShape(spec.num_embedding_streams, spec.embed_dim, dtype))
        self.decode_graphs = None
        if decode_graphs is not None:
            self.decode_graphs = DecodeGraphRunner(model, attention, decode_graphs, device,
                                                    spec.forward_reads_token_ids)
            self.decode_graphs.start()
        # with workers, items are encoded elsewhere and arrive in later steps
        self.async_encoder = None if pool is None else AsyncEncoder(pool, self.encoder, encoder_timeout_s)
        self._outcomes: list[ItemOutcome] = []  # what arrived from workers in the last step
        self.last_step = StepTiming()
        self.fault_token = faults.step_fault_token_id  # a step holding this token id raises (a test's fault)
        self._cross_kv_builds = 0

    # ---- the engine's calls besides execute -----------------------------------------------------
    def wait_for_decode_graphs(self, timeout_s: float | None = None) -> bool:
        """Block until the decode graphs (compiled in the background on the CPU) are built; False: none are
        in use (off, failed, or not built within `timeout_s`)."""
        return self.decode_graphs is not None and self.decode_graphs.wait(timeout_s)

    def cpu_decode_compile_state(self) -> str:
        """"off" (no compiled decode step), or its state: "compiling" (steps run eagerly meanwhile), "ready",
        "failed" or "stopped"."""
        graphs = self.decode_graphs
        return graphs.stats.state if graphs is not None and graphs.settings.compile else "off"

    def shutdown(self) -> None:
        """Stop a background compile: interrupted where it is, its thread waited for (DecodeGraphRunner.stop)."""
        if self.decode_graphs is not None:
            self.decode_graphs.stop()

    def release(self, request_id: str) -> None:
        """Drop a finished request's state now (the step contract would also drop it next step)."""
        self.requests.pop(request_id, None)

    def free_encoder_outputs(self, keys: Sequence[str]) -> None:
        """Forget these encoder outputs (the engine no longer trusts them: a faulted step made them)."""
        self.encoder.free(keys)

    def take_outcomes(self) -> list[ItemOutcome]:
        """The worker outcomes that arrived in the last step, unless already taken (for latency metrics)."""
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    @property
    def num_encoder_items_in_flight(self) -> int:
        """Items handed to encoder workers whose outcome is still wanted (0 when encoding inline)."""
        return 0 if self.async_encoder is None else len(self.async_encoder.jobs)

    def encoder_outputs(self) -> Mapping[str, torch.Tensor]:
        """The committed encoder outputs by content key: a read-only, live view."""
        return MappingProxyType(self.encoder.store)

    def encoder_counts(self) -> EncoderCounts:
        return EncoderCounts(self.encoder.num_items_encoded, self.encoder.num_tokens_encoded)

    def graph_stats(self) -> GraphStats:
        """A copy of the graphs' counters as of now."""
        encoder = None if self.encoder_graphs is None else self.encoder_graphs.stats
        decode = None if self.decode_graphs is None else self.decode_graphs.stats
        return GraphStats(None if encoder is None else replace(encoder, captured=list(encoder.captured),
                                                                 skipped_over_budget=list(encoder.skipped_over_budget)),
                          None if decode is None else replace(decode, captured=list(decode.captured)))

    def last_step_timing(self) -> StepTiming:
        """A copy of the last step's timing."""
        return replace(self.last_step)

    @property
    def cross_kv_builds(self) -> int:
        """Requests' cross-attention K/V built: once per request, again after a preemption."""
        return self._cross_kv_builds

    def cross_kv_holders(self) -> set[str]:
        """The requests whose cross-attention K/V the runner holds."""
        return {rid for rid, r in self.requests.items() if r.cross is not None}

    def request_views(self) -> dict[str, RunnerRequestView]:
        """Every request the runner holds state for, read-only."""
        return {rid: RunnerRequestView(r.num_prompt_tokens, r.num_computed_tokens, tuple(r.block_ids))
                for rid, r in self.requests.items()}

    # ---- step -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, inputs: StepInputs) -> ModelRunnerOutput:
        started = time.perf_counter()
        self.last_step = StepTiming(num_tokens=sched.total_num_scheduled_tokens)
        for rid in sched.finished_request_ids:
            self.requests.pop(rid, None)
        self.encoder.free(sched.free_encoder_keys)
        if self.async_encoder is not None:
            self.async_encoder.free(sched.free_encoder_keys)
        for new in sched.new_requests:
            self.requests[new.request_id] = self._start(new, inputs.prompts[new.request_id])
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.window_block_ids.extend(cached.new_window_block_ids)
            assert state.num_computed_tokens == cached.num_computed_tokens, "runner and scheduler disagree"
        for rid, drafts in sched.spec_token_ids.items():  # computed after its last token, verified below
            self.requests[rid].token_ids.extend(drafts)
        result = ModelRunnerOutput()
        if self.async_encoder is None:
            outcome = self.encoder.forward_items(inputs.encoder_jobs)
        else:
            step = self.async_encoder.step(inputs.encoder_jobs)
            outcome, self._outcomes = step.result, step.outcomes
            result.encoder_in_flight_keys = step.in_flight
        result.encoder_committed_keys = outcome.committed
        result.encoder_failed_keys = outcome.failed_keys
        result.encoder_batch_error = outcome.batch_error
        # each prefill chunk's fusion pieces, planned once: to check its rows are ready, then to fuse them
        plans = {rid: self._plan(rid, n) for rid, n in sched.num_scheduled_tokens.items()}
        result.skipped = {rid for rid, pieces in plans.items() if not self._rows_ready(rid, pieces)}
        scheduled = {rid: n for rid, n in sched.num_scheduled_tokens.items() if rid not in result.skipped}
        if scheduled:
            self._forward(scheduled, plans, result, inputs.token_bitmasks, sched.spec_token_ids)
        drafter = self.drafter
        if drafter is not None and (sched.propose_drafts or drafter.reads_hidden):  # for those that got tokens
            result.draft_token_ids = drafter.propose(self.requests, {
                rid: k for rid, k in sched.propose_drafts.items() if rid in result.sampled_token_ids},
                self._step_hidden)
        self._step_hidden = None
        for rid, snapshot_id in sched.state_snapshots.items():  # states at block boundaries, for prefix hits
            if rid in scheduled:
                state = self.attention.state
                state.copy(self.requests[rid].state_slot, state.snapshot_row(snapshot_id))
        self.last_step.total_s = time.perf_counter() - started
        return result

    def _start(self, new: NewRequestData, prompt: RunnerPrompt) -> RunnerRequest:
        mm = None
        if prompt.item_keys and not prompt.cross_spans:  # cross-attended items fuse no prompt rows
            mm = MultimodalRuntimeData(prompt.embed_mask, prompt.embed_cumsum, list(prompt.item_rows))
        state = self.attention.state
        if new.state_slot is not None and new.state_restore is not None:  # a prefix hit resumes from a snapshot
            state.copy(state.snapshot_row(new.state_restore), new.state_slot)
        elif new.state_slot is not None:  # from zero (a new prompt, or one recomputed after a preemption)
            state.clear(new.state_slot)
        return RunnerRequest(new.request_id, list(new.token_ids), new.num_prompt_tokens, prompt,
                             new.sampling_params, list(new.block_ids), new.num_computed_tokens, mm,
                             state_slot=new.state_slot, window_block_ids=list(new.window_block_ids))

    def _plan(self, rid: str, num: int) -> list[ChunkPiece]:
        """The encoder rows this request's next `num` tokens fuse (none outside a multimodal prefill)."""
        state = self.requests[rid]
        if state.mm is None or state.num_computed_tokens >= state.num_prompt_tokens:
            return []
        return state.mm.plan_chunk(state.num_computed_tokens, state.num_computed_tokens + num)

    def _rows_ready(self, rid: str, pieces: list[ChunkPiece]) -> bool:
        """Are the encoder rows this request's chunk fuses all in the store (and, for a request that
        cross-attends without its K/V yet, every item's output)?"""
        state = self.requests[rid]
        keys = state.prompt.item_keys
        if state.prompt.cross_spans and state.cross is None:
            return all(key in self.encoder.store for key in keys)
        return all(keys[p.item_index] in self.encoder.store for p in pieces)

    def _cross_inputs(self, scheduled: dict[str, int]) -> list[CrossAttentionInputs | None]:
        """Each scheduled sequence's cross-attention inputs (None: it has no images), building the K/V of a
        request that has none yet from its items' encoder outputs; [] when no sequence cross-attends."""
        out = []
        for rid, num in scheduled.items():
            state = self.requests[rid]
            if not state.prompt.cross_spans:
                out.append(None)
                continue
            if state.cross is None:
                state.cross = CrossKV.build(self.model, [self.encoder.store[key] for key in state.prompt.item_keys],
                                            state.prompt.cross_spans)
                self._cross_kv_builds += 1
            start = state.num_computed_tokens
            out.append(step_inputs(state.cross, start, start + num, self.device))
        return out if any(c is not None for c in out) else []

    def _forward(self, scheduled: dict[str, int], plans: dict[str, list[ChunkPiece]], result: ModelRunnerOutput,
                 token_bitmasks: dict[str, torch.Tensor], drafts: dict[str, tuple[int, ...]]) -> None:
        builder = BatchBuilder(self.block_size, self.device, self.attention.cpu_plan,
                               self.attention.storage.num_window_blocks is not None)
        for rid, num in scheduled.items():
            state, pieces = self.requests[rid], plans[rid]
            outputs = {p.item_index: self.encoder.store[state.prompt.item_keys[p.item_index]] for p in pieces}
            builder.add(state, num, pieces, outputs, len(drafts.get(rid, ())))
        forward_started = time.perf_counter()
        # a captured decode step holds no cross-attention: a step with a sequence that cross-attends runs eagerly
        cross = self._cross_inputs(scheduled)
        logits = None if self.decode_graphs is None or cross else self._decode_graph_logits(builder)
        if logits is None:
            hidden, batch, forward_started = self._eager_forward(builder, cross)
            if self.pooler is not None:  # a pooling runner: each finished prompt's vector, nothing sampled
                result.pooled = self.pooler.pool(hidden, [(self.requests[rid], n) for rid, n in scheduled.items()])
            else:
                logits = self.model.compute_logits(hidden[batch.sample_index]) if batch.sample_rows else None
                result.prompt_logprobs = prompt_logprobs(self.model, hidden, batch.prompt_logprob_rows)
                verified = verify(self.model, hidden, builder.draft_rows, self.logprobs_normalized,
                                  {d.request_id: meta for d in builder.draft_rows
                                   if (meta := self._verification_meta(d, token_bitmasks)) is not None})
                for rows in builder.draft_rows:
                    rid, tokens = rows.request_id, verified.tokens[rows.request_id]
                    scheduled[rid] = accept(self.requests[rid], len(drafts[rid]), tokens)
                    roll_back_states(self.attention.state, batch.attn.recorded_states, rows, scheduled[rid])
                    result.sampled_token_ids[rid] = tokens
                    if self.requests[rid].sampling is not None:  # penalties count what was emitted
                        for token in tokens:
                            self.requests[rid].sampling.record(token)
                result.sampled_logprobs.update(verified.logprobs)
                if self.drafter is not None and self.drafter.reads_hidden:  # an MTP head reads the kept rows
                    firsts = itertools.accumulate(builder.query_lens[:-1], initial=0)
                    self._step_hidden = StepHidden(hidden, {rid: (first, scheduled[rid])
                                                            for rid, first in zip(scheduled, firsts)})
            self.last_step.forward_s = time.perf_counter() - forward_started  # a sampled step's sync resets it
        if builder.sample_rows and self.pooler is None:
            rows = builder.sample_rows
            meta = sampling_metadata([self._sampled_row(r, logits.shape[1], token_bitmasks.get(r.request_id))
                                      for r in rows], self.device)
            keep = self.logprobs_processed and meta.num_logprobs is not None
            token_ids, processed = self.sampler.sample(logits, meta, keep_processed=keep)
            logprobs = sampled_logprobs(logits if processed is None else processed, token_ids, meta.num_logprobs,
                                        normalize=self.logprobs_normalized)
            tokens = token_ids.tolist()  # the one sync (with logprobs, their transfers follow)
            self.last_step.forward_s = time.perf_counter() - forward_started
            for state, token in zip(rows, tokens):
                state.token_ids.append(token)
                if state.sampling is not None:
                    state.sampling.record(token)
                result.sampled_token_ids[state.request_id] = token
            if logprobs is not None:
                result.sampled_logprobs.update({rows[row].request_id: entry for row, entry in
                                                zip(logprobs.rows, token_logprobs(logprobs, meta.num_logprobs))})
        for rid, num in scheduled.items():
            self.requests[rid].num_computed_tokens += num

    def _decode_graph_logits(self, builder: BatchBuilder) -> torch.Tensor | None:
        """A decode-only step's logits from a captured graph; None: no graph holds it."""
        if self.fault_token is not None and any(self.fault_token in ids for ids in builder.ids):
            return None  # the eager path raises the test fault
        return self.decode_graphs.run(builder)

    def _eager_forward(self, builder: BatchBuilder, cross: list[CrossAttentionInputs | None]
                       ) -> tuple[torch.Tensor, Batch, float]:
        """The step's (num_tokens, hidden) final hidden states, its batch, and when the model forward began
        (after the batch is built and fused). `cross`: the sequences' cross-attention inputs ([]: none
        cross-attends)."""
        batch = builder.build()
        batch.attn.cross = cross
        embeds = self.model.embed(batch.input_ids)
        extra = None
        if batch.fusion and self.spec.num_embedding_streams > 1:  # deepstack: zero at text rows
            extra = embeds.new_zeros(self.spec.num_embedding_streams - 1, *embeds.shape)
        for rows, positions in batch.fusion:  # rows: (streams, n, hidden)
            embeds.index_copy_(0, positions, rows[0].to(embeds.dtype))
            if extra is not None:
                extra.index_copy_(1, positions, rows[1:].to(embeds.dtype))
        if self.fault_token is not None and bool((batch.input_ids == self.fault_token).any()):
            raise RuntimeError(f"test fault: token {self.fault_token} in the batch (FaultPlan.step_fault_token_id)")
        forward_started = time.perf_counter()
        hidden = self.model(embeds, batch.positions, self.attention, batch.attn, extra,
                            **self.spec.forward_kwargs(batch.input_ids))
        return hidden, batch, forward_started

    def _sampled_row(self, state: RunnerRequest, vocab_size: int, token_bitmask: torch.Tensor | None,
                     num_drafts: int = 0) -> SampledRow:
        """The row after the request's last known token (`num_drafts`: its token ids end in drafts, not yet its)."""
        params, known = state.sampling_params, len(state.token_ids) - num_drafts
        if state.sampling is None and needs_state(params):  # built on first use, also after a preemption
            state.sampling = RequestSampling.build(params, state.token_ids[:known], state.num_prompt_tokens, vocab_size,
                                                   self.device)
        bad_words = state.prompt.bad_words_token_ids
        return SampledRow(params, known - state.num_prompt_tokens,
                          state.token_ids[state.num_prompt_tokens:known] if bad_words else (),
                          state.stop_token_ids, bad_words, state.sampling, self._generator(state), token_bitmask)

    def _verification_meta(self, rows: DraftRows, token_bitmasks: dict[str, torch.Tensor]) -> SamplingMetadata | None:
        """How each of a verification's rows is processed (None: its options change no logit)."""
        state, bitmasks = self.requests[rows.request_id], token_bitmasks.get(rows.request_id)
        if not changes_logits(state.sampling_params, state.prompt.bad_words_token_ids, bitmasks is not None):
            return None
        return verification_metadata(self._sampled_row(state, self.spec.vocab_size, None, len(rows.drafts)),
                                     rows.drafts, bitmasks, self.device)

    def _generator(self, state: RunnerRequest) -> torch.Generator | None:
        seed = state.sampling_params.seed
        if seed is None:
            return None
        # seeded per (seed, output index): the same tokens whatever the batch, also after preemption
        return make_generator(seed * 1_000_003 + state.num_output_tokens, self.device)

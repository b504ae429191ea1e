"""Building an engine's parts from its config: the model, the KV cache, the scheduler, the runner.

Role: load the model (laid out for the CPU's kernels), make the frontend (processor, `FamilySpec`),
size the KV cache, the context and the encoder budgets from the spec (engine/sizing.py), start the
encoder workers if asked, and compose the scheduler (core/) and the model runner (runner/) over them.
`assemble` returns the parts in one frozen `EngineParts`; the engine keeps them and runs the steps.
What it does not know: requests, steps, outputs; any family (the registry builds the family's pieces).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from mmserve.config import EngineConfig
from mmserve.core.budget import EncoderBudget
from mmserve.core.chunk_policy import ChunkBoundaryPolicy, resolve_token_budget
from mmserve.core.cross_kv import CrossKVBook
from mmserve.core.drafts import DraftPolicy
from mmserve.core.encoder_cache import EncoderCacheManager
from mmserve.core.item_scheduler import ItemScheduler
from mmserve.core.kv_cache import KVCacheManager
from mmserve.core.scheduler import Scheduler, SchedulerLimits
from mmserve.core.state_slots import StateSlotLayout, StateSlotPool
from mmserve.core.state_snapshots import HybridStates
from mmserve.core.window_kv import WindowedKVCacheManager
from mmserve.engine.drafter_loading import build_proposer, load_drafter
from mmserve.engine.drafter_loading import kv_bytes_per_token as drafter_kv_bytes_per_token
from mmserve.engine.frontend import Frontend
from mmserve.engine.graph_settings import resolve_runner_graphs
from mmserve.engine.kv_pools import KVPools, resolve_kv_pools
from mmserve.engine.sizing import (
    resolve_cross_kv_bytes,
    resolve_encoder_budget,
    resolve_max_model_len,
    resolve_state_slots,
)
from mmserve.faults import FaultPlan
from mmserve.models.loader import checkpoint_quantization, load_model, parse_dtype
from mmserve.models.quantization import weight_bytes
from mmserve.models.spec import FamilySpec
from mmserve.runner.attention import PagedAttentionBackend
from mmserve.runner.cpu.layout import prepare_for_cpu
from mmserve.runner.cpu.malloc import tune_malloc
from mmserve.runner.encoder.pool import EncoderPool
from mmserve.runner.kv_quant import kv_format
from mmserve.runner.kv_storage import PagedKVStorage
from mmserve.runner.model_runner import ModelRunner
from mmserve.runner.pooler import StepPooler
from mmserve.runner.state_storage import LinearStateStorage
from mmserve.workers.factory import make_pool
from mmserve.workers.spec import WorkerSpec


@dataclass(frozen=True)
class ModelParts:
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    cpu_preparation: Any  # the layouts the CPU's kernels want (runner/cpu/layout.py)
    quantization: str  # "none" when the weights are not quantized
    weight_bytes: int  # as laid out for the kernels


@dataclass(frozen=True)
class EngineParts:
    model: ModelParts
    frontend: Frontend
    kv_format: Any
    kv_bytes_per_token: int
    max_model_len: int
    budget: EncoderBudget
    kv_storage: PagedKVStorage
    encoder_pool: EncoderPool | None
    cross_kv_bytes_per_row: int  # one item row's cross-attention K/V (0: the family does not cross-attend)
    scheduler: Scheduler
    runner: ModelRunner


def load(config: EngineConfig) -> ModelParts:
    device, dtype = torch.device(config.device), parse_dtype(config.dtype)
    if device.type == "cpu":  # a step's large tensors reuse heap pages (the process's malloc, set once)
        tune_malloc()
    model = load_model(config.model, dtype, device, config.quantization)
    cpu_preparation = prepare_for_cpu(model)
    quantization = config.quantization or checkpoint_quantization(config.model) or "none"
    return ModelParts(model, device, dtype, cpu_preparation, quantization, weight_bytes(model))


def assemble(config: EngineConfig, faults: FaultPlan) -> EngineParts:
    loaded = load(config)
    frontend = Frontend(config, loaded.model.config)
    spec = frontend.spec
    fmt = kv_format(config.cache.kv_cache_dtype, loaded.dtype)
    drafter = load_drafter(config, spec, frontend.processor.tokenizer)  # speculative decoding's draft model
    # a draft model's KV lives in the target's blocks (its own layers): each block holds both
    kv_bytes_per_token = (PagedKVStorage.bytes_per_token_of(spec.kv_layer_shapes, fmt)
                          + drafter_kv_bytes_per_token(drafter, fmt))
    state_slots = None if spec.linear_state is None else resolve_state_slots(
        config.cache, LinearStateStorage.bytes_per_slot(spec.linear_state), config.scheduler.max_num_seqs,
        loaded.device)
    # a step computes at most max_num_batched_tokens (lifted to the widest item span a chunk must hold whole)
    max_batched, _ = resolve_token_budget(config.scheduler.max_num_batched_tokens, spec.max_item_span,
                                          spec.bidirectional_media)
    pools = resolve_kv_pools(config.cache, spec.kv_layer_shapes, spec.kv_window, fmt,
                             drafter_kv_bytes_per_token(drafter, fmt), config.scheduler.max_num_seqs,
                             max_batched, loaded.device, 0 if state_slots is None else state_slots.total_bytes)
    num_blocks = pools.num_blocks
    max_model_len = resolve_max_model_len(config.scheduler.max_model_len, spec.max_position_embeddings,
                                          num_blocks * config.cache.block_size)
    pools.log(max_model_len)
    frontend.max_model_len = max_model_len
    budget = resolve_encoder_budget(config.encoder, spec, loaded.dtype)
    # a window pool's storage keeps its null block after the blocks its manager hands out
    window_blocks = None if pools.window_tokens is None else pools.num_window_blocks
    graphs = resolve_runner_graphs(config, encoder_tokens_per_step=budget.max_encoder_tokens_per_step,
                                   encoder_items_per_step=budget.max_items_per_step,
                                   num_kv_blocks=num_blocks, max_model_len=max_model_len,
                                   num_position_rows=spec.num_position_rows, eager_decode=spec.eager_decode,
                                   num_window_blocks=window_blocks)
    # decode graphs' padding rows write to a scratch block after the ones the KV manager hands out
    kv_storage = PagedKVStorage.for_layers(spec.kv_layer_shapes, num_blocks + graphs.num_scratch_blocks,
                                           config.cache.block_size, fmt, loaded.device,
                                           None if window_blocks is None else window_blocks + 1)
    encoder_pool = _start_encoder_pool(config, faults) if config.encoder.encoder_workers else None
    # MEAN and CLS pooling need every prompt row computed: no prefix hits (vLLM's rule too)
    prefix_caching = config.cache.enable_prefix_caching and (frontend.pooling is None
                                                             or frontend.pooling.pooling_type == "LAST")
    scheduler = _scheduler(config, spec, loaded.dtype, pools, max_model_len, max_batched, budget,
                           encoder_pool is not None, state_slots, prefix_caching)
    state = None if state_slots is None else LinearStateStorage(spec.linear_state, state_slots.num_slots,
                                                                state_slots.num_snapshots, loaded.device)
    pooling = frontend.pooling  # a pooling runner decodes nothing: no decode graphs
    pooler = None if pooling is None else StepPooler(loaded.model, pooling.pooling_type, frontend.classifier_token_ids)
    runner = ModelRunner(loaded.model, spec, PagedAttentionBackend(kv_storage, state=state), loaded.device,
                         encoder_pool, config.encoder.encoder_timeout_s, graphs.encoder,
                         # a captured decode step returns logits only, and an MTP head reads hidden states
                         graphs.decode if pooler is None and not (drafter and drafter.mtp) else None, faults,
                         config.logprobs_mode, pooler,
                         build_proposer(drafter, loaded.model, num_blocks + graphs.num_scratch_blocks,
                                        config.cache.block_size, fmt, loaded.device))
    # bytes of one item row's cross-attention K/V (the model dtype), for a family that cross-attends
    cross_kv_bytes_per_row = 0 if spec.cross_attention is None else spec.cross_attention.bytes_per_row(
        torch.empty((), dtype=loaded.dtype).element_size())
    return EngineParts(loaded, frontend, fmt, kv_bytes_per_token, max_model_len, budget, kv_storage, encoder_pool,
                       cross_kv_bytes_per_row, scheduler, runner)


def _scheduler(config: EngineConfig, spec: FamilySpec, dtype: torch.dtype, pools: KVPools, max_model_len: int,
               max_batched: int, budget: EncoderBudget, encoder_workers: bool, state_slots: StateSlotLayout | None,
               prefix_caching: bool) -> Scheduler:
    """`max_batched`: the effective max_num_batched_tokens (resolve_token_budget's)."""
    kv = (KVCacheManager(pools.num_blocks, pools.block_size, prefix_caching) if pools.window_tokens is None else
          WindowedKVCacheManager(pools.num_blocks, pools.block_size, pools.num_window_blocks, pools.window_tokens,
                                 prefix_caching))
    items = ItemScheduler(EncoderCacheManager(budget.cache_bytes, budget.output_budget_bytes), budget,
                          outputs_arrive_later=encoder_workers)
    sched = config.scheduler
    snapshots = state_slots is not None and state_slots.num_snapshots > 0
    chunking = ChunkBoundaryPolicy(indivisible_items=spec.bidirectional_media,
                                   snapshot_block_size=config.cache.block_size if snapshots else None,
                                   snapshot_interval=config.cache.snapshot_interval_tokens if snapshots else None)
    cross_kv_bytes = resolve_cross_kv_bytes(config.cache, spec, dtype)
    states = None
    if state_slots is not None:
        states = HybridStates(StateSlotPool(state_slots), state_slots.num_snapshots, config.cache.block_size)
        kv.on_evict = states.evicted
    return Scheduler(SchedulerLimits(sched.max_num_seqs, max_batched, sched.enable_chunked_prefill, max_model_len),
                     kv, items, chunking, None if cross_kv_bytes is None else CrossKVBook(cross_kv_bytes), states,
                     _drafter(config, max_model_len))


def _drafter(config: EngineConfig, max_model_len: int) -> DraftPolicy | None:
    """Speculative decoding's drafts (a pooling engine decodes nothing: none)."""
    spec = config.speculative_config
    if spec is None or config.runner == "pooling":
        return None
    return DraftPolicy(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, max_model_len,
                       spec.disable_by_batch_size, proposed_by_runner=spec.method != "ngram")


def _start_encoder_pool(config: EngineConfig, faults: FaultPlan) -> EncoderPool:
    """Encoder workers: the cores are split evenly between the workers and the engine's own step."""
    enc = config.encoder
    if faults.encoder_pool is not None:
        return faults.encoder_pool()
    cores = len(os.sched_getaffinity(0))
    spec = WorkerSpec(config.model, config.dtype, config.device, threads=max(1, cores // (enc.encoder_workers + 1)),
                      die_on_key=faults.encoder_worker_dies_on_key)
    return make_pool(enc.encoder_backend, spec, enc.encoder_workers, enc.ray_address)

"""The engine's stats (`Engine.get_stats`), built from snapshots.

Role: one flat dict of counters and sizes, named as the server's /metrics and the benchmarks read them,
from the scheduler's frozen `SchedulerSnapshot` (core/snapshots.py), the runner's and the encoder
workers' counts, the grammars' and the engine's fixed sizes (`EngineSizes`, taken once at start).
What it does not know: how the numbers are kept, HTTP, Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.core.budget import EncoderBudget
from mmserve.core.snapshots import SchedulerSnapshot


@dataclass(frozen=True)
class EngineSizes:
    """What the engine fixed at start: formats, bytes and budgets."""

    kv_cache_dtype: str
    quantization: str
    weight_bytes: int  # as laid out for the kernels
    kv_bytes_per_token: int
    budget: EncoderBudget


def engine_stats(snap: SchedulerSnapshot, sizes: EngineSizes, runner: Any, encoder_pool: Any,
                 grammars: Any) -> dict[str, int | float | str]:
    """`runner`: the `ModelRunner` (its counts); `encoder_pool`: the encoder workers, or None;
    `grammars`: the structured outputs (engine/structured_outputs.py)."""
    s, kv, cache, budget = snap.requests, snap.kv, snap.encoder_cache, sizes.budget
    encoder = runner.encoder_counts()
    return {
        # a request handed off to a decode replica finishes there, and is counted there
        "requests_finished": s.num_finished - snap.handoff.num_handed_off,
        "requests_running": s.num_running,
        "requests_waiting": s.num_waiting,
        "prompt_tokens": s.num_prompt_tokens,
        "prompt_tokens_computed": s.num_prompt_tokens_computed,
        "prefix_cache_hit_tokens": kv.num_prefix_cache_hit_tokens,
        "prefix_cache_queries": kv.num_prefix_cache_queries,
        "generation_tokens": s.num_generation_tokens,
        "num_preemptions": s.num_preemptions,
        "grammars_compiled": grammars.num_compiled,
        "grammar_matchers": len(grammars.matchers),
        "kv_blocks_total": kv.num_blocks,
        "kv_blocks_free": kv.num_free_blocks,
        "kv_window_blocks_total": kv.num_window_blocks,  # the sliding layers' own pool (0: none)
        "kv_window_blocks_free": kv.num_free_window_blocks,
        "kv_cache_dtype": sizes.kv_cache_dtype,
        "quantization": sizes.quantization,
        "cpu_decode_compile": runner.cpu_decode_compile_state(),
        "weight_bytes": sizes.weight_bytes,
        "kv_bytes_per_token": sizes.kv_bytes_per_token,
        "kv_capacity_tokens": kv.num_blocks * kv.block_size,
        "kv_cache_evictions": kv.num_evictions,
        "encoder_items_encoded": encoder.items_encoded,
        "encoder_tokens_encoded": encoder.tokens_encoded,
        "encoder_cache_hits": cache.num_hits,
        "encoder_cache_misses": cache.num_misses,
        "encoder_cache_evictions": cache.num_evictions,
        "encoder_cache_bytes_used": cache.used_bytes,
        "encoder_cache_bytes_referenced": cache.referenced_bytes,  # held by live requests; 0 when idle
        "encoder_cache_bytes_total": cache.capacity_bytes,
        "requests_rejected": s.num_rejected,
        **_handoff_stats(snap, sizes.kv_bytes_per_token),
        **_cross_kv_stats(snap, runner),
        "budget_max_encoder_items_per_step": budget.max_items_per_step,
        "budget_max_encoder_tokens_per_step": budget.max_encoder_tokens_per_step,
        "budget_encoder_output_bytes": budget.output_budget_bytes,
        "budget_encoder_cache_bytes": budget.cache_bytes,
        "budget_bytes_per_embedding_row": budget.bytes_per_row,
        **_worker_stats(runner, encoder_pool),
    }


def _handoff_stats(snap: SchedulerSnapshot, kv_bytes_per_token: int) -> dict[str, int]:
    h = snap.handoff
    block_bytes = kv_bytes_per_token * snap.kv.block_size
    return {"requests_parked": h.num_parked, "requests_receiving_kv": h.num_receiving,
            "requests_handed_off": h.num_handed_off, "requests_received": h.num_received,
            "kv_blocks_sent": h.num_kv_blocks_sent, "kv_blocks_transferred": h.num_kv_blocks_received,
            "kv_bytes_transferred": h.num_kv_blocks_received * block_bytes,
            "kv_blocks_deduplicated": h.num_kv_blocks_deduplicated}


def _cross_kv_stats(snap: SchedulerSnapshot, runner: Any) -> dict[str, int]:
    book = snap.cross_kv
    if book is None:
        return {}
    return {"cross_kv_bytes_used": book.used_bytes, "cross_kv_bytes_total": book.capacity_bytes,
            "cross_kv_builds": runner.cross_kv_builds}


def _worker_stats(runner: Any, encoder_pool: Any) -> dict[str, int]:
    if encoder_pool is None:
        return {}
    pool = encoder_pool.stats()
    return {"encoder_workers_alive": pool.workers_alive, "encoder_worker_restarts": pool.worker_restarts,
            "encoder_items_redispatched": pool.items_redispatched,
            "encoder_items_in_flight": runner.num_encoder_items_in_flight}

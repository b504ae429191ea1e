"""Which captured graphs the engine asks its runner for, resolved once at start-up.

Role: turn the `graphs` engine args (config.GraphConfig) plus facts the engine already resolved (the
device, the encoder budgets, max_num_seqs, the context length, the KV pool) into the runner's
settings. Decode graphs need one KV block no request is ever given (padding rows write there): the
engine allocates the pool with `num_scratch_blocks` extra blocks beyond what the KV manager hands out.

What it does not know: how graphs are captured or replayed (runner/graphs/encoder_graphs.py,
runner/graphs/decode_graphs.py), scheduling.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mmserve.config import EngineConfig
from mmserve.runner.graphs.buckets import decode_batch_sizes, decode_block_widths
from mmserve.runner.graphs.decode_graphs import DecodeGraphSettings
from mmserve.runner.graphs.encoder_graphs import EncoderGraphSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerGraphs:
    encoder: EncoderGraphSettings | None  # None: the encoder runs eagerly
    decode: DecodeGraphSettings | None  # None: every step runs eagerly

    @property
    def num_scratch_blocks(self) -> int:
        return 0 if self.decode is None else 1


def resolve_runner_graphs(config: EngineConfig, *, encoder_tokens_per_step: int, encoder_items_per_step: int,
                          num_kv_blocks: int, max_model_len: int, num_position_rows: int,
                          eager_decode: str | None = None, num_window_blocks: int | None = None) -> RunnerGraphs:
    """`num_kv_blocks`: the blocks the KV manager hands out; the scratch block is the one after them.
    `eager_decode`: why the family's decode steps run eagerly (`FamilySpec.eager_decode`), or None.
    `num_window_blocks`: the window pool's (core/window_kv.py), whose null block is its scratch; None: none."""
    graphs, device_type = config.graphs, config.device.split(":")[0]
    encoder = None
    if graphs.encoder_graphs_on(device_type):
        if config.encoder.encoder_workers:  # items are encoded in the workers, not in the engine's step
            logger.info("encoder graphs: off, items are encoded by %d workers", config.encoder.encoder_workers)
        else:
            encoder = EncoderGraphSettings(encoder_tokens_per_step, encoder_items_per_step,
                                           graphs.encoder_graph_memory_bytes, graphs.encoder_graph_buckets)
    decode = None
    compile_mode = graphs.cpu_decode_compile(device_type, config.cache.kv_cache_dtype)
    if eager_decode and (compile_mode != "off" or graphs.decode_graphs_on(device_type, config.cache.kv_cache_dtype)):
        logger.info("decode steps: eager, not captured or compiled (%s)", eager_decode)
    elif graphs.decode_graphs_on(device_type, config.cache.kv_cache_dtype):
        max_num_seqs = config.scheduler.max_num_seqs
        sizes = graphs.decode_graph_batch_sizes or decode_batch_sizes(max_num_seqs)
        block_size = config.cache.block_size
        decode = DecodeGraphSettings(tuple(sorted(set(sizes))), decode_block_widths(-(-max_model_len // block_size)),
                                     scratch_block=num_kv_blocks, window_scratch_block=num_window_blocks,
                                     num_position_rows=num_position_rows,
                                     compile=compile_mode != "off", in_background=compile_mode == "background")
    if decode is not None and decode.compile:
        logger.info("decode steps: compiled for the CPU %s (batch sizes %s)",
                    "in the background, eager until then" if decode.in_background else "before serving",
                    decode.batch_sizes)
    elif device_type == "cpu" and compile_mode == "off" and graphs.compile_cpu_decode is None:
        logger.info("decode steps: eager on the CPU (compile_cpu_decode=True compiles them before serving)")
    if device_type != "cuda" and (encoder or (decode and not decode.compile)):
        logger.info("graphs on %s: the graph path runs with a replay-equivalent (for tests; no speed-up)",
                    device_type)
    return RunnerGraphs(encoder, decode)

"""Engine configuration: frozen, validated dataclasses built from vLLM-style engine args.

Role: one place that knows every engine argument, its default and its constraints.
Derived values (e.g. the number of KV blocks) are computed where the model is known, not here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.inputs.media import MediaLimits

# the bundled demo VLM, installed as package data
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "demo-model"
DEMO_MODEL_NAME = "mmserve-demo"  # what the server calls the bundled model when none is given


def resolve_model(model: str | None) -> str:
    """The checkpoint directory to load: `model`, or the bundled demo model when none is given."""
    if model:
        return str(model)
    if (DEMO_MODEL_DIR / "config.json").is_file():
        return str(DEMO_MODEL_DIR)
    raise ModelLoadError("no model given and the bundled demo model is not installed; pass a checkpoint directory")

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # what runner/kv_quant.py stores
ENCODER_BACKENDS = ("process", "ray")  # where encoder workers run (workers/process_pool.py, workers/ray_pool.py)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_bytes: int | None = None  # sizes the KV pool; default DEFAULT_KV_CACHE_BYTES
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype), "int8" or "fp8_e4m3" (per-token-per-head scales)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass(frozen=True)
class EncoderConfig:
    """The encoder budgets of docs/architecture.md §5; None means 'derive from the model' (see core/budget.py)."""

    max_encoder_items_per_step: int = 16
    max_encoder_tokens_per_step: int | None = None  # pre-merge patches; lifted to the largest item
    encoder_output_budget_bytes: int | None = None  # encoder outputs referenced by live requests
    encoder_cache_bytes: int | None = None  # the one pool (referenced + reusable entries)
    encoder_workers: int = 0  # 0: encode inline in the engine's step; N: N worker processes / Ray actors
    encoder_backend: str = "process"  # "process" (local processes) or "ray" (Ray actors)
    ray_address: str | None = None  # an existing Ray cluster to join; None: start a local one
    encoder_timeout_s: float = 30.0  # no live worker for this long: the requests waiting on items fail

    def __post_init__(self) -> None:
        for name in ("max_encoder_items_per_step", "max_encoder_tokens_per_step", "encoder_output_budget_bytes",
                     "encoder_cache_bytes", "encoder_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.encoder_workers < 0:
            raise ValueError(f"encoder_workers must be >= 0, got {self.encoder_workers}")
        if self.encoder_backend not in ENCODER_BACKENDS:
            raise ValueError(f"encoder_backend must be one of {', '.join(ENCODER_BACKENDS)}; got {self.encoder_backend!r}")


DEFAULT_ENCODER_GRAPH_MEMORY_BYTES = 2 * 1024**3  # device memory encoder graph captures may take


@dataclass(frozen=True)
class GraphConfig:
    """Captured graphs (runner/graphs/encoder_graphs.py, runner/graphs/decode_graphs.py). `None` switches: on when the
    device is CUDA, off on the CPU; True on the CPU runs the graph path with a replay-equivalent (the
    same bucketing and static buffers, no speed-up: for tests)."""

    enable_encoder_cuda_graphs: bool | None = None
    # (total_tokens, contexts) or (total_tokens, contexts per attention kind...); None: from the encoder budgets
    encoder_graph_buckets: tuple[tuple[int, ...], ...] | None = None
    encoder_graph_memory_bytes: int = DEFAULT_ENCODER_GRAPH_MEMORY_BYTES
    enable_decode_cuda_graphs: bool | None = None
    decode_graph_batch_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs
    # CPU: compile the padded decode step with TorchInductor (turns decode graphs on; costs ~20-60 s at
    # start-up, as vLLM-CPU's compile does). Off: the CPU runs every step eagerly
    compile_cpu_decode: bool = False

    def __post_init__(self) -> None:
        if self.encoder_graph_memory_bytes <= 0:
            raise ValueError(f"encoder_graph_memory_bytes must be positive, got {self.encoder_graph_memory_bytes}")
        if self.decode_graph_batch_sizes is not None and (not self.decode_graph_batch_sizes
                                                          or min(self.decode_graph_batch_sizes) <= 0):
            raise ValueError(f"decode_graph_batch_sizes must be positive, got {self.decode_graph_batch_sizes}")
        if self.encoder_graph_buckets is not None and not all(len(b) >= 2 for b in self.encoder_graph_buckets):
            raise ValueError("encoder_graph_buckets entries are (total_tokens, contexts[, contexts per kind...])")

    def encoder_graphs_on(self, device_type: str) -> bool:
        on = self.enable_encoder_cuda_graphs
        return device_type == "cuda" if on is None else on

    def decode_graphs_on(self, device_type: str) -> bool:
        on = self.enable_decode_cuda_graphs
        if self.compile_cpu_decode and device_type == "cpu":
            return on is not False
        return device_type == "cuda" if on is None else on


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    media: MediaLimits = field(default_factory=MediaLimits)
    graphs: GraphConfig = field(default_factory=GraphConfig)

    def __post_init__(self) -> None:
        if self.graphs.compile_cpu_decode and self.cache.kv_cache_dtype == "fp8_e4m3":
            # TorchInductor (torch 2.13) cannot lower the float8 quantization on the CPU
            raise ValueError("compile_cpu_decode does not support kv_cache_dtype='fp8_e4m3'; use 'int8' or 'auto'")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Flat vLLM-style engine args (max_num_seqs=..., block_size=...) -> nested config."""
        groups: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "encoder": {}, "media": {}, "graphs": {},
                                             "top": {}}
        owners = {
            "cache": {f.name for f in dataclasses.fields(CacheConfig)},
            "scheduler": {f.name for f in dataclasses.fields(SchedulerConfig)},
            "encoder": {f.name for f in dataclasses.fields(EncoderConfig)},
            "media": {f.name for f in dataclasses.fields(MediaLimits)},
            "graphs": {f.name for f in dataclasses.fields(GraphConfig)},
            "top": {"dtype", "device", "seed"},
        }
        for key, value in kwargs.items():
            owner = next((g for g, names in owners.items() if key in names), None)
            if owner is None:
                valid = sorted(set().union(*owners.values()))
                raise TypeError(f"unknown engine argument {key!r}; valid: {', '.join(valid)}")
            groups[owner][key] = value
        return cls(model=model, cache=CacheConfig(**groups["cache"]),
                   scheduler=SchedulerConfig(**groups["scheduler"]), encoder=EncoderConfig(**groups["encoder"]),
                   media=MediaLimits(**groups["media"]), graphs=GraphConfig(**groups["graphs"]),
                   **groups["top"])

"""Engine configuration: frozen, validated dataclasses built from vLLM-style engine args.

Role: one place that knows every engine argument, its default and its constraints.
Derived values (e.g. the number of KV blocks) are computed where the model is known, not here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserve.envs import compile_cpu_decode_by_default
from mmserve.errors import ModelLoadError
from mmserve.inputs.media import MediaLimits
from mmserve.options import option
from mmserve.vllm_args import resolve_dtype, translate_engine_kwargs

# the bundled demo VLM, installed as package data
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "demo-model"
DEMO_MODEL_NAME = "mmserve-demo"  # what the server calls the bundled model when none is given


def resolve_model(model: str | None, revision: str | None = None) -> str:
    """The checkpoint directory to load: `model` (a directory, or a Hugging Face repository id `ORG/NAME`
    found in the local cache or downloaded, at `revision`), or the bundled demo model when none is given."""
    if model:
        from mmserve.hub import checkpoint_dir

        return str(checkpoint_dir(str(model), revision))
    if (DEMO_MODEL_DIR / "config.json").is_file():
        return str(DEMO_MODEL_DIR)
    raise ModelLoadError("no model given and the bundled demo model is not installed; pass a checkpoint directory")

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # what runner/kv_quant.py stores
# what models/quantization.py quantizes at load; "int4" is w4a8's recipe (int8 inputs: faster to decode and
# to prefill at the same accuracy, measured in docs/performance.md), its weight-only form "int4_weight_only"
QUANTIZATION_METHODS = ("int8", "int4", "w8a8", "w4a8", "int4_weight_only")
# vLLM's logprobs_mode: what a logprob entry reports, the raw model's or the distribution the token was
# drawn from (after penalties, biases, masks, grammars, temperature, top-k, top-p, min-p), each as
# log-probabilities or as logits
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
ENCODER_BACKENDS = ("process", "ray")  # where encoder workers run (workers/process_pool.py, workers/ray_pool.py)


DEFAULT_SNAPSHOT_INTERVAL_TOKENS = 512  # CacheConfig.snapshot_interval_tokens


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = option(16, "tokens per KV-cache block")
    kv_cache_bytes: int | None = option(None, "bytes of the KV cache, scales included (sizes the block pool)",
                                        shown="256MiB")
    num_kv_blocks: int | None = option(None, "KV blocks to allocate (instead of kv_cache_bytes)",
                                       shown="from kv_cache_bytes")
    gpu_memory_utilization: float | None = option(
        None, "CUDA: the fraction of the device's memory the weights and the KV cache may take; the KV cache "
              "gets what the weights leave (instead of kv_cache_bytes; refused on the CPU)", shown="none")
    enable_prefix_caching: bool = option(True, "reuse KV blocks of earlier requests' identical prefixes (images "
                                               "included)")
    kv_cache_dtype: str = option("auto", "how keys and values are stored: the model dtype (auto), or int8 / fp8_e4m3 "
                                         "codes with a scale per token and kv head", choices=KV_CACHE_DTYPES)
    state_snapshot_interval: int | None = option(
        None, "hybrid models (Qwen3.5): snapshot the recurrent state every this many prompt tokens (a multiple of "
              "block_size; prefill chunks end there) besides each prompt's last full block, so a later prompt "
              "sharing only part of one resumes within this many tokens of where they part; 0: only prompt and "
              "chunk ends", shown="512, rounded down to a multiple of block_size")
    cross_kv_cache_bytes: int | None = option(
        None, "bytes of the running requests' image K/V in a model that cross-attends to its images (Llama 3.2 "
              "Vision; stored in the model dtype)", shown="kv_cache_bytes, lifted to one image")

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.state_snapshot_interval is not None and (
                self.state_snapshot_interval < 0 or self.state_snapshot_interval % self.block_size):
            raise ValueError(f"state_snapshot_interval must be 0 or a positive multiple of block_size "
                             f"({self.block_size}), got {self.state_snapshot_interval}")

        if self.cross_kv_cache_bytes is not None and self.cross_kv_cache_bytes <= 0:
            raise ValueError(f"cross_kv_cache_bytes must be positive, got {self.cross_kv_cache_bytes}")
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
            if self.kv_cache_bytes is not None or self.num_kv_blocks is not None:
                raise ValueError("give one of gpu_memory_utilization, kv_cache_bytes and num_kv_blocks: each sizes "
                                 "the KV cache")

    @property
    def snapshot_interval_tokens(self) -> int:
        """The state snapshot interval in effect (0: none): by default 512 tokens, rounded down to whole blocks
        (benchmarks/engine/hybrid_state.py: on six questions about one document, 512 resumes 0.83 of the later
        prompts where prompt and chunk ends alone resume none; 256 resumes 0.97 for 1.4x the snapshot bytes,
        and a released model's snapshot is tens of MB)."""
        if self.state_snapshot_interval is not None:
            return self.state_snapshot_interval
        return max(1, DEFAULT_SNAPSHOT_INTERVAL_TOKENS // self.block_size) * self.block_size


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(64, "most requests computed in one step")
    max_num_batched_tokens: int = option(2048, "most tokens computed in one step (lifted to the longest span an "
                                               "image must be prefilled in whole)")
    enable_chunked_prefill: bool = option(True, "prefill long prompts a chunk per step, beside decodes")
    max_model_len: int | None = option(None, "longest prompt plus output of a request",
                                       shown="the model's, capped to what the KV cache holds")

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass(frozen=True)
class EncoderConfig:
    """The encoder budgets of docs/architecture.md §5; None means 'derive from the model' (see core/budget.py)."""

    max_encoder_items_per_step: int = option(16, "most images or video parts encoded in one step")
    max_encoder_tokens_per_step: int | None = option(None, "most encoder tokens (pre-merge patches) in one step; "
                                                           "lifted to the largest item",
                                                     shown="the larger of 16384 and the model's largest item")
    encoder_output_budget_bytes: int | None = option(None, "bytes of encoder outputs live requests may hold",
                                                     shown="the larger of 256MiB and one legal encoder step")
    encoder_cache_bytes: int | None = option(None, "bytes of the encoder-output pool, live and kept for reuse",
                                             shown="twice encoder_output_budget_bytes")
    encoder_workers: int = option(0, "encoder processes or Ray actors (0: encode in the engine's step)")
    encoder_backend: str = option("process", "where encoder workers run: local processes or Ray actors",
                                  choices=ENCODER_BACKENDS)
    ray_address: str | None = option(None, "a Ray cluster to join", shown="start a local one")
    encoder_timeout_s: float = option(30.0, "seconds without a live encoder worker before the requests waiting "
                                            "on images fail")

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

    enable_encoder_cuda_graphs: bool | None = option(None, "capture the vision encoder as CUDA graphs",
                                                     shown="on for CUDA, off on the CPU")
    # (total_tokens, contexts) or (total_tokens, contexts per attention kind...); None: from the encoder budgets
    encoder_graph_buckets: tuple[tuple[int, ...], ...] | None = option(
        None, "encoder graph buckets as TOKENSxCONTEXTS,...", shown="from the encoder budgets")
    encoder_graph_memory_bytes: int = option(DEFAULT_ENCODER_GRAPH_MEMORY_BYTES,
                                             "device memory encoder graph captures may take", shown="2GiB")
    enable_decode_cuda_graphs: bool | None = option(None, "capture decode steps as CUDA graphs",
                                                    shown="on for CUDA, off on the CPU")
    decode_graph_batch_sizes: tuple[int, ...] | None = option(None, "decode graph batch sizes",
                                                              shown="1, 2, 4, 8, 16, 24, ... up to max_num_seqs")
    # None: eager, unless envs.COMPILE_CPU_DECODE asks for a compile in the background while the engine
    # serves eagerly (a compiling thread slows the steps beside it at every core count, so it is not the
    # default); True: compiled before the engine serves, as vLLM-CPU's compile does (a later start loads it
    # from the disk cache); False: the CPU runs every step eagerly
    compile_cpu_decode: bool | None = option(None, "CPU: compile the decode step with TorchInductor; on: before "
                                                   "serving (start-up waits; cached on disk), off: never",
                                             shown="off; MMSERVE_COMPILE_CPU_DECODE=1: in the background")
    # vLLM's --enforce-eager: every graph and compile switch off (one that is asked on is a contradiction)
    enforce_eager: bool = option(False, "run every step eagerly: no CUDA graphs, no compiled CPU decode step")

    def __post_init__(self) -> None:
        if self.encoder_graph_memory_bytes <= 0:
            raise ValueError(f"encoder_graph_memory_bytes must be positive, got {self.encoder_graph_memory_bytes}")
        if self.decode_graph_batch_sizes is not None and (not self.decode_graph_batch_sizes
                                                          or min(self.decode_graph_batch_sizes) <= 0):
            raise ValueError(f"decode_graph_batch_sizes must be positive, got {self.decode_graph_batch_sizes}")
        if self.encoder_graph_buckets is not None and not all(len(b) >= 2 for b in self.encoder_graph_buckets):
            raise ValueError("encoder_graph_buckets entries are (total_tokens, contexts[, contexts per kind...])")
        asked = [n for n in ("enable_encoder_cuda_graphs", "enable_decode_cuda_graphs", "compile_cpu_decode")
                 if getattr(self, n)]
        if self.enforce_eager and asked:
            raise ValueError(f"enforce_eager runs every step eagerly, but {', '.join(asked)} asks for graphs")

    def encoder_graphs_on(self, device_type: str) -> bool:
        if self.enforce_eager:
            return False
        on = self.enable_encoder_cuda_graphs
        return device_type == "cuda" if on is None else on

    def cpu_decode_compile(self, device_type: str, kv_cache_dtype: str) -> str:
        """How the CPU's decode step is compiled: "off", "startup" (before serving) or "background"."""
        if (device_type != "cpu" or self.enforce_eager or self.enable_decode_cuda_graphs is False
                or self.compile_cpu_decode is False):
            return "off"
        if self.compile_cpu_decode:
            return "startup"
        # unasked: in the background only where the environment asks, never for a float8 KV cache (which
        # TorchInductor cannot lower)
        return "background" if kv_cache_dtype != "fp8_e4m3" and compile_cpu_decode_by_default() else "off"

    def decode_graphs_on(self, device_type: str, kv_cache_dtype: str = "auto") -> bool:
        if self.enforce_eager:
            return False
        on = self.enable_decode_cuda_graphs
        if device_type == "cpu" and self.cpu_decode_compile(device_type, kv_cache_dtype) != "off":
            return True
        return device_type == "cuda" if on is None else on


# the engine arguments EngineConfig holds itself, not in one of its groups
TOP_LEVEL_ARGS = ("dtype", "device", "seed", "quantization", "logprobs_mode", "otlp_traces_endpoint", "tokenizer",
                  "chat_template", "generation_config", "trust_remote_code", "mm_processor_kwargs",
                  "default_chat_template_kwargs", "runner", "pooler_config", "hf_overrides",
                  "speculative_config")
GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a folder holding a generation_config.json


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    quantization: str | None = None  # QUANTIZATION_METHODS, at load (models/quantization.py); None: as stored
    logprobs_mode: str = "raw_logprobs"  # one of LOGPROBS_MODES; prompt logprobs are always raw_logprobs
    # OTLP collector for request traces (mmserve/tracing.py); None: no tracing, nothing recorded
    otlp_traces_endpoint: str | None = None
    tokenizer: str | None = None  # a directory with the tokenizer's files (and chat template); None: the model's
    chat_template: str | None = None  # a template file's path or the template itself; None: the tokenizer's
    # whose sampling defaults apply where a request leaves a field unset: "auto" (the checkpoint's
    # generation_config.json, vLLM's default), "vllm" (none: SamplingParams' own), or a folder's file
    generation_config: str = "auto"
    trust_remote_code: bool = False  # vLLM's; mmserve runs no remote code and says so once
    # processor kwargs every request starts from (vLLM's --mm-processor-kwargs); a request's own win
    mm_processor_kwargs: dict[str, Any] | None = None
    # chat template variables every chat starts from (vLLM's --default-chat-template-kwargs); a request's win
    default_chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's --runner: "generate", or "pooling" (the step returns pooled hidden states: embeddings, reranker
    # scores; mmserve/pooling.py); "auto": pooling when pooler_config or hf_overrides is given
    runner: str = "auto"
    pooler_config: Any = None  # vLLM's --pooler-config: a pooling.PoolerConfig, its dict or JSON (None: the model's)
    hf_overrides: dict[str, Any] | None = None  # only the reranker/Matryoshka keys pooling.RerankerOverrides reads
    # vLLM's speculative_config: a speculative.SpeculativeConfig, its dict or JSON (None: no speculation)
    speculative_config: Any = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    media: MediaLimits = field(default_factory=MediaLimits)
    graphs: GraphConfig = field(default_factory=GraphConfig)

    def __post_init__(self) -> None:
        _resolve_pooling_args(self)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None; "
                             f"got {self.quantization!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}; got {self.logprobs_mode!r}")
        if self.cache.gpu_memory_utilization is not None and not self.device.startswith("cuda"):
            raise ValueError("gpu_memory_utilization sizes the KV cache from a CUDA device's memory; on the "
                             f"{self.device} give kv_cache_bytes (--kv-cache-bytes, e.g. 4GiB) instead (vLLM's CPU "
                             "build: VLLM_CPU_KVCACHE_SPACE)")
        if self.generation_config not in GENERATION_CONFIG_MODES and not Path(self.generation_config).is_dir():
            raise ValueError(f"generation_config must be auto, vllm or a folder; {self.generation_config!r} is none")
        if self.graphs.compile_cpu_decode and self.cache.kv_cache_dtype == "fp8_e4m3":
            # TorchInductor (torch 2.13) cannot lower the float8 quantization on the CPU
            raise ValueError("compile_cpu_decode does not support kv_cache_dtype='fp8_e4m3'; use 'int8' or 'auto'")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Flat vLLM-style engine args (max_num_seqs=..., block_size=...) -> nested config; vLLM's own names
        (vllm_args.py's table) mean what they mean in vLLM or are refused naming why."""
        groups: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "encoder": {}, "media": {}, "graphs": {},
                                             "top": {}}
        owners = {
            "cache": {f.name for f in dataclasses.fields(CacheConfig)},
            "scheduler": {f.name for f in dataclasses.fields(SchedulerConfig)},
            "encoder": {f.name for f in dataclasses.fields(EncoderConfig)},
            "media": {f.name for f in dataclasses.fields(MediaLimits)},
            "graphs": {f.name for f in dataclasses.fields(GraphConfig)},
            "top": set(TOP_LEVEL_ARGS),
        }
        kwargs = translate_engine_kwargs(kwargs, set().union(*owners.values()))
        if "dtype" in kwargs:
            kwargs["dtype"] = resolve_dtype(kwargs["dtype"], model, kwargs.get("device", "cpu"))
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


def _resolve_pooling_args(config: EngineConfig) -> None:
    """The runner ("auto" resolved), the pooler and speculative configs parsed and the overrides checked, or
    ValueError naming the argument."""
    from mmserve.pooling import RUNNERS, PoolerConfig, RerankerOverrides
    from mmserve.speculative import SpeculativeConfig

    if config.runner not in (*RUNNERS, "auto"):
        raise ValueError(f"runner must be auto, {' or '.join(RUNNERS)}, got {config.runner!r}")
    RerankerOverrides.parse(config.hf_overrides)  # refused early: keys mmserve does not read
    runner = config.runner
    if runner == "auto":  # vLLM reads the architecture; here a pooler config or a reranker's overrides say pooling
        runner = "pooling" if config.pooler_config is not None or config.hf_overrides else "generate"
    object.__setattr__(config, "runner", runner)
    object.__setattr__(config, "pooler_config", PoolerConfig.parse(config.pooler_config))
    object.__setattr__(config, "speculative_config", SpeculativeConfig.parse(config.speculative_config))
    if runner == "generate" and (config.pooler_config is not None or config.hf_overrides):
        raise ValueError("pooler_config and hf_overrides shape a pooling model: pass runner='pooling' "
                         "(--runner pooling)")

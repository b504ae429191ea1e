"""vLLM's `vllm serve` / `LLM(...)` arguments and what each one does in mmserve: one table, read by the
command line (cli_args.py registers every row it does not define itself), by `EngineConfig.from_kwargs`
(so `LLM(tensor_parallel_size=1, trust_remote_code=True)` means what it means in vLLM) and by the docs.

Every row is one of: `works` (mmserve has the argument, same name, same meaning), `alias` (vLLM's name
for an mmserve argument: the value goes there), `accepted` (mmserve already behaves as the value asks; a
value that asks for something else is refused) or `refused` (start-up stops with why and what to use
instead). Nothing is accepted and silently ignored.

What it does not know: argparse, the engine, the server; how a working argument is implemented.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserve.errors import InvalidInputError


class Support(enum.Enum):
    WORKS = "works"
    ALIAS = "alias"
    ACCEPTED = "accepted"
    REFUSED = "refused"


@dataclass(frozen=True)
class VllmArg:
    name: str  # vLLM's argument, snake_case; its flag is --name-with-dashes
    support: Support
    note: str  # what it does here; a refused one: why, and what to use instead
    target: str | None = None  # ALIAS: the mmserve argument it sets
    switch: bool = False  # a flag without a value (store_true in vLLM)
    accepted_values: tuple[str, ...] = ()  # ACCEPTED with a value: the ones that mean what mmserve does
    server_only: bool = False  # a `serve` flag, not an engine (LLM) argument
    # a server flag an offline LLM(...) also takes, and drops: offline already does what it asks
    dropped_offline: bool = False
    example: tuple[str, ...] = ()  # WORKS/ALIAS: a value the tests (and the docs) pass
    short: tuple[str, ...] = ()  # vLLM's short spellings (-tp)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def refusal(self, value: Any = None) -> str:
        """The message a refused row (or a refused value of an accepted one) stops start-up with."""
        if self.support is Support.ACCEPTED:
            return (f"{self.flag} {value}: mmserve supports only {' or '.join(self.accepted_values)} here "
                    f"({self.note})")
        return f"{self.flag} is not supported by mmserve: {self.note}"


W, A, OK, NO = Support.WORKS, Support.ALIAS, Support.ACCEPTED, Support.REFUSED
LORA = "mmserve serves no LoRA adapters; merge the adapter into the weights (peft's merge_and_unload) and serve that"
NO_TP = ("mmserve runs a model on one device; more devices serve more requests as replicas "
         "(--data-parallel-size N)")

VLLM_ARGS: tuple[VllmArg, ...] = (
    # the model and its files
    VllmArg("model", W, "the checkpoint directory or Hugging Face id (also positional)", example=("m",)),
    VllmArg("served_model_name", W, "one or more names clients send as `model`; the first is the one answered",
            server_only=True, example=("a", "b")),
    VllmArg("tokenizer", W, "a directory (or Hugging Face id) holding tokenizer.json, tokenizer_config.json "
            "and the chat template, instead of the model's", example=("tok",)),
    VllmArg("revision", W, "the repository's branch, tag or commit", server_only=True, example=("v1",)),
    VllmArg("tokenizer_revision", NO, "give the tokenizer's files as a directory with --tokenizer DIR"),
    VllmArg("trust_remote_code", OK, "mmserve runs no code from the checkpoint (its families are "
            "built in); logged once", switch=True),
    VllmArg("download_dir", NO, "downloads go to Hugging Face's cache; set HF_HUB_CACHE (or HF_HOME)"),
    VllmArg("load_format", OK, "safetensors weights", accepted_values=("auto", "safetensors")),
    VllmArg("tokenizer_mode", OK, "the fast tokenizer from tokenizer.json", accepted_values=("auto", "hf")),
    VllmArg("skip_tokenizer_init", NO, "mmserve needs the tokenizer to render prompts and text", switch=True),
    VllmArg("hf_token", NO, "set the HF_TOKEN environment variable"),
    VllmArg("hf_overrides", W, "only a reranker's keys (architectures *ForSequenceClassification, "
            "classifier_from_token, is_original_qwen3_reranker) and is_matryoshka, matryoshka_dimensions; for any "
            "other, edit config.json in a copy of the checkpoint", example=('{"classifier_from_token": ["no", "yes"]}',)),
    VllmArg("rope_scaling", NO, "edit rope_parameters in a copy of the checkpoint's config.json"),
    VllmArg("rope_theta", NO, "edit rope_parameters in a copy of the checkpoint's config.json"),
    VllmArg("disable_sliding_window", NO, "a sliding-window model runs with its window", switch=True),
    VllmArg("model_impl", OK, "mmserve's own implementation of each family", accepted_values=("auto",)),
    VllmArg("config", NO, "give the flags on the command line"),
    VllmArg("chat_template", W, "a Jinja chat template file, or the template itself inline", server_only=False,
            example=("{{ messages[0]['content'] }}",)),
    VllmArg("chat_template_content_format", OK, "message content is given to the template as it expects",
            accepted_values=("auto",)),
    VllmArg("default_chat_template_kwargs", W, "chat template variables (JSON) every chat starts from, e.g. "
            '{"enable_thinking": false}; a request\'s chat_template_kwargs win', example=('{"enable_thinking": false}',)),
    VllmArg("generation_config", W, "auto: generation_config.json's sampling defaults apply where a request "
            "leaves them unset; vllm: none; a folder: that folder's generation_config.json", example=("vllm",)),
    VllmArg("override_generation_config", NO, "write the values into a generation_config.json in a folder "
            "and pass --generation-config FOLDER"),
    # precision and memory
    VllmArg("dtype", W, "float32, bfloat16 or float16 (vLLM's half and float are the same names here; auto: "
            "the checkpoint's dtype, float32 checkpoints as float16 on CUDA and float32 on the CPU)",
            example=("bfloat16",)),
    VllmArg("quantization", W, "here: quantize the language model at load (int8, int4, w8a8, w4a8, int4_weight_only); a "
            "pre-quantized checkpoint runs as stored", example=("int8",)),
    VllmArg("kv_cache_dtype", W, "auto, int8 or fp8_e4m3", example=("int8",)),
    VllmArg("max_model_len", W, "refused above the checkpoint's positions unless MMSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 "
            "or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1", example=("1024",)),
    VllmArg("gpu_memory_utilization", W, "CUDA: the fraction of the device's memory weights and KV cache may "
            "take (the KV cache gets what the weights leave); refused on the CPU, where --kv-cache-bytes sizes "
            "it (vLLM's CPU build: VLLM_CPU_KVCACHE_SPACE)", example=("0.5",)),
    VllmArg("kv_cache_memory_bytes", A, "bytes of the KV cache", target="kv_cache_bytes", example=("64MiB",)),
    VllmArg("num_gpu_blocks_override", A, "the KV blocks to allocate", target="num_kv_blocks", example=("64",)),
    VllmArg("block_size", W, "tokens per KV-cache block", example=("32",)),
    VllmArg("swap_space", NO, "mmserve recomputes a preempted request's KV and keeps no CPU swap space"),
    VllmArg("cpu_offload_gb", NO, "weights stay on the device; use --quantization to make them smaller"),
    VllmArg("enable_prefix_caching", W, "reuse the KV of identical prefixes (images included); on by "
            "default, --no-enable-prefix-caching turns it off", switch=True, example=()),
    VllmArg("calculate_kv_scales", NO, "int8/fp8 KV scales are computed per token and head as written",
            switch=True),
    # scheduling
    VllmArg("max_num_seqs", W, "most requests computed in one step", example=("8",)),
    VllmArg("max_num_batched_tokens", W, "most tokens computed in one step", example=("1024",)),
    VllmArg("enable_chunked_prefill", W, "prefill long prompts a chunk per step (on by default)", switch=True),
    VllmArg("scheduling_policy", OK, "first come, first served", accepted_values=("fcfs",)),
    VllmArg("max_logprobs", OK, "a request may ask for up to 20 top logprobs (OpenAI's bound)",
            accepted_values=("20",)),
    VllmArg("seed", W, "the engine's random seed", example=("7",)),
    VllmArg("device", W, "cpu, cuda or cuda:N (default: cuda where there is one)", example=("cuda",)),
    VllmArg("enforce_eager", W, "run every step eagerly: no CUDA graphs, no compiled CPU decode step",
            switch=True),
    VllmArg("max_seq_len_to_capture", NO, "CUDA graphs are captured per batch size: --decode-graph-batch-sizes"),
    VllmArg("async_scheduling", NO, "mmserve schedules a step after the one before it has sampled", switch=True),
    VllmArg("compilation_config", NO, "use --enforce-eager, --compile-cpu-decode or the CUDA-graph flags",
            short=("-O",)),
    VllmArg("speculative_config", W, "method ngram (num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, "
            "disable_by_batch_size), draft_model (model, num_speculative_tokens, disable_by_batch_size) or mtp "
            "(Qwen3.5's head): greedy and sampled requests verify the drafts; eagle, eagle3, medusa and suffix "
            "are refused",
            example=('{"method": "ngram", "num_speculative_tokens": 3}',)),
    VllmArg("task", OK, "mmserve generates text", accepted_values=("auto", "generate")),
    VllmArg("runner", W, "generate, or pooling: embeddings and reranker scores (/v1/embeddings, /v1/score, "
            "/v1/rerank; docs/embeddings.md); auto: pooling when --pooler-config or --hf-overrides is given",
            example=("pooling",)),
    VllmArg("pooler_config", W, "task (embed, score), pooling_type (LAST, MEAN, CLS), use_activation, dimensions; "
            "vLLM's other keys are refused", example=('{"pooling_type": "MEAN"}',)),
    VllmArg("logprobs_mode", W, "raw or processed logprobs or logits", example=("processed_logprobs",)),
    VllmArg("structured_outputs_backend", OK, "grammars compile with xgrammar",
            accepted_values=("auto", "xgrammar")),
    VllmArg("guided_decoding_backend", OK, "grammars compile with xgrammar", accepted_values=("auto", "xgrammar")),
    VllmArg("enable_sleep_mode", NO, "mmserve cannot release its device memory while it runs", switch=True),
    # parallelism
    VllmArg("tensor_parallel_size", OK, NO_TP, accepted_values=("1",), short=("-tp",)),
    VllmArg("pipeline_parallel_size", OK, NO_TP, accepted_values=("1",), short=("-pp",)),
    VllmArg("data_parallel_size", W, "engine replicas behind one server", server_only=True, example=("2",)),
    VllmArg("distributed_executor_backend", OK, "one device, in the engine's process (Ray replicas: "
            "--data-parallel-backend ray)", accepted_values=("uni", "mp")),
    VllmArg("enable_expert_parallel", NO, NO_TP, switch=True),
    VllmArg("disable_custom_all_reduce", OK, "one device per engine: there is no all-reduce", switch=True),
    VllmArg("api_server_count", OK, "one API server process", accepted_values=("1",), server_only=True),
    VllmArg("headless", NO, "an engine runs behind its own API server; replicas: --data-parallel-size",
            switch=True, server_only=True),
    VllmArg("disable_frontend_multiprocessing", OK, "the API server and its engine share one process",
            switch=True, server_only=True),
    VllmArg("kv_transfer_config", NO, "disaggregated prefill: --prefill-replicas P --decode-replicas D"),
    # multimodal
    VllmArg("limit_mm_per_prompt", W, "most images, videos and audio clips in one prompt: "
            "image=N,video=M,audio=K or vLLM's JSON",
            server_only=True, example=('{"image": 2}',)),
    VllmArg("mm_processor_kwargs", W, "processor kwargs (JSON) every request starts from, e.g. "
            '{"max_pixels": 401408}; a request\'s own mm_processor_kwargs win', example=('{"max_pixels": 401408}',)),
    VllmArg("mm_processor_cache_gb", NO, "mmserve caches encoder outputs, not processor inputs: "
            "--encoder-cache-bytes"),
    VllmArg("allowed_local_media_path", W, "local files may be read only below this directory",
            example=("/tmp",)),
    VllmArg("allowed_media_domains", W, "fetch media URLs only from these hosts", server_only=True,
            example=("example.com",)),
    # LoRA
    VllmArg("enable_lora", NO, LORA, switch=True),
    VllmArg("lora_modules", NO, LORA),
    VllmArg("max_loras", NO, LORA),
    VllmArg("max_lora_rank", NO, LORA),
    # the server
    VllmArg("host", W, "address to listen on", server_only=True, example=("0.0.0.0",)),
    VllmArg("port", W, "port to listen on", server_only=True, example=("8001",)),
    VllmArg("uds", NO, "listen on --host and --port", server_only=True),
    VllmArg("api_key", W, "require 'Authorization: Bearer KEY' on the API routes", server_only=True,
            example=("secret",)),
    VllmArg("root_path", W, "the path prefix a proxy serves the API under", server_only=True, example=("/llm",)),
    VllmArg("uvicorn_log_level", A, "what the server logs (mmserve's lines and uvicorn's)", target="log_level",
            server_only=True, example=("warning",)),
    VllmArg("disable_uvicorn_access_log", NO, "use --log-level warning", switch=True, server_only=True),
    VllmArg("disable_log_stats", W, "no stats line every 10 s (throughput, requests running and waiting, KV cache "
            "usage, prefix-cache hit rate; with speculative decoding the mean acceptance length); offline "
            "LLM(...) takes it and logs none either way", switch=True, server_only=True, dropped_offline=True),
    VllmArg("disable_log_requests", OK, "mmserve logs no request contents", switch=True, server_only=True),
    VllmArg("enable_log_outputs", NO, "mmserve never logs outputs; trace requests with --otlp-traces-endpoint",
            switch=True, server_only=True),
    VllmArg("enable_log_requests", NO, "mmserve never logs prompts; trace requests with --otlp-traces-endpoint",
            switch=True, server_only=True),
    VllmArg("max_log_len", OK, "mmserve never logs prompts, so there is nothing to shorten", server_only=True,
            accepted_values=()),
    VllmArg("log_config_file", NO, "use --log-level", server_only=True),
    VllmArg("allowed_origins", W, 'CORS: the origins browsers may call the API from, a JSON list (default ["*"], '
            "as vLLM)", server_only=True, example=('["http://a.example"]',)),
    VllmArg("allowed_methods", W, 'CORS: the methods allowed, a JSON list (default ["*"])', server_only=True,
            example=('["GET","POST"]',)),
    VllmArg("allowed_headers", W, 'CORS: the request headers allowed, a JSON list (default ["*"])',
            server_only=True, example=('["Authorization"]',)),
    VllmArg("allow_credentials", W, "CORS: allow credentials (cookies, Authorization) in cross-origin calls",
            switch=True, server_only=True),
    VllmArg("ssl_keyfile", W, "TLS: the server's private key file (PEM); with --ssl-certfile it serves https",
            server_only=True, example=("key.pem",)),
    VllmArg("ssl_certfile", W, "TLS: the server's certificate chain file (PEM)", server_only=True,
            example=("cert.pem",)),
    VllmArg("ssl_ca_certs", W, "TLS: CA certificates that client certificates are checked against",
            server_only=True, example=("ca.pem",)),
    VllmArg("ssl_cert_reqs", W, "TLS: whether a client certificate is needed (0: no, 1: optional, 2: required; "
            "Python's ssl.CERT_*)", server_only=True, example=("2",)),
    VllmArg("middleware", NO, "mmserve imports no user code into its server; put the logic in a proxy",
            server_only=True),
    VllmArg("disable_fastapi_docs", NO, "the API's schema pages are always served (/docs, /openapi.json)",
            switch=True, server_only=True),
    VllmArg("response_role", OK, "the answer's role", accepted_values=("assistant",), server_only=True),
    VllmArg("return_tokens_as_token_ids", W, "logprobs name tokens as 'token_id:N'", switch=True, server_only=True),
    VllmArg("enable_auto_tool_choice", W, "tool_choice auto (always on)", switch=True, server_only=True),
    VllmArg("tool_call_parser", W, "hermes (<tool_call>{json}</tool_call>), qwen3_xml / qwen3_coder "
            "(<function=...><parameter=...>) or gemma4 (<|tool_call>call:name{...}<tool_call|>); auto: the syntax "
            "the chat template renders", server_only=True,
            example=("qwen3_xml",)),
    VllmArg("tool_parser_plugin", NO, "mmserve imports no user code; the hermes, qwen3_xml and gemma4 syntaxes are "
            "built in",
            server_only=True),
    VllmArg("reasoning_parser", W, "a thinking template's thought (<think>, or Gemma 4's <|channel>thought) is "
            "returned as reasoning; gemma4 names Gemma 4's channel, any other name the template's tags",
            server_only=True, example=("qwen3",)),
    VllmArg("enable_request_id_headers", W, "answer with an X-Request-Id header", switch=True, server_only=True),
    VllmArg("enable_tokenizer_info_endpoint", W, "serve GET /tokenizer_info", switch=True, server_only=True),
    VllmArg("enable_force_include_usage", W, "every streamed answer ends with its usage, as if stream_options."
            "include_usage were set", switch=True, server_only=True),
    VllmArg("enable_server_load_tracking", W, "count the generation requests in flight; GET /load answers "
            '{"server_load": N}', switch=True, server_only=True),
    VllmArg("enable_prompt_tokens_details", OK, "usage always carries prompt_tokens_details (cached tokens)",
            switch=True, server_only=True),
    VllmArg("otlp_traces_endpoint", W, "export OpenTelemetry traces of every request", example=("http://x:4318",)),
)

BY_NAME: dict[str, VllmArg] = {row.name: row for row in VLLM_ARGS}
# vLLM's dtype spellings that name one of mmserve's
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def check_accepted(row: VllmArg, value: Any) -> None:
    """Raise InvalidInputError (naming the argument) unless `value` asks for what mmserve does."""
    if row.support is Support.REFUSED:
        raise InvalidInputError(row.refusal(), param=row.name, setting=row.name)
    if row.switch or not row.accepted_values:  # a switch asks for what mmserve does; so does any value
        return
    if str(value) not in row.accepted_values:
        raise InvalidInputError(row.refusal(value), param=row.name, setting=row.name)


def translate_engine_kwargs(kwargs: Mapping[str, Any], engine_names: set[str]) -> dict[str, Any]:
    """An offline `LLM(**kwargs)`'s arguments as mmserve's: vLLM's aliases renamed, accepted ones checked and
    dropped (`trust_remote_code` is kept: the engine says once that it runs no remote code), refused ones
    (and server-only ones) raised as InvalidInputError naming the argument. Unknown names pass through
    (EngineConfig.from_kwargs lists the valid ones)."""
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        row = BY_NAME.get(key)
        if key in engine_names or row is None:
            out[key] = value
        elif row.server_only and row.dropped_offline:
            continue
        elif row.server_only:
            raise InvalidInputError(f"{key} is a server flag ({row.flag} of `mmserve serve`), not an engine "
                                    "argument", param=key, setting=key)
        elif row.support is Support.WORKS:
            out[key] = value
        elif row.support is Support.ALIAS and row.target in engine_names:
            out[row.target] = value
        else:
            check_accepted(row, value)
    return out


def resolve_dtype(dtype: str, model_dir: str, device: str) -> str:
    """vLLM's dtype spellings as mmserve's: half/float/bf16/..., and auto: the checkpoint's dtype
    (config.json's dtype or torch_dtype), a float32 checkpoint as float16 on CUDA (vLLM's rule) and as
    float32 on the CPU."""
    if dtype != "auto":
        return DTYPE_ALIASES.get(dtype, dtype)
    path = Path(model_dir) / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    sections = (raw, raw.get("text_config") or {})
    stored = next((s.get(k) for s in sections for k in ("dtype", "torch_dtype") if s.get(k)), "float32")
    stored = DTYPE_ALIASES.get(str(stored), str(stored))
    if stored not in ("float32", "bfloat16", "float16"):
        stored = "float32"
    return "float16" if stored == "float32" and device.startswith("cuda") else stored


DOCS_INTRO = """# vLLM's flags in mmserve

`mmserve serve` takes the flags a user of `vllm serve` passes, and `LLM(...)` the same engine arguments.
Each one either works with vLLM's meaning (*works*), is vLLM's name for an mmserve flag (*alias*), is
accepted for the values that mean what mmserve does anyway (*accepted*; any other value stops start-up),
or stops start-up with the reason and what to use instead (*refused*). None is accepted and ignored.
A vLLM flag not listed here is not known to mmserve either (argparse names it).

This page is generated from `src/mmserve/vllm_args.py` (`python -c "import mmserve.vllm_args as a; print(a.docs_page(), end='')" > docs/vllm-flags.md`);
a test keeps the two equal.
"""


def docs_page() -> str:
    return f"{DOCS_INTRO}\n{markdown_table()}\n"


def markdown_table() -> str:
    """The table as the docs print it: flag, what mmserve does with it."""
    lines = ["| vLLM flag | here | what it does in mmserve |", "|---|---|---|"]
    for row in VLLM_ARGS:
        what = row.note
        if row.support is Support.ALIAS:
            what = f"same as --{row.target.replace('_', '-')}: {row.note}"
        elif row.support is Support.ACCEPTED and row.accepted_values:
            what = f"{' or '.join(row.accepted_values)} accepted ({row.note}); other values refused"
        spellings = ", ".join(f"`{flag}`" for flag in (row.flag, *row.short))
        lines.append(f"| {spellings} | {row.support.value} | {what} |")
    return "\n".join(lines)

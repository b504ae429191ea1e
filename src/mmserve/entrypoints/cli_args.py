"""The `mmserve` command line's arguments: the parser, its flag groups, and the values they parse to.

Role: the `serve`, `generate` and `chat` parsers; engine flags (`--max-num-seqs`, `--encoder-cache-bytes`,
...) generated from the fields of the config dataclasses, so a new engine argument becomes a flag without
being listed here; sizes (`64MiB`), integer lists; the model named positionally or by --model.
What it does not know: what the commands do with the arguments (cli.py), the engine, the server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import typing
from typing import Any

from mmserve.cluster.router import ROUTING_POLICIES
from mmserve.config import (
    DEMO_MODEL_NAME,
    LOGPROBS_MODES,
    QUANTIZATION_METHODS,
    TOP_LEVEL_ARGS,
    CacheConfig,
    EncoderConfig,
    GraphConfig,
    SchedulerConfig,
    resolve_model,
)
from mmserve.entrypoints.server_flags import add_response_store_args
from mmserve.entrypoints.text_flags import add_text_flags
from mmserve.errors import InvalidInputError
from mmserve.inputs.media import MediaLimits
from mmserve.vllm_args import VLLM_ARGS, Support, VllmArg, check_accepted

ENGINE_ARG_GROUPS = (("cache", CacheConfig), ("scheduler", SchedulerConfig), ("encoder budgets", EncoderConfig),
                     ("media limits", MediaLimits), ("captured graphs (CUDA), compiled decode (CPU)", GraphConfig))


MM_KINDS = ("image", "video", "audio")  # what --limit-mm-per-prompt counts
DEFAULT_MM_LIMITS = {"image": 16, "video": 4, "audio": 4}
DTYPE_CHOICES = ["float32", "bfloat16", "float16", "auto", "half", "float"]
SIZE_SUFFIXES = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


EPILOG = """examples:
  mmserve serve                         the bundled demo model, at http://127.0.0.1:8000/v1 and a chat page at /
  mmserve serve Qwen/Qwen2-VL-2B-Instruct --port 8000 --max-num-seqs 32
  mmserve generate ./my-qwen2-vl --image cat.png --prompt "What is this?"
  mmserve chat ./my-qwen2-vl            (then: /image cat.png, a question, /help, /quit)
run `mmserve COMMAND --help` for the flags of one command."""


SERVE_EXAMPLES = """examples:
  mmserve serve                                     the demo model on 127.0.0.1:8000, chat page at /
  mmserve serve ./my-qwen2-vl --served-model-name qwen2-vl --api-key secret
  mmserve serve Qwen/Qwen2-VL-2B-Instruct --dtype bfloat16 --max-model-len 8192
  mmserve serve ./ckpt --host 0.0.0.0 --encoder-workers 2 --kv-cache-bytes 2GiB
then:
  curl http://127.0.0.1:8000/v1/models"""


def int_or_size(text: str) -> int:
    """'1048576', '64MiB', '512k' or '2GB' (k/M/G decimal, KiB/MiB/GiB binary) -> int."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg](?:i?b)?)?", text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected an integer or a size like 64MiB, got {text!r}")
    number, unit = match.groups()
    return int(float(number) * SIZE_SUFFIXES[(unit or "").removesuffix("b") if unit and "i" not in unit
                                              else (unit or "")])


def _int_tuple(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def _int_tuples(text: str) -> tuple[tuple[int, ...], ...]:
    """'1024x2,4096x8' -> ((1024, 2), (4096, 8)): comma-separated entries of 'x'-joined integers."""
    try:
        return tuple(tuple(int(n) for n in entry.split("x")) for entry in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected entries like 1024x2 separated by commas, got {text!r}") from None


# engine args whose flag also has a shorter name
FLAG_ALIASES = {"encoder_timeout_s": ("--encoder-timeout",)}


def _help(f: dataclasses.Field) -> str:
    """The field's help line, its choices and its default as a user reads it."""
    meta = f.metadata
    default = f.default if f.default is not dataclasses.MISSING else None
    shown = meta.get("shown") or (default if default is not None else "none")
    if isinstance(shown, bool):
        shown = "on" if shown else "off"
    choices = f" (one of: {', '.join(meta['choices'])})" if meta.get("choices") else ""
    return f"{meta.get('help', '')}{choices} (default: {shown})".strip()


def _add_field_flag(group: argparse._ArgumentGroup, f: dataclasses.Field, hint: Any) -> None:
    flags = ("--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, ()))
    args = typing.get_args(hint)
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    common = {"default": argparse.SUPPRESS, "dest": f.name, "help": _help(f)}
    if base is bool:
        group.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
    elif base is int:
        group.add_argument(*flags, type=int_or_size, metavar="N", **common)
    elif typing.get_origin(base) is tuple:
        nested = typing.get_origin(typing.get_args(base)[0]) is tuple
        group.add_argument(*flags, type=_int_tuples if nested else _int_tuple,
                           metavar="TxC,..." if nested else "N,...", **common)
    elif f.metadata.get("choices"):
        group.add_argument(*flags, choices=f.metadata["choices"], **common)
    else:
        group.add_argument(*flags, type=base if base in (float, str) else str,
                           metavar="PATH" if f.name.endswith("_path") else "VALUE", **common)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per engine argument of EngineConfig.from_kwargs; unset flags keep the config's defaults."""
    top = parser.add_argument_group("engine")
    top.add_argument("--dtype", default=argparse.SUPPRESS, choices=DTYPE_CHOICES,
                     help="weights and activations; vLLM's half/float name float16/float32, auto the checkpoint's "
                          "dtype (a float32 checkpoint: float16 on CUDA, float32 on the CPU) (default: float32)")
    top.add_argument("--device", default=argparse.SUPPRESS,
                     help="torch device, e.g. cpu, cuda or cuda:1 (default: cuda where it is available, else cpu)")
    top.add_argument("--seed", type=int, default=argparse.SUPPRESS, help="random seed (default: 0)")
    top.add_argument("--quantization", default=argparse.SUPPRESS, choices=QUANTIZATION_METHODS,
                     help="quantize the language model's linears at load: int8 weights, int4 weights with int8 "
                          "inputs (int4, the same as w4a8), w8a8 (int8 weights and inputs) or int4_weight_only; a "
                          "checkpoint stored quantized runs as stored (default: none)")
    top.add_argument("--logprobs-mode", default=argparse.SUPPRESS, choices=LOGPROBS_MODES,
                     help="what logprobs report: the model's raw distribution (raw_logprobs, the default) or the "
                          "one sampled from after penalties, biases, grammars, temperature and top-k/p "
                          "(processed_logprobs); *_logits: the logits instead")
    top.add_argument("--otlp-traces-endpoint", default=argparse.SUPPRESS, metavar="URL",
                     help="export OpenTelemetry traces of every request (server, routing, each replica's queue, "
                          "encode, prefill chunks and decode) to this OTLP collector, e.g. http://localhost:4318 "
                          "(OTLP/HTTP; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc for gRPC); needs mmserve[otel] "
                          "(default: no tracing)")
    add_text_flags(top)
    for title, cls in ENGINE_ARG_GROUPS:
        group = parser.add_argument_group(title)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _add_field_flag(group, f, hints[f.name])


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = set(TOP_LEVEL_ARGS) | {f.name for _, cls in ENGINE_ARG_GROUPS for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in vars(args).items() if k in names}
    kwargs.setdefault("device", default_device())
    return kwargs


def _model_arg(parser: argparse.ArgumentParser) -> None:
    """The model as the positional MODEL or as --model (vLLM's spelling), and its --revision."""
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="a checkpoint directory (config.json, *.safetensors, tokenizer) or a Hugging Face "
                             "repository id ORG/NAME (from the local cache, else downloaded); default: the bundled "
                             "demo model")
    parser.add_argument("--model", dest="model_flag", metavar="MODEL", default=None,
                        help="the same as the positional MODEL")
    parser.add_argument("--revision", default=None, help="the repository's branch, tag or commit (default: main)")


def resolved_model(args: argparse.Namespace) -> str:
    """The checkpoint directory the command loads."""
    if args.model and args.model_flag and args.model != args.model_flag:
        raise InvalidInputError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
    return resolve_model(args.model or args.model_flag, args.revision)


def _add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                                       "/v1/completions, /v1/models, /health, /metrics), with a chat page "
                                       "at /.", epilog=SERVE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_arg(serve)
    http = serve.add_argument_group("server")
    _add_listen_flags(http)
    _add_media_flags(serve.add_argument_group("media fetching"))
    _add_http_flags(http)
    _add_replica_flags(serve.add_argument_group("replicas"))
    add_engine_args(serve)
    add_vllm_flags(serve)


def _add_listen_flags(http: argparse._ArgumentGroup) -> None:
    """Where the server listens, its key, its model's name, what it logs, the chat page."""
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    http.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    http.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                      help="the model name(s) clients send; the first is the one answered (default: MODEL, or "
                           f"{DEMO_MODEL_NAME} for the demo model)")
    http.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                      help="what the server logs: at info, each request and each refused one with its reason "
                           "(default: info)")
    http.add_argument("--no-web-ui", dest="web_ui", action="store_false",
                      help="do not serve the browser chat page at / (served by default; it needs no build)")


def _add_media_flags(media: argparse._ArgumentGroup) -> None:
    """What media the server fetches, from where, how much."""
    shown = ",".join(f"{kind}={n}" for kind, n in DEFAULT_MM_LIMITS.items())
    media.add_argument("--limit-mm-per-prompt", default="", metavar="image=N,video=M,audio=K",
                       help="most media items of each kind in one prompt, or vLLM's JSON "
                            f"'{{\"image\": N}}'; a kind not given keeps its default (default: {shown})")
    media.add_argument("--allowed-media-domains", nargs="+", default=(), metavar="DOMAIN",
                       help="fetch media URLs only from these hosts (and subdomains), which are trusted")
    media.add_argument("--allow-private-media-urls", action="store_true",
                       help="allow media URLs that resolve to private, loopback or link-local addresses")
    media.add_argument("--media-fetch-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="total time limit for fetching one media URL (default: 10)")
    media.add_argument("--max-video-bytes", type=int_or_size, default=64 * 1024 * 1024, metavar="N",
                       help="largest encoded video file (default: 64MiB)")


def _add_http_flags(http: argparse._ArgumentGroup) -> None:
    """Shutdown, body size, and vLLM's server flags."""
    http.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="on SIGTERM, how long requests in flight may take to finish before they are aborted "
                           "(default: 30)")
    http.add_argument("--max-request-bytes", type=int_or_size, default=32 * 1024 * 1024, metavar="N",
                      help="largest request body; a larger one gets 413 before it is read (default: 32MiB)")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "request headers")):
        http.add_argument(flag, type=json.loads, default=["*"], metavar="JSON",
                          help=f"CORS: the {what} browsers may use to call the API, a JSON list (default: [\"*\"])")
    http.add_argument("--allow-credentials", action="store_true",
                      help="CORS: allow credentials (cookies, Authorization) in cross-origin calls")
    http.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                      help="TLS: the server's private key (PEM); with --ssl-certfile it serves https")
    http.add_argument("--ssl-certfile", default=None, metavar="FILE", help="TLS: the server's certificate chain (PEM)")
    http.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                      help="TLS: CA certificates client certificates are checked against")
    http.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2), metavar="N",
                      help="TLS: a client certificate is 0: not asked for, 1: optional, 2: required (default: 0)")
    http.add_argument("--return-tokens-as-token-ids", action="store_true",
                      help="logprobs name tokens as 'token_id:N' instead of their text (vLLM's flag)")
    http.add_argument("--enable-request-id-headers", action="store_true",
                      help="answer with an X-Request-Id header (the client's, else a new id)")
    http.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                      help="serve GET /tokenizer_info: the tokenizer's configuration and chat template (vLLM's)")
    http.add_argument("--tool-call-parser", default=None, metavar="NAME",
                      help="the tool-call syntax, by vLLM's parser names: hermes (<tool_call>{json}</tool_call>), "
                           "qwen3_xml or qwen3_coder (<tool_call><function=...><parameter=...>), gemma4 "
                           "(<|tool_call>call:name{...}<tool_call|>); default auto: the syntax the model's chat "
                           "template renders")
    http.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="accepted for vLLM compatibility: tool_choice auto is always enabled")
    http.add_argument("--reasoning-parser", default=None, metavar="NAME",
                      help="a chat template that thinks (<think>...</think>, or Gemma 4's <|channel>thought..."
                           "<channel|>) has its thought returned as reasoning (and reasoning_content), and grammars "
                           "apply after it; gemma4 names Gemma 4's tags, any other name (vLLM's) the template's")
    http.add_argument("--enable-force-include-usage", action="store_true",
                      help="every streamed answer ends with its usage, as if stream_options.include_usage were set")
    add_response_store_args(http, int_or_size)
    http.add_argument("--enable-server-load-tracking", action="store_true",
                      help="count the generation requests in flight: GET /load answers {\"server_load\": N}")
    http.add_argument("--disable-log-stats", action="store_true",
                      help="no stats line every 10 s (throughput, running and waiting requests, KV cache usage, "
                           "prefix-cache hit rate; with speculative decoding the mean acceptance length)")
    http.add_argument("--root-path", default="", metavar="PATH",
                      help="the path prefix a proxy serves the API under, e.g. /llm: every route answers with "
                           "and without it (/llm/v1/models and /v1/models; default: none)")


def _add_replica_flags(replicas: argparse._ArgumentGroup) -> None:
    """Engine replicas behind the server, disaggregation and routing."""
    replicas.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                          help="engine replicas behind this server, each a local process with its share of the "
                               "cores (default: 1, the engine in the server's process)")
    replicas.add_argument("--data-parallel-backend", default="mp", choices=("mp", "ray"),
                          help="replicas as local processes (mp, the default) or Ray actors placed by Ray (ray: "
                               "--ray-address joins a cluster, else a local Ray is started and stopped with the "
                               "server)")
    replicas.add_argument("--prefill-replicas", type=int, default=0, metavar="P",
                          help="prefill/decode disaggregation: P replicas that encode and prefill each request "
                               "and sample its first token, then hand its KV to one of --decode-replicas, which "
                               "decodes the rest (same backend and routing; default: 0, no disaggregation)")
    replicas.add_argument("--decode-replicas", type=int, default=0, metavar="D",
                          help="the decode replicas of --prefill-replicas (both at least 1 to disaggregate)")
    replicas.add_argument("--routing", default="cache_aware", choices=ROUTING_POLICIES,
                          help="which replica a request goes to: the one likely to hold its images' encoder "
                               "outputs and its prompt's prefix, balanced by load (cache_aware, the default), "
                               "round_robin, or least_loaded")

class _Checked(argparse.Action):
    """A vLLM flag mmserve accepts for some values or none: any other stops start-up with why and what to
    use instead."""

    def __init__(self, option_strings: list[str], dest: str, row: VllmArg, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.row = row

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            check_accepted(self.row, True if self.row.switch else values)
        except InvalidInputError as exc:
            parser.error(str(exc))
        if self.dest != argparse.SUPPRESS:  # an accepted flag the engine answers (trust_remote_code)
            setattr(namespace, self.dest, True if self.row.switch else values)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Every row of vllm_args.py's table that the parser does not define itself: vLLM's aliases set the
    mmserve flag they name; accepted ones check their value; refused ones stop start-up saying why."""
    group = parser.add_argument_group("vLLM's flags (what each does here: docs/vllm-flags.md)")
    defined = parser._option_string_actions
    for row in VLLM_ARGS:
        if row.flag in defined or row.support is Support.WORKS:
            continue
        if row.support is Support.ALIAS:
            target = next(a for a in parser._actions if a.dest == row.target)
            group.add_argument(row.flag, *row.short, dest=row.target, type=target.type, choices=target.choices,
                               metavar=target.metavar, default=argparse.SUPPRESS,
                               help=f"vLLM's name for --{row.target.replace('_', '-')}")
            continue
        keeps = row.name in TOP_LEVEL_ARGS  # trust_remote_code: the engine logs its answer once
        group.add_argument(row.flag, *row.short, action=_Checked, row=row, nargs=0 if row.switch else None,
                           dest=row.name if keeps else argparse.SUPPRESS, default=argparse.SUPPRESS,
                           help=f"{row.support.value}: {row.note}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmserve",
        description="mmserve: serve vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision, "
                    "Gemma 3, Mistral 3) on PyTorch.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mmserve {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve_parser(sub)
    gen = sub.add_parser("generate", help="answer one prompt about an image and print the answer",
                         description="Load a model, ask one question about an image, print the answer.")
    _model_arg(gen)
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="image file to show the model (repeat for several)")
    gen.add_argument("--prompt", required=True, help="the question or instruction")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    gen.add_argument("--min-tokens", type=int, default=0, help="generate at least this many tokens")
    gen.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES,
                     help="weights and activations (default: float32)")
    gen.add_argument("--device", default=None,
                     help="torch device, e.g. cpu or cuda (default: cuda where it is available, else cpu)")
    chat = sub.add_parser("chat", help="chat with a model in the terminal",
                          description="An interactive chat. Type a message and press Enter. Commands: "
                                      "/image PATH attaches an image to your next message, /clear forgets the "
                                      "conversation, /quit (or Ctrl-D) leaves.")
    _model_arg(chat)
    chat.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer (default 256)")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    chat.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(chat)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mmserve")
    except PackageNotFoundError:
        return "unknown (not installed)"

"""The `mmserve` command line: what each command does with its arguments.

Role: `serve` composes the server — one `AsyncEngine(Engine(...))` or a `ReplicaSet` of engine processes,
handed as an `EngineClient` to `serve()` — and prints the start-up summary; `generate` answers one
prompt about an image (or none) and prints the answer; `chat` is an interactive chat in the terminal.
The parser and its flags live in cli_args.py.
What it does not know: model logic, HTTP, how requests are scheduled.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserve.engine.client import EngineClient
from mmserve.engine.generation_defaults import describe
from mmserve.entrypoints.cli_args import (
    DEFAULT_MM_LIMITS,
    MM_KINDS,
    build_parser,
    default_device,
    engine_kwargs,
    resolved_model,
)
from mmserve.entrypoints.server_flags import build_server_config, cors_policy, response_store_error, tls_files
from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.inputs.media import MediaLimits
from mmserve.tracing import otlp_exporter


def _generate(args: argparse.Namespace) -> int:
    from mmserve.entrypoints.llm import LLM
    from mmserve.sampling_params import SamplingParams

    started = time.perf_counter()
    images = [_read_image(Path(p), MediaLimits()) for p in args.image]  # a bad file fails before the model loads
    model = resolved_model(args)
    print(f"loading {model} ...", file=sys.stderr, flush=True)
    llm = LLM(model, dtype=args.dtype, device=args.device or default_device())
    print(f"loaded in {time.perf_counter() - started:.1f}s; generating ...", file=sys.stderr, flush=True)
    content = [{"type": "image", "image": data} for data in images] + [{"type": "text", "text": args.prompt}]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, min_tokens=args.min_tokens)
    output = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]
    if output.error:
        raise InvalidInputError(output.error)
    print(output.outputs[0].text)
    return 0


def _read_image(path: Path, limits: MediaLimits) -> bytes:
    """The bytes of an image file the user named, checked to decode under the limits."""
    from mmserve.inputs.media import decode_image_bytes

    path = path.expanduser()
    if not path.is_file():
        raise InvalidInputError(f"no such file: {path}")
    data = path.read_bytes()
    decode_image_bytes(data, limits, what=str(path))
    return data


def _limit_per_prompt(text: str) -> dict[str, int]:
    """image=N,video=M,audio=K, or vLLM's JSON {"image": N, "video": M, "audio": K}."""
    if text.strip().startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"--limit-mm-per-prompt: not JSON: {exc}") from exc
        counts = parsed.items() if isinstance(parsed, dict) else [(None, None)]
        if not all(k in MM_KINDS and type(v) is int and v >= 0 for k, v in counts):  # type(): not a bool
            raise InvalidInputError(f"--limit-mm-per-prompt takes image, video and audio counts; "
                                    f"got {text!r}")
        return parsed
    limits = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in MM_KINDS or not value.strip().isdigit():
            raise InvalidInputError(f"--limit-mm-per-prompt takes image=N,video=M,audio=K; got {text!r}")
        limits[key.strip()] = int(value)
    return limits


def _serve(args: argparse.Namespace) -> int:
    from mmserve.config import EngineConfig
    from mmserve.entrypoints.openai.server import PortTakenError, bind_port, serve
    from mmserve.entrypoints.openai.tool_formats import TOOL_FORMATS
    from mmserve.inputs.fetch import FetchPolicy

    _log_to_stderr(args.log_level)
    if args.tool_call_parser not in (None, "auto", *TOOL_FORMATS):
        print(f"error: --tool-call-parser {args.tool_call_parser}: mmserve reads {', '.join(TOOL_FORMATS)} (or "
              "auto: the syntax the model's chat template renders, the default)", file=sys.stderr)
        return 2
    model = resolved_model(args)
    limits = {**DEFAULT_MM_LIMITS, **_limit_per_prompt(args.limit_mm_per_prompt)}
    config = EngineConfig.from_kwargs(model, **engine_kwargs(args))
    fetch = FetchPolicy(timeout_s=args.media_fetch_timeout, allowed_domains=tuple(args.allowed_media_domains),
                        allow_private=args.allow_private_media_urls)
    tls_files(args)  # the TLS and CORS flags checked before the model loads (the server reads them again)
    cors_policy(args)
    error = (_served_names_error(args) or _replica_args_error(args) or response_store_error(args)
             or _tracing_error(config.otlp_traces_endpoint))
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:  # before the model loads: a taken port fails in a second, not after the load
        sock = bind_port(args.host, args.port)
    except PortTakenError as exc:
        print(f"error: {exc.strerror}; stop the server there or pass --port", file=sys.stderr)
        return 1
    print(f"loading {model} ...", file=sys.stderr, flush=True)
    # SIGTERM while loading stops as Ctrl-C does (exit 0, below), not by the signal; serve() takes both over
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        client = _engine_client(args, config)
    except KeyboardInterrupt:
        print("stopped while loading the model", file=sys.stderr)
        return 0
    server_config = build_server_config(args, model, client, fetch, limits)
    summary = startup_summary(client, server_config.served_model_name,
                              f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{sock.getsockname()[1]}",
                              web_ui=server_config.web_ui)
    serve(client, server_config, args.host, args.port, args.log_level, args.shutdown_timeout,
          on_ready=lambda: print(summary, file=sys.stderr, flush=True), sock=sock)
    return 0


def _served_names_error(args: argparse.Namespace) -> str | None:
    """--served-model-name takes one or more names, so a MODEL written after it is read as a name: say so
    rather than serve the demo model under that name."""
    if args.model or args.model_flag or not args.served_model_name:
        return None
    swallowed = [n for n in args.served_model_name[1:] if Path(n).expanduser().is_dir()]
    if swallowed:
        return (f"--served-model-name read {swallowed[0]!r} as a name; write MODEL before --served-model-name, "
                "or give it with --model")
    return None


def _disaggregated(args: argparse.Namespace) -> bool:
    return args.prefill_replicas > 0 or args.decode_replicas > 0


def _replica_args_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the replica flags (None: nothing)."""
    if args.data_parallel_size < 1:
        return f"--data-parallel-size must be at least 1, got {args.data_parallel_size}"
    if _disaggregated(args) and (args.prefill_replicas < 1 or args.decode_replicas < 1
                                 or args.data_parallel_size > 1):
        return ("disaggregation takes --prefill-replicas P and --decode-replicas D, both at least 1, and no "
                "--data-parallel-size")
    return None


def _tracing_error(endpoint: str | None) -> str | None:
    """Why tracing cannot start (None: it is off, or the SDK is installed and the endpoint parses)."""
    if endpoint is None:
        return None
    try:
        otlp_exporter(endpoint)
    except ValueError as exc:
        return str(exc)
    return None


def _engine_client(args: argparse.Namespace, config: Any) -> EngineClient:
    """The engine(s) the server talks to: one engine on its own thread, or replicas (launched here)."""
    if args.data_parallel_size > 1 or _disaggregated(args):
        from mmserve.cluster.replicas import ReplicaSet
        from mmserve.cluster.router import RouterConfig

        disaggregated = _disaggregated(args)
        replicas = ReplicaSet(config, args.prefill_replicas if disaggregated else args.data_parallel_size,
                              RouterConfig(policy=args.routing), backend=args.data_parallel_backend,
                              ray_address=config.encoder.ray_address, decode_replicas=args.decode_replicas)
        replicas.launch()
        return replicas
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.engine.llm_engine import Engine

    return AsyncEngine(Engine(config))


def _log_to_stderr(level: str) -> None:
    """mmserve's own log lines (a refused request and why, shutdown) beside uvicorn's, at its level."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)-9s %(name)s: %(message)s"))
    root = logging.getLogger("mmserve")
    root.addHandler(handler)
    root.setLevel(level.upper())


def startup_summary(client: EngineClient, served_name: str, base_url: str, *, web_ui: bool) -> str:
    """What `mmserve serve` prints once its port answers: the model, where its memory went (summed over
    replicas), and the addresses to use."""
    frontend, stats = client.frontend, client.stats()
    config = frontend.config
    workers = config.encoder.encoder_workers
    encoder = (f"{workers} {config.encoder.encoder_backend} worker(s)" if workers else "in the engine's step")
    replicas = stats.get("replicas_total")
    lines = [
        f"model         {served_name} ({frontend.spec.name}, {config.dtype} on {config.device})",
        f"context       {frontend.max_model_len} tokens per request",
        f"defaults      {describe(frontend.default_sampling)} (generation_config: {config.generation_config}; "
        "--generation-config vllm turns them off)",
        f"KV cache      {stats['kv_capacity_tokens']} tokens ({stats['kv_cache_dtype']})",
        f"image cache   {_mib(stats['budget_encoder_cache_bytes'])}; encoder {encoder}",
        f"API           {base_url}/v1  (OpenAI-compatible: /v1/chat/completions, /v1/completions, /v1/responses; Anthropic's /v1/messages)",
    ]
    if frontend.pooling is not None:  # a pooling engine: no sampling defaults, other routes
        pooling = frontend.pooling
        lines[2] = f"pooling       {pooling.task}: {pooling.pooling_type} token, activation {pooling.use_activation}"
        lines[-1] = f"API           {base_url}/v1  (/v1/embeddings, /v1/score, /v1/rerank)"
    if replicas:
        lines.insert(1, f"replicas      {replicas} ({stats['replica_backend']}), "
                        f"routed {stats['router']['policy']}; "
                        f"the caches below are all replicas' together")
    if web_ui:
        lines.append(f"chat in your browser: {base_url}/")
    return "\n".join(["mmserve is ready", *("  " + line for line in lines)])


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.0f} MiB"


def _chat_turn(engine: Any, history: list[dict[str, Any]], params: Any, turn: int) -> str:
    """Run one answer, printing it as it streams; returns the whole answer."""
    engine.add_request(f"chat-{turn}", engine.process_chat(history), params)
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            print(output.delta_text, end="", flush=True)
            if output.finished:
                text = output.outputs[0].text
                if output.outputs[0].finish_reason == "error":
                    print(f"\n[error: {output.error}]", end="")
    print()
    return text


CHAT_COMMANDS = {
    "/image PATH": "attach a picture to your next message",
    "/clear": "forget the conversation (and any attached picture)",
    "/help": "list these commands",
    "/quit": "leave (also /exit or Ctrl-D)",
}


@dataclass
class _Conversation:
    """The terminal chat's state: its system prompt, the turns so far, the pictures for the next message."""

    system: list[dict[str, Any]]
    history: list[dict[str, Any]] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)

    def clear(self) -> None:
        self.history, self.images = list(self.system), []


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _chat_command(conversation: _Conversation, command: str, rest: str, limits: MediaLimits) -> None:
    """A slash command other than /quit."""
    if command == "/help":
        _say("\n".join(f"  {name:<12} {what}" for name, what in CHAT_COMMANDS.items()))
    elif command == "/clear":
        conversation.clear()
        _say("conversation cleared")
    elif command == "/image" and not rest.strip():
        _say("usage: /image PATH")
    elif command == "/image":
        try:  # refused now, so a bad file never rides along with the later messages
            conversation.images.append(_read_image(Path(rest.strip()), limits))
        except InvalidInputError as exc:
            _say(f"not attached: {exc}")
        else:
            _say(f"attached {Path(rest.strip()).name} to your next message")
    else:
        _say(f"unknown command {command}; /help lists the commands")


def _ask(engine: Any, conversation: _Conversation, line: str, params: Any, turn: int) -> None:
    """One user message (with the attached pictures) and the streamed answer; a refused message is dropped."""
    images, conversation.images = conversation.images, []
    content = [{"type": "image", "image": data} for data in images] + [{"type": "text", "text": line}]
    conversation.history.append({"role": "user", "content": content})
    print("assistant> ", end="", flush=True)
    try:
        answer = _chat_turn(engine, conversation.history, params, turn)
    except InvalidInputError as exc:
        print()
        _say(f"error: {exc}" + ("; the attached picture(s) were dropped" if images else ""))
        conversation.history.pop()
        return
    conversation.history.append({"role": "assistant", "content": answer})


def _chat(args: argparse.Namespace) -> int:
    from mmserve.config import EngineConfig
    from mmserve.engine.llm_engine import Engine
    from mmserve.sampling_params import SamplingParams

    model = resolved_model(args)
    print(f"loading {model} ...", file=sys.stderr, flush=True)
    config = EngineConfig.from_kwargs(model, **engine_kwargs(args))
    if config.runner != "generate":
        raise InvalidInputError("mmserve chat generates answers: --runner pooling is served by mmserve serve "
                                "(/v1/embeddings, /v1/score, /v1/rerank)", param="runner")
    engine = Engine(config)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    conversation = _Conversation([{"role": "system", "content": args.system}] if args.system else [])
    conversation.clear()
    _say("type a message; /help lists the commands")
    for turn in range(sys.maxsize):
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            break
        command, _, rest = line.partition(" ")
        if command in ("/quit", "/exit"):
            break
        if line.startswith("/"):
            _chat_command(conversation, command, rest, engine.config.media)
        elif line:
            _ask(engine, conversation, line, params, turn)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `mmserve` alone: what it can do
        parser.print_help()
        return 0
    commands = {"serve": _serve, "generate": _generate, "chat": _chat}
    try:
        return commands[args.command](args)
    except (InvalidInputError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a config value out of range (EngineConfig's __post_init__)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

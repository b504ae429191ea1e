"""The `mmserve` command line.

Role: parse arguments and call the library; no model logic here.
Commands: `serve` — the OpenAI-compatible HTTP server; `generate` — answer one prompt about an
image (or none) and print the answer; `chat` — an interactive chat in the terminal.
Engine flags (`--max-num-seqs`, `--encoder-cache-bytes`, ...) are generated from the fields of the
config dataclasses, so a new engine argument becomes a flag without being listed here.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmserve.config import (
    DEMO_MODEL_DIR,
    DEMO_MODEL_NAME,
    CacheConfig,
    EncoderConfig,
    GraphConfig,
    SchedulerConfig,
    resolve_model,
)
from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.inputs.media import MediaLimits

ENGINE_ARG_GROUPS = (("cache", CacheConfig), ("scheduler", SchedulerConfig), ("encoder budgets", EncoderConfig),
                     ("media limits", MediaLimits), ("captured graphs (CUDA), compiled decode (CPU)", GraphConfig))
SIZE_SUFFIXES = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}
EPILOG = """examples:
  mmserve serve ./my-qwen2-vl --port 8000 --max-num-seqs 32
  mmserve generate --model ./my-qwen2-vl --image cat.png --prompt "What is this?"
  mmserve chat ./my-qwen2-vl            (then: /image cat.png, a question, /quit)
run `mmserve COMMAND --help` for the flags of one command."""


def _int_or_size(text: str) -> int:
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


def _add_field_flag(group: argparse._ArgumentGroup, f: dataclasses.Field, hint: Any) -> None:
    flags = ("--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, ()))
    default = f.default if f.default is not dataclasses.MISSING else None
    shown = "automatic" if default is None else default
    args = typing.get_args(hint)
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if base is bool:
        group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=f"(default: {shown})", dest=f.name)
    elif base is int:
        group.add_argument(*flags, type=_int_or_size, default=argparse.SUPPRESS, metavar="N",
                           help=f"(default: {shown})", dest=f.name)
    elif typing.get_origin(base) is tuple:
        nested = typing.get_origin(typing.get_args(base)[0]) is tuple
        group.add_argument(*flags, type=_int_tuples if nested else _int_tuple, default=argparse.SUPPRESS,
                           metavar="TxC,..." if nested else "N,...", help=f"(default: {shown})", dest=f.name)
    else:
        group.add_argument(*flags, type=base if base in (float, str) else str, default=argparse.SUPPRESS,
                           metavar="PATH" if f.name.endswith("_path") else "VALUE", help=f"(default: {shown})",
                           dest=f.name)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per engine argument of EngineConfig.from_kwargs; unset flags keep the config's defaults."""
    top = parser.add_argument_group("engine")
    top.add_argument("--dtype", default=argparse.SUPPRESS, choices=["float32", "bfloat16", "float16"],
                     help="weights and activations (default: float32)")
    top.add_argument("--device", default=argparse.SUPPRESS, help="torch device, e.g. cpu or cuda (default: cpu)")
    top.add_argument("--seed", type=int, default=argparse.SUPPRESS, help="random seed (default: 0)")
    for title, cls in ENGINE_ARG_GROUPS:
        group = parser.add_argument_group(title)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _add_field_flag(group, f, hints[f.name])


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = {"dtype", "device", "seed"} | {f.name for _, cls in ENGINE_ARG_GROUPS for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


def _model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="checkpoint directory (config.json, *.safetensors, tokenizer); "
                             "default: the bundled demo model")


def _add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                                       "/v1/completions, /v1/models, /health, /metrics), with a chat page "
                                       "at /.")
    _model_arg(serve)
    http = serve.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    http.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    http.add_argument("--served-model-name", default=None, help=f"the model name clients send (default: MODEL, or {DEMO_MODEL_NAME} for the demo model)")
    http.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    http.add_argument("--no-web-ui", dest="web_ui", action="store_false",
                      help="do not serve the browser chat page at / (served by default; it needs no build)")
    media = serve.add_argument_group("media fetching")
    media.add_argument("--limit-mm-per-prompt", default="image=16,video=4", metavar="image=N,video=M",
                       help="most media items of each kind in one prompt (default: image=16,video=4)")
    media.add_argument("--allowed-media-domains", nargs="+", default=(), metavar="DOMAIN",
                       help="fetch media URLs only from these hosts (and subdomains), which are trusted")
    media.add_argument("--allow-private-media-urls", action="store_true",
                       help="allow media URLs that resolve to private, loopback or link-local addresses")
    media.add_argument("--media-fetch-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="total time limit for fetching one media URL (default: 10)")
    media.add_argument("--max-video-bytes", type=_int_or_size, default=64 * 1024 * 1024, metavar="N",
                       help="largest encoded video file (default: 64MiB)")
    http.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="on SIGTERM, how long requests in flight may take to finish before they are aborted "
                           "(default: 30)")
    http.add_argument("--max-request-bytes", type=_int_or_size, default=32 * 1024 * 1024, metavar="N",
                      help="largest request body; a larger one gets 413 before it is read (default: 32MiB)")
    _add_engine_args(serve)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmserve",
        description="mmserve: serve vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision, "
                    "Gemma 3, Mistral 3) on PyTorch.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve_parser(sub)
    gen = sub.add_parser("generate", help="answer one prompt about an image and print the answer",
                         description="Load a model, ask one question about an image, print the answer.")
    gen.add_argument("--model", default=None,
                     help="checkpoint directory (config.json, *.safetensors, tokenizer); default: the demo model")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="image file to show the model (repeat for several)")
    gen.add_argument("--prompt", required=True, help="the question or instruction")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    gen.add_argument("--min-tokens", type=int, default=0, help="generate at least this many tokens")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    chat = sub.add_parser("chat", help="chat with a model in the terminal",
                          description="An interactive chat. Type a message and press Enter. Commands: "
                                      "/image PATH attaches an image to your next message, /clear forgets the "
                                      "conversation, /quit (or Ctrl-D) leaves.")
    _model_arg(chat)
    chat.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer (default 256)")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    chat.add_argument("--system", default=None, help="a system prompt")
    _add_engine_args(chat)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from mmserve.entrypoints.llm import LLM
    from mmserve.sampling_params import SamplingParams

    started = time.perf_counter()
    model = resolve_model(args.model)
    print(f"loading {model} ...", file=sys.stderr, flush=True)
    images = [str(Path(p).resolve()) for p in args.image]
    roots = {str(Path(p).parent) for p in images}
    llm = LLM(model, dtype=args.dtype, device=args.device,
              allowed_local_media_path=roots.pop() if len(roots) == 1 else "/")
    print(f"loaded in {time.perf_counter() - started:.1f}s; generating ...", file=sys.stderr, flush=True)
    content = [{"type": "image_url", "image_url": {"url": p}} for p in images] + [{"type": "text", "text": args.prompt}]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, min_tokens=args.min_tokens)
    output = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]
    if output.error:
        raise InvalidInputError(output.error)
    print(output.outputs[0].text)
    return 0


def _limit_per_prompt(text: str) -> dict[str, int]:
    limits = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("image", "video") or not value.strip().isdigit():
            raise InvalidInputError(f"--limit-mm-per-prompt takes image=N,video=M; got {text!r}")
        limits[key.strip()] = int(value)
    return limits


def _serve(args: argparse.Namespace) -> int:
    from mmserve.config import EngineConfig
    from mmserve.engine.llm_engine import Engine
    from mmserve.entrypoints.openai.media import MediaRules
    from mmserve.entrypoints.openai.server import serve
    from mmserve.entrypoints.openai.serving import ServerConfig
    from mmserve.inputs.fetch import FetchPolicy

    model = resolve_model(args.model)
    limits = {"image": 16, "video": 4, **_limit_per_prompt(args.limit_mm_per_prompt)}
    config = EngineConfig.from_kwargs(model, **_engine_kwargs(args))
    fetch = FetchPolicy(timeout_s=args.media_fetch_timeout, allowed_domains=tuple(args.allowed_media_domains),
                        allow_private=args.allow_private_media_urls)
    name = args.served_model_name or args.model or DEMO_MODEL_NAME
    print(f"loading {model} ...", file=sys.stderr, flush=True)
    engine = Engine(config)
    rules = MediaRules(config.media, fetch, args.max_video_bytes, limits, engine.spec.default_video_fps)
    server_config = ServerConfig(name, rules, args.api_key, extra_model_names=(model,) if name != model else (),
                                 max_request_bytes=args.max_request_bytes, web_ui=args.web_ui,
                                 demo_model=Path(model).resolve() == DEMO_MODEL_DIR.resolve())
    if args.web_ui:
        print(f"chat in your browser: http://{args.host}:{args.port}/", file=sys.stderr, flush=True)
    serve(engine, server_config, args.host, args.port, args.log_level, args.shutdown_timeout)
    return 0


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


def _chat(args: argparse.Namespace) -> int:
    from mmserve.config import EngineConfig
    from mmserve.engine.llm_engine import Engine
    from mmserve.sampling_params import SamplingParams

    model = resolve_model(args.model)
    print(f"loading {model} ...", file=sys.stderr, flush=True)
    engine = Engine(EngineConfig.from_kwargs(model, **_engine_kwargs(args)))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, Any]] = list(system)
    images: list[bytes] = []
    print("type a message; /image PATH attaches an image, /clear starts over, /quit leaves", file=sys.stderr)
    for turn in range(sys.maxsize):
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            break
        if line in ("/quit", "/exit"):
            break
        if line == "/clear":
            history, images = list(system), []
            continue
        if line.startswith("/image"):
            path = Path(line.removeprefix("/image").strip()).expanduser()
            if not path.is_file():
                print(f"no such file: {path}", file=sys.stderr)
                continue
            images.append(path.read_bytes())
            print(f"attached {path.name} to your next message", file=sys.stderr)
            continue
        if not line:
            continue
        content = [{"type": "image", "image": data} for data in images] + [{"type": "text", "text": line}]
        history.append({"role": "user", "content": content})
        print("assistant> ", end="", flush=True)
        try:
            answer = _chat_turn(engine, history, params, turn)
        except InvalidInputError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            history.pop()
            continue
        images = []
        history.append({"role": "assistant", "content": answer})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
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

"""The `serve` command's server flags: the `ServerConfig` they make and their checks before the model loads.

Role: `add_response_store_args` declares the Responses store's flags; `build_server_config` turns the parsed flags (names, media rules, API key, limits, CORS, TLS, tool-call
syntax, the Responses store's limits) into the server's `ServerConfig`; `cors_policy`, `tls_files` and
`response_store_error` check their flags so that a bad one fails in a second, before the model loads.
What it does not know: the engine, HTTP, the parser (cli_args.py), the other commands.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mmserve.config import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from mmserve.engine.client import EngineClient
from mmserve.errors import InvalidInputError


def add_response_store_args(group: Any, size: Any) -> None:
    """The Responses API store's flags, in the server's flag group (`size`: the parser's byte-size type)."""
    group.add_argument("--response-store-bytes", type=size, default=64 * 1024 * 1024, metavar="N",
                       help="the Responses API's stored responses (previous_response_id): their bytes, the oldest "
                            "evicted first (default: 64MiB)")
    group.add_argument("--response-store-max-age", type=float, default=3600.0, metavar="SECONDS",
                       help="the Responses API's stored responses: how long one is kept (default: 3600)")


def response_store_error(args: argparse.Namespace) -> str | None:
    if args.response_store_bytes <= 0 or not args.response_store_max_age > 0:
        return (f"--response-store-bytes ({args.response_store_bytes}) and --response-store-max-age "
                f"({args.response_store_max_age}) must be positive")
    return None


def build_server_config(args: argparse.Namespace, model: str, client: EngineClient, fetch: Any,
                   limits: dict[str, int]) -> Any:
    """The server's own settings (a `ServerConfig`) from its flags."""
    from mmserve.entrypoints.openai.media import MediaRules
    from mmserve.entrypoints.openai.serving import ServerConfig
    from mmserve.entrypoints.openai.stats_log import LOG_INTERVAL_S

    names = args.served_model_name or [args.model or args.model_flag or DEMO_MODEL_NAME]
    name = names[0]
    extra = tuple(dict.fromkeys(n for n in (*names[1:], model) if n != name))
    rules = MediaRules(client.frontend.config.media, fetch, args.max_video_bytes, limits,
                       client.frontend.spec.default_video_fps)
    return ServerConfig(name, rules, args.api_key, extra_model_names=extra,
                        max_request_bytes=args.max_request_bytes,
                        web_ui=args.web_ui and client.frontend.config.runner == "generate",  # a chat page
                        demo_model=Path(model).resolve() == DEMO_MODEL_DIR.resolve(),
                        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                        request_id_headers=args.enable_request_id_headers, root_path=args.root_path,
                        tokenizer_info=args.enable_tokenizer_info_endpoint,
                        force_include_usage=args.enable_force_include_usage,
                        server_load_tracking=args.enable_server_load_tracking,
                        cors=cors_policy(args), tls=tls_files(args),
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        response_store_bytes=args.response_store_bytes,
                        response_store_age_s=args.response_store_max_age,
                        log_stats_interval_s=None if args.disable_log_stats else LOG_INTERVAL_S)


def cors_policy(args: argparse.Namespace) -> Any:
    from mmserve.entrypoints.openai.serving import CorsPolicy

    return CorsPolicy(*(json_strings(getattr(args, name), name) for name in
                        ("allowed_origins", "allowed_methods", "allowed_headers")),
                      allow_credentials=args.allow_credentials)


def tls_files(args: argparse.Namespace) -> Any:
    """vLLM's --ssl-* flags as the server's TlsFiles, or None for plain http; a key without its certificate
    (or the reverse) is refused."""
    from mmserve.entrypoints.openai.serving import TlsFiles

    if args.ssl_keyfile is None and args.ssl_certfile is None:
        return None
    if args.ssl_keyfile is None or args.ssl_certfile is None:
        missing = "ssl_keyfile" if args.ssl_keyfile is None else "ssl_certfile"
        raise InvalidInputError(f"https needs both --ssl-keyfile and --ssl-certfile: give --{missing.replace('_', '-')}",
                                param=missing, setting=missing)
    for path in (args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs):
        if path is not None and not Path(path).is_file():
            raise InvalidInputError(f"no such file: {path}", param="ssl", setting="ssl")
    return TlsFiles(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)


def json_strings(value: Any, name: str) -> tuple[str, ...]:
    """A CORS flag's JSON value, which must be a list of strings (vLLM's form)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidInputError(f"--{name.replace('_', '-')} takes a JSON list of strings, got {value!r}",
                                param=name, setting=name)
    return tuple(value)

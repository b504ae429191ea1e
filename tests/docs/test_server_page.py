"""docs/server.md names every flag of `mmserve serve` (walked from the parser in cli_args.py; vLLM's flags may
have their row on docs/vllm-flags.md, the page generated from vllm_args.py, instead) and every route
of the app (walked from `build_app`'s routes, optional routes on), so a flag or route added without its row
fails here; the checks run on planted pages too, so they can fail."""

from __future__ import annotations

import argparse

import pytest

from mmserve.entrypoints.cli_args import build_parser
from tests.docs.snippets import ROOT

SERVER_PAGE = ROOT / "docs" / "server.md"
VLLM_FLAGS_PAGE = ROOT / "docs" / "vllm-flags.md"


def serve_flags() -> list[str]:
    """Every option string of `mmserve serve` but --help, and MODEL for the positional."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = []
    for action in commands.choices["serve"]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flags += list(action.option_strings) or [action.metavar or action.dest.upper()]
    return flags


def undocumented_flags(page: str, flags: list[str]) -> list[str]:
    """Flags the page does not name; a switch's `--no-X` (argparse's BooleanOptionalAction) is named by its
    `--X` row."""
    def named(flag: str) -> bool:
        return f"`{flag}`" in page or (flag.startswith("--no-") and f"`--{flag[5:]}`" in page)
    return [flag for flag in flags if not named(flag)]


def undocumented_routes(page: str, routes: list[str]) -> list[str]:
    return [route for route in routes if f"`{route}`" not in page]


def _walk(routes: list) -> list[tuple[str, set[str]]]:
    """(path, methods) of every route, also of included routers (FastAPI >= 0.16x keeps those as
    `_IncludedRouter`s whose `effective_route_contexts()` are the routes with their prefix)."""
    found = []
    for route in routes:
        if hasattr(route, "effective_route_contexts"):
            found += [(context.path, set(context.methods or ())) for context in route.effective_route_contexts()]
        elif getattr(route, "methods", None):
            found.append((route.path, set(route.methods)))
    return found


@pytest.fixture(scope="module")
def app_routes() -> list[str]:
    """`METHOD /path` for every route of the app on the demo model, with every optional route turned on."""
    from mmserve import LLM
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.entrypoints.openai.media import MediaRules
    from mmserve.entrypoints.openai.server import build_app
    from mmserve.entrypoints.openai.serving import ServerConfig

    llm = LLM()
    try:
        config = ServerConfig("mmserve-demo", MediaRules(llm.engine.config.media), web_ui=True, demo_model=True,
                              tokenizer_info=True)
        app = build_app(AsyncEngine(llm.engine), config)
        return sorted({f"{method} {path}" for path, methods in _walk(app.routes) for method in methods
                       if method != "HEAD"})
    finally:
        llm.shutdown()


def test_every_serve_flag_has_its_row_on_the_server_page():
    flags = serve_flags()
    assert {"--port", "--max-num-seqs", "--no-enable-prefix-caching", "--encoder-timeout", "MODEL"} <= set(flags)
    missing = undocumented_flags(SERVER_PAGE.read_text() + VLLM_FLAGS_PAGE.read_text(), flags)
    assert not missing, f"docs/server.md (or docs/vllm-flags.md) does not name these flags of `mmserve serve`: {missing}"


def test_every_route_has_its_row_on_the_server_page(app_routes):
    assert {"POST /v1/chat/completions", "GET /tokenizer_info", "GET /demo/sample", "GET /health"} <= set(app_routes)
    missing = undocumented_routes(SERVER_PAGE.read_text(), app_routes)
    assert not missing, f"docs/server.md does not name these routes: {missing}"


def test_the_checks_catch_a_flag_and_a_route_left_out():
    page = "| `--port` | ... |\n| `GET /health` | ... |\n`--max-num-seqs-extra`"
    assert undocumented_flags(page, ["--port", "--max-num-seqs"]) == ["--max-num-seqs"]
    assert undocumented_routes(page, ["GET /health", "GET /metrics"]) == ["GET /metrics"]

"""Every code block of the README and docs/*.md, run as written: the collector and runner the docs tier uses.

A fenced block's language says what it is: ```python runs in the page's Python process (one namespace per
page, blocks in order, `__name__ == "__main__"`); ```bash runs in bash (`set -euo pipefail`); ```json must
parse; ```text is output or a picture, not code. Any other language, or none, fails: a block is either
code that runs or says it is text. An HTML comment on the line before a fence says how to run the block:

    <!-- docs: server -->          it talks to the demo server on 127.0.0.1:8000 (one server per test session;
                                   `127.0.0.1:8000`, `localhost:8000` and `--port 8000` are pointed at its port)
    <!-- docs: serve -->           each command starts a server: started on a free port, must answer /health,
                                   then SIGTERM, and must exit 0
    <!-- docs: dry-run -->         an install: each command runs with `--dry-run` appended (installs nothing)
    <!-- docs: covered-by T -->    a command a test of the suite runs (T: tests/...py::test_name), or the
                                   test command itself; the harness checks that test exists

Blocks run in a scratch directory that looks like the checkout (links to its top-level entries, `.venv` to
the interpreter's environment), so files a snippet writes do not land in the checkout; `.venv/bin` leads
PATH, so `mmserve` and `python` are this environment's.

Why our own collector, not Sybil or pytest-markdown-docs: those run Python blocks inside the pytest
process, and the blocks here build engines (threads, compiled kernels, spawned encoder workers) and talk to
a server in shell; a process per page keeps the suite's process clean, and the directives above are the
whole of what the shell blocks need.

What it does not know: pytest (tests/docs/test_snippets.py drives it), the server's flags.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("snippet_worker.py")
PYTHON, SHELL, JSON, TEXT = ("python", "py"), ("bash", "sh", "shell"), ("json",), ("text",)
DIRECTIVES = ("server", "serve", "dry-run", "covered-by")
BLOCK_TIMEOUT_S = 600
SERVE_TIMEOUT_S = 300  # a `serve` block's server must answer /health within this (replicas start slowly)
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*docs:\s*(?P<kind>[\w-]+)\s*(?P<arg>.*?)\s*-->\s*$")
DOC_PORT = "8000"


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text (the fence's indent removed) and directive."""

    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    directive: str = ""
    argument: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


class SnippetFailed(AssertionError):
    def __init__(self, block: Block, why: str) -> None:
        super().__init__(f"{block.where}: the ```{block.language} block failed: {why}\n--- the block ---\n"
                         f"{block.code}")


def collect(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, in order, each with the directive on the line before it."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), len(lines))
        code = "\n".join(line[indent:] if line[:indent].strip() == "" else line.lstrip() for line in lines[i + 1:end])
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        directive = DIRECTIVE.match(before)
        blocks.append(Block(path, i + 1, opening["info"].lower(), code + "\n",
                            directive["kind"] if directive else "", directive["arg"] if directive else ""))
        i = end + 1
    return blocks


def point_at(text: str, port: int | None) -> str:
    """The documented address (127.0.0.1:8000) pointed at the port the test serves on."""
    if port is None:
        return text
    text = re.sub(rf"\b(127\.0\.0\.1|localhost):{DOC_PORT}\b", rf"\g<1>:{port}", text)
    return re.sub(rf"--port {DOC_PORT}\b", f"--port {port}", text)


def commands(code: str) -> list[str]:
    """A shell block's commands: one per line, `\\` continuations joined, comments and blank lines left out."""
    joined = re.sub(r"\\\n", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def scratch_checkout(where: Path) -> Path:
    """A directory that looks like the checkout: links to its top-level entries and `.venv` to this
    interpreter's environment."""
    where.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv") and not (where / entry.name).exists():
            (where / entry.name).symlink_to(entry)
    if not (where / ".venv").exists():
        (where / ".venv").symlink_to(Path(sys.prefix))
    return where


def snippet_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("MMSERVE_COMPILE_CPU_DECODE", "0")  # as tests/conftest.py: a short-lived server
    return env


class PageRun:
    """Runs one page's blocks in order: a scratch checkout, one Python process, the demo server's port."""

    def __init__(self, workdir: Path, server_port: int | None) -> None:
        self.workdir, self.server_port = scratch_checkout(workdir), server_port
        self.env = snippet_env()
        self.log_path = workdir / "snippets.log"
        self.python: subprocess.Popen | None = None
        self.not_run: list[str] = []  # blocks that cannot run on this checkout, and why

    def run(self, block: Block) -> None:
        if block.directive and block.directive not in DIRECTIVES:
            raise SnippetFailed(block, f"unknown directive {block.directive!r} (known: {', '.join(DIRECTIVES)})")
        if block.language in TEXT:
            return
        if block.language in JSON:
            try:
                json.loads(block.code)
            except ValueError as e:
                raise SnippetFailed(block, f"not JSON: {e}") from None
        elif block.directive == "covered-by":
            self._check_covered(block)
        elif block.directive == "server" and self.server_port is None:
            raise SnippetFailed(block, "it needs the demo server, and none was given")
        elif block.language in PYTHON:
            self._run_python(block)
        elif block.language in SHELL:
            self._run_shell(block)
        else:
            raise SnippetFailed(block, f"a block says what it is: python, bash, json or text "
                                       f"(this one: {block.language or 'nothing'!r})")

    def close(self) -> None:
        if self.python is not None and self.python.poll() is None:
            self.python.kill()  # the page's engines go with it; their exit is not what this tests
            self.python.wait(timeout=30)

    def _port(self, block: Block) -> int | None:
        return self.server_port if block.directive == "server" else None

    def _run_python(self, block: Block) -> None:
        if self.python is None:
            self.python = subprocess.Popen([sys.executable, str(WORKER)], cwd=self.workdir, env=self.env, text=True,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=self.log_path.open("a"))
        start = self._log_size()
        self.python.stdin.write(json.dumps({"code": point_at(block.code, self._port(block)),
                                            "where": block.where}) + "\n")
        self.python.stdin.flush()
        with selectors.DefaultSelector() as selector:
            selector.register(self.python.stdout, selectors.EVENT_READ)
            if not selector.select(timeout=BLOCK_TIMEOUT_S):
                raise SnippetFailed(block, f"no answer in {BLOCK_TIMEOUT_S} s\n{self._log_since(start)}")
        line = self.python.stdout.readline()
        reply = json.loads(line) if line else {"ok": False, "error": f"the Python process died ({self.python.poll()})"}
        if not reply["ok"]:
            raise SnippetFailed(block, f"{reply['error']}\n--- its output ---\n{self._log_since(start)}")

    def _run_shell(self, block: Block) -> None:
        if block.directive == "serve":
            for command in commands(block.code):
                self._serve(block, command)
            return
        code = point_at(block.code, self._port(block))
        if block.directive == "dry-run":
            code = "\n".join(f"{command} --dry-run" for command in commands(code))
        try:
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=self.workdir, env=self.env,
                                  capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SnippetFailed(block, f"still running after {BLOCK_TIMEOUT_S} s") from None
        with self.log_path.open("a") as log:
            log.write(done.stdout + done.stderr)
        if done.returncode != 0:
            raise SnippetFailed(block, f"exit {done.returncode}\n--- stdout ---\n{done.stdout}\n--- stderr ---\n"
                                       f"{done.stderr}")

    def _serve(self, block: Block, command: str) -> None:
        """Start one documented server on a free port, wait for /health, SIGTERM it: it must exit 0."""
        from tests.e2e.conftest import free_port

        port = free_port()
        command = point_at(command, port) if "--port" in command else f"{command} --port {port}"
        log_path = self.workdir / f"serve-{block.line}-{port}.log"
        with log_path.open("w") as log:
            server = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.workdir, env=self.env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_healthy(server, port, block, log_path)
            server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=120)
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)
        if code != 0:
            raise SnippetFailed(block, f"`{command}` exited {code} on SIGTERM\n{log_path.read_text()[-4000:]}")

    def _check_covered(self, block: Block) -> None:
        path, _, test = block.argument.partition("::")
        if block.argument == "the-test-command":
            return  # `bash scripts/test.sh`: the command this harness runs under
        source = (ROOT / path).read_text() if path and (ROOT / path).is_file() else ""
        if not test or f"def {test}(" not in source:
            raise SnippetFailed(block, f"covered-by names {block.argument!r}, which is not a test of the suite")

    def _log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def _log_since(self, start: int) -> str:
        with contextlib.suppress(OSError), self.log_path.open(errors="replace") as log:
            log.seek(start)
            return log.read()[-6000:]
        return ""


def _wait_healthy(server: subprocess.Popen, port: int, block: Block, log_path: Path) -> None:
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SnippetFailed(block, f"the server exited {server.returncode}\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise SnippetFailed(block, f"/health did not answer in {SERVE_TIMEOUT_S} s\n{log_path.read_text()[-4000:]}")


def run_page(path: Path, workdir: Path, server_port: int | None) -> list[str]:
    """Run every block of the page in order; raise SnippetFailed at the first that fails. Returns the blocks
    that could not run on this checkout, each with why (empty: all ran)."""
    page = PageRun(workdir, server_port)
    try:
        for block in collect(path):
            page.run(block)
        return page.not_run
    finally:
        page.close()

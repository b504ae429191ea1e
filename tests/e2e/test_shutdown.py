"""Graceful shutdown: on SIGTERM `mmserve serve` stops accepting, lets requests in flight finish for
--shutdown-timeout seconds, aborts the rest, and exits 0 with no process left behind."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import start_server, stop_server, wait_healthy


def _chat(server, tokens: int, stream: bool = False) -> httpx.Response:
    body = {"model": server.model, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (the encoder workers and their helpers)."""
    found: set[int] = set()
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            for child in map(int, children.read_text().split()):
                found |= {child} | _descendants(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("case", ["finishes_in_time", "cut_off_at_the_timeout", "stream_cut_off_with_workers"])
def test_sigterm_with_a_request_in_flight(checkpoint_dirs, tmp_path, case):
    finishes = case == "finishes_in_time"
    stream = case.startswith("stream")
    workers = ("--encoder-workers", "1") if case.endswith("with_workers") else ()
    server = start_server(str(checkpoint_dirs["qwen2_vl"]), tmp_path / "server.log", "--num-kv-blocks", "512",
                          "--shutdown-timeout", "20" if finishes else "2", *workers)
    try:
        wait_healthy(server)
        children = _descendants(server.process.pid)
        assert len(children) >= (1 if workers else 0), children
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tokens = 60 if finishes else 1900  # ~0.5 s, or far longer than the 2 s allowed
            pending = pool.submit(_chat, server, tokens, stream)
            time.sleep(0.5)  # the request is in the engine
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            code = server.process.wait(timeout=40)
            took = time.monotonic() - started
            response = pending.result(timeout=5)
            if finishes:
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] == tokens
            elif stream:  # the stream had started: it ends with an error event that says why, then [DONE]
                events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]", events[-3:]
                error = json.loads(events[-2])["error"]
                assert error["code"] == "server_shutting_down" and "shutdown timeout" in error["message"], error
                assert len(events) > 3  # some tokens were streamed before the cut
            else:
                assert response.status_code == 503, response.text
                error = response.json()["error"]
                assert error["type"] == "server_error" and error["code"] == "server_shutting_down", error
                assert "2 s shutdown timeout" in error["message"], error
            if not finishes:
                assert took < 15, took
        assert code == 0, server.log()
        assert "Traceback" not in server.log(), server.log()
        with pytest.raises(httpx.ConnectError):  # nothing listens any more
            httpx.get(server.url + "/health", timeout=2)
        orphans = {pid for pid in children if _alive(pid)}
        assert not orphans, f"processes left behind: {orphans}"
    finally:
        if server.process.poll() is None:
            stop_server(server)

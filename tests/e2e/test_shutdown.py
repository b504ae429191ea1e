"""Graceful shutdown: on SIGTERM `mmserve serve` stops accepting, lets requests in flight finish for
--shutdown-timeout seconds, aborts the rest, and exits 0 with no process left behind."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import pytest

from tests.e2e.conftest import start_server, stop_server, wait_healthy


def _chat(server, tokens: int) -> httpx.Response:
    body = {"model": server.model, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("case", ["finishes_in_time", "aborted_at_the_timeout"])
def test_sigterm_with_a_request_in_flight(checkpoint_dirs, tmp_path, case):
    finishes = case == "finishes_in_time"
    server = start_server(str(checkpoint_dirs["qwen2_vl"]), tmp_path / "server.log", "--num-kv-blocks", "512",
                          "--shutdown-timeout", "20" if finishes else "1")
    try:
        wait_healthy(server)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tokens = 60 if finishes else 3000  # ~0.5 s, or far longer than the 1 s allowed
            pending = pool.submit(_chat, server, tokens)
            time.sleep(0.3)  # the request is in the engine
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            code = server.process.wait(timeout=40)
            took = time.monotonic() - started
            if finishes:
                response = pending.result(timeout=5)
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] == tokens
            else:
                with pytest.raises(httpx.HTTPError):  # its connection is closed: the client sees it end
                    pending.result(timeout=5).raise_for_status()
                assert took < 15, took
        assert code == 0, server.log()
        with pytest.raises(httpx.ConnectError):  # nothing listens any more
            httpx.get(server.url + "/health", timeout=2)
    finally:
        if server.process.poll() is None:
            stop_server(server)

"""The request-body limit (entrypoints/openai/body_limit.py) as an ASGI middleware, driven with a fake
server: an oversized body is refused with a 413 only after the rest of it has been read off the
connection (so closing it cannot reset the 413 away), and a body within the limit reaches the app."""

import asyncio
import json

from mmserve.entrypoints.openai.body_limit import BodyLimit

PIECE_BYTES = 1000


def _run(headers: list[tuple[bytes, bytes]], pieces: int) -> tuple[list[str], list[dict], list[bytes]]:
    events: list[str] = []
    sent: list[dict] = []
    seen_by_app: list[bytes] = []
    queue = [{"type": "http.request", "body": b"x" * PIECE_BYTES, "more_body": i < pieces - 1}
             for i in range(pieces)]

    async def receive():
        events.append("receive")
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message):
        events.append(message["type"])
        sent.append(message)

    async def app(scope, receive, send):
        seen_by_app.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    asyncio.run(BodyLimit(app, max_bytes=2500)(scope, receive, send))
    return events, sent, seen_by_app


def _is_413_after_whole_body(events: list[str], sent: list[dict], pieces: int) -> None:
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
    assert events[:pieces] == ["receive"] * pieces, "the 413 went out before the body was read off"
    assert events[pieces:] == ["http.response.start", "http.response.body"]


def test_an_oversized_body_with_a_length_is_read_off_before_the_413():
    events, sent, seen = _run([(b"content-length", str(10 * PIECE_BYTES).encode())], pieces=10)
    _is_413_after_whole_body(events, sent, pieces=10)
    assert not seen
    assert "10000 bytes" in json.loads(sent[1]["body"])["error"]["message"]


def test_an_oversized_chunked_body_is_read_off_before_the_413():
    events, sent, seen = _run([], pieces=10)
    _is_413_after_whole_body(events, sent, pieces=10)
    assert not seen


def test_a_body_within_the_limit_reaches_the_app_whole():
    _events, sent, seen = _run([], pieces=2)
    assert sent[0]["status"] == 200 and seen == [b"x" * 2 * PIECE_BYTES]

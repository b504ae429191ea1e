"""Request traces (mmserve/tracing.py), read from the OpenTelemetry SDK's in-memory exporter: the engine's
spans of what a request went through, under the span its caller propagated; the server's span of an HTTP
request continuing the client's trace; and nothing recorded without tracing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from mmserve import SamplingParams
from mmserve.config import EngineConfig
from mmserve.engine.llm_engine import Engine
from mmserve.entrypoints.openai.media import MediaRules
from mmserve.entrypoints.openai.serving import ServerConfig
from tests.e2e.test_server import data_uri, png_bytes
from tests.models.helpers import image_part, random_image, text_part, user

pytest.importorskip("opentelemetry.sdk")  # the `otel` extra, which the test environment installs
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from mmserve.tracing import Tracing  # noqa: E402

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # a W3C traceparent: trace id, span id
CALLER_TRACE, CALLER_SPAN = int("0af7651916cd43dd8448eb211c80319c", 16), int("b7ad6b7169203331", 16)
NUM_TOKENS = 5
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
ENGINE_ARGS = {"max_num_batched_tokens": 24, "num_kv_blocks": 128}  # the prompt is prefilled in chunks


def _engine(model_dir, exporter: InMemorySpanExporter | None) -> Engine:
    tracing = None if exporter is None else Tracing(exporter, "test", batch=False)
    return Engine(EngineConfig.from_kwargs(str(model_dir), **ENGINE_ARGS), tracing=tracing)


def _run(engine: Engine, image, trace_parent: str | None, request_id: str) -> list[int]:
    engine.add_request(request_id, engine.process_chat(user(image_part(image), text_part("What is it?"))), GREEDY,
                       trace_parent=trace_parent)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return tokens


def _children(spans, parent) -> list:
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def test_an_engine_request_has_the_spans_of_its_queue_encode_prefill_chunks_and_decode(checkpoint_dirs):
    model_dir = checkpoint_dirs["qwen2_vl"]
    image = random_image(np.random.default_rng(0), 96, 64)
    plain = _engine(model_dir, None)
    expected = [_run(plain, image, None, r) for r in ("a", "b")]
    plain.shutdown()

    exporter = InMemorySpanExporter()
    engine = _engine(model_dir, exporter)
    got = [_run(engine, image, CALLER, "a"), _run(engine, image, None, "b")]
    assert got == expected  # tracing changes no answer
    engine.check_integrity()
    spans = exporter.get_finished_spans()
    requests = {s.attributes["gen_ai.request.id"]: s for s in spans if s.name == "engine.request"}
    assert set(requests) == {"a", "b"}

    first = requests["a"]  # under the caller's span, in the caller's trace
    assert first.context.trace_id == CALLER_TRACE and first.parent.span_id == CALLER_SPAN
    assert first.attributes["gen_ai.usage.completion_tokens"] == NUM_TOKENS
    prompt_tokens = first.attributes["gen_ai.usage.prompt_tokens"]
    children = _children(spans, first)
    assert all(c.context.trace_id == CALLER_TRACE for c in children)
    assert all(first.start_time <= c.start_time <= c.end_time <= first.end_time for c in children)
    names = [c.name for c in children]
    assert names.count("queue") == 1 and names.count("decode") == 1
    chunks = [c for c in children if c.name == "prefill"]
    assert len(chunks) >= 2  # prefilled in chunks of at most the step's token budget
    assert sum(c.attributes["mmserve.prefill.tokens"] for c in chunks) == prompt_tokens
    assert [c.attributes["mmserve.prefill.first_position"] for c in chunks] == sorted(
        c.attributes["mmserve.prefill.first_position"] for c in chunks)
    decode = next(c for c in children if c.name == "decode")
    assert decode.attributes["mmserve.decode.steps"] == NUM_TOKENS - 1  # the first token came with the prefill
    (encode,) = [c for c in children if c.name == "encode"]
    assert encode.attributes["mmserve.encoder.cache_hit"] is False and encode.end_time > encode.start_time

    second = requests["b"]  # no caller: a trace of its own; its image was encoded by the first
    assert second.parent is None and second.context.trace_id != CALLER_TRACE
    (hit,) = [c for c in _children(spans, second) if c.name == "encode"]
    assert hit.attributes["mmserve.encoder.cache_hit"] is True
    assert hit.attributes["mmserve.item.content_key"] == encode.attributes["mmserve.item.content_key"]
    assert second.attributes["mmserve.prefix_cached_tokens"] > 0
    engine.shutdown()


def test_without_tracing_nothing_is_recorded(checkpoint_dirs):
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.entrypoints.openai.server import build_app
    from mmserve.entrypoints.openai.trace_middleware import TraceMiddleware

    engine = _engine(checkpoint_dirs["qwen2_vl"], None)
    assert engine.tracing is None
    engine.add_request("a", engine.process({"prompt": "hello"}), GREEDY, trace_parent=CALLER)
    assert engine.output_processor.get("a").timeline is None  # no records kept, whatever the caller sent
    engine.abort_request(["a"])
    engine.check_integrity()
    app = build_app(AsyncEngine(engine), ServerConfig("m", MediaRules(engine.config.media)))
    assert not any(m.cls is TraceMiddleware for m in app.user_middleware)
    engine.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_span_continues_the_clients_trace_and_holds_the_engines(checkpoint_dirs, stream):
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.entrypoints.openai.server import build_app

    exporter = InMemorySpanExporter()
    engine = _engine(checkpoint_dirs["qwen2_vl"], exporter)
    app = build_app(AsyncEngine(engine), ServerConfig("m", MediaRules(engine.config.media)))
    body = {"model": "m", "max_tokens": NUM_TOKENS, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_uri(png_bytes((200, 30, 30), size=(64, 48)))}},
                {"type": "text", "text": "What color?"}]}]}
    with TestClient(app) as client:
        response = client.post("/v1/chat/completions", json=body, headers={"traceparent": CALLER})
        assert response.status_code == 200, response.text
        if stream:
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            reply_id = json.loads(events[0])["id"]
        else:
            reply_id = response.json()["id"]
        bad = client.post("/v1/chat/completions", json={**body, "max_tokens": -1})
        assert bad.status_code == 400
        assert client.get("/health").status_code == 200
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert len(servers) == 2  # the refused request has its span too, with its status
    (server,) = [s for s in servers if s.attributes["http.response.status_code"] == 200]
    assert [s.attributes["http.response.status_code"] for s in servers if s is not server] == [400]
    assert server.context.trace_id == CALLER_TRACE and server.parent.span_id == CALLER_SPAN
    assert server.attributes["gen_ai.request.id"] == reply_id
    children = {s.name: s for s in _children(spans, server)}
    assert set(children) == {"media_load", "engine.request"}
    engine_span = children["engine.request"]
    assert engine_span.attributes["gen_ai.request.id"] == reply_id
    assert children["media_load"].end_time <= engine_span.start_time  # processed before the engine has it
    assert engine_span.end_time <= server.end_time  # the server's span lasts to the answer's last byte
    assert {c.name for c in _children(spans, engine_span)} >= {"queue", "encode", "prefill", "decode"}
    assert not any(s.name.startswith("GET") for s in spans)  # only generation requests are traced


def test_the_offline_api_exports_each_request_as_a_trace_over_otlp(checkpoint_dirs):
    from mmserve import LLM
    from tests.e2e.conftest import otlp_receiver

    with otlp_receiver() as (endpoint, spans):
        llm = LLM(str(checkpoint_dirs["qwen2_vl"]), otlp_traces_endpoint=endpoint, **ENGINE_ARGS)
        outputs = llm.generate(["hello", "a cat"], GREEDY, use_tqdm=False)
        llm.shutdown()  # exports what the batch processor still holds
        requests = [s for s in spans if s.name == "engine.request"]
        assert sorted(s.attributes["gen_ai.request.id"] for s in requests) == sorted(o.request_id for o in outputs)
        assert {s.service for s in requests} == {"mmserve"} and all(not s.parent_span_id for s in requests)
        assert len({s.trace_id for s in requests}) == 2
        for request in requests:
            assert {s.name for s in spans if s.parent_span_id == request.span_id} == {"queue", "prefill", "decode"}


def test_an_unknown_otlp_protocol_is_a_clear_error(monkeypatch):
    from mmserve.tracing import PROTOCOL_ENV, otlp_exporter

    monkeypatch.setenv(PROTOCOL_ENV, "carrier-pigeon")
    with pytest.raises(ValueError, match="http/protobuf or grpc"):
        otlp_exporter("http://localhost:4318")

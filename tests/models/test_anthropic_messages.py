"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) in process (the app over an
AsyncEngine, FastAPI's TestClient), on the bundled demo model (its template renders tools; it answers
about pictures of shapes) and on a tiny Qwen3.5 with its thinking template: a conversation is the same
prompt and the same greedy answer as chat completions' (system string and blocks, a base64 picture,
tool_use / tool_result turns); stop sequences, max_tokens and tool choices end as Anthropic says; a
stream's events come in Anthropic's order and join to the whole answer; a thought is a thinking block
(none with thinking disabled); count_tokens counts what /v1/messages runs; every malformed request is a
4xx in Anthropic's error shape naming the field, and the server answers on; a failure midway is a
stream's error event; the key is taken as `x-api-key` (and as a Bearer token)."""

from __future__ import annotations

import base64
import io
import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from mmserve import LLM
from mmserve.demo import shapes
from mmserve.demo.eval import default_model_dir
from mmserve.engine.async_engine import AsyncEngine
from mmserve.entrypoints.openai.media import MediaRules
from mmserve.entrypoints.openai.server import build_app
from mmserve.entrypoints.openai.serving import ServerConfig
from mmserve.faults import FaultPlan
from tests.fixtures.hub_templates import QWEN3_5

KEY = "anthropic-test-key"
MAX_REQUEST_BYTES = 1_000_000
QUESTION = [{"role": "user", "content": "How many shapes are there?"}]
COUNT_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                "required": ["color"], "additionalProperties": False}
COUNT_TOOL = {"name": "count_shapes", "description": "Count the shapes of one color",
              "input_schema": COUNT_SCHEMA}
AREA_TOOL = {"name": "area", "input_schema": {"type": "object", "properties": {}}}


def chat_tool(tool: dict) -> dict:
    described = {"description": tool["description"]} if "description" in tool else {}
    function = {"name": tool["name"], **described, "parameters": tool["input_schema"]}
    return {"type": "function", "function": function}


@pytest.fixture(scope="module")
def llm():
    return LLM(str(default_model_dir()), num_kv_blocks=256)


@pytest.fixture(scope="module")
def client(llm):
    config = ServerConfig("demo", MediaRules(llm.engine.config.media), api_key=KEY,
                          max_request_bytes=MAX_REQUEST_BYTES)
    with TestClient(build_app(AsyncEngine(llm.engine), config), headers={"x-api-key": KEY}) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def qwen_client(all_checkpoints, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "qwen3_5.jinja"
    template.write_text(QWEN3_5)
    llm = LLM(str(all_checkpoints["qwen3_5"]), chat_template=str(template), num_kv_blocks=64)
    app = build_app(AsyncEngine(llm.engine), ServerConfig("qwen", MediaRules(llm.engine.config.media)))
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def picture() -> tuple[str, str]:
    """(base64 PNG, its question) of a shapes picture the demo model answers."""
    sample = shapes.make_sample(0, 0, "count")
    buffer = io.BytesIO()
    sample.images[0].save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode(), sample.question


def create(client, model: str = "demo", **body) -> dict:
    reply = client.post("/v1/messages", json={"model": model, "max_tokens": 32, "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["id"].startswith("msg_") and answer["type"] == "message" and answer["role"] == "assistant"
    return answer


def chat(client, messages: list, model: str = "demo", **body) -> dict:
    reply = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 32,
                                                      "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def chat_view(answer: dict) -> tuple[str | None, str, list]:
    """A chat answer as (thought, text, calls) to compare with a message's blocks."""
    message = answer["choices"][0]["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in message.get("tool_calls") or []]
    return message.get("reasoning") or None, message["content"] or "", calls


def blocks_view(content: list[dict]) -> tuple[str | None, str, list]:
    thought = "".join(b["thinking"] for b in content if b["type"] == "thinking") or None
    return (thought, "".join(b["text"] for b in content if b["type"] == "text"),
            [(b["name"], b["input"]) for b in content if b["type"] == "tool_use"])


def events(reply) -> list[dict]:
    """A stream's events, each `event:` line checked against its data's type."""
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/event-stream")
    out = []
    for chunk in reply.text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), chunk
        out.append(json.loads(data[len("data: "):]))
        assert out[-1]["type"] == name[len("event: "):]
    return out


def joined(stream: list[dict]) -> list[dict]:
    """The blocks a stream's events build, checked to come in Anthropic's order: message_start, ping, each
    block started, written and stopped in turn, message_delta, message_stop."""
    assert [e["type"] for e in stream[:2]] == ["message_start", "ping"]
    assert [e["type"] for e in stream[-2:]] == ["message_delta", "message_stop"]
    assert stream[0]["message"]["content"] == [] and stream[0]["message"]["stop_reason"] is None
    blocks: list[dict] = []
    partial: dict[int, str] = {}
    for event in stream[2:-2]:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(dict(event["content_block"]))
            continue
        assert event["index"] == len(blocks) - 1, event  # deltas and the stop go to the open block
        if event["type"] == "content_block_stop":
            continue
        delta, block = event["delta"], blocks[-1]
        assert event["type"] == "content_block_delta"
        if delta["type"] == "input_json_delta":
            partial[len(blocks) - 1] = partial.get(len(blocks) - 1, "") + delta["partial_json"]
        else:
            key = {"text_delta": "text", "thinking_delta": "thinking"}[delta["type"]]
            block[key] += delta[key]
    stops = [e["index"] for e in stream if e["type"] == "content_block_stop"]
    assert stops == list(range(len(blocks)))
    for index, text in partial.items():
        blocks[index]["input"] = json.loads(text)
    return blocks


def same_blocks(streamed: list[dict], whole: list[dict]) -> None:
    """The same blocks (a tool_use's id is each answer's own)."""
    strip = [{k: v for k, v in b.items() if k != "id"} for b in whole]
    assert [{k: v for k, v in b.items() if k != "id"} for b in streamed] == strip
    assert all(b["id"].startswith("toolu_") for b in streamed + whole if b["type"] == "tool_use")


# ---- the same conversation as chat's ------------------------------------------------------------------
def conversations(picture: tuple[str, str]) -> dict[str, tuple[dict, list, dict]]:
    """name -> (the Messages request's conversation, chat's messages, chat's other fields)."""
    data, question = picture
    tool_turns = [
        {"role": "user", "content": "How many red shapes are there?"},
        {"role": "assistant", "content": [{"type": "text", "text": "I will count them."}, {
            "type": "tool_use", "id": "toolu_01", "name": "count_shapes", "input": {"color": "red"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": [
            {"type": "text", "text": "2"}]}, {"type": "text", "text": "So how many?"}]}]
    chat_turns = [
        {"role": "user", "content": "How many red shapes are there?"},
        {"role": "assistant", "content": "I will count them.", "tool_calls": [{
            "id": "toolu_01", "type": "function", "function": {"name": "count_shapes",
                                                               "arguments": json.dumps({"color": "red"})}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "2"},
        {"role": "user", "content": [{"type": "text", "text": "So how many?"}]}]
    return {
        "system string": ({"system": "Answer in one word.", "messages": QUESTION},
                          [{"role": "system", "content": "Answer in one word."}, *QUESTION], {}),
        "system blocks": ({"system": [{"type": "text", "text": "Answer in "}, {
            "type": "text", "text": "one word.", "cache_control": {"type": "ephemeral"}}],
            "messages": QUESTION}, [{"role": "system", "content": "Answer in one word."}, *QUESTION], {}),
        "base64 picture": ({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
            {"type": "text", "text": question}]}]},
            [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                {"type": "text", "text": question}]}], {}),
        "tool turns": ({"messages": tool_turns, "tools": [COUNT_TOOL]}, chat_turns,
                       {"tools": [chat_tool(COUNT_TOOL)]}),
        "prefill": ({"messages": [*QUESTION, {"role": "assistant", "content": "There are"}]},
                    [*QUESTION, {"role": "assistant", "content": "There are"}],
                    {"add_generation_prompt": False, "continue_final_message": True}),
    }


@pytest.mark.parametrize("name", ["system string", "system blocks", "base64 picture", "tool turns",
                                  "prefill"])
def test_a_conversation_is_chats_prompt_and_greedy_answer(client, picture, name):
    conversation, chat_messages, chat_fields = conversations(picture)[name]
    answer = create(client, **conversation)
    expected = chat(client, chat_messages, **chat_fields)
    assert answer["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]
    assert answer["usage"]["output_tokens"] == expected["usage"]["completion_tokens"]
    assert blocks_view(answer["content"]) == chat_view(expected)
    counted = client.post("/v1/messages/count_tokens", json={"model": "demo", **conversation})
    assert counted.json() == {"input_tokens": answer["usage"]["input_tokens"]}, counted.text
    if name == "base64 picture":  # the demo model reads the picture
        assert answer["content"] == [{"type": "text", "text": shapes.make_sample(0, 0, "count").answer}]
        assert answer["stop_reason"] == "end_turn" and answer["stop_sequence"] is None


def test_stop_sequences_and_max_tokens_end_as_anthropic_says(client):
    whole = create(client, messages=QUESTION, metadata={"user_id": "user-7"})
    text = whole["content"][0]["text"]
    assert whole["stop_reason"] == "end_turn" and len(text) >= 3, whole
    stop = text[1:3]
    cut = create(client, messages=QUESTION, stop_sequences=["never written", stop])
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop, cut
    assert cut["content"] == [{"type": "text", "text": text[:text.index(stop)]}]
    assert create(client, messages=QUESTION, stop_sequences=["never written"])["content"] == whole["content"]
    short = create(client, messages=QUESTION, max_tokens=1)
    assert short["stop_reason"] == "max_tokens" and short["usage"]["output_tokens"] == 1
    assert "user-7" not in json.dumps(whole)  # metadata is taken, never echoed


def test_tool_choices_make_tool_use_blocks_held_to_the_schema(client):
    for choice, count in (({"type": "any"}, None), ({"type": "tool", "name": "count_shapes"}, 1),
                          ({"type": "any", "disable_parallel_tool_use": True}, 1)):
        answer = create(client, messages=[{"role": "user", "content": "How many red shapes?"}],
                        max_tokens=150, tools=[COUNT_TOOL, AREA_TOOL], tool_choice=choice)
        uses = [b for b in answer["content"] if b["type"] == "tool_use"]
        assert uses and (count is None or len(uses) == count), answer
        assert answer["stop_reason"] == "tool_use" and answer["stop_sequence"] is None
        for use in uses:
            assert use["id"].startswith("toolu_")
            if use["name"] == "count_shapes":
                jsonschema.validate(use["input"], COUNT_SCHEMA)
        assert choice["type"] == "any" or uses[0]["name"] == "count_shapes"
    plain = create(client, messages=QUESTION, tools=[COUNT_TOOL], tool_choice={"type": "none"})
    assert all(b["type"] == "text" for b in plain["content"]) and plain["stop_reason"] == "end_turn"


FORCED_CALL = {"tools": [COUNT_TOOL], "tool_choice": {"type": "any"}, "max_tokens": 150}


@pytest.mark.parametrize("extra", [{}, FORCED_CALL, {"stop_sequences": ["e"]}],
                         ids=["text", "tool_use", "stop_sequence"])
def test_a_stream_comes_in_anthropics_order_and_joins_to_the_whole_answer(client, extra):
    body = {"model": "demo", "max_tokens": 32, "temperature": 0, "messages": QUESTION, **extra}
    whole = create(client, **body)
    stream = events(client.post("/v1/messages", json={**body, "stream": True}))
    same_blocks(joined(stream), whole["content"])
    start, end = stream[0]["message"], stream[-2]
    assert start["usage"]["input_tokens"] == whole["usage"]["input_tokens"] and start["id"].startswith("msg_")
    assert end["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]}
    assert end["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_a_template_that_does_not_think_answers_without_a_thinking_block(client):
    plain = create(client, messages=QUESTION)
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}, {"type": "disabled"}):
        answer = create(client, messages=QUESTION, thinking=thinking)
        assert answer["content"] == plain["content"] and answer["usage"] == plain["usage"]


# ---- thinking (Qwen3.5's template) ----------------------------------------------------------------------
def test_thinking_is_a_thinking_block_and_none_when_disabled(qwen_client):
    question = [{"role": "user", "content": "How many red shapes?"}]
    for thinking, enabled in (({"type": "enabled", "budget_tokens": 1024}, True),
                              ({"type": "disabled"}, False)):
        body = {"model": "qwen", "messages": question, "max_tokens": 6, "temperature": 0,
                "thinking": thinking}
        answer = create(qwen_client, **body)
        expected = chat(qwen_client, question, model="qwen", max_tokens=6,
                        chat_template_kwargs={"enable_thinking": enabled})
        assert answer["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]
        assert blocks_view(answer["content"]) == chat_view(expected)
        kinds = [b["type"] for b in answer["content"]]
        assert ("thinking" in kinds) == enabled and answer["stop_reason"] == "max_tokens", answer
        if enabled:
            assert answer["content"][0]["signature"] == ""
        stream = events(qwen_client.post("/v1/messages", json={**body, "stream": True}))
        same_blocks(joined(stream), answer["content"])
        counted = qwen_client.post("/v1/messages/count_tokens", json={
            "model": "qwen", "messages": question, "thinking": thinking}).json()
        assert counted == {"input_tokens": answer["usage"]["input_tokens"]}
    # a thought given back in an assistant turn is the template's reasoning_content
    history = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Count them.", "signature": "sig"},
        {"type": "text", "text": "Two."}]},
        {"role": "user", "content": "And red ones?"}]
    answer = create(qwen_client, model="qwen", messages=history, max_tokens=2)
    expected = chat(qwen_client, [history[0], {"role": "assistant", "content": "Two.",
                                               "reasoning_content": "Count them."}, history[2]],
                    model="qwen", max_tokens=2)
    assert answer["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]


# ---- errors --------------------------------------------------------------------------------------------
def _image(source: dict) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                        {"type": "image", "source": source}]}


def _called(*after: dict) -> list[dict]:
    return [{"role": "user", "content": "Count."}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "count_shapes", "input": {"color": "red"}}]}, *after]


ANSWERED = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"}]}
NOT_A_PICTURE = base64.b64encode(b"not a picture").decode()
MALFORMED = {  # name -> (what replaces the body's fields (None: removes one), the field the error names)
    "max_tokens missing": ({"max_tokens": None}, "max_tokens"),
    "max_tokens zero": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens a string": ({"max_tokens": "5"}, "max_tokens"),
    "max_tokens past the context": ({"max_tokens": 10**7}, "max_tokens"),
    "no messages": ({"messages": []}, "messages"),
    "a system role": ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    "content a number": ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    "an unknown block type": ({"messages": [{"role": "user", "content": [{"type": "video"}]}]},
                              "messages.0.content.0.type"),
    "a block with an unknown key": ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "colour": "red"}]}]}, "messages.0.content.0.colour"),
    "base64 that does not decode": ({"messages": [_image({"type": "base64", "media_type": "image/png",
                                                          "data": "%%%"})]}, "messages.0.content.1.source"),
    "base64 of no picture": ({"messages": [_image({"type": "base64", "media_type": "image/png",
                                                   "data": NOT_A_PICTURE})]}, "messages.0.content.1.source"),
    "an image media type": ({"messages": [_image({"type": "base64", "media_type": "image/bmp",
                                                  "data": "AA=="})]}, "messages.0.content.1.source.media_type"),
    "a private image URL": ({"messages": [_image({"type": "url", "url": "http://127.0.0.1:9/shapes.png"})]},
                            "messages.0.content.1.source"),
    "an image source type": ({"messages": [_image({"type": "file", "file_id": "f"})]},
                             "messages.0.content.1.source.type"),
    "a tool_use in a user turn": ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "count_shapes", "input": {}}]}]},
        "messages.0.content.0"),
    "a thinking block in a user turn": ({"messages": [{"role": "user", "content": [
        {"type": "thinking", "thinking": "hm", "signature": ""}]}]}, "messages.0.content.0"),
    "a tool_result in an assistant turn": ({"messages": [*QUESTION, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"}]}]}, "messages.1.content.0"),
    "a tool_result answering no tool_use": ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "2"}]}]},
        "messages.0.content.0.tool_use_id"),
    "a tool_result answering another id": ({"messages": _called({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "2"}]}), "tools": [COUNT_TOOL]},
        "messages.2.content.0.tool_use_id"),
    "two tool_use blocks of one id": ({"messages": [*_called(ANSWERED), *_called(ANSWERED)[1:]],
                                       "tools": [COUNT_TOOL]}, "messages.3.content.0.id"),
    "a last assistant turn ending in a tool_use": ({"messages": _called(), "tools": [COUNT_TOOL]},
                                                   "messages.1.content.0"),
    "tool_choice tool without a name": ({"tools": [COUNT_TOOL], "tool_choice": {"type": "tool"}},
                                        "tool_choice"),
    "tool_choice of an unknown type": ({"tools": [COUNT_TOOL], "tool_choice": {"type": "some"}},
                                       "tool_choice.type"),
    "tool_choice naming no tool": ({"tools": [COUNT_TOOL], "tool_choice": {"type": "tool", "name": "area"}},
                                   "tool_choice"),
    "tool_choice without tools": ({"tool_choice": {"type": "any"}}, "tool_choice"),
    "none with disable_parallel_tool_use": ({"tools": [COUNT_TOOL], "tool_choice": {
        "type": "none", "disable_parallel_tool_use": True}}, "tool_choice.disable_parallel_tool_use"),
    "a tool without input_schema": ({"tools": [{"name": "count_shapes"}]}, "tools.0.input_schema"),
    "a server tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    "a thinking budget as a string": ({"thinking": {"type": "enabled", "budget_tokens": "1024"}},
                                      "thinking.budget_tokens"),
    "a thinking budget of zero": ({"thinking": {"type": "enabled", "budget_tokens": 0}},
                                  "thinking.budget_tokens"),
    "a fractional thinking budget": ({"thinking": {"type": "enabled", "budget_tokens": 1.5}},
                                     "thinking.budget_tokens"),
    "a thinking type": ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    "a temperature above 1": ({"temperature": 1.5}, "temperature"),
    "stop_sequences a string": ({"stop_sequences": "x"}, "stop_sequences"),
    "an empty stop sequence": ({"stop_sequences": [""]}, "stop_sequences"),
    "system a number": ({"system": 5}, "system"),
    "metadata's unknown key": ({"metadata": {"user": "x"}}, "metadata.user"),
    "service_tier": ({"service_tier": "auto"}, "service_tier"),
    "container": ({"container": "c"}, "container"),
    "mcp_servers": ({"mcp_servers": [{"type": "url", "url": "https://example.com", "name": "x"}]},
                    "mcp_servers"),
    "an unknown field": ({"frobnicate": 1}, "frobnicate"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_request_is_a_4xx_in_anthropics_shape_naming_the_field(client, name):
    patch, field = MALFORMED[name]
    body = {"model": "demo", "max_tokens": 8, "messages": QUESTION, **patch}
    body = {k: v for k, v in body.items() if v is not None}
    for stream in (False, True):
        reply = client.post("/v1/messages", json={**body, "stream": stream} if stream else body)
        assert reply.status_code == 400, (name, reply.text)
        error = reply.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        assert field in error["error"]["message"], (name, error)
    assert create(client, messages=QUESTION, max_tokens=2)["usage"]["output_tokens"] >= 1  # and it answers on


def test_a_stream_that_fails_midway_ends_with_an_error_event(client):
    """A model step that fails after the first token (a planted fault on the answer's first token, which
    the next step reads): the stream has begun, so the failure is an `error` event, not an HTTP status;
    unstreamed it is a 500 `api_error`; with the engine stopped, a 503 `overloaded_error`."""
    first_token = chat(client, QUESTION, return_token_ids=True)["choices"][0]["token_ids"][0]
    llm = LLM(str(default_model_dir()), num_kv_blocks=64, faults=FaultPlan(step_fault_token_id=first_token))
    app = build_app(AsyncEngine(llm.engine), ServerConfig("demo", MediaRules(llm.engine.config.media)))
    with TestClient(app) as faulty:
        reply = faulty.post("/v1/messages", json={"model": "demo", "max_tokens": 8, "temperature": 0,
                                                  "messages": QUESTION, "stream": True})
        stream = events(reply)
        assert [e["type"] for e in stream[:2]] == ["message_start", "ping"] and stream[-1]["type"] == "error"
        assert stream[-1]["error"]["type"] == "api_error" and stream[-1]["error"]["message"], stream[-1]
        assert "message_stop" not in [e["type"] for e in stream]
        whole = faulty.post("/v1/messages", json={"model": "demo", "max_tokens": 8, "messages": QUESTION})
        assert whole.status_code == 500 and whole.json()["error"]["type"] == "api_error", whole.text
    stopped = TestClient(app).post("/v1/messages", json={"model": "demo", "max_tokens": 8, "messages": QUESTION})
    assert stopped.status_code == 503 and stopped.json()["error"]["type"] == "overloaded_error", stopped.text


def test_other_refusals_in_anthropics_shape(client):
    def refused(reply, status: int, kind: str) -> str:
        assert reply.status_code == status, reply.text
        assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == kind, reply.text
        return reply.json()["error"]["message"]

    unknown = {"model": "nope", "max_tokens": 8, "messages": QUESTION}
    assert "model" in refused(client.post("/v1/messages", json=unknown), 404, "not_found_error")
    broken = client.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert "JSON" in refused(broken, 400, "invalid_request_error")
    refused(client.post("/v1/messages/nowhere", json={}), 404, "not_found_error")
    refused(client.get("/v1/messages"), 405, "invalid_request_error")
    refused(client.post("/v1/messages", content=b"x" * (MAX_REQUEST_BYTES + 1)), 413, "request_too_large")
    assert "max_tokens" in refused(client.post("/v1/messages/count_tokens", json={
        "model": "demo", "messages": QUESTION, "max_tokens": 8}), 400, "invalid_request_error")
    assert "messages" in refused(client.post("/v1/messages/count_tokens", json={"model": "demo"}), 400,
                                 "invalid_request_error")
    # the chat route keeps OpenAI's shape
    assert "error" in client.post("/v1/chat/completions", json={"model": "nope", "messages": QUESTION}).json()


def test_the_key_is_taken_as_x_api_key_or_a_bearer_token(client):
    body = {"model": "demo", "max_tokens": 2, "messages": QUESTION}
    for headers in ({"x-api-key": ""}, {"x-api-key": "wrong"},
                    {"x-api-key": "", "authorization": "Bearer wrong"}):
        reply = client.post("/v1/messages", json=body, headers=headers)
        assert reply.status_code == 401, reply.text
        assert reply.json()["error"]["type"] == "authentication_error", reply.text
        assert "x-api-key" in reply.json()["error"]["message"]
    assert client.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": ""}).status_code == 401
    bearer = client.post("/v1/messages", json=body,
                         headers={"x-api-key": "", "authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200, bearer.text
    versioned = client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert versioned.status_code == 200, versioned.text
    assert client.post("/v1/chat/completions", json={**body, "model": "demo"}).status_code == 200  # any route


# ---- fields one by one (tests/unit/test_request_field_coverage.py names these tests) ---------------------
def test_top_k_and_top_p_reach_the_sampler(client):
    """At temperature 1 a top_k of 1, or a top_p so small that only the top token is left, answers exactly
    the greedy answer: the fields reach the sampler (without them temperature 1 samples the whole vocabulary)."""
    greedy = create(client, messages=QUESTION, max_tokens=12)["content"]
    for narrowed in ({"top_k": 1}, {"top_p": 1e-9}):
        assert create(client, messages=QUESTION, max_tokens=12, temperature=1.0, **narrowed)["content"] == greedy


def test_an_is_error_tool_result_is_said_as_an_error_and_input_schema_holds_the_input(client):
    tool_turns = [{"role": "user", "content": "Count the red shapes."},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "count_shapes",
                                                     "input": {"color": "red"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                                "content": "no picture given"}]}]
    answer = create(client, messages=tool_turns, tools=[COUNT_TOOL])
    expected = chat(client, [{"role": "user", "content": "Count the red shapes."},
                             {"role": "assistant", "content": None, "tool_calls": [{
                                 "id": "toolu_1", "type": "function",
                                 "function": {"name": "count_shapes", "arguments": '{"color": "red"}'}}]},
                             {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no picture given"}],
                    tools=[chat_tool(COUNT_TOOL)])
    assert answer["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]
    forced = create(client, messages=QUESTION, max_tokens=150, tool_choice={"type": "tool", "name": "count_shapes"},
                    tools=[{**COUNT_TOOL, "input_schema": COUNT_SCHEMA}])
    (call,) = [b for b in forced["content"] if b["type"] == "tool_use"]
    jsonschema.validate(call["input"], COUNT_TOOL["input_schema"])


def test_cache_control_breakpoints_change_nothing_and_citations_are_refused(client, picture):
    """Every prefix is cached here without a breakpoint: a cache_control (with either ttl) on the system,
    text, image, tool, tool_use and tool_result blocks answers exactly as without; citations on a text block
    are not implemented, so anything but null is a 400 naming them."""
    data, question = picture

    def conversation(extra: dict) -> dict:
        return dict(system=[{"type": "text", "text": "Be brief.", **extra}], tools=[{**COUNT_TOOL, **extra}],
                    messages=[{"role": "user", "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data},
                         **extra}, {"type": "text", "text": question, **extra}]},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "count_shapes",
                                                           "input": {"color": "red"}, **extra}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "2",
                                                      **extra}]}])
    plain = create(client, **conversation({}))
    for ttl in ("5m", "1h", None):
        marked = create(client, **conversation({"cache_control": {"type": "ephemeral", "ttl": ttl}}))
        assert marked["content"] == plain["content"] and marked["usage"] == plain["usage"]
    bad_ttl = client.post("/v1/messages", json={"model": "demo", "max_tokens": 4, **conversation(
        {"cache_control": {"type": "ephemeral", "ttl": "1d"}})})
    assert bad_ttl.status_code == 400 and "ttl" in bad_ttl.json()["error"]["message"]
    cited = client.post("/v1/messages", json={"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "citations": [{"type": "char_location"}]}]}]})
    assert cited.status_code == 400 and "citations" in cited.json()["error"]["message"]


def test_a_tools_description_reaches_the_template_and_strict_or_not_a_forced_input_fits_its_schema(client):
    def counted(tool: dict) -> int:
        reply = client.post("/v1/messages/count_tokens", json={"model": "demo", "messages": QUESTION, "tools": [tool]})
        return reply.json()["input_tokens"]
    bare = {k: v for k, v in COUNT_TOOL.items() if k != "description"}
    described = {**bare, "description": "Count the shapes of one color in the picture"}
    assert counted(described) > counted(bare)  # the chat template writes the description into the prompt
    expected = chat(client, QUESTION, tools=[chat_tool(described)], max_tokens=1)["usage"]["prompt_tokens"]
    assert counted(described) == expected
    for strict in (True, False, None):
        forced = create(client, messages=QUESTION, max_tokens=150, tool_choice={"type": "any"},
                        tools=[{**described, "strict": strict}])
        (call,) = [b for b in forced["content"] if b["type"] == "tool_use"][:1]
        jsonschema.validate(call["input"], COUNT_SCHEMA)

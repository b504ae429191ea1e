"""Qwen3.5's chat surface through the server (the app over an AsyncEngine, FastAPI's TestClient), on a tiny
Qwen3.5 with a chat template written like the published one: the generation prompt opens a thought, which
comes back as `reasoning` (none with `enable_thinking: false`); tools are rendered and called in its XML
syntax (`<function=...><parameter=...>`), parsed into OpenAI's `tool_calls` with values typed by the
tool's schema, held to the schema when forced, whole or streamed; an assistant's earlier calls render back
in the same syntax."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from mmserve import LLM
from mmserve.engine.async_engine import AsyncEngine
from mmserve.entrypoints.openai.media import MediaRules
from mmserve.entrypoints.openai.server import build_app
from mmserve.entrypoints.openai.serving import ServerConfig
from tests.fixtures.hub_templates import QWEN3_5

MESSAGES = [{"role": "user", "content": "How many red shapes?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
COUNT_TOOL = {"type": "function", "function": {"name": "count_shapes", "parameters": {
    "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "big": {"type": "boolean"},
                                     "at_most": {"type": "integer"}},
    "required": ["color", "big", "at_most"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def llm(all_checkpoints, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "qwen3_5.jinja"  # as `--chat-template FILE` gives it
    template.write_text(QWEN3_5)
    return LLM(str(all_checkpoints["qwen3_5"]), chat_template=str(template), num_kv_blocks=64)


@pytest.fixture(scope="module")
def client(llm):
    app = build_app(AsyncEngine(llm.engine), ServerConfig("qwen", MediaRules(llm.engine.config.media)))
    with TestClient(app) as test_client:
        yield test_client


def _chat(client, **body):
    reply = client.post("/v1/chat/completions", json={"model": "qwen", "messages": MESSAGES, "temperature": 0,
                                                      "max_tokens": 6, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_the_thought_the_generation_prompt_opens_is_returned_as_reasoning(client, llm):
    from mmserve import SamplingParams

    raw = llm.chat([MESSAGES], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].text
    thinking = _chat(client)
    assert thinking["message"]["reasoning"] == raw.strip("\n") == thinking["message"]["reasoning_content"]
    assert thinking["message"]["content"] == ""  # the thought never closed within max_tokens
    plain = _chat(client, **NO_THINKING)
    assert plain["message"]["reasoning"] is None and isinstance(plain["message"]["content"], str)


def test_forced_calls_are_written_in_the_xml_syntax_and_parsed_as_the_schema_types_them(client):
    import jsonschema

    schema = COUNT_TOOL["function"]["parameters"]
    named = {"type": "function", "function": {"name": "count_shapes"}}
    for choice, finish in ((named, "stop"), ("required", "tool_calls")):
        answer = _chat(client, tools=[COUNT_TOOL], tool_choice=choice, max_tokens=400, **NO_THINKING)
        assert answer["finish_reason"] == finish and answer["message"]["content"] == "", answer
        calls = answer["message"]["tool_calls"]
        assert len(calls) == 1 or (choice == "required" and calls)  # required allows parallel calls
        for call in calls:
            assert call["function"]["name"] == "count_shapes"
            # `big` a JSON boolean, `at_most` an integer: typed by the schema
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
        if choice is named:
            arguments = json.loads(calls[0]["function"]["arguments"])
    reply = client.post("/v1/chat/completions", json={
        "model": "qwen", "messages": MESSAGES, "tools": [COUNT_TOOL], "tool_choice": named, "max_tokens": 400,
        "temperature": 0, "stream": True, **NO_THINKING})
    lines = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [d for c in map(json.loads, lines) for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == "count_shapes"
    assert json.loads("".join(d["function"].get("arguments", "") for d in deltas)) == arguments


def test_an_assistants_earlier_calls_render_back_in_the_xml_syntax(client, llm):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "count_shapes", "arguments": json.dumps({"color": "red", "big": True, "at_most": 3})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    tokens = client.post("/tokenize", json={"messages": history, "tools": [COUNT_TOOL]}).json()["tokens"]
    prompt = llm.engine.processor.tokenizer.decode(tokens, skip_special_tokens=False)
    assert ("<tool_call>\n<function=count_shapes>\n<parameter=color>\nred\n</parameter>\n<parameter=big>\ntrue\n"
            "</parameter>\n<parameter=at_most>\n3\n</parameter>\n</function>\n</tool_call>") in prompt
    assert "<tool_response>\n2\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert _chat(client, messages=history, tools=[COUNT_TOOL])["finish_reason"] == "length"
    # arguments that are no JSON object stay text, which this template cannot iterate: the request's fault
    broken = [dict(history[1], tool_calls=[{"id": "call_1", "type": "function", "function": {
        "name": "count_shapes", "arguments": "color=red"}}])]
    reply = client.post("/v1/chat/completions", json={"model": "qwen", "messages": MESSAGES + broken + history[2:],
                                                      "max_tokens": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages", reply.text
    assert _chat(client, max_tokens=2)["finish_reason"] == "length"  # and the engine serves on

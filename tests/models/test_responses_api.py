"""OpenAI's Responses API in process (the app over an AsyncEngine, FastAPI's TestClient, the router added as
the server will add it), on the bundled demo model and, for a thought, a tiny Qwen3.5 with its thinking
template: a conversation sent as Responses input is chat's prompt token for token and, greedy, chat's answer;
previous_response_id continues as the whole history would; text.format and forced tool choices hold; a
stream's events come in order with rising sequence numbers and join to the response it ends with; stored
responses are retrieved, listed and deleted; every malformed shape is a 400 naming its field. Every answer
passes the `openai` SDK's `Response` model with no field it does not know."""

from __future__ import annotations

import base64
import io
import json

import jsonschema
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from mmserve import LLM
from mmserve.demo import shapes
from mmserve.demo.eval import default_model_dir
from mmserve.engine.async_engine import AsyncEngine
from mmserve.entrypoints.openai.media import MediaRules
from mmserve.entrypoints.openai.responses import reasoning_tokens
from mmserve.entrypoints.openai.server import build_app
from mmserve.entrypoints.openai.serving import ServerConfig
from tests.fixtures.hub_templates import QWEN3_5

QUESTION = "How many shapes are there?"
SCHEMA = {"type": "object", "properties": {"count": {"type": "integer"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["count", "color"], "additionalProperties": False}
COUNT_TOOL = {"type": "function", "name": "count_shapes", "description": "Count the shapes of a color",
              "parameters": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                             "required": ["color"], "additionalProperties": False}, "strict": True}
CHAT_COUNT_TOOL = {"type": "function", "function": {k: v for k, v in COUNT_TOOL.items() if k != "type"}}
MAX_CHAIN_DEPTH = 3
GREEDY = {"temperature": 0}


def picture_data_uri() -> str:
    buffer = io.BytesIO()
    shapes.make_sample(0, 0, "count").images[0].save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _known_fields_only(value: object, where: str = "response") -> None:
    """Every SDK model in the tree holds only fields the SDK declares."""
    if isinstance(value, BaseModel):
        assert not value.model_extra, f"{where}: fields the SDK does not know: {sorted(value.model_extra)}"
        for name in type(value).model_fields:
            _known_fields_only(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _known_fields_only(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _known_fields_only(v, f"{where}.{k}")


def sdk_response(data: dict) -> Response:
    response = Response.model_validate(data)
    _known_fields_only(response)
    return response


def create(client: TestClient, **body) -> dict:
    reply = client.post("/v1/responses", json={"model": "demo", **GREEDY, **body})
    assert reply.status_code == 200, reply.text
    sdk_response(reply.json())
    return reply.json()


def chat(client: TestClient, messages: list, **body) -> dict:
    reply = client.post("/v1/chat/completions", json={"model": "demo", "messages": messages, **GREEDY, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def refused(client: TestClient, status: int = 400, **body) -> dict:
    # JSON as Python writes it (\\ud800 escaped), which httpx's encoder cannot send
    reply = client.post("/v1/responses", content=json.dumps({"model": "demo", **body}),
                        headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def stream(client: TestClient, **body) -> list[dict]:
    """The stream's events (each SSE `event:` line names its data's type)."""
    reply = client.post("/v1/responses", json={"model": "demo", **GREEDY, **body, "stream": True})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream"), reply.text
    events = []
    for block in reply.text.strip().split("\n\n"):
        (event_line, data_line) = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        _known_fields_only(TypeAdapter(ResponseStreamEvent).validate_python(event), event["type"])
        events.append(event)
    return events


def without_ids(value: object) -> object:
    """A response with what differs between two runs of the same request left out: ids, times, and what the
    prefix cache held."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items()
                if k not in ("id", "call_id", "created_at", "completed_at", "input_tokens_details")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


@pytest.fixture(scope="module")
def llm():
    return LLM(str(default_model_dir()), num_kv_blocks=256)


@pytest.fixture(scope="module")
def app(llm):
    return build_app(AsyncEngine(llm.engine), ServerConfig("demo", MediaRules(llm.engine.config.media),
                                                           response_chain_depth=MAX_CHAIN_DEPTH))


@pytest.fixture(scope="module")
def store(app):
    return app.state.response_store  # the app's own, with the config's limits


@pytest.fixture(scope="module")
def client(app, store):
    with TestClient(app) as test_client:
        yield test_client
    store.check_integrity()


# ---- the same conversation as chat ---------------------------------------------------------------------
def _conversations() -> dict[str, tuple[dict, dict]]:
    """name -> (the Responses body, the chat body of the same conversation)."""
    image = picture_data_uri()
    call = {"type": "function_call", "call_id": "call_1", "name": "count_shapes", "arguments": '{"color": "red"}'}
    chat_call = {"id": "call_1", "type": "function", "function": {"name": "count_shapes",
                                                                  "arguments": '{"color": "red"}'}}
    return {
        "string input": ({"input": QUESTION}, {"messages": [{"role": "user", "content": QUESTION}]}),
        "instructions and an image": (
            {"instructions": "You count shapes.", "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": image, "detail": "auto"},
                {"type": "input_text", "text": "How many red shapes are there?"}]}]},
            {"messages": [{"role": "system", "content": "You count shapes."}, {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image}},
                {"type": "text", "text": "How many red shapes are there?"}]}]}),
        "a function call and its output": (
            {"input": [{"role": "user", "content": "How many red shapes?"}, call,
                       {"type": "function_call_output", "call_id": "call_1", "output": "2"}], "tools": [COUNT_TOOL]},
            {"messages": [{"role": "user", "content": "How many red shapes?"},
                          {"role": "assistant", "content": None, "tool_calls": [chat_call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "2"}], "tools": [CHAT_COUNT_TOOL]}),
        "developer and assistant turns": (
            {"input": [{"role": "developer", "content": "Answer in one word."},
                       {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
                       {"type": "message", "role": "assistant", "content": [
                           {"type": "output_text", "text": "three", "annotations": []}]},
                       {"role": "user", "content": "And how many are red?"}]},
            {"messages": [{"role": "system", "content": "Answer in one word."},
                          {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
                          {"role": "assistant", "content": "three"},
                          {"role": "user", "content": "And how many are red?"}]}),
    }


@pytest.mark.parametrize("name", list(_conversations()))
def test_a_conversation_is_chats_prompt_and_greedy_answer(client, name):
    responses_body, chat_body = _conversations()[name]
    response = create(client, **responses_body, max_output_tokens=12)
    expected = chat(client, **chat_body, max_tokens=12)
    assert response["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]
    assert output_text(response) == expected["choices"][0]["message"]["content"]
    assert response["usage"]["output_tokens"] == expected["usage"]["completion_tokens"]
    assert response["usage"]["total_tokens"] == response["usage"]["input_tokens"] + response["usage"]["output_tokens"]
    assert response["status"] == ("incomplete" if expected["choices"][0]["finish_reason"] == "length" else "completed")


def test_previous_response_id_continues_as_the_whole_history_would(client):
    """The stored input and output items come before the new input; the earlier instructions do not (as at
    OpenAI); a function call answered through previous_response_id is chat's tool round trip."""
    first = create(client, instructions="Be brief.", input=QUESTION, max_output_tokens=8)
    follow_up = {"role": "user", "content": "And how many are red?"}
    continued = create(client, previous_response_id=first["id"], input=[follow_up], max_output_tokens=8)
    assert continued["previous_response_id"] == first["id"] and continued["instructions"] is None
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": output_text(first)}, follow_up]
    whole = create(client, input=history, max_output_tokens=8)
    expected = chat(client, history, max_tokens=8)
    for same in (whole["usage"]["input_tokens"], expected["usage"]["prompt_tokens"]):
        assert continued["usage"]["input_tokens"] == same
    assert output_text(continued) == output_text(whole) == expected["choices"][0]["message"]["content"]

    called = create(client, input="How many red shapes?", tools=[COUNT_TOOL], tool_choice="required",
                    max_output_tokens=150)
    (call,) = [item for item in called["output"] if item["type"] == "function_call"]
    answered = create(client, previous_response_id=called["id"], tools=[COUNT_TOOL], max_output_tokens=8,
                      input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "2"}])
    expected = chat(client, [{"role": "user", "content": "How many red shapes?"},
                             {"role": "assistant", "content": None, "tool_calls": [{
                                 "id": call["call_id"], "type": "function",
                                 "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                             {"role": "tool", "tool_call_id": call["call_id"], "content": "2"}],
                    tools=[CHAT_COUNT_TOOL], max_tokens=8)
    assert answered["usage"]["input_tokens"] == expected["usage"]["prompt_tokens"]
    assert output_text(answered) == expected["choices"][0]["message"]["content"]


def test_a_chain_deeper_than_the_store_allows_is_refused(client):
    previous = None
    for _ in range(MAX_CHAIN_DEPTH + 1):
        previous = create(client, input="Hi", previous_response_id=previous and previous["id"], max_output_tokens=1)
    error = refused(client, input="Hi", previous_response_id=previous["id"], max_output_tokens=1)
    assert error["param"] == "previous_response_id" and f"at most {MAX_CHAIN_DEPTH}" in error["message"]


# ---- formats, tools, limits ----------------------------------------------------------------------------
def test_text_format_constrains_the_output_and_is_echoed(client):
    text = {"format": {"type": "json_schema", "name": "count", "schema": SCHEMA, "strict": True}}
    response = create(client, input=QUESTION, text=text, max_output_tokens=150)
    assert response["text"] == text and response["status"] == "completed"
    jsonschema.validate(json.loads(output_text(response)), SCHEMA)
    expected = chat(client, [{"role": "user", "content": QUESTION}], max_tokens=150, response_format={
        "type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMA, "strict": True}})
    assert output_text(response) == expected["choices"][0]["message"]["content"]
    loose = create(client, input=QUESTION, text={"format": {"type": "json_object"}}, max_output_tokens=150)
    assert isinstance(json.loads(output_text(loose)), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "count_shapes"}])
def test_a_forced_tool_choice_answers_with_function_call_items(client, choice):
    area = {"type": "function", "name": "area", "parameters": {"type": "object", "properties": {}}}
    response = create(client, input="How many red shapes?", tools=[COUNT_TOOL, area], tool_choice=choice,
                      parallel_tool_calls=False, max_output_tokens=150)
    assert response["tool_choice"] == choice and response["parallel_tool_calls"] is False
    assert response["tools"][0] == COUNT_TOOL and response["tools"][1]["description"] is None
    (call,) = response["output"]  # no message: the forced call is all there is
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    if isinstance(choice, dict):
        assert call["name"] == "count_shapes"
    jsonschema.validate(json.loads(call["arguments"]), (COUNT_TOOL if call["name"] == "count_shapes" else area)
                        ["parameters"])


def test_max_output_tokens_makes_an_incomplete_response(client):
    response = create(client, input=QUESTION, max_output_tokens=1, metadata={"run": "7"}, user="u-1",
                      safety_identifier="s-1", prompt_cache_key="k-1", store=False)
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][-1]["status"] == "incomplete" and response["usage"]["output_tokens"] == 1
    assert (response["metadata"], response["user"], response["safety_identifier"], response["prompt_cache_key"],
            response["max_output_tokens"]) == ({"run": "7"}, "u-1", "s-1", "k-1", 1)
    assert client.get(f"/v1/responses/{response['id']}").status_code == 404  # store: false


# ---- streams -------------------------------------------------------------------------------------------
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


def _collapsed(types: list[str]) -> list[str]:
    """Event types with each run of the same delta type as one."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


@pytest.mark.parametrize("body, items", [
    ({"input": QUESTION, "max_output_tokens": 12}, MESSAGE_EVENTS),
    ({"input": QUESTION, "max_output_tokens": 1}, MESSAGE_EVENTS),
    ({"input": "How many red shapes?", "tools": [COUNT_TOOL], "tool_choice": "required", "max_output_tokens": 150},
     CALL_EVENTS),
], ids=["text", "incomplete", "function call"])
def test_a_stream_is_the_response_as_events(client, body, items):
    whole = create(client, **body)
    events = stream(client, **body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = events[-1]
    assert _collapsed([e["type"] for e in events]) == ["response.created", "response.in_progress", *items,
                                                       f"response.{whole['status']}"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert without_ids(last["response"]) == without_ids(whole)
    response = last["response"]
    assert events[0]["response"]["id"] == response["id"]
    sdk_response(response)
    for item in response["output"]:
        if item["type"] == "message":
            assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == \
                item["content"][0]["text"]
        else:
            assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == \
                item["arguments"]
        done = [e for e in events if e["type"] == "response.output_item.done"]
        assert item in [e["item"] for e in done]
    assert client.get(f"/v1/responses/{response['id']}").json() == response  # stored as streamed


# ---- retrieve, list, delete ----------------------------------------------------------------------------
def test_stored_responses_are_retrieved_listed_and_deleted(client):
    first = create(client, input=[{"role": "user", "content": QUESTION}], max_output_tokens=4)
    second = create(client, previous_response_id=first["id"], max_output_tokens=4,
                    input=[{"role": "user", "content": [{"type": "input_text", "text": "Really?"}]}])
    assert client.get(f"/v1/responses/{second['id']}").json() == second
    listed = client.get(f"/v1/responses/{second['id']}/input_items", params={"order": "asc"}).json()
    data = [TypeAdapter(ResponseItem).validate_python(item) for item in listed["data"]]
    for item in data:
        _known_fields_only(item)
    assert [(i.type, getattr(i, "role", None)) for i in data] == [("message", "user"), ("message", "assistant"),
                                                                   ("message", "user")]
    assert data[0].content[0].text == QUESTION and data[1].id == first["output"][0]["id"]
    assert (listed["object"], listed["first_id"], listed["last_id"], listed["has_more"]) == \
        ("list", data[0].id, data[2].id, False)
    newest = client.get(f"/v1/responses/{second['id']}/input_items", params={"limit": 2}).json()
    assert [i["id"] for i in newest["data"]] == [data[2].id, data[1].id] and newest["has_more"] is True
    rest = client.get(f"/v1/responses/{second['id']}/input_items", params={"after": data[1].id}).json()
    assert [i["id"] for i in rest["data"]] == [data[0].id] and rest["has_more"] is False

    deleted = client.delete(f"/v1/responses/{first['id']}")
    assert deleted.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
    for method, path, param in (("GET", f"/v1/responses/{first['id']}", "response_id"),
                                ("DELETE", f"/v1/responses/{first['id']}", "response_id"),
                                ("GET", "/v1/responses/resp_unknown/input_items", "response_id")):
        gone = client.request(method, path)
        assert gone.status_code == 404 and gone.json()["error"]["param"] == param, gone.text
    error = refused(client, 404, input="Hi", previous_response_id=first["id"])
    assert error["param"] == "previous_response_id" and "evicted" in error["message"]
    # the continuation holds its whole conversation: it goes on after the first is gone
    assert create(client, previous_response_id=second["id"], input="Hi", max_output_tokens=2)["status"]
    assert client.get(f"/v1/responses/{second['id']}", params={"stream": "true"}).status_code == 400


# ---- refusals ------------------------------------------------------------------------------------------
PNG = picture_data_uri()
MALFORMED = {
    "an item of an unknown type": ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    "a role no chat has": ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    "a file part": ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
                    "input[0].content[0].type"),
    "an image by file id": ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f",
                                                                     "detail": "auto"}]}]},
                            "input[0].content[0].file_id"),
    "an image detail not honoured": ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": PNG, "detail": "low"}]}]}, "input[0].content[0].detail"),
    "an image that is no image": ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA",
                                               "detail": "high"}]}]}, "input[0].content[1].image_url"),
    "a lone surrogate in the input": ({"input": "\ud800"}, "input"),
    "a lone surrogate in the instructions": ({"instructions": "\ud800", "input": "x"}, "instructions"),
    "an input_text in an assistant message": ({"input": [{"role": "assistant", "content": [
        {"type": "input_text", "text": "x"}]}]}, "input[0].content[0].type"),
    "an unknown key on an item": ({"input": [{"role": "user", "content": "x", "colour": "red"}]}, "input[0].colour"),
    "an output for no call": ({"input": [{"role": "user", "content": "x"},
                                         {"type": "function_call_output", "call_id": "call_9", "output": "2"}]},
                              "input[1].call_id"),
    "encrypted reasoning": ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [],
                                        "encrypted_content": "xyz"}]}, "input[0].encrypted_content"),
    "a hosted tool": ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    "an unknown key on a tool": ({"input": "x", "tools": [{**COUNT_TOOL, "colour": 1}]}, "tools[0].colour"),
    "a tool with a bad name": ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0]"),
    "a hosted tool choice": ({"input": "x", "tools": [COUNT_TOOL], "tool_choice": {"type": "file_search"}},
                             "tool_choice"),
    "a forced tool and a format": ({"input": "x", "tools": [COUNT_TOOL], "tool_choice": "required",
                                    "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    "background": ({"input": "x", "background": True}, "background"),
    "truncation auto": ({"input": "x", "truncation": "auto"}, "truncation"),
    "include": ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    "top_logprobs": ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
    "a conversation object": ({"input": "x", "conversation": "conv_1"}, "conversation"),
    "a stored prompt": ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    "an unknown field": ({"input": "x", "colour": "red"}, "colour"),
    "a reasoning effort": ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    "a reasoning summary": ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
    "a text format of no kind": ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    "a json_schema without a schema": ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
                                       "text.format"),
    "verbosity": ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    "too much metadata": ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    "metadata that is no string": ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
    "no input": ({}, "input"),
    "input of no type": ({"input": 5}, "input"),
    "more tokens than the context": ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    "a temperature out of range": ({"input": "x", "temperature": -1}, "temperature"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_request_is_a_400_naming_the_field(client, name):
    body, param = MALFORMED[name]
    error = refused(client, **body)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "messages[" not in error["message"] and "response_format" not in error["message"], error


def test_unknown_ids_and_models_are_404s_and_the_server_answers_after(client):
    assert refused(client, 404, input="x", previous_response_id="resp_nope")["param"] == "previous_response_id"
    assert refused(client, 404, input="x", model="nope")["param"] == "model"
    assert create(client, input=QUESTION, max_output_tokens=2)["status"] in ("completed", "incomplete")


def test_a_request_the_engine_fails_midway_ends_its_stream_with_response_failed(llm):
    """The engine's step raises on the answer's first token (planted): the stream has sent it, then ends with
    `response.failed` carrying the error; nothing is stored; the engine serves on."""
    from mmserve import SamplingParams
    from mmserve.faults import FaultPlan

    messages = [{"role": "user", "content": QUESTION}]
    first = llm.chat([messages], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    fault = first.outputs[0].token_ids[0]
    assert fault not in first.prompt_token_ids
    faulty = LLM(str(default_model_dir()), num_kv_blocks=64, faults=FaultPlan(step_fault_token_id=fault))
    faulty_app = build_app(AsyncEngine(faulty.engine), ServerConfig("demo", MediaRules(faulty.engine.config.media)))
    faulty_store = faulty_app.state.response_store
    with TestClient(faulty_app) as faulty_client:
        events = stream(faulty_client, input=QUESTION, max_output_tokens=8)
        assert events[-1]["type"] == "response.failed" and "response.output_text.delta" in [e["type"] for e in events]
        failed = sdk_response(events[-1]["response"])
        assert failed.status == "failed" and failed.error.code == "server_error" and "test fault" in failed.error.message
        assert len(faulty_store) == 0
        error = faulty_client.post("/v1/responses", json={"model": "demo", "input": QUESTION, **GREEDY}).json()["error"]
        assert error["type"] == "server_error"
        assert create(faulty_client, input="Hi", max_output_tokens=1)["status"]  # the engine serves on


# ---- a thinking model ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen(all_checkpoints, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "qwen3_5.jinja"
    template.write_text(QWEN3_5)
    llm = LLM(str(all_checkpoints["qwen3_5"]), chat_template=str(template), num_kv_blocks=64)
    thinking_app = build_app(AsyncEngine(llm.engine), ServerConfig("demo", MediaRules(llm.engine.config.media)))
    with TestClient(thinking_app) as test_client:
        yield test_client, llm.engine.processor.tokenizer


def test_a_thought_is_a_reasoning_item(qwen):
    client, _ = qwen
    question = [{"role": "user", "content": QUESTION}]
    response = create(client, input=QUESTION, max_output_tokens=6)
    expected = chat(client, question, max_tokens=6)["choices"][0]["message"]
    (item,) = response["output"]  # the thought never closes in 6 tokens: no message
    assert item["type"] == "reasoning" and item["id"].startswith("rs_") and item["summary"] == []
    assert item["content"] == [{"type": "reasoning_text", "text": expected["reasoning"]}] and expected["content"] == ""
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
    events = stream(client, input=QUESTION, max_output_tokens=6)
    assert _collapsed([e["type"] for e in events])[2:-1] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == expected["reasoning"]
    assert without_ids(events[-1]["response"]) == without_ids(response)
    # the thought goes back as the assistant's reasoning_content, as a chat client sends it
    continued = create(client, previous_response_id=response["id"], input="And red ones?", max_output_tokens=4)
    history = [*question, {"role": "assistant", "content": None, "reasoning_content": expected["reasoning"]},
               {"role": "user", "content": "And red ones?"}]
    assert continued["usage"]["input_tokens"] == chat(client, history, max_tokens=4)["usage"]["prompt_tokens"]
    plain = create(client, input=QUESTION, reasoning={"effort": "none"}, max_output_tokens=6)
    unthought = chat(client, question, max_tokens=6, chat_template_kwargs={"enable_thinking": False})
    assert plain["usage"]["input_tokens"] == unthought["usage"]["prompt_tokens"]
    assert [i["type"] for i in plain["output"]] == ["message"] and plain["reasoning"]["effort"] == "none"
    assert output_text(plain) == unthought["choices"][0]["message"]["content"]


def test_reasoning_tokens_end_with_the_closing_tag(qwen):
    _, tokenizer = qwen
    thought = tokenizer.encode("a few words of thought\n</think>")
    answer = tokenizer.encode("\n\nthe answer")
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert reasoning_tokens(decode, thought + answer) == len(thought) > 1
    assert reasoning_tokens(decode, answer) == len(answer)  # a thought that never closed


def test_top_p_reaches_the_sampler(client):
    """At temperature 1 a top_p so small that only the top token is left answers the greedy answer."""
    greedy = output_text(create(client, input=QUESTION, max_output_tokens=12, temperature=0))
    narrowed = create(client, input=QUESTION, max_output_tokens=12, temperature=1.0, top_p=1e-9)
    assert narrowed["top_p"] == 1e-9 and output_text(narrowed) == greedy

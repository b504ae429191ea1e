"""OpenAI's Responses API end to end: a real `mmserve serve` of the bundled demo model (one for the module),
driven by the clients people use — the `openai` SDK (`responses.create` with text and image input, the
`responses.stream` helper, `responses.parse` with a pydantic model, a function-call round trip,
previous_response_id, retrieve, input_items and delete), `openai-agents` (an Agent whose tool is forced for
one turn, and a plain one) and LangChain's `ChatOpenAI(use_responses_api=True)`. The demo model answers
about pictures of shapes and was never trained to call tools, so answers are checked against the chat
route's for the same conversation and for the protocol round trip, not for sense."""

from __future__ import annotations

import base64
import io
from typing import Literal

import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel

from mmserve.config import DEMO_MODEL_NAME
from mmserve.demo import shapes
from tests.e2e.conftest import running_server

QUESTION = "How many shapes are there?"
COUNT_TOOL = {"type": "function", "name": "count_shapes", "description": "Count the shapes of one color",
              "parameters": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                             "required": ["color"], "additionalProperties": False}, "strict": True}


class Count(BaseModel):
    count: int
    color: Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(None, tmp_path_factory.mktemp("responses") / "serve.log", "--num-kv-blocks", "256") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def picture_data_uri() -> str:
    buffer = io.BytesIO()
    shapes.make_sample(0, 0, "count").images[0].save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def greedy(client: OpenAI, **body):
    return client.responses.create(model=DEMO_MODEL_NAME, temperature=0, **body)


def greedy_chat(client: OpenAI, messages: list, max_tokens: int):
    return client.chat.completions.create(model=DEMO_MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                          temperature=0)


def test_create_answers_a_string_and_an_image_as_chat_does(client):
    image = picture_data_uri()
    cases = [
        (QUESTION, [{"role": "user", "content": QUESTION}]),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": image, "detail": "auto"},
                                       {"type": "input_text", "text": "How many red shapes are there?"}]}],
         [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                       {"type": "text", "text": "How many red shapes are there?"}]}]),
    ]
    for responses_input, messages in cases:
        response = greedy(client, input=responses_input, max_output_tokens=16)
        expected = greedy_chat(client, messages, 16)
        assert response.object == "response" and response.model == DEMO_MODEL_NAME
        assert response.output_text == expected.choices[0].message.content
        assert response.usage.input_tokens == expected.usage.prompt_tokens
        assert response.status == ("incomplete" if expected.choices[0].finish_reason == "length" else "completed")


def test_the_stream_helper_builds_the_same_response(client):
    whole = greedy(client, input=QUESTION, max_output_tokens=16)
    deltas = []
    with client.responses.stream(model=DEMO_MODEL_NAME, input=QUESTION, temperature=0, max_output_tokens=16) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status


def test_parse_fills_a_pydantic_model(client):
    parsed = client.responses.parse(model=DEMO_MODEL_NAME, input="How many red shapes? Answer in JSON.",
                                    text_format=Count, temperature=0, max_output_tokens=100)
    assert isinstance(parsed.output_parsed, Count)
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Count"


def test_a_function_call_round_trip_by_history_and_by_previous_response_id(client):
    question = [{"role": "user", "content": "How many red shapes are there?"}]
    called = greedy(client, input=question, tools=[COUNT_TOOL], tool_choice="required", max_output_tokens=150)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "count_shapes" and call.call_id.startswith("call_")
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "2"}
    # the client keeps the history: its input, the model's output items, the tool's answer
    history = [*question, *(item.model_dump(exclude_none=True) for item in called.output), answer]
    by_history = greedy(client, input=history, tools=[COUNT_TOOL], max_output_tokens=16)
    # the server keeps it
    by_id = greedy(client, previous_response_id=called.id, input=[answer], tools=[COUNT_TOOL], max_output_tokens=16)
    assert by_id.usage.input_tokens == by_history.usage.input_tokens
    assert by_id.output_text == by_history.output_text and by_id.previous_response_id == called.id


def test_previous_response_id_retrieve_input_items_and_delete(client):
    first = greedy(client, input=QUESTION, max_output_tokens=8)
    second = greedy(client, previous_response_id=first.id, input="And how many are red?", max_output_tokens=8)
    whole = greedy(client, max_output_tokens=8, input=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And how many are red?"}])
    assert second.output_text == whole.output_text and second.usage.input_tokens == whole.usage.input_tokens
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    items = client.responses.input_items.list(second.id, order="asc")
    assert [item.type for item in items.data] == ["message", "message", "message"]
    assert items.data[1].id == first.output[0].id
    deleted = client.responses.delete(first.id)  # the SDK answers None for a 200
    assert deleted is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        greedy(client, previous_response_id=first.id, input="Hi", max_output_tokens=2)
    assert missing.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as refused:
        greedy(client, input="Hi", background=True)
    assert refused.value.body["param"] == "background"


def test_an_openai_agents_agent_runs_against_the_server(server):
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_api,
        set_default_openai_client,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    set_default_openai_api("responses")
    set_default_openai_client(AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0),
                              use_for_tracing=False)
    colors = []

    @function_tool
    def count_shapes(color: Literal["red", "green", "blue"]) -> str:
        """Count the shapes of one color in the picture."""
        colors.append(color)
        return "2"

    # the demo model never learnt to call tools: the tool is forced for its one turn
    agent = Agent(name="counter", instructions="You count shapes.", model=DEMO_MODEL_NAME, tools=[count_shapes],
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=150))
    result = Runner.run_sync(agent, "How many red shapes are there?")
    assert colors and colors[0] in ("red", "green", "blue") and result.final_output == "2"
    plain = Runner.run_sync(Agent(name="plain", model=DEMO_MODEL_NAME,
                                  model_settings=ModelSettings(temperature=0, max_tokens=16)), QUESTION)
    assert isinstance(plain.final_output, str)


def test_langchain_chat_openai_speaks_the_responses_api(server, client):
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=DEMO_MODEL_NAME, use_responses_api=True,
                       temperature=0, max_tokens=16, max_retries=0)
    message = model.invoke(QUESTION)
    assert message.text == greedy(client, input=QUESTION, max_output_tokens=16).output_text
    assert message.response_metadata["id"].startswith("resp_")

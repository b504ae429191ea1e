"""Anthropic's clients against a real `mmserve serve` of the bundled demo model (an API key set, which
they send as `x-api-key`): the official `anthropic` SDK's `messages.create` with a base64 picture, its
`messages.stream` helper (text_stream, get_final_message), a picture by URL, a tool_use -> tool_result
round trip, `messages.count_tokens`, its typed errors; and LangChain's `ChatAnthropic(...).invoke`. The
demo model answers questions about pictures of shapes exactly, so answers are checked against the
picture's ground truth; greedy answers (temperature 0, sent as an extra field: this SDK's `create` has
none) are compared between clients."""

from __future__ import annotations

import base64
import io

import anthropic
import pytest

from mmserve.demo import shapes
from tests.e2e.conftest import file_server, running_server

API_KEY = "anthropic-e2e-key"
MODEL = "mmserve-demo"
GREEDY = {"extra_body": {"temperature": 0}}
COUNT_TOOL = {"name": "count_shapes", "description": "Count the shapes of one color in the picture",
              "input_schema": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                               "required": ["color"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # loopback media URLs allowed: a picture is also given by URL, from a loopback file server
    log = tmp_path_factory.mktemp("anthropic") / "serve.log"
    with running_server(None, log, "--allow-private-media-urls", api_key=API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def picture_turn(sample: shapes.Sample) -> list[dict]:
    buffer = io.BytesIO()
    sample.images[0].save(buffer, "PNG")
    data = base64.b64encode(buffer.getvalue()).decode()
    return [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": sample.question}]}]


def test_create_with_a_picture_stream_and_count_tokens(client):
    sample = shapes.make_sample(0, 0, "count")
    messages = picture_turn(sample)
    reply = client.messages.create(model=MODEL, max_tokens=24, messages=messages, **GREEDY)
    assert reply.id.startswith("msg_") and reply.role == "assistant" and reply.model == MODEL
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == sample.answer and reply.stop_reason == "end_turn"
    assert reply.usage.input_tokens > 0 and reply.usage.output_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=24, messages=messages, **GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == reply.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == reply.usage.output_tokens
    assert final.usage.input_tokens == reply.usage.input_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=messages)
    assert counted.input_tokens == reply.usage.input_tokens


def test_a_picture_by_url(client, tmp_path):
    sample = shapes.make_sample(1, 0, "count")
    sample.images[0].save(tmp_path / "shapes.png")
    with file_server(tmp_path) as base_url:
        reply = client.messages.create(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": f"{base_url}/shapes.png"}},
            {"type": "text", "text": sample.question}]}], **GREEDY)
    assert reply.content[0].text == sample.answer


def test_a_tool_use_and_its_result_round_trip(client):
    sample = shapes.make_sample(0, 0, "count")
    messages = picture_turn(sample)
    called = client.messages.create(model=MODEL, max_tokens=150, messages=messages, tools=[COUNT_TOOL],
                                    tool_choice={"type": "tool", "name": "count_shapes"}, **GREEDY)
    (use,) = [block for block in called.content if block.type == "tool_use"]
    assert use.name == "count_shapes" and use.input["color"] in ("red", "green", "blue")
    assert use.id.startswith("toolu_") and called.stop_reason == "tool_use"
    messages += [{"role": "assistant", "content": called.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "2"},
                                              {"type": "text", "text": "So how many are there?"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=24, messages=messages, tools=[COUNT_TOOL],
                                    **GREEDY)
    assert answer.stop_reason in ("end_turn", "tool_use", "max_tokens") and answer.content
    assert client.messages.count_tokens(model=MODEL, messages=messages, tools=[COUNT_TOOL]).input_tokens == \
        answer.usage.input_tokens


def test_the_sdks_typed_errors(server, client):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}}]}])
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0.source" in refused.value.body["error"]["message"]
    hello = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=8, messages=hello)
    stranger = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        stranger.messages.create(model=MODEL, max_tokens=8, messages=hello)
    assert unauthorized.value.body["error"]["type"] == "authentication_error"


def test_langchain_chat_anthropic_invokes(server, client):
    from langchain_anthropic import ChatAnthropic

    question = "How many shapes are there?"
    chat = ChatAnthropic(base_url=server.url, api_key=API_KEY, model=MODEL, max_tokens=16, temperature=0,
                         max_retries=0)
    answer = chat.invoke(question)
    expected = client.messages.create(model=MODEL, max_tokens=16,
                                      messages=[{"role": "user", "content": question}], **GREEDY)
    assert answer.content == expected.content[0].text and answer.usage_metadata["input_tokens"] > 0

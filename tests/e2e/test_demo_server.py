"""`mmserve serve` with no model argument serves the bundled demo VLM, and it answers correctly.

A real server subprocess, the official `openai` client, pictures from the shapes generator sent as
data URIs. The demo model is trained to answer these questions exactly, so here answers are checked
against the generator's ground truth (the accuracy floors themselves are tested by the eval test);
a wrong M-RoPE position, a shifted embedding row or a stale cache hit in the serving path turns a
right answer into a wrong one.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io

import pytest
from openai import OpenAI

from mmserve.demo import shapes
from tests.e2e.conftest import start_server, stop_server, wait_healthy

SEED = 7  # an eval-range seed (below shapes.TRAIN_SEED_BASE): never trained on


def png_data_uri(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def openai_messages(sample: shapes.Sample) -> list[dict]:
    """The sample's user turn with its images as data-URI `image_url` parts, then the question."""
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": png_data_uri(img)}} for img in sample.images]
    parts.append({"type": "text", "text": sample.question})
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "demo.log"
    server = start_server(None, log)  # no model: `mmserve serve` falls back to the demo model
    try:
        wait_healthy(server)
        server.model = new_client(server).models.list().data[0].id
        yield server
    finally:
        stop_server(server)


def new_client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client: OpenAI, server, sample: shapes.Sample, **kwargs):
    return client.chat.completions.create(model=server.model, messages=openai_messages(sample), max_tokens=24,
                                          temperature=0, **kwargs)


def test_models_lists_the_demo_model(demo_server):
    assert [m.id for m in new_client(demo_server).models.list().data] == ["mmserve-demo"]


def test_chat_answers_a_shapes_question_correctly(demo_server):
    sample = shapes.make_sample(SEED, 0, "describe")
    response = ask(new_client(demo_server), demo_server, sample)
    assert response.choices[0].message.content == sample.answer
    assert response.choices[0].finish_reason == "stop"
    # the answer's tokens plus <|im_end|>, which ends the turn and is not in the text
    assert response.usage.completion_tokens >= 2
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streaming_answer_is_correct_and_usage_counts(demo_server):
    client = new_client(demo_server)
    sample = shapes.make_sample(SEED, 1, "color")
    whole = ask(client, demo_server, sample)
    chunks = list(ask(client, demo_server, sample, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == sample.answer == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_twenty_concurrent_clients_all_answered_correctly(demo_server):
    # every question type in turn (index % 6), two-image comparisons included
    samples = [shapes.make_sample(SEED, 100 + i) for i in range(20)]

    def one(sample: shapes.Sample):
        return ask(new_client(demo_server), demo_server, sample)

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        responses = list(pool.map(one, samples))
    answers = [r.choices[0].message.content for r in responses]
    assert answers == [s.answer for s in samples]
    assert {s.question_type for s in samples} == set(shapes.QUESTION_TYPES)
    assert all(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens for r in responses)

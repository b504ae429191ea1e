"""`mmserve serve` on a tiny Llama 3.2 Vision checkpoint with the official `openai` client: two images in
one message (a data URI and a local file), answered as the offline `LLM` answers them, streamed the same;
a system message beside an image is refused with a 400 naming `messages` (the checkpoint's template
raises) and the server keeps serving; its cross-attention K/V is in /v1/stats and back to 0 when idle."""

from __future__ import annotations

import io

import httpx
import openai
import pytest
from openai import OpenAI
from PIL import Image

from mmserve import LLM, SamplingParams
from testkit.conversations import random_image
from tests.e2e.conftest import start_server, stop_server, wait_healthy
from tests.e2e.test_server import data_uri, metric_samples

NUM_TOKENS = 8


@pytest.fixture(scope="module")
def served(all_checkpoints, tmp_path_factory):
    model = str(all_checkpoints["mllama"])
    media = tmp_path_factory.mktemp("media")
    import numpy as np

    rng = np.random.default_rng(11)
    wide, small = random_image(rng, 120, 40), random_image(rng, 30, 30)
    wide.save(media / "wide.png")
    buf = io.BytesIO()
    small.save(buf, "PNG")
    server = start_server(model, tmp_path_factory.mktemp("logs") / "mllama.log", "--allowed-local-media-path",
                          str(media))
    try:
        wait_healthy(server)
        yield server, model, media, buf.getvalue()
    finally:
        stop_server(server)


def _client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_two_images_answer_as_offline_and_stream_the_same(served):
    server, model, media, small_png = served
    content = [{"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": data_uri(small_png)}},
               {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": f"file://{media}/wide.png"}},
               {"type": "text", "text": "please."}]
    client = _client(server)
    reply = client.chat.completions.create(model=server.model, max_tokens=NUM_TOKENS, temperature=0,
                                           messages=[{"role": "user", "content": content}])
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=server.model, max_tokens=NUM_TOKENS, temperature=0, stream=True,
        messages=[{"role": "user", "content": content}]) if chunk.choices)
    offline_content = [content[0], {"type": "image_pil", "image_pil": Image.open(io.BytesIO(small_png))}, content[2],
                       {"type": "image_pil", "image_pil": Image.open(media / "wide.png")}, content[4]]
    llm = LLM(model)
    want = llm.chat([{"role": "user", "content": offline_content}],
                    SamplingParams(temperature=0, max_tokens=NUM_TOKENS), use_tqdm=False)[0]
    assert reply.choices[0].message.content == want.outputs[0].text == streamed
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
    stats = httpx.get(server.url + "/v1/stats", timeout=30).json()
    assert stats["cross_kv_builds"] >= 2 and stats["cross_kv_bytes_used"] == 0
    assert stats["cross_kv_bytes_total"] > 0
    assert metric_samples(server)[("mmserve_cross_kv_builds_total", ())] == stats["cross_kv_builds"]


def test_a_system_message_beside_an_image_is_a_400_and_it_keeps_serving(served):
    server, model, media, small_png = served
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=server.model, max_tokens=NUM_TOKENS, messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(small_png)}},
                                         {"type": "text", "text": "What is it?"}]}])
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == "messages"
    reply = client.chat.completions.create(model=server.model, max_tokens=NUM_TOKENS, temperature=0,
                                           messages=[{"role": "user", "content": "Hello?"}])
    assert reply.choices[0].finish_reason == "length"

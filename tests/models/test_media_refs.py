"""vLLM's media surface through the server, in process: media named by `uuid` alone once seen (and a uuid
never seen refused naming it), offline too, and the video data URL of base64 JPEG frames
(`data:video/jpeg;base64,<JPEG>,<JPEG>,...`) answered as the same frames sent one by one."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def llm(checkpoint_dirs):
    from mmserve import LLM

    return LLM(str(checkpoint_dirs["qwen2_vl"]))


@pytest.fixture(scope="module")
def client(llm):
    from fastapi.testclient import TestClient

    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.entrypoints.openai.media import MediaRules
    from mmserve.entrypoints.openai.server import build_app
    from mmserve.entrypoints.openai.serving import ServerConfig

    app = build_app(AsyncEngine(llm.engine), ServerConfig("m", MediaRules(llm.engine.config.media)))
    with TestClient(app) as test_client:
        yield test_client


def _b64(image: Image.Image, fmt: str) -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return base64.b64encode(buffer.getvalue()).decode()


def _picture(seed: int) -> Image.Image:
    image = Image.new("RGB", (56, 56), (seed * 40 % 256, 90, 200))
    image.paste((255 - seed * 30 % 256, 20, 20), (seed * 5 % 40, 8, seed * 5 % 40 + 14, 30))
    return image


def _ask(client, part: dict) -> dict:
    body = {"model": "m", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]}
    return client.post("/v1/chat/completions", json=body).json()


def _answer(reply: dict) -> tuple:
    assert "choices" in reply, reply
    return reply["choices"][0]["message"]["content"], reply["usage"]["prompt_tokens"]


def test_image_named_by_uuid_alone_once_seen(client):
    uri = "data:image/png;base64," + _b64(_picture(1), "PNG")
    first = _answer(_ask(client, {"type": "image_url", "image_url": {"url": uri}, "uuid": "pic-1"}))
    for part in ({"type": "image_url", "uuid": "pic-1"}, {"type": "image_url", "image_url": None, "uuid": "pic-1"},
                 {"type": "image_url", "image_url": {"url": None}, "uuid": "pic-1"}):
        assert _answer(_ask(client, part)) == first, part
    unknown = _ask(client, {"type": "image_url", "image_url": None, "uuid": "never-sent"})
    assert "never-sent" in unknown["error"]["message"]
    assert unknown["error"]["param"] == "messages[0].content[0].image_url"
    completion = {"model": "m", "max_tokens": 4, "temperature": 0,
                  "prompt": "<|vision_start|><|image_pad|><|vision_end|>What is this?"}
    with_media = client.post("/v1/completions", json={**completion, "media": [
        {"type": "image_url", "image_url": {"url": uri}, "uuid": "pic-1"}]}).json()
    by_uuid = client.post("/v1/completions", json={**completion, "media": [{"type": "image_url", "uuid": "pic-1"}]})
    assert by_uuid.json()["choices"][0]["text"] == with_media["choices"][0]["text"]
    assert by_uuid.json()["usage"]["prompt_tokens"] == with_media["usage"]["prompt_tokens"]
    no_media = _ask(client, {"type": "image_url", "image_url": None})
    assert no_media["error"]["param"] == "messages[0].content[0].image_url"


def test_offline_multi_modal_uuids_name_media_sent_before(llm):
    from mmserve import SamplingParams
    from mmserve.errors import InvalidInputError

    params = SamplingParams(max_tokens=4, temperature=0)
    prompt = "<|vision_start|><|image_pad|><|vision_end|>What is this?"
    sent = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [_picture(2)]},
                         "multi_modal_uuids": {"image": ["offline-pic"]}}, params)[0]
    again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [None]},
                          "multi_modal_uuids": {"image": ["offline-pic"]}}, params)[0]
    assert again.outputs[0].token_ids == sent.outputs[0].token_ids
    assert again.prompt_token_ids == sent.prompt_token_ids
    with pytest.raises(InvalidInputError, match="'other'") as caught:
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": [None]},
                      "multi_modal_uuids": {"image": ["other"]}}, params)
    assert caught.value.param == "multi_modal_data.image[0]"


def test_video_data_url_of_jpeg_frames(client):
    frames = [_picture(k) for k in range(4)]
    jpegs = [_b64(frame, "JPEG") for frame in frames]
    as_url = _answer(_ask(client, {"type": "video_url",
                                   "video_url": {"url": "data:video/jpeg;base64," + ",".join(jpegs)}}))
    one_by_one = _answer(_ask(client, {"type": "video_frames", "video_frames": {
        "urls": ["data:image/jpeg;base64," + j for j in jpegs]}}))
    assert as_url == one_by_one
    assert as_url != _answer(_ask(client, {"type": "video_url", "video_url": {
        "url": "data:video/jpeg;base64," + ",".join(jpegs[:2])}}))  # fewer frames: a shorter prompt
    too_many = _ask(client, {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,"
                                                                + ",".join(jpegs * 100)}})
    assert "400 JPEG frames" in too_many["error"]["message"] and "--max-video-frames" in too_many["error"]["message"]
    assert too_many["error"]["param"] == "messages[0].content[0].video_url"
    broken = _ask(client, {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + jpegs[0] + ",!!"}})
    assert broken["error"]["param"].startswith("messages[0].content[0].video_url"), broken

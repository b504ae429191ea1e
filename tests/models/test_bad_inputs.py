"""Prompt-level bad input: clear InvalidInputError, and the processor keeps working afterwards."""

import numpy as np
import pytest
from PIL import Image

from mmserve import InvalidInputError
from tests.models.helpers import image_part, load_processor, random_image, text_part, user


@pytest.fixture
def processor(checkpoint_dirs):
    return load_processor(checkpoint_dirs["qwen2_vl"])


@pytest.fixture
def img():
    return random_image(np.random.default_rng(0), 56, 56)


def test_more_images_than_placeholders(processor, img):
    prompt = processor.render_chat(user(image_part(img), text_part("hi"))).prompt
    with pytest.raises(InvalidInputError, match=r"1 image placeholder.*but 2 image\(s\) were given"):
        processor.process(prompt, images=[img, img])


def test_more_placeholders_than_images(processor, img):
    prompt = processor.render_chat(user(image_part(img), image_part(img), text_part("hi"))).prompt
    with pytest.raises(InvalidInputError, match=r"2 image placeholder.*but 1 image\(s\) were given"):
        processor.process(prompt, images=[img])


def test_video_placeholder_without_video(processor):
    with pytest.raises(InvalidInputError, match=r"1 video placeholder.*but 0 video"):
        processor.process("<|vision_start|><|video_pad|><|vision_end|>hi")


def test_expanded_run_of_wrong_length_names_both_counts(processor, img):
    good = processor.process(processor.render_chat(user(image_part(img), text_part("hi"))).prompt, images=[img])
    rows = good.items[0].output_rows
    ids = list(good.prompt_token_ids)
    pad = processor.pad_ids["image"]
    start = ids.index(pad)
    broken = ids[:start] + [pad] * (rows - 1) + ids[start + rows:]
    with pytest.raises(InvalidInputError, match=rf"multi_modal_data.image\[0\].*{rows - 1} placeholder positions.*"
                                                rf"{rows} embedding rows") as caught:
        processor.process(prompt_token_ids=broken, images=[img])
    assert caught.value.param == "multi_modal_data.image[0]"


def test_unknown_content_part_type(processor):
    with pytest.raises(InvalidInputError, match=r"messages\[0\].content\[0\].type 'file' is not a supported "
                                                r"content part type") as caught:
        processor.render_chat(user({"type": "file", "file": {"file_id": "x"}}))
    assert caught.value.param == "messages[0].content[0].type"


def test_audio_on_a_model_without_audio(processor):
    with pytest.raises(InvalidInputError, match="this model does not take audios") as caught:
        processor.render_chat(user(text_part("hi"), {"type": "audio_url", "audio_url": {"url": "x"}}))
    assert caught.value.param == "messages[0].content[1].audio_url"


def test_extreme_aspect_ratio(processor):
    wide = Image.new("RGB", (4020, 20))
    prompt = processor.render_chat(user(image_part(wide))).prompt
    with pytest.raises(InvalidInputError, match="aspect ratio"):
        processor.process(prompt, images=[wide])


def test_bad_processor_kwargs(processor, img):
    prompt = processor.render_chat(user(image_part(img))).prompt
    with pytest.raises(InvalidInputError, match="unsupported mm_processor_kwargs"):
        processor.process(prompt, images=[img], mm_processor_kwargs={"resize_mode": "crop"})
    with pytest.raises(InvalidInputError, match="min_pixels <= max_pixels"):
        processor.process(prompt, images=[img], mm_processor_kwargs={"max_pixels": 10})


def test_processor_kwargs_change_processing(processor):
    big = random_image(np.random.default_rng(1), 400, 300)
    prompt = processor.render_chat(user(image_part(big))).prompt
    full = processor.process(prompt, images=[big])
    small = processor.process(prompt, images=[big], mm_processor_kwargs={"max_pixels": 28 * 28 * 16})
    assert small.items[0].output_rows < full.items[0].output_rows
    assert small.items[0].content_hash != full.items[0].content_hash


def test_token_ids_outside_vocab(processor):
    vocab = processor.vocab_size
    with pytest.raises(InvalidInputError, match=rf"prompt: token ids {10**6}, {vocab} are out of vocabulary "
                                                rf"\(size {vocab}\)"):
        processor.process(prompt_token_ids=[1, 10**6, 2, vocab, 10**6])


def test_corrupt_image_in_chat_then_good_request(processor, img):
    prompt = processor.render_chat(user(image_part(img))).prompt
    with pytest.raises(InvalidInputError, match=r"multi_modal_data.image\[0\] could not be decoded") as caught:
        processor.process(prompt, images=[b"\x89PNG\r\n\x1a\n garbage"])
    assert caught.value.param == "multi_modal_data.image[0]"
    assert processor.process(prompt, images=[img]).items[0].output_rows == 4


@pytest.mark.parametrize("kwargs, param", [({"min_pixels": 2**40}, "mm_processor_kwargs.min_pixels"),
                                           ({"max_pixels": 10**300}, "mm_processor_kwargs.max_pixels"),
                                           ({"max_pixels": "many"}, "mm_processor_kwargs.max_pixels"),
                                           ({"sharpen": 1}, "mm_processor_kwargs.sharpen"),
                                           ({"fps": -1}, "mm_processor_kwargs.fps")])
def test_processor_kwargs_are_checked_against_the_limits_before_anything_is_resized(processor, img, kwargs, param):
    """An absurd pixel count would allocate terabytes: it is refused first, naming the key."""
    prompt = processor.render_chat(user(image_part(img), text_part("hi"))).prompt
    with pytest.raises(InvalidInputError) as caught:
        processor.process(prompt, images=[img], mm_processor_kwargs=kwargs)
    assert caught.value.param == param


def test_text_that_is_not_unicode_is_refused_naming_the_field(processor):
    with pytest.raises(InvalidInputError, match="not valid Unicode") as caught:
        processor.render_chat([{"role": "user", "content": [text_part("fine"), text_part("lone \ud800")]}])
    assert caught.value.param == "messages[0].content[1].text"


def test_the_server_answers_400_naming_the_field(checkpoint_dirs):
    import json

    from fastapi.testclient import TestClient

    from mmserve import LLM
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.entrypoints.openai.media import MediaRules
    from mmserve.entrypoints.openai.server import build_app
    from mmserve.entrypoints.openai.serving import ServerConfig

    llm = LLM(str(checkpoint_dirs["qwen2_vl"]))
    app = build_app(AsyncEngine(llm.engine), ServerConfig("m", MediaRules(llm.engine.config.media)))
    with TestClient(app) as client:
        surrogate = '{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "a \\ud800"}]}'
        reply = client.post("/v1/chat/completions", content=surrogate, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[0].content", reply.text
        body = {"model": "m", "max_tokens": 2, "mm_processor_kwargs": {"min_pixels": 2**40},
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": _png_uri()}}, {"type": "text", "text": "hi"}]}]}
        reply = client.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "mm_processor_kwargs.min_pixels"
        ok = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
    llm.check_integrity()


def _png_uri() -> str:
    import base64
    import io

    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 200, 90)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

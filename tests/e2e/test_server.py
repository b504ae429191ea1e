"""`mmserve serve` end to end: a real server subprocess, the official `openai` client (raw httpx
where the exact wire format is the point), the tiny random checkpoint.

The model is random, so answers are checked for protocol behaviour, token counts and determinism
(the server's greedy output equals the offline `LLM`'s for the same messages), not correctness.
Two servers start once for the module: `server` (loopback media URLs allowed, a local media root,
small limits) and `strict` (default media safety, an API key, logprob tokens named by id, X-Request-Id).
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
from openai import OpenAI
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from mmserve import LLM, ModelLoadError, SamplingParams, VideoFrames
from mmserve.demo.video import encode_video, moving_shapes
from mmserve.inputs.video import decode_video
from tests.e2e.conftest import file_server, start_server, stop_server, wait_healthy

API_KEY = "test-secret"
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def png_bytes(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def mp4_bytes(num_frames: int = 12, fps: int = 6) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(num_frames):
            frame = np.full((48, 64, 3), (20 * i) % 255, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_message(url: str, text: str = "What color is it?", **extra) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}, **extra},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "red.png").write_bytes(png_bytes((220, 20, 20)))
    (root / "clip.mp4").write_bytes(mp4_bytes())
    return root


@pytest.fixture(scope="module")
def servers(checkpoint_dirs, media_dir, tmp_path_factory):
    model = str(checkpoint_dirs["qwen2_vl"])
    logs = tmp_path_factory.mktemp("logs")
    main = start_server(model, logs / "main.log", "--allow-private-media-urls", "--allowed-local-media-path",
                        str(media_dir), "--limit-mm-per-prompt", "image=2,video=1", "--max-image-pixels", "1000000",
                        "--max-video-frames", "4", "--num-kv-blocks", "256", "--max-request-bytes", "3000000")
    strict = start_server(model, logs / "strict.log", "--num-kv-blocks", "64", "--return-tokens-as-token-ids",
                          "--enable-request-id-headers", "--enable-tokenizer-info-endpoint", api_key=API_KEY)
    # the bundled demo model: its chat template renders tools
    demo = start_server(None, logs / "demo.log", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                        "--num-kv-blocks", "128")
    try:
        for started in (main, strict, demo):
            wait_healthy(started)
        yield {"main": main, "strict": strict, "demo": demo}
    finally:
        for started in (main, strict, demo):
            stop_server(started)


@pytest.fixture(scope="module")
def server(servers):
    return servers["main"]


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(server):
    return LLM(server.model, num_kv_blocks=256)


@pytest.fixture(scope="module")
def files(media_dir):
    with file_server(media_dir) as base:
        yield base


def greedy_chat(client, server, messages, max_tokens=8, **kwargs):
    return client.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens,
                                          temperature=0, **kwargs)


def stats(server) -> dict:
    return httpx.get(server.url + "/v1/stats", timeout=10).json()


def metric_samples(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ---- the happy path ----------------------------------------------------------------------------------
def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [server.model]


def test_chat_matches_offline_llm(server, client, llm):
    messages = image_message(data_uri(png_bytes((220, 20, 20))))
    response = greedy_chat(client, server, messages, max_tokens=12)
    offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == offline.outputs[0].text
    assert choice.finish_reason == offline.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert response.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streaming_chat_equals_non_streaming(server, client):
    messages = image_message(data_uri(png_bytes((20, 220, 20))), "Describe the image.")
    whole = greedy_chat(client, server, messages, max_tokens=10)
    chunks = list(greedy_chat(client, server, messages, max_tokens=10, stream=True,
                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_twenty_concurrent_clients(server, llm):
    def ask(i: int):
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = image_message(data_uri(png_bytes((10 * i, 255 - 10 * i, 90))), f"Question {i}?")
        response = greedy_chat(client, server, messages, max_tokens=4, extra_body={"min_tokens": 4})
        return messages, response

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(ask, range(20)))
    assert len(results) == 20
    for messages, response in results:
        assert response.usage.completion_tokens == 4
        assert response.usage.prompt_tokens == llm.engine.process_chat(messages).num_tokens
        assert response.choices[0].finish_reason == "length"


def test_text_completion_with_media_matches_offline(server, client, llm):
    image = png_bytes((30, 30, 200))
    prompt = f"{PLACEHOLDER}What is this?"
    response = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"media": [{"type": "image_url",
                                                                "image_url": {"url": data_uri(image)}}]})
    offline = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}},
                           SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert response.choices[0].text == offline.outputs[0].text
    assert response.usage.prompt_tokens == len(offline.prompt_token_ids)
    streamed = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0,
                                         stream=True, extra_body={"media": [{"type": "image_url",
                                                                             "image_url": {"url": data_uri(image)}}]})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == offline.outputs[0].text


def test_media_from_urls_and_local_paths(server, client, media_dir, files):
    """An image fetched over http (directly and through a redirect) or read from the allowed local
    root is the very same input as its data URI: same greedy answer, same token counts."""
    reference = greedy_chat(client, server, image_message(data_uri((media_dir / "red.png").read_bytes())))
    for url in (f"{files}/red.png", f"{files}/redirect?to=/red.png", str(media_dir / "red.png"),
                f"file://{media_dir / 'red.png'}"):
        response = greedy_chat(client, server, image_message(url))
        assert response.choices[0].message.content == reference.choices[0].message.content, url
        assert response.usage.prompt_tokens == reference.usage.prompt_tokens


def test_video_url_from_file_server_and_data_uri(server, client, media_dir, files):
    def video_chat(url: str):
        messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                 {"type": "text", "text": "Describe the video."}]}]
        return greedy_chat(client, server, messages, max_tokens=6)

    over_http = video_chat(f"{files}/clip.mp4")
    inline = video_chat(data_uri((media_dir / "clip.mp4").read_bytes(), "video/mp4"))
    assert over_http.choices[0].message.content == inline.choices[0].message.content
    assert over_http.usage.prompt_tokens == inline.usage.prompt_tokens > 20


# ---- streaming video: a growing video encodes only its new frames -------------------------------------
def _video_question(part: dict) -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": "What is happening now?"}]}]


def _png_uri(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return data_uri(buf.getvalue())


def _new_frame_tokens(llm, frames, num_old_frames: int) -> int:
    """Encoder tokens of the temporal groups (two frames each) past the first `num_old_frames` frames."""
    items = llm.engine.process_chat(_video_question({"type": "video_frames",
                                                     "video_frames": {"frames": frames, "fps": 2}})).items
    return sum(i.encoder_tokens for i in items if i.part >= num_old_frames // 2)


def test_video_frames_part_streams(server, client, llm):
    """A video sent as its frames (the `video_frames` part) grows by two frames: the server encodes only
    those and reuses the KV of the old ones; its answers equal the offline LLM's (chat and generate)."""
    frames = moving_shapes(4, fps=2.0, seed=5, width=64, height=48)
    answers = []
    for count in (2, 4):
        part = {"type": "video_frames", "video_frames": {"urls": [_png_uri(f) for f in frames[:count]], "fps": 2}}
        before = stats(server)
        answers.append(greedy_chat(client, server, _video_question(part), max_tokens=6))
        after = stats(server)
        if count == 4:
            assert after["encoder_tokens_encoded"] - before["encoder_tokens_encoded"] == \
                _new_frame_tokens(llm, frames[:4], 2)
            assert after["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    for count, answer in zip((2, 4), answers, strict=True):
        offline = llm.chat(_video_question({"type": "video_frames",
                                            "video_frames": {"frames": frames[:count], "fps": 2}}),
                           greedy, use_tqdm=False)[0]
        assert answer.choices[0].message.content == offline.outputs[0].text
        assert answer.usage.prompt_tokens == len(offline.prompt_token_ids)
        chat = llm.engine.processor.render_chat(_video_question({"type": "video"}))
        generated = llm.generate({"prompt": chat.prompt,
                                  "multi_modal_data": {"video": VideoFrames(frames[:count], fps=2)}},
                                 greedy, use_tqdm=False)[0]
        assert generated.outputs[0].token_ids == offline.outputs[0].token_ids


def test_growing_video_file_reuses_its_sampled_frames(server, client, llm, media_dir):
    """A video file that grows between requests, sampled at 2 fps from t=0: the frames it had keep
    their place, so the second request encodes only the new second's frames."""
    clip = moving_shapes(20, fps=10.0, seed=6, width=64, height=48)
    path = media_dir / "growing.mp4"
    part = {"type": "video_url", "video_url": {"url": str(path)}}
    answers = []
    for seconds in (1, 2):
        path.write_bytes(encode_video(clip[:seconds * 10], 10))
        before = stats(server)
        answers.append(greedy_chat(client, server, _video_question(part), max_tokens=6))
        after = stats(server)
        frames = decode_video(path.read_bytes(), 2.0, 4, 10**6, sampling="fps")
        assert len(frames) == 2 * seconds
        if seconds == 2:
            assert after["encoder_tokens_encoded"] - before["encoder_tokens_encoded"] == \
                _new_frame_tokens(llm, frames, 2)
            assert after["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
        offline = llm.chat(_video_question({"type": "video", "video": frames}),
                           SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
        assert answers[-1].choices[0].message.content == offline.outputs[0].text


def test_mm_processor_kwargs_change_the_prompt(server, client):
    messages = image_message(data_uri(png_bytes((200, 200, 20), size=(224, 224))))
    full = greedy_chat(client, server, messages, max_tokens=1)
    small = greedy_chat(client, server, messages, max_tokens=1,
                        extra_body={"mm_processor_kwargs": {"max_pixels": 56 * 56}})
    assert small.usage.prompt_tokens < full.usage.prompt_tokens


# ---- bad input: an error JSON, then the server serves on -----------------------------------------------
def _chat_body(content, **extra) -> dict:
    return {"model": None, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


BAD_REQUESTS = {
    "malformed_json": (b'{"model": "x", "messages": [', 400, "not valid JSON"),
    "messages_not_a_list": ({"messages": "hi"}, 400, "messages"),
    "unknown_part_type": (_chat_body([{"type": "file", "file": {"file_id": "x"}}]), 400,
                          "content[0].type 'file' is not a supported content part type"),
    "audio_without_audio": (_chat_body([{"type": "input_audio",
                                         "input_audio": {"data": "AAAA", "format": "wav"}}]),
                            400, "this model does not take audios"),
    "corrupt_base64": (_chat_body([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]),
                       400, "invalid base64"),
    "undecodable_image": (_chat_body([{"type": "image_url", "image_url": {"url": data_uri(b"not a png")}}]), 400,
                          "could not be decoded"),
    "undecodable_video": (_chat_body([{"type": "video_url", "video_url": {"url": data_uri(b"nope" * 50,
                                                                                        "video/mp4")}}]),
                          400, "could not be decoded"),
    "path_outside_root": (_chat_body([{"type": "image_url", "image_url": {"url": "/etc/hostname"}}]), 400,
                          "outside the allowed media directory (--allowed-local-media-path)"),
    "role_not_a_string": ({**_chat_body("hi"), "messages": [{"role": 7, "content": "hi"}]}, 400,
                          "messages[0].role must be a non-empty string"),
    "message_without_role": ({**_chat_body("hi"), "messages": [{"content": "hi"}]}, 400, "must be an object with a"),
    "empty_messages": ({**_chat_body("hi"), "messages": []}, 400, "messages must not be empty"),
    "second_part_is_bad": (_chat_body([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {
        "url": data_uri(b"not a png")}}]), 400, "messages[0].content[1].image_url could not be decoded"),
    "too_many_images": (_chat_body([{"type": "image_url", "image_url": {"url": data_uri(png_bytes((1, 2, 3)))}}] * 3),
                        400, "at most 2 image"),
    "image_too_large": (_chat_body([{"type": "image_url",
                                     "image_url": {"url": data_uri(png_bytes((9, 9, 9), (1200, 1000)))}}]),
                        400, "over the limit"),
    "unknown_model": ({**_chat_body("hi"), "model": "no-such-model"}, 404, "does not exist"),
    "max_tokens_beyond_context": ({**_chat_body("hi"), "max_tokens": 10**6}, 400, "maximum context length"),
    "n_zero": ({**_chat_body("hi"), "n": 0}, 400, "n must be an integer in [1, 128]"),
    "tools": ({**_chat_body("hi"), "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
              "chat template renders no tools"),
    "tool_choice_without_tools": ({**_chat_body("hi"), "tool_choice": "required"}, 400, "tool_choice needs tools"),
    "invalid_json_schema": ({**_chat_body("hi"), "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, 400,
        "response_format json does not compile"),
    "unknown_response_format": ({**_chat_body("hi"), "response_format": {"type": "yaml"}}, 400,
                                "response_format type must be text, json_object or json_schema"),
    "presence_penalty": ({**_chat_body("hi"), "presence_penalty": 2.5}, 400, "presence_penalty must be a number in"),
    "repetition_penalty": ({**_chat_body("hi"), "repetition_penalty": 0}, 400, "repetition_penalty must be a"),
    "logit_bias": ({**_chat_body("hi"), "logit_bias": {"five": 10}}, 400, "logit_bias keys must be token ids"),
    "logit_bias_value": ({**_chat_body("hi"), "logit_bias": {"5": 200}}, 400, "logit_bias values must be numbers"),
    "logit_bias_outside_vocab": ({**_chat_body("hi"), "logit_bias": {"99999999": 1, "5": 1, "99999998": 1}}, 400,
                                 "logit_bias: token ids 99999999, 99999998 are out of vocabulary (size "),
    "allowed_token_ids_empty": ({**_chat_body("hi"), "allowed_token_ids": []}, 400, "allowed_token_ids must be"),
    "bad_words_blank": ({**_chat_body("hi"), "bad_words": [" "]}, 400, "bad_words must be non-empty strings"),
    "top_logprobs_without_logprobs": ({**_chat_body("hi"), "top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    "top_logprobs_too_many": ({**_chat_body("hi"), "logprobs": True, "top_logprobs": 21}, 400,
                              "top_logprobs must be an integer in [0, 20]"),
    "best_of": ({**_chat_body("hi"), "best_of": 2}, 400, "ask for n choices instead"),
    "prompt_logprobs_streamed": ({**_chat_body("hi"), "prompt_logprobs": 1, "stream": True}, 400,
                                 "prompt_logprobs are not available when stream is true"),
    "prompt_logprobs_too_many": ({**_chat_body("hi"), "prompt_logprobs": 30}, 400, "prompt_logprobs must be"),
    "invalid_regex": ({**_chat_body("hi"), "structured_outputs": {"regex": "(unclosed"}}, 400,
                      "structured_outputs regex does not compile"),
    "structured_outputs_unknown_key": ({**_chat_body("hi"), "structured_outputs": {"yaml": "x"}}, 400,
                                       "structured_outputs has unknown keys"),
    "two_constraints": ({**_chat_body("hi"), "guided_choice": ["a"], "response_format": {"type": "json_object"}},
                        400, "each constrains the output"),
    "guided_choice_empty": ({**_chat_body("hi"), "guided_choice": []}, 400, "guided_choice choice must be"),
    "cache_salt": ({**_chat_body("hi"), "cache_salt": ""}, 400, "cache_salt must be a non-empty string"),
    "stream_options_without_stream": ({**_chat_body("hi"), "stream_options": {"include_usage": True}}, 400,
                                      "stream_options needs stream set to true"),
    "seed_beyond_int64": ({**_chat_body("hi"), "seed": 2**63}, 400, "seed must be a 64-bit signed integer"),
    "stop_token_ids_outside_vocab": ({**_chat_body("hi"), "stop_token_ids": [10**8]}, 400,
                                     f"stop_token_ids: token id {10**8} is out of vocabulary (size "),
    "image_url_as_a_string": (_chat_body([{"type": "image_url", "image_url": data_uri(png_bytes((1, 2, 3)))}]), 400,
                              "needs {'image_url': {'url'"),
    "continue_and_generation_prompt": ({**_chat_body("hi"), "continue_final_message": True}, 400,
                                       "continue_final_message and add_generation_prompt"),
    "video_frames_without_urls": (_chat_body([{"type": "video_frames", "video_frames": {"fps": 2}}]), 400,
                                  "needs {'video_frames': {'urls'"),
    "video_frames_over_the_limit": (_chat_body([{"type": "video_frames", "video_frames": {
        "urls": [data_uri(png_bytes((1, 2, 3)))] * 5}}]), 400, "over the limit of 4"),
    "video_frames_bad_fps": (_chat_body([{"type": "video_frames", "video_frames": {
        "urls": [data_uri(png_bytes((1, 2, 3)))], "fps": 0}}]), 400, "fps must be a positive number"),
    "video_frames_bad_frame": (_chat_body([{"type": "video_frames", "video_frames": {
        "urls": [data_uri(b"not a png")]}}]), 400, "could not be decoded"),
    "unknown_video_sampling": ({**_chat_body([{"type": "video_url", "video_url": {"url": data_uri(
        b"x", "video/mp4")}}]), "mm_processor_kwargs": {"video_sampling": "later"}}, 400, "video_sampling"),
    "bad_temperature": ({**_chat_body("hi"), "temperature": -1}, 400, "temperature"),
    "bad_stop": ({**_chat_body("hi"), "stop": ["ok", ""]}, 400, "stop must not contain empty strings"),
}
PART = "messages[0].content[0]"
# the field each 4xx names in `param`: every one whose request has a field at fault (a body that is not
# JSON has none)
BAD_REQUEST_PARAMS = {
    "malformed_json": None, "messages_not_a_list": "messages", "unknown_part_type": f"{PART}.type",
    "corrupt_base64": f"{PART}.image_url", "undecodable_image": f"{PART}.image_url",
    "undecodable_video": f"{PART}.video_url", "path_outside_root": f"{PART}.image_url",
    "role_not_a_string": "messages[0].role", "message_without_role": "messages[0]", "empty_messages": "messages",
    "second_part_is_bad": "messages[0].content[1].image_url",
    "too_many_images": "messages[0].content[2].image_url", "image_too_large": f"{PART}.image_url",
    "unknown_model": "model", "max_tokens_beyond_context": "max_tokens", "n_zero": "n", "tools": "tools", "tool_choice_without_tools": "tool_choice",
    "invalid_json_schema": "response_format", "unknown_response_format": "response_format",
    "invalid_regex": "structured_outputs", "structured_outputs_unknown_key": "structured_outputs",
    "two_constraints": "guided_choice", "guided_choice_empty": "guided_choice", "presence_penalty": "presence_penalty", "logit_bias": "logit_bias",
    "repetition_penalty": "repetition_penalty", "logit_bias_value": "logit_bias",
    "logit_bias_outside_vocab": "logit_bias", "allowed_token_ids_empty": "allowed_token_ids",
    "bad_words_blank": "bad_words", "top_logprobs_without_logprobs": "top_logprobs",
    "top_logprobs_too_many": "top_logprobs", "best_of": "best_of", "prompt_logprobs_streamed": "prompt_logprobs",
    "prompt_logprobs_too_many": "prompt_logprobs", "cache_salt": "cache_salt", "stream_options_without_stream": "stream_options",
    "seed_beyond_int64": "seed", "stop_token_ids_outside_vocab": "stop_token_ids",
    "image_url_as_a_string": f"{PART}.image_url", "continue_and_generation_prompt": "continue_final_message",
    "video_frames_without_urls": f"{PART}.video_frames", "video_frames_over_the_limit": f"{PART}.video_frames.urls",
    "video_frames_bad_fps": f"{PART}.video_frames.fps", "video_frames_bad_frame": f"{PART}.video_frames",
    "unknown_video_sampling": "mm_processor_kwargs.video_sampling", "bad_temperature": "temperature",
    "bad_stop": "stop", "audio_without_audio": f"{PART}.input_audio",
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_error_json_and_server_serves_on(server, case):
    body, status, needle = BAD_REQUESTS[case]
    if isinstance(body, dict):
        body = json.dumps({**body, "model": body.get("model") or server.model}).encode()
    response = httpx.post(server.url + "/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"], error["message"]
    assert error["param"] == BAD_REQUEST_PARAMS[case], error
    assert httpx.get(server.url + "/health").status_code == 200


def test_request_body_limit(server, client):
    """A body over --max-request-bytes gets 413 with OpenAI's error JSON: by its Content-Length before it
    is read, or while a chunked one arrives; a chunked body within the limit is served."""
    big = json.dumps({**_chat_body("x" * 3_100_000), "model": server.model}).encode()
    response = httpx.post(server.url + "/v1/chat/completions", content=big,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"
    assert "3000000" in response.json()["error"]["message"]

    def chunks(body: bytes):
        for i in range(0, len(body), 65536):
            yield body[i:i + 65536]

    response = httpx.post(server.url + "/v1/chat/completions", content=chunks(big),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413 and "content-length" not in response.request.headers
    small = json.dumps({**_chat_body("hi"), "model": server.model}).encode()
    response = httpx.post(server.url + "/v1/chat/completions", content=chunks(small),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 200, response.text
    assert greedy_chat(client, server, image_message(data_uri(png_bytes((5, 6, 7)))), max_tokens=2).choices


def test_neutral_values_of_unsupported_fields_are_accepted(server, client):
    """What clients send by default (a user id, no tools, plain text, zero penalties) changes nothing."""
    reply = greedy_chat(client, server, image_message(data_uri(png_bytes((9, 8, 7)))), max_tokens=2, user="u-1",
                        presence_penalty=0, frequency_penalty=0.0, response_format={"type": "text"}, logprobs=False)
    assert reply.usage.completion_tokens == 2 and reply.choices[0].logprobs is None


# ---- the sampling surface ------------------------------------------------------------------------------
def _offline_entries(llm, messages, **params):
    out = llm.chat(messages, SamplingParams(temperature=0, **params), use_tqdm=False)[0].outputs[0]
    return out


def test_chat_logprobs_are_the_offline_ones(server, client, llm):
    """logprobs + top_logprobs: one entry per completion token, each the offline engine's value, the top
    ones in rank order with their bytes; streamed, the chunks' entries join into the same list."""
    messages = image_message(data_uri(png_bytes((200, 120, 20))), "Describe the image.")
    whole = greedy_chat(client, server, messages, max_tokens=8, logprobs=True, top_logprobs=3)
    offline = _offline_entries(llm, messages, max_tokens=8, logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == len(offline.token_ids)
    for entry, token_id, ours in zip(content, offline.token_ids, offline.logprobs):
        assert entry.token == ours[token_id].decoded_token
        assert entry.logprob == pytest.approx(ours[token_id].logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        ranked = sorted((lp for lp in ours.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [t.token for t in entry.top_logprobs] == [lp.decoded_token for lp in ranked]
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    chunks = list(greedy_chat(client, server, messages, max_tokens=8, logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_legacy_shape(server, client, llm):
    """Completions: logprobs=2 gives tokens, token_logprobs, top_logprobs (the 2 best and the sampled one)
    and text offsets; logprobs=0 still gives the sampled tokens' logprobs; streamed alike."""
    for k in (2, 0):
        response = client.completions.create(model=server.model, prompt="Count to five:", max_tokens=6,
                                             temperature=0, logprobs=k)
        offline = llm.generate(["Count to five:"], SamplingParams(temperature=0, max_tokens=6, logprobs=k),
                               use_tqdm=False)[0].outputs[0]
        logprobs = response.choices[0].logprobs
        assert len(logprobs.tokens) == len(offline.token_ids) == response.usage.completion_tokens
        assert logprobs.token_logprobs == pytest.approx([e[t].logprob for e, t in zip(offline.logprobs,
                                                                                     offline.token_ids)], abs=1e-5)
        for token, top in zip(logprobs.tokens, logprobs.top_logprobs):
            assert token in top and len(top) <= k + 1
        assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    stream = client.completions.create(model=server.model, prompt="Count to five:", max_tokens=6, temperature=0,
                                       logprobs=2, stream=True)
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    whole = client.completions.create(model=server.model, prompt="Count to five:", max_tokens=6, temperature=0,
                                      logprobs=2).choices[0].logprobs
    assert [t for lp in streamed for t in lp.tokens] == whole.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.text_offset


def test_penalties_bias_and_masks_are_the_offline_ones(server, client, llm):
    """The server's fields reach the engine as offline SamplingParams do (logit_bias keys are strings)."""
    messages = image_message(data_uri(png_bytes((30, 60, 200))), "Describe the image.")
    plain = _offline_entries(llm, messages, max_tokens=8).token_ids
    fields = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3,
              "logit_bias": {str(plain[0]): -100}, "allowed_token_ids": sorted(set(plain) | {1, 2, 3}),
              "bad_words": ["the"]}
    reply = greedy_chat(client, server, messages, max_tokens=8, logprobs=True,
                        extra_body={k: v for k, v in fields.items() if k not in ("frequency_penalty",
                                                                                   "presence_penalty", "logit_bias")},
                        frequency_penalty=1.5, presence_penalty=0.5, logit_bias={str(plain[0]): -100})
    offline = _offline_entries(llm, messages, max_tokens=8, logprobs=0,
                               **{**fields, "logit_bias": {plain[0]: -100.0}})
    assert [e.token for e in reply.choices[0].logprobs.content] == [
        e[t].decoded_token for e, t in zip(offline.logprobs, offline.token_ids)]
    assert offline.token_ids[0] != plain[0]


def test_openai_client_error_types(server, client):
    """The official client maps our error responses onto its own error types, with our message."""
    import openai

    with pytest.raises(openai.BadRequestError, match="chat template renders no tools"):
        greedy_chat(client, server, image_message(data_uri(png_bytes((1, 1, 1)))), max_tokens=2,
                    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        greedy_chat(client, server, [{"role": "user", "content": "hi"}], max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.APIStatusError) as too_large:
        greedy_chat(client, server, [{"role": "user", "content": "x" * 3_100_000}], max_tokens=2)
    assert too_large.value.status_code == 413 and "--max-request-bytes" in too_large.value.message


def test_good_request_after_bad_ones(server, client):
    response = greedy_chat(client, server, image_message(data_uri(png_bytes((5, 5, 5)))), max_tokens=2)
    assert response.usage.completion_tokens >= 1


def test_private_urls_refused_by_default(servers, files):
    strict = servers["strict"]
    client = OpenAI(base_url=strict.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(Exception) as info:
        greedy_chat(client, strict, image_message(f"{files}/red.png"))
    assert getattr(info.value, "status_code", None) == 400
    assert "private, loopback or link-local" in str(info.value)
    assert httpx.get(strict.url + "/health").status_code == 200


def test_api_key_enforced(servers):
    strict = servers["strict"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(strict.url + "/v1/models", headers=headers)
        assert response.status_code == 401
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    client = OpenAI(base_url=strict.url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [strict.model]
    assert httpx.get(strict.url + "/health").status_code == 200  # not a /v1 route
    assert httpx.get(strict.url + "/metrics").status_code == 200


# ---- metrics and disconnects ---------------------------------------------------------------------------
def test_metrics_move_with_a_cached_image(server, client):
    before = metric_samples(server)
    messages = image_message(data_uri(png_bytes((123, 45, 67))))
    for _ in range(2):
        greedy_chat(client, server, messages, max_tokens=3, extra_body={"min_tokens": 3})
    after = metric_samples(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("mmserve_requests_total", finish_reason="length") == 2
    assert delta("mmserve_encoder_items_encoded_total") == 1  # the second request reuses the first's output
    assert delta("mmserve_encoder_cache_misses_total") == 1
    assert delta("mmserve_encoder_cache_hits_total") >= 1
    assert delta("mmserve_prefix_cache_hit_tokens_total") > 0
    assert delta("mmserve_generation_tokens_total") == 6
    assert delta("mmserve_time_to_first_token_seconds_count") == 2
    assert delta("mmserve_time_per_output_token_seconds_count") == 2
    assert ("mmserve_kv_blocks_in_use", ()) in after and ("mmserve_requests_running", ()) in after


def _wait_idle(server, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        current = stats(server)
        idle = current["requests_running"] == 0 and current["requests_waiting"] == 0
        if idle and current["kv_blocks_free"] == current["kv_blocks_total"] or time.monotonic() > deadline:
            return current
        time.sleep(0.1)


def _long_request(server, stream: bool) -> dict:
    return {"model": server.model, "messages": image_message(data_uri(png_bytes((77, 77, 7)))),
            "max_tokens": 1500, "min_tokens": 1500, "stream": stream}


def test_disconnect_mid_stream_frees_everything(server):
    aborted_before = metric_samples(server).get(("mmserve_requests_total", (("finish_reason", "abort"),)), 0.0)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=_long_request(server, True),
                      timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for _, line in zip(range(6), lines)]
        assert any(line.startswith("data: ") for line in received)
    final = _wait_idle(server)
    assert final["kv_blocks_free"] == final["kv_blocks_total"], final
    assert final["encoder_cache_bytes_used"] <= final["encoder_cache_bytes_total"]
    aborted = metric_samples(server)[("mmserve_requests_total", (("finish_reason", "abort"),))]
    assert aborted == aborted_before + 1


def test_disconnect_while_waiting_for_a_whole_answer(server):
    aborted_before = metric_samples(server).get(("mmserve_requests_total", (("finish_reason", "abort"),)), 0.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=_long_request(server, False), timeout=1.0)
    final = _wait_idle(server)
    assert final["kv_blocks_free"] == final["kv_blocks_total"], final
    assert final["requests_running"] == 0
    aborted = metric_samples(server)[("mmserve_requests_total", (("finish_reason", "abort"),))]
    assert aborted == aborted_before + 1


# ---- the command line ----------------------------------------------------------------------------------
def test_chat_command_streams_answers_and_attaches_images(server, media_dir):
    script = f"/image {media_dir / 'red.png'}\nWhat color is it?\n/image /no/such.png\n/clear\nhi\n/quit\n"
    result = subprocess.run([sys.executable, "-m", "mmserve.entrypoints.cli", "chat", server.model,
                             "--max-tokens", "4", "--num-kv-blocks", "64"], input=script, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "attached red.png" in result.stderr and "no such file" in result.stderr
    assert result.stdout.count("assistant> ") == 2


def test_model_defaults_to_the_bundled_demo_model(monkeypatch, tmp_path):
    from mmserve import config

    assert config.resolve_model(None) == str(config.DEMO_MODEL_DIR)
    assert (config.DEMO_MODEL_DIR / "config.json").is_file()
    monkeypatch.setattr(config, "DEMO_MODEL_DIR", tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="no model given and the bundled demo model is not installed"):
        config.resolve_model(None)


def test_n_choices_whole_and_streamed(server, client, llm):
    """n=3 with a seed: three choices (index 0..2), each the offline engine's choice; usage counts every
    choice's tokens; streamed, each choice's chunks carry its index, open with its role and end with its
    finish reason, and join into the same texts."""
    messages = image_message(data_uri(png_bytes((90, 200, 90))), "Describe the image.")
    kwargs = dict(model=server.model, messages=messages, max_tokens=8, temperature=0.9, seed=21, n=3)
    whole = client.chat.completions.create(**kwargs)
    offline = llm.chat(messages, SamplingParams(n=3, temperature=0.9, seed=21, max_tokens=8), use_tqdm=False)[0]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == [o.text for o in offline.outputs]
    assert whole.usage.completion_tokens == sum(len(o.token_ids) for o in offline.outputs)
    texts, roles, finishes = {}, {}, {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            roles.setdefault(choice.index, choice.delta.role)
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [finishes[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    completions = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=5, n=2,
                                            temperature=0, logprobs=1)
    assert [c.index for c in completions.choices] == [0, 1]
    assert completions.choices[0].text == completions.choices[1].text
    assert completions.choices[1].logprobs.token_logprobs == completions.choices[0].logprobs.token_logprobs


def test_prompt_logprobs_and_echo(server, client, llm):
    """vLLM's prompt_logprobs (first entry null) are the offline engine's; completions' echo puts the
    prompt before the completion, and with logprobs its tokens first (the first without a logprob),
    streamed alike."""
    messages = image_message(data_uri(png_bytes((10, 10, 240))), "What is it?")
    reply = greedy_chat(client, server, messages, max_tokens=3, extra_body={"prompt_logprobs": 2})
    offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2), use_tqdm=False)[0]
    served = reply.model_extra["prompt_logprobs"]
    assert served[0] is None and len(served) == len(offline.prompt_token_ids) == reply.usage.prompt_tokens
    for entry, ours, token_id in list(zip(served, offline.prompt_logprobs, offline.prompt_token_ids))[1:]:
        assert entry[str(token_id)]["logprob"] == pytest.approx(ours[token_id].logprob, abs=1e-5)
    prompt = "The sky is"
    plain = client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                       logprobs=1)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    logprobs = echoed.choices[0].logprobs
    num_prompt = echoed.usage.prompt_tokens
    assert len(logprobs.tokens) == num_prompt + echoed.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    offline = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1),
                           use_tqdm=False)[0]
    assert logprobs.token_logprobs[1:num_prompt] == pytest.approx(
        [e[t].logprob for e, t in zip(offline.prompt_logprobs[1:], offline.prompt_token_ids[1:])], abs=1e-5)
    stream = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0,
                                            echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text
    assert [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == \
        logprobs.tokens


def test_request_conformance(server, client, llm):
    """An empty model name means the served model; unsupported values say `unsupported_parameter`;
    continue_final_message continues the last message; continuous_usage_stats puts the usage so far in
    every chunk."""
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["model"] == server.model
    refused = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": server.model, "prompt": "hi", "suffix": "x", "max_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_parameter"
    messages = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two"}]
    continued = greedy_chat(client, server, messages, max_tokens=4,
                            extra_body={"continue_final_message": True, "add_generation_prompt": False})
    offline_prompt = llm.engine.process_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert continued.usage.prompt_tokens == len(offline_prompt.prompt_token_ids)
    rendered = llm.engine.processor.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert rendered.prompt.endswith("One, two")
    cut = client.completions.create(model=server.model, prompt="one two three four five six seven eight nine",
                                    max_tokens=2, temperature=0, extra_body={"truncate_prompt_tokens": 4})
    assert cut.usage.prompt_tokens == 4
    for keep, messages in ((3, image_message(data_uri(png_bytes((3, 3, 3))))), (0, [{"role": "user", "content": "x"}])):
        refused = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": server.model, "messages": messages, "max_tokens": 2, "truncate_prompt_tokens": keep})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"
    long = [{"role": "user", "content": "Please read this shared context carefully. " * 8}]

    def cached(salt):
        return greedy_chat(client, server, long, max_tokens=1,
                           extra_body={"cache_salt": salt}).usage.prompt_tokens_details.cached_tokens
    assert cached("team-a") == 0 and cached("team-a") > 0 and cached("team-b") == 0
    chunks = list(greedy_chat(client, server, [{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
                              stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counted and counted == sorted(counted) and chunks[-1].usage.completion_tokens == counted[-1]


def test_tokenize_and_detokenize(server, llm):
    """/tokenize gives the ids the generation routes run (a chat's pictures expanded to their rows);
    /detokenize turns ids back into text; /version answers."""
    messages = image_message(data_uri(png_bytes((70, 70, 70))))
    chat = httpx.post(server.url + "/tokenize", json={"model": server.model, "messages": messages}, timeout=60)
    assert chat.status_code == 200, chat.text
    expected = llm.engine.process_chat(messages).prompt_token_ids
    body = chat.json()
    assert body["tokens"] == list(expected) and body["count"] == len(expected)
    assert body["max_model_len"] == llm.engine.max_model_len
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": server.model, "messages": messages, "max_tokens": 1}).json()
    assert reply["usage"]["prompt_tokens"] == body["count"]
    text = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, timeout=60).json()
    assert text["tokens"] == list(llm.engine.process({"prompt": "Hello world"}).prompt_token_ids)
    back = httpx.post(server.url + "/detokenize", json={"tokens": text["tokens"]}, timeout=60).json()
    assert back["prompt"] == "Hello world"
    both = httpx.post(server.url + "/tokenize", json={"prompt": "x", "messages": messages}, timeout=60)
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    outside = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    assert httpx.get(server.url + "/version", timeout=10).json()["version"]


def test_tokenizer_info_where_enabled(servers, llm):
    """/tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint and the API key): the tokenizer's
    class, its tokenizer_config.json entries and the chat template it renders; a server not asked for it
    answers 404."""
    strict = servers["strict"]
    reply = httpx.get(strict.url + "/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert reply.status_code == 200, reply.text
    info = reply.json()
    config = json.loads((Path(strict.model) / "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] == config.get("tokenizer_class", "PreTrainedTokenizerFast")
    assert info["eos_token"] == config["eos_token"] and "added_tokens_decoder" not in info
    assert info["chat_template"] == llm.engine.processor.tokenizer.chat_template
    assert httpx.get(strict.url + "/tokenizer_info", timeout=10).status_code == 401
    assert httpx.get(servers["main"].url + "/tokenizer_info", timeout=10).status_code == 404


def test_completions_with_several_prompts(server, client, llm):
    """A list of prompts (strings or token-id lists) answers one choice per prompt and n, choice j of
    prompt i at index i * n + j, each the offline answer; streamed alike; usage counts every prompt."""
    prompts = ["Once upon a time", "The capital of", "One, two,"]
    params = SamplingParams(temperature=0, max_tokens=5)
    offline = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    whole = client.completions.create(model=server.model, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [t for t in offline for _ in range(2)]
    prompt_ids = [llm.engine.process({"prompt": p}).prompt_token_ids for p in prompts]
    assert whole.usage.prompt_tokens == sum(len(ids) for ids in prompt_ids)
    texts = {}
    for chunk in client.completions.create(model=server.model, prompt=[list(ids) for ids in prompt_ids],
                                           max_tokens=5, temperature=0, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(3)] == offline
    refused = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": server.model, "prompt": prompts, "echo": True, "max_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
    bad = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": server.model, "prompt": ["fine", ""], "max_tokens": 2})
    assert bad.status_code == 400
    for _ in range(100):  # the first prompt's request is aborted with the refusal (in the engine's thread)
        if stats(server)["requests_running"] == 0:
            break
        time.sleep(0.05)
    assert stats(server)["requests_running"] == 0


def test_token_ids_in_answers_and_headers(servers, llm):
    """return_token_ids puts the prompt's and the choice's ids in the answer; --return-tokens-as-token-ids
    names logprob tokens "token_id:N"; --enable-request-id-headers echoes X-Request-Id (or makes one)."""
    main, strict = servers["main"], servers["strict"]
    messages = [{"role": "user", "content": "Say hi."}]
    body = {"model": main.model, "messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    reply = httpx.post(main.url + "/v1/chat/completions", json=body, timeout=60).json()
    offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert reply["prompt_token_ids"] == list(offline.prompt_token_ids)
    assert reply["choices"][0]["token_ids"] == list(offline.outputs[0].token_ids)
    assert "x-request-id" not in httpx.get(main.url + "/health").headers
    auth = {"Authorization": f"Bearer {API_KEY}"}
    named = httpx.post(strict.url + "/v1/chat/completions", headers={**auth, "X-Request-Id": "abc-1"}, timeout=60,
                       json={**body, "model": strict.model, "logprobs": True, "top_logprobs": 1})
    assert named.headers["x-request-id"] == "abc-1"
    content = named.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in offline.outputs[0].token_ids]
    assert httpx.get(strict.url + "/health").headers["x-request-id"]
    # streamed: each chunk its new ids, each choice's first chunk the prompt's, joined as the whole answer's
    sampled = {"temperature": 0.9, "seed": 5, "n": 2}
    for route, extra in (("/v1/chat/completions", {"messages": messages}),
                         ("/v1/completions", {"prompt": "Once upon a time"})):
        request = {k: v for k, v in body.items() if k != "messages"} | extra | sampled
        whole = httpx.post(main.url + route, json=request, timeout=60).json()
        events = _sse_payloads(httpx.post(main.url + route, json={**request, "stream": True}, timeout=60))
        ids = {0: [], 1: []}
        prompts = {}
        for event in events:
            for choice in event["choices"]:
                ids[choice["index"]] += choice["token_ids"]
                prompt_ids = event.get("prompt_token_ids") or choice.get("prompt_token_ids")
                if prompt_ids is not None:
                    assert choice["index"] not in prompts
                    prompts[choice["index"]] = prompt_ids
        assert ids == {c["index"]: c["token_ids"] for c in whole["choices"]}
        expected_prompt = whole.get("prompt_token_ids") or whole["choices"][0]["prompt_token_ids"]
        assert prompts == {0: expected_prompt, 1: expected_prompt}


def _sse_payloads(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_structured_outputs_whole_and_streamed(server, client, llm):
    """response_format json_schema / json_object, vLLM's structured_outputs and guided_choice: the answers
    match, equal the offline engine's, streamed chunks join into the same text; no matcher outlives them."""
    import jsonschema

    from mmserve import StructuredOutputsParams

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["color", "n"], "additionalProperties": False}
    messages = image_message(data_uri(png_bytes((200, 30, 30))), "What color is it?")
    kwargs = dict(model=server.model, messages=messages, max_tokens=40, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    whole = client.chat.completions.create(**kwargs)
    offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json=schema)), use_tqdm=False)[0]
    assert whole.choices[0].message.content == offline.outputs[0].text
    if whole.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(whole.choices[0].message.content), schema)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    assert streamed == whole.choices[0].message.content
    choice = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0.9,
                                            seed=4, n=3, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.message.content in ("red", "green", "blue") for c in choice.choices)
    regex = client.completions.create(model=server.model, prompt="The code is", max_tokens=12, temperature=0.9,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{2}", regex.choices[0].text), regex.choices[0].text
    assert stats(server)["grammar_matchers"] == 0


COUNT_TOOL = {"type": "function", "function": {
    "name": "count_shapes", "description": "Count the shapes of one colour in the picture", "strict": True,
    "parameters": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue", "yellow", "purple",
                                                                       "orange"]}},
                   "required": ["color"], "additionalProperties": False}}}
AREA_TOOL = {"type": "function", "function": {"name": "area", "parameters": {"type": "object"}}}


def test_tool_calls_forced_streamed_and_round_tripped(servers):
    """On the demo model: tool_choice required (one call with parallel_tool_calls false) and a named choice
    return calls that parse and match the strict tool's schema (finish_reason tool_calls, and stop for the
    named one, as vLLM); streamed, the
    official client's deltas assemble into the same call; the tool's result sent back renders and the
    model answers; bad tool requests are 400s naming their field."""
    import jsonschema

    from mmserve.demo import shapes

    demo = servers["demo"]
    client = OpenAI(base_url=demo.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    sample = shapes.make_sample(5, 0, "describe")
    buffer = io.BytesIO()
    sample.images[0].save(buffer, format="PNG")
    messages = image_message(data_uri(buffer.getvalue()), "How many red shapes are there?")
    tools = [COUNT_TOOL, AREA_TOOL]
    for choice, parallel in (("required", False), ({"type": "function", "function": {"name": "count_shapes"}}, None)):
        reply = client.chat.completions.create(model=demo.model, messages=messages, tools=tools, tool_choice=choice,
                                               max_tokens=80, temperature=0,
                                               **({} if parallel is None else {"parallel_tool_calls": parallel}))
        answer = reply.choices[0]
        # as vLLM (and OpenAI): a named choice ends with stop, required with tool_calls; content "", not null
        assert answer.finish_reason == ("tool_calls" if choice == "required" else "stop")
        assert len(answer.message.tool_calls) == 1 and answer.message.content == ""
        called = answer.message.tool_calls[0]
        assert called.type == "function" and called.id.startswith("call_")
        if called.function.name == "count_shapes":
            jsonschema.validate(json.loads(called.function.arguments), COUNT_TOOL["function"]["parameters"])
        else:
            assert choice == "required" and isinstance(json.loads(called.function.arguments), dict)
    named = {"type": "function", "function": {"name": "count_shapes"}}
    whole = client.chat.completions.create(model=demo.model, messages=messages, tools=tools, tool_choice=named,
                                           max_tokens=80, temperature=0)
    assembled: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=demo.model, messages=messages, tools=tools, tool_choice=named,
                                                max_tokens=80, temperature=0, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = assembled.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
    call = whole.choices[0].message.tool_calls[0]
    assert finish == "stop" and len(assembled) == 1 and assembled[0]["id"]
    assert (assembled[0]["name"], json.loads(assembled[0]["arguments"])) == (
        call.function.name, json.loads(call.function.arguments))
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "2"}]
    final = client.chat.completions.create(model=demo.model, messages=history, tools=tools, max_tokens=16,
                                           temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokenized = httpx.post(demo.url + "/tokenize", json={"model": demo.model, "messages": history}, timeout=60)
    assert tokenized.status_code == 200
    for bad, param in (({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                        "tool_choice"),
                       ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0]"),
                       ({"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}},
                        "tool_choice")):
        response = httpx.post(demo.url + "/v1/chat/completions", timeout=60,
                              json={"model": demo.model, "messages": messages, "max_tokens": 4, **bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    on_completions = httpx.post(demo.url + "/v1/completions", timeout=60,
                                json={"model": demo.model, "prompt": "hi", "max_tokens": 4, "tools": tools})
    assert on_completions.status_code == 400 and on_completions.json()["error"]["param"] == "tools"
    assert stats(demo)["grammar_matchers"] == 0

"""`mmserve serve <dir>` for the families beyond Qwen2-VL (whose server is tested in depth in
test_server.py): a real server subprocess per family, the official `openai` client, an image and a
video sent as data URIs. The served greedy answer and prompt size equal the offline `LLM`'s for the
same pixels, so the server path (media decoding at the family's default fps, the family's
processor, the engine) is the one parity-tested against transformers in tests/models/. An
image-only family answers a video with a 400 in OpenAI's error format and keeps serving. Two
families run with `--kv-cache-dtype` int8 / fp8_e4m3, and /metrics says so."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from mmserve import LLM, SamplingParams
from mmserve.inputs.media import decode_image_bytes
from mmserve.inputs.video import decode_video
from testkit.families import FAMILIES
from tests.e2e.conftest import start_server, stop_server, wait_healthy
from tests.e2e.test_server import data_uri, metric_samples, mp4_bytes, png_bytes

MAX_FRAMES = 4
NUM_TOKENS = 6


# two families are served with a quantized KV cache (the CLI flag; the offline engine likewise)
KV_CACHE_DTYPE = {"gemma3": "int8", "mistral3": "fp8_e4m3"}


@pytest.fixture(scope="module", params=["qwen3_vl", "llava_onevision", "gemma3", "mistral3", "mllama"])
def served(request, all_checkpoints, tmp_path_factory):
    model = str(all_checkpoints[request.param])
    kv_cache_dtype = KV_CACHE_DTYPE.get(request.param, "auto")
    server = start_server(model, tmp_path_factory.mktemp("logs") / f"{request.param}.log",
                          "--max-video-frames", str(MAX_FRAMES), "--num-kv-blocks", "128",
                          "--kv-cache-dtype", kv_cache_dtype)
    try:
        wait_healthy(server)
        yield server, LLM(model, max_video_frames=MAX_FRAMES, num_kv_blocks=128, kv_cache_dtype=kv_cache_dtype), \
            request.param
    finally:
        stop_server(server)


def _ask(server, content):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model=server.model, max_tokens=NUM_TOKENS, temperature=0,
                                          messages=[{"role": "user", "content": content}])


def _offline(llm, part):
    out = llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}],
                   SamplingParams(temperature=0, max_tokens=NUM_TOKENS), use_tqdm=False)[0]
    return out.outputs[0].text, len(out.prompt_token_ids), len(out.outputs[0].token_ids)


def test_image_answer_equals_offline(served):
    server, llm, family = served
    png = png_bytes((30, 140, 220), size=(150, 60))
    reply = _ask(server, [{"type": "image_url", "image_url": {"url": data_uri(png)}},
                          {"type": "text", "text": "Describe it."}])
    image = decode_image_bytes(png, llm.engine.config.media)
    text, prompt_tokens, completion_tokens = _offline(llm, {"type": "image_pil", "image_pil": image})
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == prompt_tokens and reply.usage.completion_tokens == completion_tokens


def test_video_answer_equals_offline(served):
    server, llm, family = served
    clip = mp4_bytes()
    content = [{"type": "video_url", "video_url": {"url": data_uri(clip, "video/mp4")}},
               {"type": "text", "text": "Describe it."}]
    if not FAMILIES[family].takes_video:
        with pytest.raises(openai.BadRequestError) as refused:
            _ask(server, content)
        assert refused.value.status_code == 400 and "video" in refused.value.message
        test_image_answer_equals_offline(served)  # and it keeps serving
        return
    reply = _ask(server, content)
    limits = llm.engine.config.media
    frames = decode_video(clip, llm.engine.spec.default_video_fps, limits.max_video_frames, limits.max_image_pixels)
    assert 1 < len(frames) <= MAX_FRAMES
    text, prompt_tokens, completion_tokens = _offline(llm, {"type": "video", "video": frames})
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == prompt_tokens > len(frames)
    assert reply.usage.completion_tokens == completion_tokens


def test_metrics_report_the_kv_cache(served):
    server, llm, family = served
    samples = metric_samples(server)
    ours = llm.get_stats()
    kv_cache_dtype = KV_CACHE_DTYPE.get(family, "auto")
    assert samples[("mmserve_kv_cache_dtype_info", (("kv_cache_dtype", kv_cache_dtype),))] == 1.0
    assert samples[("mmserve_kv_bytes_per_token", ())] == ours["kv_bytes_per_token"]
    assert samples[("mmserve_kv_capacity_tokens", ())] == ours["kv_capacity_tokens"] == 128 * 16

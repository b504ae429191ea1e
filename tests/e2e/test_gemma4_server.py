"""`mmserve serve` on the tiny random Gemma 4 checkpoint (vision and audio towers; testkit/tiny_gemma4.py)
through the official `openai` client: audio in, Gemma 4's tool-call syntax and thinking switch out.

One server starts for the module, with small media limits (`--max-audio-duration-s 5`,
`--limit-mm-per-prompt audio=2`) and the default media-URL safety. What it must do:
- answer a WAV clip sent as `input_audio`, an image and a clip in one turn, the clip as an `audio_url` data
  URL, and FLAC, MP3 and Ogg Opus files encoded here with PyAV, each with the very tokens, text, finish
  reason and usage the offline `LLM` gives for the same messages (the server's path — base64, decoding,
  resampling, the processor, the engine — is the one tests/models/test_gemma4.py parity-tests against
  transformers); the same clip as `input_audio` and as `audio_url` is the same prompt;
- refuse every bad clip with a 400 in OpenAI's error shape whose `param` names the part (or its `format` /
  `data` field): undecodable bytes (as `input_audio` and as an `audio_url` data URL), a clip over the
  duration limit (a plain WAV, and a streamed WAV whose header gives no size), an unknown or mismatched
  format name, a WAV of no samples, a hand-written WAV header with a sampling rate of 0, a WAV header
  claiming 10 hours over a few bytes (refused from the header: the server's peak memory does not grow by
  what decoding it would take), bad or empty base64, more clips than --limit-mm-per-prompt allows, an
  `audio_url` on a loopback / private / link-local / `localhost` http address (the SSRF rules); the
  official client sees such a 400 as `BadRequestError`, and the server answers a good clip afterwards.
  (An audio part sent to a model without audio is tested on Qwen2-VL in test_server.py's BAD_REQUESTS.)
- answer `tool_choice="required"` with a call in Gemma 4's `<|tool_call>call:NAME{...}<tool_call|>` syntax
  (forced by the structural tag even from a random model) read back as `tool_calls`: a known name,
  arguments that parse as JSON and fit the tool's schema, finish reason `tool_calls`; streamed, the deltas
  assemble the same call;
- take `chat_template_kwargs={"enable_thinking": true}`: the template's `<|think|>` switch is in the
  prompt (the offline engine's prompt and tokens), and the message's reasoning (None or text) and content
  hold none of Gemma 4's channel, turn or call markers.
The model is random: answers are checked for equality with the offline engine and for structure, never
for meaning, and nothing depends on timing.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import wave
from pathlib import Path

import av
import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI

from mmserve import LLM, SamplingParams
from tests.e2e.conftest import start_server, stop_server, wait_healthy
from tests.e2e.test_server import data_uri, png_bytes

RATE = 16_000
NUM_TOKENS = 6
MAX_DURATION_S = 5
MAX_AUDIOS = 2
NUM_KV_BLOCKS = 128
PART = "messages[0].content[0]"
MARKERS = ("<|channel>", "<channel|>", "<turn|>", "<|turn>", "<|tool_call>", "<tool_call|>")


def tone(seconds: float, hz: float = 440.0, seed: int = 0) -> np.ndarray:
    """A tone under a little noise, int16 samples at RATE."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    signal = 0.3 * np.sin(2 * np.pi * hz * t) + 0.05 * rng.standard_normal(t.shape)
    return np.round(np.clip(signal, -1, 1) * 32767).astype("<i2")


def wav_bytes(samples: np.ndarray, rate: int = RATE) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.astype("<i2").tobytes())
    return buffer.getvalue()


def wav_header(*, rate: int, data_size: int, byte_rate: int | None = None, present: bytes = b"") -> bytes:
    """A mono 16-bit PCM RIFF/WAVE header written by hand, whatever it claims, then `present` bytes of
    data."""
    byte_rate = rate * 2 if byte_rate is None else byte_rate
    fmt = struct.pack("<HHIIHH", 1, 1, rate, byte_rate, 2, 16)
    body = (b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", data_size)
            + present)
    return b"RIFF" + struct.pack("<I", min(len(body) + data_size - len(present), 0xFFFFFFFF)) + body


def encoded(samples: np.ndarray, container: str, codec: str) -> bytes:
    """`samples` (int16 mono at RATE) encoded by PyAV into an in-memory `container` file."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=RATE, layout="mono")
        resampler = av.AudioResampler(format=stream.codec_context.codec.audio_formats[0].name, layout="mono",
                                      rate=RATE)  # to a sample format the encoder takes
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")
        frame.sample_rate = RATE
        for converted in resampler.resample(frame):
            out.mux(stream.encode(converted))
        out.mux(stream.encode(None))
    return buffer.getvalue()


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def audio_url(url: str) -> dict:
    return {"type": "audio_url", "audio_url": {"url": url}}


def text(words: str) -> dict:
    return {"type": "text", "text": words}


CLIP = wav_bytes(tone(1.0, 440.0, seed=1))
OTHER_CLIP = wav_bytes(tone(1.3, 330.0, seed=2))
PNG = png_bytes((30, 140, 220), size=(60, 40))


@pytest.fixture(scope="module")
def model_dir(all_checkpoints) -> Path:
    return all_checkpoints["gemma4"]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    started = start_server(str(model_dir), tmp_path_factory.mktemp("logs") / "gemma4.log",
                           "--max-audio-duration-s", str(MAX_DURATION_S), "--limit-mm-per-prompt",
                           f"audio={MAX_AUDIOS}", "--num-kv-blocks", str(NUM_KV_BLOCKS))
    try:
        wait_healthy(started)
        yield started
    finally:
        stop_server(started)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_kv_blocks=NUM_KV_BLOCKS, max_audio_duration_s=MAX_DURATION_S)


def ask(client, server, content, **extra):
    """A greedy chat request of one user message; `extra` goes in the body (mmserve's and vLLM's fields)."""
    return client.chat.completions.create(model=server.model, max_tokens=NUM_TOKENS, temperature=0,
                                          messages=[{"role": "user", "content": content}],
                                          extra_body={"return_token_ids": True, **extra})


def assert_equals_offline(reply, llm, content) -> None:
    """The reply's tokens, text and usage are the offline engine's for the same message. The server decodes
    Gemma 4's answers with special tokens kept (its thought and call markers are special tokens), so offline
    decodes them so too."""
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, skip_special_tokens=False)
    offline = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]
    choice = reply.choices[0]
    assert choice.token_ids == offline.outputs[0].token_ids
    assert choice.message.content == offline.outputs[0].text
    assert choice.finish_reason == offline.outputs[0].finish_reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(offline.prompt_token_ids), len(offline.outputs[0].token_ids))


# ---- answers equal the offline engine's ----------------------------------------------------------------
@pytest.mark.parametrize("case", ["input_audio_wav", "image_and_clip", "audio_url_data", "flac", "mp3",
                                  "ogg_opus"])
def test_audio_answers_equal_offline(server, client, llm, case):
    content = {
        "input_audio_wav": lambda: [input_audio(CLIP), text("What do you hear?")],
        "image_and_clip": lambda: [{"type": "image_url", "image_url": {"url": data_uri(PNG)}},
                                   input_audio(OTHER_CLIP), text("Describe both.")],
        "audio_url_data": lambda: [text("Listen:"), audio_url(data_uri(CLIP, "audio/wav"))],
        "flac": lambda: [input_audio(encoded(tone(1.2, 523.0, seed=3), "flac", "flac"), "flac"),
                         text("What do you hear?")],
        "mp3": lambda: [input_audio(encoded(tone(1.2, 262.0, seed=4), "mp3", "libmp3lame"), "mp3"),
                        text("What do you hear?")],
        "ogg_opus": lambda: [input_audio(encoded(tone(0.8, 660.0, seed=5), "ogg", "libopus"), "ogg"),
                             text("What do you hear?")],
    }[case]()
    reply = ask(client, server, content)
    assert_equals_offline(reply, llm, content)
    assert reply.usage.prompt_tokens > 20  # the clip's soft tokens are in the prompt


def test_the_same_clip_as_input_audio_and_as_audio_url_is_the_same_prompt(server, client):
    by_data = ask(client, server, [input_audio(CLIP), text("Hm?")])
    by_url = ask(client, server, [audio_url(data_uri(CLIP, "audio/wav")), text("Hm?")])
    assert by_data.choices[0].token_ids == by_url.choices[0].token_ids
    assert by_data.usage.prompt_tokens == by_url.usage.prompt_tokens


# ---- every bad clip is a 400 naming its part -----------------------------------------------------------
TEN_HOURS = wav_header(rate=RATE, data_size=10 * 3600 * RATE * 2, present=b"\x00\x01" * 800)

BAD_AUDIO = {
    "undecodable": ([input_audio(np.random.default_rng(0).bytes(4000))], f"{PART}.input_audio"),
    "too_long": ([input_audio(wav_bytes(tone(MAX_DURATION_S + 1.0)))], f"{PART}.input_audio"),
    # a streamed WAV (data size 0xFFFFFFFF: "unknown"): its length is still found out and refused
    "too_long_streamed": ([input_audio(wav_header(rate=RATE, data_size=0xFFFFFFFF,
                                                  present=tone(MAX_DURATION_S + 1.0).tobytes()))],
                          f"{PART}.input_audio"),
    "format_aiff": ([input_audio(CLIP, "aiff")], f"{PART}.input_audio.format"),
    "format_wma": ([input_audio(CLIP, "wma")], f"{PART}.input_audio.format"),
    "format_mismatch": ([input_audio(CLIP, "mp3")], f"{PART}.input_audio.format"),
    "no_samples": ([input_audio(wav_bytes(np.zeros(0, np.int16)))], f"{PART}.input_audio"),
    "rate_zero": ([input_audio(wav_header(rate=0, byte_rate=0, data_size=3200, present=bytes(3200)))],
                  f"{PART}.input_audio"),
    "ten_hour_header": ([input_audio(TEN_HOURS)], f"{PART}.input_audio"),
    "bad_base64": ([{"type": "input_audio", "input_audio": {"data": "@@not base64@@", "format": "wav"}}],
                   f"{PART}.input_audio.data"),
    "empty_data": ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
                   f"{PART}.input_audio.data"),
    "too_many_clips": ([text("Three:"), *[input_audio(CLIP)] * (MAX_AUDIOS + 1)],
                       f"messages[0].content[{MAX_AUDIOS + 1}].input_audio"),
    "undecodable_audio_url": ([audio_url(data_uri(b"RIFF nothing more", "audio/wav"))], f"{PART}.audio_url"),
    "bad_base64_audio_url": ([audio_url("data:audio/wav;base64,@@@@")], f"{PART}.audio_url"),
    "loopback_audio_url": ([audio_url("http://127.0.0.1:9/clip.wav")], f"{PART}.audio_url"),
    "private_audio_url": ([audio_url("http://10.1.2.3/clip.wav")], f"{PART}.audio_url"),
    "link_local_audio_url": ([audio_url("http://169.254.169.254/latest/meta-data")], f"{PART}.audio_url"),
    "localhost_audio_url": ([audio_url("http://localhost:9/clip.wav")], f"{PART}.audio_url"),
}


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


@pytest.mark.parametrize("case", sorted(BAD_AUDIO))
def test_bad_audio_is_a_400_naming_the_part(server, case):
    content, param = BAD_AUDIO[case]
    body = {"model": server.model, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    peak = peak_rss_bytes(server.process.pid)
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if case == "ten_hour_header":
        # refused from what the header claims, before decoding; 10 hours of float32 samples would be 2.3 GB
        assert "declares a duration of 36000" in error["message"], error
        assert peak_rss_bytes(server.process.pid) - peak < 256 * 1024 * 1024
    if case.startswith("too_long"):
        assert f"over the limit of {MAX_DURATION_S} s" in error["message"], error
    if case == "too_many_clips":
        assert f"at most {MAX_AUDIOS} audio" in error["message"], error


def test_after_bad_audio_the_server_serves_on_and_the_official_client_sees_the_error(server, client, llm):
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, server, [input_audio(b"\x00" * 64), text("Hm?")])
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == f"{PART}.input_audio"
    content = [input_audio(CLIP), text("And now?")]
    assert_equals_offline(ask(client, server, content), llm, content)


# ---- tool calls in Gemma 4's syntax --------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "celsius": {"type": "boolean"}},
                   "required": ["city", "celsius"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_call(name: str, arguments: str) -> dict:
    import jsonschema

    assert name in SCHEMAS, name
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, SCHEMAS[name])
    return parsed


def test_a_forced_tool_call_in_gemma4_syntax_whole_and_streamed(server, client):
    messages = [{"role": "user", "content": [input_audio(CLIP), text("The weather where this was said?")]}]
    kwargs = dict(model=server.model, messages=messages, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=150, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    assert whole.message.content == "" and len(whole.message.tool_calls) == 1
    call = whole.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    arguments = _check_call(call.function.name, call.function.arguments)

    assembled: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = assembled.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert finish == "tool_calls" and content == "" and list(assembled) == [0], (finish, content, assembled)
    assert assembled[0]["id"] and assembled[0]["name"] == call.function.name
    assert _check_call(assembled[0]["name"], assembled[0]["arguments"]) == arguments


# ---- thinking -------------------------------------------------------------------------------------------
def test_enable_thinking_is_accepted_and_the_message_is_consistent(server, client, llm):
    """The template's `<|think|>` switch reaches the prompt (whose generation prompt then leaves the thought
    channel for the model to open); the reply is the offline engine's tokens, split into a thought (None or
    text) and content with none of Gemma 4's markers left in either."""
    content = [input_audio(CLIP), text("Think, then answer.")]
    plain = ask(client, server, content)
    thinking = ask(client, server, content, chat_template_kwargs={"enable_thinking": True})
    offline = llm.chat([{"role": "user", "content": content}],
                       SamplingParams(temperature=0, max_tokens=NUM_TOKENS, skip_special_tokens=False),
                       use_tqdm=False, chat_template_kwargs={"enable_thinking": True})[0]
    assert "<|think|>" in offline.prompt and "<|channel>" not in offline.prompt.split("<|turn>model")[-1]
    assert thinking.prompt_token_ids == offline.prompt_token_ids != plain.prompt_token_ids
    assert thinking.choices[0].token_ids == offline.outputs[0].token_ids
    assert thinking.usage.completion_tokens == len(offline.outputs[0].token_ids)
    message = thinking.choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    assert reasoning is None or isinstance(reasoning, str)
    assert isinstance(message.content, str)
    for field in (message.content, reasoning or ""):
        assert not any(marker in field for marker in MARKERS), message


# ---- the Responses API takes clips too -------------------------------------------------------------------
def test_the_responses_api_takes_an_input_audio_part_as_the_chat_does(server, client):
    """/v1/responses with an input_audio part answers as chat completions does for the same message; a bad
    clip there is a 400 naming the Responses field."""
    chat = ask(client, server, [input_audio(CLIP), text("What do you hear?")])
    part = {"type": "input_audio", "input_audio": input_audio(CLIP)["input_audio"]}
    response = client.responses.create(model=server.model, max_output_tokens=NUM_TOKENS, temperature=0, input=[
        {"role": "user", "content": [part, {"type": "input_text", "text": "What do you hear?"}]}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    bad = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"not audio").decode(),
                                                  "format": "wav"}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=server.model, max_output_tokens=NUM_TOKENS, input=[
            {"role": "user", "content": [bad, {"type": "input_text", "text": "Hm?"}]}])
    assert caught.value.body["param"] == "input[0].content[0].input_audio"

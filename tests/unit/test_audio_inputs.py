"""Audio as a media item of the input stack: chat parts (`input_audio`, `audio_url`) -> `{"type": "audio"}`
template parts and sources in order; `multi_modal_data={"audio": ...}` in vLLM's forms; every clip mono
float32 at the family's rate (an array resampled exactly as a file of the same samples), keyed by those
samples; every bad input an InvalidInputError naming the field; a family without audio refusing the first
audio part; the server's resolution (counts, SSRF rules, byte caps) of the same parts.

The family that takes audio is a stub on the demo checkpoint's tokenizer (`<|video_pad|>` stands for its
audio placeholder; one row per 100 ms; its payload is the samples it was given); the family that takes
none is the demo checkpoint's own (Qwen2-VL). All audio is generated here."""

from __future__ import annotations

import base64
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from mmserve.config import DEMO_MODEL_DIR
from mmserve.engine.prompts import parse_prompt
from mmserve.entrypoints.openai.media import MediaRules, resolve_media, resolve_messages
from mmserve.errors import InvalidInputError
from mmserve.inputs.audio import AudioClip, AudioLimits, decode_audio
from mmserve.inputs.audio_sources import EncodedAudio
from mmserve.inputs.chat import ChatInput, normalize_messages
from mmserve.inputs.fetch import FetchPolicy
from mmserve.inputs.items import AUDIO, IMAGE, VIDEO
from mmserve.inputs.media import MediaLimits
from mmserve.inputs.media_refs import MediaRefs
from mmserve.inputs.processing import ItemExpansion, MultimodalProcessor
from mmserve.inputs.tokenizer import TextTokenizer
from mmserve.models.loader import read_config
from mmserve.models.registry import resolve
from tests.unit.test_audio_decoding import _pcm16 as pcm16  # the same clips as the decoder's tests
from tests.unit.test_audio_decoding import _wav as wav

RATE = 16000  # the stub family's feature-extractor rate
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
            "{% else %}{% for c in m.content %}{% if c.type == 'image' %}<|image_pad|>"
            "{% elif c.type == 'audio' %}<|video_pad|>{% elif c.type == 'text' %}{{ c.text }}{% endif %}"
            "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLACEHOLDER = "<|video_pad|>"


class AudioFamily(MultimodalProcessor):
    modalities = (IMAGE, AUDIO)
    audio_sampling_rate_hz = RATE
    mel_bins = 128  # stands for the feature-extractor settings the family keys by

    def __init__(self, limits: MediaLimits | None = None) -> None:
        tokenizer = TextTokenizer(DEMO_MODEL_DIR, chat_template=TEMPLATE)
        ids = {IMAGE: tokenizer.token_to_id("<|image_pad|>"), AUDIO: tokenizer.token_to_id(PLACEHOLDER)}
        super().__init__(DEMO_MODEL_DIR, ids, 397, limits, tokenizer=tokenizer)

    def processing_key(self, modality: str, kwargs: dict) -> dict:
        return {"mel_bins": self.mel_bins} if modality == AUDIO else super().processing_key(modality, kwargs)

    def expand_image(self, image, kwargs, num_images):
        return ItemExpansion([self.pad_ids[IMAGE]] * 4, 4, 4, None)

    def expand_audio(self, samples, kwargs):
        assert samples.dtype == np.float32 and samples.ndim == 1
        rows = -(-len(samples) // (RATE // 10))
        return ItemExpansion([self.pad_ids[AUDIO]] * rows, rows, rows, samples)


@pytest.fixture(scope="module")
def family() -> AudioFamily:
    return AudioFamily()




def wav_header(payload: bytes, rate: int = RATE, data_size: int | None = None) -> bytes:
    """A mono 16-bit WAV written by hand, so its header can say what the data is not."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    size = len(payload) if data_size is None else data_size
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", size) + payload
    return b"RIFF" + struct.pack("<I", len(body)) + body


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def input_audio(data: bytes, fmt: str = "wav", **extra) -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}, **extra}


def audio_url(url: str, **extra) -> dict:
    return {"type": "audio_url", "audio_url": {"url": url}, **extra}


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def run_chat(proc: MultimodalProcessor, messages: list[dict]):
    chat = proc.render_chat(messages)
    return proc.process(chat.prompt, None, chat.images, chat.videos, None, chat.uuids, chat.params,
                        audios=chat.audios)


def run_prompt(proc: MultimodalProcessor, raw: dict):
    """What the engine's front end does with a `generate` prompt."""
    p = parse_prompt(raw)
    return proc.process(p.prompt, p.prompt_token_ids, p.images, p.videos, p.mm_processor_kwargs, p.uuids,
                        audios=p.audios)


def audio_prompt(clips) -> dict:
    count = len(clips) if isinstance(clips, list) else 1
    return {"prompt": "Hear:" + PLACEHOLDER * count, "multi_modal_data": {"audio": clips}}


def refused(call, param: str, match: str | None = None) -> InvalidInputError:
    with pytest.raises(InvalidInputError, match=match) as caught:
        call()
    assert caught.value.param == param, (caught.value.param, str(caught.value))
    assert "Traceback" not in str(caught.value)
    return caught.value


CLIP = pcm16(0.5, RATE)
CLIP_WAV = wav(CLIP, RATE)
PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQ"
       "AAAABJRU5ErkJggg==")


# --- chat parts ------------------------------------------------------------------------------------------

def test_chat_audio_parts_become_audio_template_parts_in_order_with_uuids_and_paths():
    media = ChatInput(prompt="")
    messages = user({"type": "image_url", "image_url": {"url": PNG}}, input_audio(CLIP_WAV, "WAV", uuid="a"),
                    {"type": "text", "text": "and"}, audio_url("data:audio/wav;base64," + b64(CLIP_WAV)))
    normalized = normalize_messages(messages + user(audio_url("/clips/b.flac")), media)
    assert [p["type"] for p in normalized[0]["content"]] == ["image", "audio", "text", "audio"]
    assert normalized[1]["content"] == [{"type": "audio"}]
    first, second, third = media.audios
    assert first == EncodedAudio(CLIP_WAV, "wav") and second.startswith("data:audio/wav")
    assert third == "/clips/b.flac"
    assert media.uuids[AUDIO] == ["a", None, None] and media.uuids[IMAGE] == [None]
    assert media.params == {IMAGE: ["messages[0].content[0].image_url"], VIDEO: [],
                            AUDIO: ["messages[0].content[1].input_audio", "messages[0].content[3].audio_url",
                                    "messages[1].content[0].audio_url"]}


def test_chat_items_stand_where_their_parts_stand(family):
    prompt = run_chat(family, user(input_audio(CLIP_WAV), {"type": "image_url", "image_url": {"url": PNG}},
                                   audio_url("data:audio/wav;base64," + b64(CLIP_WAV))))
    assert [(i.modality, i.index, i.length) for i in prompt.items] == [(AUDIO, 0, 5), (IMAGE, 0, 4),
                                                                       (AUDIO, 1, 5)]
    assert prompt.items[0].content_hash == prompt.items[2].content_hash  # one clip, two forms: one key
    np.testing.assert_array_equal(prompt.items[0].payload, CLIP[:, 0].astype(np.float32) / 32768)


PART = "messages[0].content[0]"
BAD_PARTS = [  # (the part, the param its error names, what the message says)
    ({"type": "input_audio", "input_audio": {"data": b64(CLIP_WAV), "format": "aiff"}},
     "messages[0].content[0].input_audio.format", "not one of wav, mp3, flac, ogg"),
    ({"type": "input_audio", "input_audio": {"data": b64(CLIP_WAV)}}, f"{PART}.input_audio.format", None),
    ({"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}},
     "messages[0].content[0].input_audio.data", "not valid base64"),
    ({"type": "input_audio", "input_audio": {"format": "wav"}}, f"{PART}.input_audio.data", None),
    ({"type": "input_audio", "input_audio": b64(CLIP_WAV)}, "messages[0].content[0].input_audio", "object"),
    ({"type": "input_audio", "input_audio": {"data": b64(CLIP_WAV), "format": "wav", "rate": 1}},
     "messages[0].content[0].input_audio.rate", "unknown keys"),
    ({"type": "audio_url", "audio_url": {"uri": "x"}}, "messages[0].content[0].audio_url", "needs"),
]


@pytest.mark.parametrize(("part", "param", "match"), BAD_PARTS)
def test_malformed_audio_parts_are_refused_naming_the_field(family, part, param, match):
    refused(lambda: family.render_chat(user(part)), param, match)


def test_malformed_audio_parts_are_refused_by_the_server_before_anything_is_fetched():
    rules = MediaRules(MediaLimits())
    for part, param, match in BAD_PARTS:
        refused(lambda part=part: resolve_messages(user(part), rules), param, match)


LONG = MediaLimits(max_audio_duration_s=1.0)
BAD_AUDIO = [  # (the part, limits, the param, what the message says): refused when decoded, in the processor
    (input_audio(b"RIFF nonsense, not a file"), None, f"{PART}.input_audio", "not a readable audio"),
    (input_audio(CLIP_WAV, "mp3"), None, "messages[0].content[0].input_audio.format", "the data is 'wav'"),
    (input_audio(wav(pcm16(1.5, RATE), RATE)), LONG, f"{PART}.input_audio", "over the limit of 1 s"),
    (input_audio(wav_header(b"", data_size=0)), None, f"{PART}.input_audio", "no decodable samples"),
    (audio_url("data:audio/wav;base64," + b64(wav_header(b"\x00\x01" * 100, rate=0))), None,
     "messages[0].content[0].audio_url", "not a readable audio file|sampling rate 0 Hz"),
    (input_audio(wav_header(b"\x01\x00" * 50, data_size=RATE * 2 * 36000)), None,
     "messages[0].content[0].input_audio", "declares a duration of 36000.0 s"),
    (audio_url("data:audio/wav;base64," + b64(CLIP_WAV)), MediaLimits(max_audio_bytes=1000),
     "messages[0].content[0].audio_url", "over the limit of 1000 bytes"),
    (audio_url("data:audio/wav,raw"), None, "messages[0].content[0].audio_url", "base64"),
    (audio_url("https://example.com/a.wav"), None, "messages[0].content[0].audio_url", "only by the server"),
    (audio_url("file:///etc/passwd"), None, f"{PART}.audio_url", "local files are not allowed"),
]


@pytest.mark.parametrize(("part", "limits", "param", "match"), BAD_AUDIO)
def test_bad_audio_is_refused_naming_the_part(part, limits, param, match):
    proc = AudioFamily(limits)
    param = param.replace("messages[0]", "messages[1]")
    error = refused(lambda: run_chat(proc, user({"type": "text", "text": "hi"}) + user(part)), param, match)
    assert str(error).startswith(param.removesuffix(".format"))  # the message names the part, as images' do


def test_an_audio_file_under_the_allowed_directory_is_read(tmp_path):
    (tmp_path / "a.wav").write_bytes(CLIP_WAV)
    proc = AudioFamily(MediaLimits(allowed_local_media_path=str(tmp_path), max_audio_bytes=len(CLIP_WAV)))
    prompt = run_chat(proc, user(audio_url(f"file://{tmp_path}/a.wav"), audio_url(str(tmp_path / "a.wav"))))
    assert prompt.items[0].content_hash == prompt.items[1].content_hash == run_chat(
        proc, user(input_audio(CLIP_WAV))).items[0].content_hash
    small = AudioFamily(MediaLimits(allowed_local_media_path=str(tmp_path),
                                    max_audio_bytes=len(CLIP_WAV) - 1))
    error = refused(lambda: run_chat(small, user(audio_url(str(tmp_path / "a.wav")))),
                    "messages[0].content[0].audio_url", "max_audio_bytes")
    assert error.setting == "max_audio_bytes"


# --- multi_modal_data -------------------------------------------------------------------------------------

def test_a_tuple_at_44k_is_the_wav_file_of_the_same_samples(family):
    pcm = pcm16(0.7, 44100, channels=2, seed=3)
    from_file = run_prompt(family, audio_prompt(wav(pcm, 44100))).items[0]
    as_float = pcm.astype(np.float32) / 32768
    for clip in ((as_float, 44100), (as_float.T, 44100), (pcm, 44100),
                 (as_float.T.astype(np.float64), 44100.0)):
        item = run_prompt(family, audio_prompt(clip)).items[0]
        # the same scaling, mix-down and soxr stream as the file's: the very same samples, so the same key
        np.testing.assert_array_equal(item.payload, from_file.payload)
        assert item.content_hash == from_file.content_hash
    direct = decode_audio(wav(pcm, 44100), param="p", sampling_rate_hz=RATE, limits=AudioLimits())
    np.testing.assert_array_equal(from_file.payload, direct.samples)


def test_every_offline_form_of_one_clip_is_one_item(family, tmp_path):
    (tmp_path / "a.wav").write_bytes(CLIP_WAV)
    proc = AudioFamily(MediaLimits(allowed_local_media_path=str(tmp_path)))
    clip = CLIP[:, 0].astype(np.float32) / 32768
    forms = [(clip, RATE), (clip.tolist(), RATE), CLIP_WAV, bytearray(CLIP_WAV),
             "data:audio/wav;base64," + b64(CLIP_WAV), str(tmp_path / "a.wav"), EncodedAudio(CLIP_WAV, "wav"),
             AudioClip(clip, RATE)]
    prompt = run_prompt(proc, audio_prompt(forms))
    assert len(prompt.items) == len(forms) and len({i.content_hash for i in prompt.items}) == 1
    assert [i.index for i in prompt.items] == list(range(len(forms)))
    one = run_prompt(proc, audio_prompt((clip, RATE))).items  # one clip, not a list of two
    assert len(one) == 1 and one[0].content_hash == prompt.items[0].content_hash


def test_an_array_at_the_models_rate_is_copied_not_resampled(family):
    clip = CLIP[:, 0].astype(np.float32) / 32768
    item = run_prompt(family, audio_prompt((clip, RATE))).items[0]
    np.testing.assert_array_equal(item.payload, clip)
    clip[:] = 0  # the caller reuses its buffer: the item keeps what it was given
    assert item.payload.any()


def test_uuids_name_clips_and_a_uuid_alone_is_the_clip_sent_before():
    proc = AudioFamily()
    sent = run_prompt(proc, {**audio_prompt([CLIP_WAV, (CLIP[:, 0] / 32768.0, RATE)]),
                             "multi_modal_uuids": {"audio": ["u", None]}}).items
    again = run_prompt(proc, {**audio_prompt([None]), "multi_modal_uuids": {"audio": ["u"]}}).items[0]
    assert again.content_hash == sent[0].content_hash != sent[1].content_hash
    np.testing.assert_array_equal(again.payload, sent[0].payload)
    assert proc.media_refs.used_bytes == len(CLIP) * 4  # float32 samples at the model's rate
    refused(lambda: run_prompt(proc, {**audio_prompt([None]), "multi_modal_uuids": {"audio": ["v"]}}),
            "multi_modal_data.audio[0]", "never sent")
    two_uuids = {**audio_prompt([CLIP_WAV]), "multi_modal_uuids": {"audio": ["a", "b"]}}
    refused(lambda: run_prompt(proc, two_uuids), "multi_modal_uuids.audio", "2 entries for 1")


def test_audio_kept_by_uuid_is_bounded_by_its_samples():
    refs = MediaRefs(3 * RATE * 4)  # three seconds of float32 samples
    limits = MediaLimits()
    for name in "abc":
        refs.audio((np.zeros(RATE, np.float32), RATE), name, limits, RATE, "p")
    assert refs.used_bytes == 3 * RATE * 4
    refs.audio((np.zeros(RATE, np.float32), RATE), "d", limits, RATE, "p")  # evicts a
    refused(lambda: refs.audio(None, "a", limits, RATE, "q"), "q", "evicted")
    assert refs.audio(None, "d", limits, RATE, "q").shape == (RATE,)


BAD_CLIPS = [  # (multi_modal_data["audio"], what the message says); each names multi_modal_data.audio[0]
    (np.zeros(RATE, np.float32), "as \\(samples, sampling_rate_hz\\)"),
    ((np.zeros(RATE, np.float32), 0), "sampling rate 0 is not a number of Hz"),
    ((np.zeros(RATE, np.float32), float("nan")), "sampling rate nan"),
    ((np.zeros(RATE, np.float32), "16k"), "sampling rate '16k'"),
    ((np.zeros(RATE, np.float32), 10**6), "sampling rate 1000000"),
    ((np.zeros(0, np.float32), RATE), "no samples"),
    ((np.zeros((2, 3, 4), np.float32), RATE), "1-D \\(mono\\) or 2-D"),
    ((np.zeros((9, RATE), np.float32), RATE), "9 channels"),
    ((np.zeros(RATE, np.complex64), RATE), "dtype complex64"),
    ((np.full(RATE, np.nan, np.float32), RATE), "non-finite"),
    ((np.zeros(RATE * 601, np.float32), RATE), "over the limit of 600 s"),
    ((np.zeros(1, np.float32), 192000), "too short to resample"),
    ((np.zeros(RATE, np.float32), RATE, "mono"), "not 3 values"),
    ((["a", "b"], RATE), "dtype <U1"),
    (([[0.0], [0.0, 1.0]], RATE), "array of numbers"),
    ("https://example.com/a.wav", "only by the server"),
    (12, "unsupported type int"),
]


@pytest.mark.parametrize(("clip", "match"), BAD_CLIPS)
def test_bad_clips_are_refused_naming_the_item(family, clip, match):
    error = refused(lambda: run_prompt(family, audio_prompt(clip)), "multi_modal_data.audio[0]", match)
    assert str(error).startswith("multi_modal_data.audio[0]")


def test_a_mismatched_placeholder_count_is_refused(family):
    refused(lambda: run_prompt(family, {"prompt": "no placeholder", "multi_modal_data": {"audio": CLIP_WAV}}),
            "prompt", "0 audio placeholder")


# --- content keys -----------------------------------------------------------------------------------------

def test_keys_follow_the_samples_the_model_sees(family):
    def key(clip, proc=family) -> str:
        return run_prompt(proc, audio_prompt(clip)).items[0].content_hash

    other = pcm16(0.5, RATE, seed=1)  # the same length, other samples
    assert key(CLIP_WAV) == key(CLIP_WAV) == key((CLIP, RATE))
    assert key(wav(other, RATE)) != key(CLIP_WAV)
    # one signal sent at 44.1 kHz and at 16 kHz: the key is over the samples at the model's rate, and
    # resampled samples are not bit for bit the native ones, so these are two entries (documented)
    t44, t16 = np.arange(44100) / 44100, np.arange(RATE) / RATE
    tone = lambda t: (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)  # noqa: E731
    assert key((tone(t44), 44100)) != key((tone(t16), RATE))

    class OtherSettings(AudioFamily):
        mel_bins = 80

    assert key(CLIP_WAV, OtherSettings()) != key(CLIP_WAV)  # the family's processing key is in the key


# --- families -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def no_audio() -> MultimodalProcessor:
    family = resolve(read_config(DEMO_MODEL_DIR))
    config = family.parse_config(read_config(DEMO_MODEL_DIR))
    return family.processor_class(DEMO_MODEL_DIR, config, MediaLimits())


def test_a_family_without_audio_refuses_the_first_audio_part(no_audio):
    assert AUDIO not in no_audio.modalities and no_audio.audio_sampling_rate_hz is None
    messages = user({"type": "image_url", "image_url": {"url": PNG}}, input_audio(b"not even decoded"),
                    audio_url("data:audio/wav;base64,AAAA"))
    refused(lambda: no_audio.render_chat(messages), "messages[0].content[1].input_audio",
            "this model does not take audios \\(2 given\\); it takes: image, video")
    refused(lambda: run_prompt(no_audio, audio_prompt([CLIP_WAV, CLIP_WAV])), "multi_modal_data.audio[0]",
            "does not take audios")


def test_a_family_that_takes_audio_names_its_rate():
    class NoRate(AudioFamily):
        audio_sampling_rate_hz = None

    with pytest.raises(ValueError, match="audio_sampling_rate_hz"):
        NoRate()


def test_audio_limits_are_media_limits():
    assert MediaLimits(max_audio_bytes=1000, max_audio_duration_s=2.5).audio == AudioLimits(1000, 2.5)
    assert MediaLimits().audio == AudioLimits()
    for bad in ({"max_audio_bytes": 0}, {"max_audio_duration_s": -1.0}):
        with pytest.raises(ValueError):
            MediaLimits(**bad)


# --- the server's resolution --------------------------------------------------------------------------

def test_audio_parts_count_against_the_limit_per_prompt():
    rules = MediaRules(MediaLimits(), limit_per_prompt={IMAGE: 16, VIDEO: 4, AUDIO: 1})
    two = user(input_audio(CLIP_WAV), audio_url("https://example.com/a.wav"))
    refused(lambda: resolve_messages(two, rules), "messages[0].content[1].audio_url", "at most 1 audio")
    assert MediaRules(MediaLimits()).limit_per_prompt[AUDIO] == 4
    with pytest.raises(ValueError):
        MediaRules(MediaLimits(), limit_per_prompt={"speech": 1})


def test_audio_urls_are_fetched_under_the_image_rules():
    rules = MediaRules(MediaLimits())
    refused(lambda: resolve_messages(user(audio_url("http://127.0.0.1:9/a.wav")), rules),
            "messages[0].content[0].audio_url", "private, loopback or link-local")


@pytest.fixture
def served_clip():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Length", str(len(CLIP_WAV)))
            self.end_headers()
            self.wfile.write(CLIP_WAV)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/clip.wav"
    server.shutdown()
    server.server_close()


def test_a_fetched_audio_url_is_capped_at_max_audio_bytes_and_decoded_in_the_processor(served_clip):
    private = FetchPolicy(allow_private=True)
    rules = MediaRules(MediaLimits(max_audio_bytes=len(CLIP_WAV)), private)
    resolved = resolve_messages(user(audio_url(served_clip), input_audio(CLIP_WAV)), rules)
    assert resolved[0]["content"][0]["audio_url"] == {"url": CLIP_WAV}
    assert resolved[0]["content"][1]["input_audio"] == EncodedAudio(CLIP_WAV, "wav")
    prompt = run_chat(AudioFamily(), resolved)
    assert prompt.items[0].content_hash == prompt.items[1].content_hash
    small = MediaRules(MediaLimits(max_audio_bytes=len(CLIP_WAV) - 1, max_image_bytes=10**6), private)
    refused(lambda: resolve_messages(user(audio_url(served_clip)), small), "messages[0].content[0].audio_url",
            f"over the limit of {len(CLIP_WAV) - 1} bytes")
    big = input_audio(CLIP_WAV * 2)  # refused before its base64 is decoded
    error = refused(lambda: resolve_messages(user(big), small), "messages[0].content[0].input_audio",
                    "input_audio.data is about .* over the limit")
    assert error.setting == "max_audio_bytes"


def test_a_uuid_alone_goes_on_as_the_clip_sent_before():
    rules = MediaRules(MediaLimits())
    for part in ({"type": "input_audio", "uuid": "u"}, {"type": "input_audio", "input_audio": {"data": None},
                                                         "uuid": "u"}, {"type": "audio_url", "uuid": "u"}):
        resolved = resolve_messages(user(part), rules)[0]["content"][0]
        assert resolved[part["type"]] is None and resolved["uuid"] == "u"


def test_completions_media_take_audio_parts():
    parts = [input_audio(CLIP_WAV, "wav"), {"type": "image_url", "image_url": {"url": PNG}},
             audio_url("data:audio/wav;base64," + b64(CLIP_WAV), uuid="c")]
    media = resolve_media(parts, MediaRules(MediaLimits()))
    assert media.audios == [EncodedAudio(CLIP_WAV, "wav"), "data:audio/wav;base64," + b64(CLIP_WAV)]
    assert media.params[AUDIO] == ["media[0].input_audio", "media[2].audio_url"]
    assert media.uuids[AUDIO] == [None, "c"]
    refused(lambda: resolve_media([input_audio(CLIP_WAV, "aac")], MediaRules(MediaLimits())),
            "media[0].input_audio.format", "not one of")

"""The web chat's audio, driven in headless Chromium (Playwright) against a server on the tiny Gemma 4
checkpoint (testkit/tiny_gemma4.py, audio tower included).

An attached WAV file (a 440 Hz tone written here with `wave`) must be sent as an `input_audio` part
holding that file's base64 and format "wav", shown as an audio player in the composer and in the
transcript, and answered; a file in a format input_audio does not take is refused in the page with a
message. The microphone button records from Chromium's fake microphone
(`--use-fake-device-for-media-stream`, permission granted by `--use-fake-ui-for-media-stream`); the
recording must be sent as a valid 16-bit PCM mono WAV (parsed here from the request the page sent) and
answered. A microphone refused (permission denied, none found, no getUserMedia on an insecure page)
must give its message and leave the page working. That the audio controls are hidden for a model
without audio is checked on the demo model in test_web_ui.py.

Browser and driver as in test_web_ui.py; the tests skip when either is missing.
"""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import wave

import httpx
import pytest

from tests.e2e.conftest import running_server
from tests.e2e.test_web_ui import _last_answer, _send, _wait_done, chromium

# a fake microphone that needs no permission prompt
FAKE_MEDIA_ARGS = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]
RATE_HZ = 16_000
RECORD_MS = 1000  # how long the fake microphone records (any length makes a valid WAV)
# replaces getUserMedia as a refused microphone: `window.micFailure` names the DOMException to raise, or
# "insecure" removes navigator.mediaDevices (what a plain-http page on another host sees)
REFUSED_MICROPHONE_JS = """
Object.defineProperty(window, "micFailure", { value: "NotAllowedError", writable: true });
const realMediaDevices = navigator.mediaDevices;
Object.defineProperty(navigator, "mediaDevices", { get: () => (window.micFailure === "insecure" ? undefined : {
  getUserMedia: () => Promise.reject(new DOMException("refused in the test", window.micFailure)),
  enumerateDevices: () => realMediaDevices.enumerateDevices(),
}) });
"""


def tone_wav(seconds: float = 1.0, hz: float = 440.0) -> bytes:
    """A mono 16-bit PCM WAV file of a sine tone at RATE_HZ."""
    frames = b"".join(struct.pack("<h", round(0.3 * 32767 * math.sin(2 * math.pi * hz * i / RATE_HZ)))
                      for i in range(int(seconds * RATE_HZ)))
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE_HZ)
        out.writeframes(frames)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def server(all_checkpoints, tmp_path_factory):
    model_dir = all_checkpoints["gemma4"]
    with running_server(str(model_dir), tmp_path_factory.mktemp("logs") / "web-ui-audio.log") as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    yield from chromium(tuple(FAKE_MEDIA_ARGS))


def _open(browser, server, errors: list[str]):
    """A page on the chat, ready, with short answers; every chat request body it sends is appended to the
    list it returns, every console error and uncaught exception to `errors`."""
    page = browser.new_page(viewport={"width": 900, "height": 1000})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    bodies: list[dict] = []

    def chat_request(route, request):
        bodies.append(json.loads(request.post_data))
        route.continue_()

    page.route("**/v1/chat/completions", chat_request)
    page.goto(server.url + "/")
    page.wait_for_selector("body[data-ready=true]")
    page.fill("#max-tokens", "4")
    return page, bodies


def test_config_names_the_media_the_model_takes(server):
    config = httpx.get(server.url + "/web-ui/config.json", timeout=5).json()
    assert config["input_modalities"] == ["image", "video", "audio"], config


def test_attach_a_wav_file(server, browser):
    errors: list[str] = []
    page, bodies = _open(browser, server, errors)
    assert page.locator("#audio-button").is_visible() and page.locator("#record-button").is_visible()
    wav = tone_wav()
    page.set_input_files("#audio-input", files=[{"name": "tone.wav", "mimeType": "audio/wav", "buffer": wav}])
    attached = page.locator("#attachments figure.audio")
    attached.locator("audio[controls]").wait_for()
    assert attached.locator("figcaption").inner_text() == "tone.wav"

    _send(page, "What do you hear?")
    _wait_done(page)
    parts = bodies[-1]["messages"][-1]["content"]
    assert parts == [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
                     {"type": "text", "text": "What do you hear?"}]
    players = page.locator("article.message.user").last.locator("audio[controls]")
    assert players.count() == 1
    assert players.get_attribute("src").startswith("data:audio/wav;base64,")
    assert page.locator("#attachments figure").count() == 0  # sent: the composer is empty again
    # the server took the clip as a media item of the prompt
    assert _last_answer(page).locator(".cache").get_attribute("data-mm-items") == "1"

    # a format input_audio does not take is refused in the page; a clip can be removed before sending
    page.set_input_files("#audio-input", files=[{"name": "clip.m4a", "mimeType": "audio/mp4", "buffer": b"m4a"},
                                                {"name": "again.wav", "mimeType": "audio/wav", "buffer": wav}])
    page.locator("#attachments figure.audio").wait_for()
    assert "Not attached: clip.m4a" in page.inner_text("#error")
    assert page.locator("#attachments figcaption").all_inner_texts() == ["again.wav"]
    page.click("button[aria-label='Remove again.wav']")
    page.locator("#attachments figure").wait_for(state="detached")
    assert not errors, errors
    page.close()


def _parse_wav(data: bytes) -> tuple[int, int, int, int, int]:
    """(audio format, channels, rate, bits per sample, frames) from a canonical 44-byte WAV header,
    checked against the data's length."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE" and data[12:16] == b"fmt ", data[:16]
    assert struct.unpack("<I", data[4:8])[0] == len(data) - 8
    audio_format, channels, rate, _, block, bits = struct.unpack("<HHIIHH", data[20:36])
    assert data[36:40] == b"data"
    size = struct.unpack("<I", data[40:44])[0]
    assert size == len(data) - 44 and block == channels * bits // 8
    return audio_format, channels, rate, bits, size // block


def test_record_from_the_microphone(server, browser):
    errors: list[str] = []
    page, bodies = _open(browser, server, errors)
    page.click("#record-button")
    page.wait_for_selector("#record-button[aria-pressed=true]")
    assert page.inner_text("#record-button") == "Stop recording"
    page.wait_for_timeout(RECORD_MS)  # sound for the recording; no verdict depends on how much
    page.click("#record-button")
    page.locator("#attachments figure.audio audio[controls]").wait_for()
    assert page.inner_text("#attachments figcaption") == "recording 1.wav"
    assert page.get_attribute("#record-button", "aria-pressed") == "false"

    _send(page, "Transcribe this.")
    _wait_done(page)
    part = bodies[-1]["messages"][-1]["content"][0]
    assert part["type"] == "input_audio" and part["input_audio"]["format"] == "wav", part["type"]
    data = base64.b64decode(part["input_audio"]["data"], validate=True)
    audio_format, channels, rate, bits, frames = _parse_wav(data)
    assert (audio_format, channels, rate, bits) == (1, 1, RATE_HZ, 16)  # PCM, mono, 16 kHz, 16-bit
    assert frames > 0
    with wave.open(io.BytesIO(data)) as clip:  # Python's reader agrees
        assert (clip.getnchannels(), clip.getsampwidth(), clip.getframerate(), clip.getnframes()) == \
            (1, 2, RATE_HZ, frames)
    print(f"recorded {frames / RATE_HZ:.2f} s")
    assert page.locator("article.message.user").last.locator("audio[controls]").count() == 1
    assert not errors, errors
    page.close()


@pytest.mark.parametrize(("failure", "message"), [
    ("NotAllowedError", "Microphone access was denied"),
    ("NotFoundError", "No microphone was found"),
    ("insecure", "browsers allow the microphone only on https or localhost"),
])
def test_a_refused_microphone_says_why(server, browser, failure, message):
    errors: list[str] = []
    page = browser.new_page()
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    page.add_init_script(REFUSED_MICROPHONE_JS)
    page.goto(server.url + "/")
    page.wait_for_selector("body[data-ready=true]")
    page.evaluate("(failure) => { window.micFailure = failure; }", failure)
    page.click("#record-button")
    page.wait_for_selector("#error:not([hidden])")
    assert message in page.inner_text("#error")
    # nothing is left half-started: the button is ready for another try, nothing was attached
    assert page.inner_text("#record-button") == "Record" and page.is_enabled("#record-button")
    assert page.get_attribute("#record-button", "aria-pressed") == "false"
    assert page.locator("#attachments figure").count() == 0
    assert not errors, errors
    page.close()

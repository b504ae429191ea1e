"""Audio loading (`inputs/audio.py`): bytes of an audio file -> mono float32 at a requested rate, as
librosa/transformers load it (int PCM / 32768, channels averaged, soxr "HQ"), and every bad input an
InvalidInputError naming the request field. All audio is generated here; nothing is downloaded."""

from __future__ import annotations

import io
import struct
import wave

import av
import numpy as np
import pytest
import soundfile
import soxr
from PIL import Image

from mmserve.errors import InvalidInputError
from mmserve.inputs.audio import AUDIO_FORMATS, AudioClip, AudioLimits, decode_audio

PARAM = "messages[0].content[1].input_audio"
LIMITS = AudioLimits()


def _decode(data: bytes, rate: int = 16000, limits: AudioLimits = LIMITS,
            format: str | None = None) -> AudioClip:
    return decode_audio(data, param=PARAM, sampling_rate_hz=rate, limits=limits, format=format)


def _refused(data: bytes, match: str, param: str = PARAM, **kwargs) -> InvalidInputError:
    with pytest.raises(InvalidInputError, match=match) as caught:
        _decode(data, **kwargs)
    assert caught.value.param == param
    assert "Traceback" not in str(caught.value) and len(str(caught.value)) < 300
    return caught.value


def _pcm16(seconds: float, rate: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    """(samples, channels) int16: tones plus a little noise, using the full range's sign and low bits."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    tones = [0.4 * np.sin(2 * np.pi * (330 + 220 * c) * t) + 0.05 * rng.standard_normal(len(t))
             for c in range(channels)]
    return np.round(np.stack(tones, axis=1) * 32767).astype(np.int16)


def _wav(pcm: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(pcm.shape[1])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buf.getvalue()


def _wav_header(payload: bytes, *, rate: int = 16000, channels: int = 1, bits: int = 16, tag: int = 1,
                data_size: int | None = None, extra_chunk: bytes = b"") -> bytes:
    """A RIFF/WAVE file written by hand, so its header can say what the data is not."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    size = len(payload) if data_size is None else data_size
    body = (b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + extra_chunk
            + b"data" + struct.pack("<I", size) + payload)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _encode(signal: np.ndarray, rate: int, container: str, codec: str, sample_format: str) -> bytes:
    """`signal` (channels, samples) float in [-1, 1] encoded with PyAV; skips where this build lacks
    `codec`."""
    try:
        av.codec.Codec(codec, "w")
    except av.codec.codec.UnknownCodecError:
        pytest.skip(f"this PyAV build cannot encode {codec}")
    layout = "mono" if signal.shape[0] == 1 else "stereo"
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        # FFmpeg's own vorbis encoder is marked experimental; it is the only vorbis encoder here
        stream = out.add_stream(codec, rate=rate, layout=layout, options={"strict": "experimental"})
        planar = av.AudioFormat(sample_format).is_planar
        for start in range(0, signal.shape[1], 1024):
            chunk = signal[:, start:start + 1024]
            chunk = np.round(chunk * 32767).astype(np.int16) if sample_format.startswith("s16") else \
                chunk.astype(np.float32)
            chunk = np.ascontiguousarray(chunk if planar else chunk.T.reshape(1, -1))
            frame = av.AudioFrame.from_ndarray(chunk, format=sample_format, layout=layout)
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _tone(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return np.stack([0.3 * np.sin(2 * np.pi * (440 + 110 * c) * t) for c in range(channels)])


def _flac(pcm: np.ndarray, rate: int) -> bytes:
    return _encode(pcm.T.astype(np.float64) / 32767, rate, "flac", "flac", "s16")


def _with_flac_total_samples(data: bytes, total: int) -> bytes:
    """Rewrite STREAMINFO's total-samples field (the low 36 bits of the 8 bytes at offset 18; 0: unknown)."""
    assert data[:4] == b"fLaC"
    packed = int.from_bytes(data[18:26], "big")
    packed = (packed & ~((1 << 36) - 1)) | total
    return data[:18] + packed.to_bytes(8, "big") + data[26:]


COMPRESSED = {  # format name -> (container, codec, sample format, channels)
    "mp3": ("mp3", "libmp3lame", "fltp", 1),
    "ogg-vorbis": ("ogg", "vorbis", "fltp", 2),  # FFmpeg's vorbis encoder takes stereo only
    "ogg-opus": ("ogg", "libopus", "flt", 1),
    "m4a-aac": ("ipod", "aac", "fltp", 1),
}


# --- decoding what librosa would decode ----------------------------------------------------------------


def test_16k_mono_wav_is_decoded_exactly():
    pcm = _pcm16(1.0, 16000)
    clip = _decode(_wav(pcm, 16000))
    assert clip.samples.dtype == np.float32 and clip.samples.ndim == 1
    assert clip.sampling_rate_hz == 16000 and clip.duration_s == 1.0
    np.testing.assert_array_equal(clip.samples, pcm[:, 0].astype(np.float32) / 32768)


def test_a_latin1_tag_does_not_fail_the_file():
    title = "Chanson d'\xe9t\xe9\0".encode("latin-1")  # not UTF-8
    info = b"INFO" + b"INAM" + struct.pack("<I", len(title)) + title
    pcm = _pcm16(0.25, 16000)
    data = _wav_header(pcm.tobytes(), extra_chunk=b"LIST" + struct.pack("<I", len(info)) + info)
    np.testing.assert_array_equal(_decode(data).samples, pcm[:, 0].astype(np.float32) / 32768)


def test_44k_stereo_is_averaged_to_mono_then_resampled_like_soxr_hq():
    pcm = _pcm16(1.5, 44100, channels=2)
    clip = _decode(_wav(pcm, 44100), rate=16000)
    mono = (pcm.astype(np.float32) / 32768).mean(axis=1, dtype=np.float32)
    expected = soxr.resample(mono, 44100, 16000, quality="HQ")
    assert clip.sampling_rate_hz == 16000 and clip.samples.shape == expected.shape
    np.testing.assert_allclose(clip.samples, expected, rtol=0, atol=1e-6)


def test_flac_is_lossless():
    pcm = _pcm16(1.0, 16000, channels=2, seed=1)
    clip = _decode(_flac(pcm, 16000))
    expected = (pcm.astype(np.float32) / 32768).mean(axis=1, dtype=np.float32)
    np.testing.assert_array_equal(clip.samples, expected)


@pytest.mark.parametrize("name", COMPRESSED)
def test_lossy_formats_decode_to_about_the_right_duration(name):
    container, codec, sample_format, channels = COMPRESSED[name]
    clip = _decode(_encode(_tone(1.0, 48000, channels), 48000, container, codec, sample_format), rate=16000)
    assert clip.sampling_rate_hz == 16000 and clip.samples.dtype == np.float32
    assert abs(clip.duration_s - 1.0) < 0.1
    assert 0.2 < np.abs(clip.samples).max() < 0.45  # a 0.3 tone (channel mean), not silence or noise


# --- the request's `format` ----------------------------------------------------------------------------


def test_format_names_match_the_openai_ones():
    assert AUDIO_FORMATS == ("wav", "mp3", "flac", "ogg")


@pytest.mark.parametrize("name, make", [
    ("wav", lambda: _wav(_pcm16(0.2, 16000), 16000)),
    ("WAV", lambda: _wav(_pcm16(0.2, 16000), 16000)),
    ("flac", lambda: _flac(_pcm16(0.2, 16000), 16000)),
    ("mp3", lambda: _encode(_tone(0.5, 44100), 44100, *COMPRESSED["mp3"][:3])),
    ("ogg", lambda: _encode(_tone(0.5, 48000), 48000, *COMPRESSED["ogg-opus"][:3])),
])
def test_a_matching_format_passes(name, make):
    assert _decode(make(), format=name).duration_s > 0.1


def test_a_mismatched_format_is_refused_naming_the_format_field():
    _refused(_wav(_pcm16(0.2, 16000), 16000), "given as 'mp3' but the data is 'wav'", param=f"{PARAM}.format",
             format="mp3")
    _refused(_flac(_pcm16(0.2, 16000), 16000), "given as 'wav' but the data is 'flac'",
             param=f"{PARAM}.format", format="wav")


@pytest.mark.parametrize("name", ["aiff", "pcm16", "", "m4a"])
def test_an_unknown_format_name_is_refused_naming_the_format_field(name):
    _refused(_wav(_pcm16(0.2, 16000), 16000), "is not one of wav, mp3, flac, ogg", param=f"{PARAM}.format",
             format=name)


# --- bad input: always InvalidInputError with the field named ----------------------------------------


def test_oversized_bytes_are_refused_before_decoding():
    # garbage past the cap says "over the limit", not "not readable": nothing was decoded
    _refused(b"\x00" * 1001, "1001 bytes, over the limit of 1000 bytes", limits=AudioLimits(max_bytes=1000))
    _refused(_wav(_pcm16(1.0, 16000), 16000), "over the limit", limits=AudioLimits(max_bytes=1000))


@pytest.mark.parametrize("data", [b"definitely not audio" * 50, bytes(range(256)) * 20, b"RIFF", b"\xff\xfb"],
                         ids=["text", "bytes", "riff-stub", "mp3-stub"])
def test_garbage_is_refused(data):
    _refused(data, "not a readable audio file|could not be decoded|no audio stream|no decodable samples")


def test_empty_bytes_are_refused():
    _refused(b"", "empty")


def test_an_image_is_refused():
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buf, format="PNG")
    _refused(buf.getvalue(), "not a readable audio file")


def test_a_video_without_audio_is_refused():
    try:
        av.codec.Codec("mpeg4", "w")
    except av.codec.codec.UnknownCodecError:
        pytest.skip("this PyAV build cannot encode mpeg4 video")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(5):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 40 * i, np.uint8), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    _refused(buf.getvalue(), "no audio stream")


def test_a_wav_header_declaring_ten_hours_over_100_bytes_is_refused():
    # FFmpeg clamps the data size to the bytes present; the header's own claim is what is refused
    _refused(_wav_header(b"\x01\x00" * 50, data_size=16000 * 2 * 36000), "declares a duration of 36000.0 s")


def test_a_flac_header_declaring_ten_hours_is_refused():
    _refused(_with_flac_total_samples(_flac(_pcm16(0.5, 16000), 16000), 16000 * 36000), "declares a duration")


def test_a_clip_over_the_duration_limit_is_refused_from_its_header():
    _refused(_wav(_pcm16(3.0, 16000), 16000), "declares a duration of 3.0 s, over the limit of 2 s",
             limits=AudioLimits(max_duration_s=2.0))


def test_decoding_stops_at_the_duration_limit_when_no_header_says_how_long():
    # FLAC with total samples 0 ("unknown"): nothing declares the 3 s, so the decoded count must catch it
    data = _with_flac_total_samples(_flac(_pcm16(3.0, 16000), 16000), 0)
    assert _decode(data).duration_s == 3.0
    _refused(data, "longer than the limit of 2 s \\(decoded past it\\)",
             limits=AudioLimits(max_duration_s=2.0))


def test_a_sampling_rate_of_zero_is_refused():
    _refused(_wav_header(b"\x00\x01" * 1000, rate=0), "not a readable audio file|sampling rate 0 Hz")


def test_no_channels_is_refused():
    _refused(_wav_header(b"\x00\x01" * 1000, channels=0), "not a readable audio file|0 channels|no channels")


def test_a_sampling_rate_over_the_limit_is_refused():
    _refused(_wav(_pcm16(0.1, 16000), 16000), "sampling rate 16000 Hz is not in 1..8000 Hz",
             limits=AudioLimits(max_sampling_rate_hz=8000))


def test_too_many_channels_are_refused():
    _refused(_wav(_pcm16(0.1, 16000, channels=3), 16000), "3 channels, not 1..2",
             limits=AudioLimits(max_channels=2))


def test_an_unknown_codec_is_refused():
    _refused(_wav_header(b"\x00\x01" * 1000, bits=0), "codec is unknown or unsupported")


def test_a_file_with_no_samples_is_refused():
    _refused(_wav(np.zeros((0, 1), np.int16), 16000), "no decodable samples|not a readable audio file")


def test_non_finite_float_samples_are_refused():
    payload = np.array([0.1, np.nan, -0.2, np.inf] * 100, np.float32).tobytes()
    _refused(_wav_header(payload, bits=32, tag=3), "non-finite")


def test_truncated_compressed_audio_never_escapes_as_another_error():
    data = _encode(_tone(1.0, 44100), 44100, *COMPRESSED["mp3"][:3])
    for cut in (10, 100, 417, len(data) // 2):
        try:
            _decode(data[:cut])
        except InvalidInputError as exc:
            assert exc.param == PARAM


# --- the types -----------------------------------------------------------------------------------------


def test_limits_must_be_positive():
    with pytest.raises(ValueError):
        AudioLimits(max_duration_s=0)
    with pytest.raises(ValueError):
        AudioLimits(max_bytes=-1)


def test_a_nonpositive_output_rate_is_the_callers_bug():
    with pytest.raises(ValueError, match="sampling_rate_hz"):
        _decode(_wav(_pcm16(0.1, 16000), 16000), rate=0)


def test_mp3_is_decoded_by_libsndfile_under_the_duration_limit():
    """MP3 goes through libsndfile (transformers' decoder); its length is counted as it decodes: over the
    limit it is refused whatever the header, and the samples are libsndfile's, mixed and resampled alike."""
    data = _encode(_tone(3.0, 44100, channels=2), 44100, *COMPRESSED["mp3"][:3])
    clip = _decode(data)
    decoded, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    expected = soxr.resample(decoded.T.mean(axis=0, dtype=np.float32), rate, 16000, quality="HQ")
    assert np.array_equal(clip.samples, expected)
    _refused(data, "over the limit of 2 s|longer than the limit of 2 s", limits=AudioLimits(max_duration_s=2.0))
    _refused(data[:200] + bytes(range(256)) * 8, "could not be decoded|not a readable|no decodable|no audio")

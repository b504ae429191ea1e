"""An audio item's source, in whatever form a request or a caller gives it, as the samples the model hears.

Role: `EncodedAudio` is an audio file's bytes with the format a request names for them (OpenAI's
`input_audio`); `input_audio(value, where)` checks an `input_audio` object (`{"data": <base64>, "format":
"wav" | "mp3" | "flac" | "ogg"}`) and decodes its base64; `load_audio(source, limits, sampling_rate_hz,
where)` turns one source into mono float32 samples at the family's rate under the media limits:
- an encoded file: bytes, `EncodedAudio`, a `data:` URL, a local path or `file://` URL (only below
  `allowed_local_media_path`): decoded by audio.py's `decode_audio`;
- samples: vLLM's `(array, sampling_rate_hz)` tuple or an `AudioClip`: audio.py's `clip_from_samples`
  (the same scaling, mix-down and resampler as a file's).
A bare array is refused: without its rate, samples at the wrong rate would pass unnoticed.
Every bad source is an `InvalidInputError` naming `where` (or `where.format`, `where.data`).

What it does not know: models, feature extraction, uuids, HTTP (the server fetches http(s) URLs).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserve.errors import InvalidInputError
from mmserve.inputs.audio import AUDIO_FORMATS, AudioClip, clip_from_samples, decode_audio
from mmserve.inputs.media import MediaLimits, decode_data_uri, read_local_file


@dataclass(frozen=True)
class EncodedAudio:
    """The bytes of an audio file, and the format the request says they are (None: any audio container)."""

    data: bytes
    format: str | None = None


def _over_cap(base64_chars: int, max_bytes: int, what: str, param: str) -> None:
    """Refuse base64 whose bytes would pass `max_bytes`, before decoding it (4 characters hold 3 bytes)."""
    if base64_chars // 4 * 3 > max_bytes + 3:
        raise InvalidInputError(f"{what} is about {base64_chars // 4 * 3} bytes, over the limit of "
                                f"{max_bytes} bytes (max_audio_bytes)", param=param,
                                setting="max_audio_bytes")


def input_audio(value: Any, where: str, max_bytes: int | None = None) -> EncodedAudio:
    """OpenAI's `input_audio` object at `where` (`messages[0].content[1].input_audio`) as its bytes;
    `max_bytes` (the server's: max_audio_bytes) refuses larger data before its base64 is decoded."""
    if not isinstance(value, dict):
        raise InvalidInputError(f"{where} must be an object {{'data': <base64>, 'format': "
                                f"{' | '.join(repr(f) for f in AUDIO_FORMATS)}}}", param=where)
    unknown = sorted(set(value) - {"data", "format"})
    if unknown:
        raise InvalidInputError(f"{where} has unknown keys {unknown}", param=f"{where}.{unknown[0]}")
    name = value.get("format")
    if not isinstance(name, str) or name.strip().lower() not in AUDIO_FORMATS:
        raise InvalidInputError(f"{where}.format {name!r:.40} is not one of {', '.join(AUDIO_FORMATS)}",
                                param=f"{where}.format")
    data = value.get("data")
    if not isinstance(data, str) or not data:
        raise InvalidInputError(f"{where}.data must be the audio file as a non-empty base64 string",
                                param=f"{where}.data")
    if max_bytes is not None:
        _over_cap(len(data), max_bytes, f"{where}.data", where)
    try:
        return EncodedAudio(base64.b64decode(data, validate=True), name.strip().lower())
    except (binascii.Error, ValueError) as exc:
        raise InvalidInputError(f"{where}.data is not valid base64: {exc}", param=f"{where}.data") from exc


def _data_url_bytes(url: str, limits: MediaLimits, where: str) -> bytes:
    """A data URL's bytes, refused before decoding when its base64 alone says they are over the cap."""
    what = f"{where}: the audio in the data URL"
    _over_cap(len(url) - url.find(",") - 1, limits.max_audio_bytes, what, where)
    return decode_data_uri(url, where)


def _encoded(source: Any, limits: MediaLimits, where: str) -> EncodedAudio:
    if isinstance(source, EncodedAudio):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return EncodedAudio(bytes(source))
    if isinstance(source, str):
        if source.startswith("data:"):
            return EncodedAudio(_data_url_bytes(source, limits, where))
        if source.startswith(("http://", "https://")):
            raise InvalidInputError(f"{where}: http(s) URLs are fetched only by the server", param=where)
        return EncodedAudio(read_local_file(source, limits, where, limits.max_audio_bytes, "max_audio_bytes"))
    if isinstance(source, np.ndarray):
        raise InvalidInputError(f"{where}: give samples with their rate, as (samples, sampling_rate_hz)",
                                param=where)
    raise InvalidInputError(f"{where} has unsupported type {type(source).__name__}; expected (samples, "
                            "sampling_rate_hz), an audio file's bytes, a data URL or a local path",
                            param=where)


def load_audio(source: Any, limits: MediaLimits, sampling_rate_hz: int, where: str) -> np.ndarray:
    """One audio source -> mono float32 samples at `sampling_rate_hz` (1-D, at least one sample). Every
    error's message starts with `where`, as the image loaders' do."""
    try:
        return _clip(source, limits, sampling_rate_hz, where).samples
    except InvalidInputError as exc:
        if str(exc).startswith(where):
            raise
        raise exc.reworded(f"{where}: {exc}") from exc


def _clip(source: Any, limits: MediaLimits, sampling_rate_hz: int, where: str) -> AudioClip:
    audio_limits = limits.audio
    if isinstance(source, (tuple, AudioClip)):
        if isinstance(source, AudioClip):
            source = (source.samples, source.sampling_rate_hz)
        if len(source) != 2:
            raise InvalidInputError(f"an audio clip given as a tuple is (samples, sampling_rate_hz), not "
                                    f"{len(source)} values", param=where)
        return clip_from_samples(source[0], source[1], param=where, sampling_rate_hz=sampling_rate_hz,
                                 limits=audio_limits)
    encoded = _encoded(source, limits, where)
    if len(encoded.data) > limits.max_audio_bytes:  # decode_audio refuses it too, without naming the setting
        raise InvalidInputError(f"audio is {len(encoded.data)} bytes, over the limit of "
                                f"{limits.max_audio_bytes} bytes (max_audio_bytes)", param=where,
                                setting="max_audio_bytes")
    return decode_audio(encoded.data, param=where, sampling_rate_hz=sampling_rate_hz, limits=audio_limits,
                        format=encoded.format)

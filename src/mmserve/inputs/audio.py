"""Decode the bytes of an audio file into mono float32 samples at a requested sampling rate, with limits.

Role: `decode_audio(data, param=..., sampling_rate_hz=..., limits=...)` reads any container and codec
PyAV reads (wav/pcm, mp3, flac, ogg vorbis/opus, m4a/aac, webm/opus, ...), mixes the channels down to
mono by averaging them, scales integer PCM to float32 as librosa/soundfile do (int16 / 32768, ...), and
resamples with soxr at "HQ" quality: librosa's default `res_type="soxr_hq"`, the loading transformers'
and vLLM's audio paths use, so the samples match theirs. MP3 is decoded by libsndfile (soundfile), as
transformers' loader decodes it: MP3 decoders differ in their last bits, and its mpg123 is the reference;
PCM in WAV too, for speed (PyAV still opens and checks every file first). Every bad input raises `InvalidInputError`
naming `param` (or `param.format`): oversized bytes (refused before decoding), undecodable or audio-less
files, impossible stream parameters, a declared or decoded duration over the limit.
`clip_from_samples(samples, rate_hz, ...)` does the same for samples a caller already holds (vLLM's
`(array, sampling_rate)`): the same scaling, mix-down and resampler, so an array and a WAV file of the
same samples give the same clip.

Memory and time are bounded by the limits, not by what a header says: the byte cap is checked first,
the declared duration (the container's, and a WAV header's own data size, which FFmpeg clamps to the
bytes present) is refused before decoding, and decoded samples are counted frame by frame so decoding
stops as soon as they pass `max_duration_s`. Samples are resampled as they are decoded, so only the
output rate's samples are ever held.

What it does not know: models, feature extraction, HTTP, where the bytes or samples came from.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import av
import numpy as np
import soundfile
import soxr

from mmserve.errors import InvalidInputError

AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")

# The demuxer name(s) PyAV reports for a file of each requested format.
_CONTAINER_NAMES = {"wav": ("wav",), "mp3": ("mp3",), "flac": ("flac",), "ogg": ("ogg",)}

# Only audio containers may be probed: without a whitelist FFmpeg would also open playlists (hls,
# concat) that name other files or URLs, and image or subtitle demuxers no audio can come from.
_DEMUXERS = ",".join(("wav", "w64", "mp3", "flac", "ogg", "aac", "aiff", "caf", "au",
                      "mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm"))

# PyAV's and FFmpeg's failures (av.FFmpegError subclasses ValueError/OSError/...), soxr's ValueError,
# libsndfile's (soundfile.SoundFileError).
_DECODE_ERRORS = (av.FFmpegError, OSError, ValueError, EOFError, RuntimeError, soundfile.SoundFileError)
_SNDFILE_BLOCK_FRAMES = 1 << 16  # frames libsndfile decodes at a time

# (offset, divisor) turning each integer sample format into float32 in [-1, 1], as libsndfile does.
_INT_SCALES = {"u8": (128.0, 128.0), "s16": (0.0, 32768.0), "s32": (0.0, 2.0**31), "s64": (0.0, 2.0**63)}

_MAX_WAV_CHUNKS = 64  # real WAV files carry a handful; a header walk must not scan megabytes of chunks


@dataclass(frozen=True)
class AudioLimits:
    """What one audio input may cost. The decoded samples held are at most
    `max_duration_s * sampling_rate_hz` (the requested output rate); decoding work is at most
    `max_duration_s * max_sampling_rate_hz * max_channels` samples."""

    max_bytes: int = 25 * 1024 * 1024  # OpenAI's audio upload limit
    max_duration_s: float = 600.0
    max_sampling_rate_hz: int = 192_000  # the highest rate common (studio) audio uses
    max_channels: int = 8  # 7.1 surround

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_duration_s, self.max_sampling_rate_hz, self.max_channels) <= 0:
            raise ValueError("audio limits must be positive")


@dataclass(frozen=True, eq=False)  # eq=False: numpy arrays do not compare to one bool
class AudioClip:
    """Mono float32 samples (1-D) at `sampling_rate_hz`."""

    samples: np.ndarray
    sampling_rate_hz: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sampling_rate_hz


def _check_format_name(format: str | None, param: str) -> str | None:
    if format is None:
        return None
    name = format.strip().lower()
    if name not in AUDIO_FORMATS:
        raise InvalidInputError(f"audio format {format!r} is not one of {', '.join(AUDIO_FORMATS)}",
                                param=f"{param}.format")
    return name


def _check_container(container: av.container.InputContainer, format: str | None, param: str) -> None:
    if format is None:
        return
    names = container.format.name.split(",")
    if not set(names) & set(_CONTAINER_NAMES[format]):
        raise InvalidInputError(f"audio format is given as {format!r} but the data is {names[0]!r}",
                                param=f"{param}.format")


def _wav_declared_duration_s(data: bytes) -> float | None:
    """What a RIFF/WAVE header's data chunk size says, in seconds; None when it says nothing.

    FFmpeg clamps a data size past the end of the bytes to what is there, so a header claiming hours
    over a few bytes would pass unnoticed; this reads the claim itself. 0 and 0xFFFFFFFF are the
    conventional "size unknown" (streamed WAV) and count as no claim."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    offset, byte_rate = 12, 0
    for _ in range(_MAX_WAV_CHUNKS):
        if offset + 8 > len(data):
            return None
        chunk_id, size = data[offset:offset + 4], struct.unpack_from("<I", data, offset + 4)[0]
        body = offset + 8
        if chunk_id == b"fmt " and size >= 14 and body + 14 <= len(data):
            _tag, _channels, rate, byte_rate, block_align = struct.unpack_from("<HHIIH", data, body)
            byte_rate = byte_rate or rate * block_align
        elif chunk_id == b"data":
            if byte_rate <= 0 or size in (0, 0xFFFFFFFF):
                return None
            return size / byte_rate
        offset = body + size + (size & 1)  # chunks are padded to an even size
    return None


def _declared_duration_s(data: bytes, container: av.container.InputContainer,
                         stream: av.audio.stream.AudioStream) -> float | None:
    """The longest duration the file claims for itself, from whichever of its headers say one."""
    claims = []
    if stream.duration is not None and stream.time_base is not None:
        claims.append(float(stream.duration * stream.time_base))
    if container.duration is not None:
        claims.append(container.duration / av.time_base)
    wav = _wav_declared_duration_s(data)
    if wav is not None:
        claims.append(wav)
    return max(claims) if claims else None


def _audio_stream(data: bytes, container: av.container.InputContainer,
                  limits: AudioLimits, param: str) -> av.audio.stream.AudioStream:
    """The first audio stream, once its header shows nothing the limits refuse."""
    if not container.streams.audio:
        raise InvalidInputError("the file has no audio stream", param=param)
    stream = container.streams.audio[0]
    if stream.codec_context is None:  # FFmpeg has no decoder for what the header names
        raise InvalidInputError("audio codec is unknown or unsupported", param=param)
    rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
    if not 0 < rate <= limits.max_sampling_rate_hz:
        raise InvalidInputError(f"audio sampling rate {rate} Hz is not in "
                                f"1..{limits.max_sampling_rate_hz} Hz", param=param)
    if not 0 < channels <= limits.max_channels:
        raise InvalidInputError(f"audio has {channels} channels, not 1..{limits.max_channels}", param=param)
    declared = _declared_duration_s(data, container, stream)
    if declared is not None and declared > limits.max_duration_s:
        raise InvalidInputError(f"audio declares a duration of {declared:.1f} s, over the limit of "
                                f"{limits.max_duration_s:g} s", param=param)
    return stream


def _as_float32(values: np.ndarray, base: str, param: str) -> np.ndarray:
    """(channels, samples) of one sample format as float32 in [-1, 1]: integer PCM scaled as libsndfile
    scales it, floats cast."""
    if base in _INT_SCALES:
        offset, divisor = _INT_SCALES[base]
        # rounding to float32 first then dividing by a power of two rounds once, as dividing exactly would
        return (values.astype(np.float32) - np.float32(offset)) / np.float32(divisor)
    if base in ("flt", "dbl"):
        return values.astype(np.float32, copy=False)
    raise InvalidInputError(f"audio sample format {base!r} is not supported", param=param)


def _mix_down(values: np.ndarray, param: str) -> np.ndarray:
    """(channels, samples) float32 -> mono: librosa's `to_mono`, a float32 mean over channels."""
    mono = values[0] if values.shape[0] == 1 else values.mean(axis=0, dtype=np.float32)
    if not np.isfinite(mono).all():  # librosa refuses these too; they would poison every feature downstream
        raise InvalidInputError("audio contains non-finite (NaN or infinite) samples", param=param)
    return mono


def _mono_float32(frame: av.AudioFrame, param: str) -> np.ndarray:
    """One decoded frame as mono float32."""
    planar = frame.format.is_planar
    base = frame.format.name[:-1] if planar else frame.format.name  # "s16p" -> "s16"
    channels = len(frame.layout.channels)
    if channels <= 0:
        raise InvalidInputError("audio has a frame with no channels", param=param)
    array = frame.to_ndarray()
    if not planar:  # interleaved: one row of samples * channels values
        array = array.reshape(-1, channels).T
    return _mix_down(_as_float32(array, base, param), param)


def _resampler(in_rate_hz: float, out_rate_hz: int) -> soxr.ResampleStream | None:
    """librosa's `res_type="soxr_hq"` as a stream (None: the rates are equal). Its output does not depend
    on how the input is cut into chunks, so a decoded file and an array of the same samples resample to
    the very same samples."""
    if in_rate_hz == out_rate_hz:
        return None
    return soxr.ResampleStream(in_rate_hz, out_rate_hz, 1, dtype="float32", quality="HQ")


def _joined(chunks: list[np.ndarray], decoded: int, resampler: soxr.ResampleStream | None,
            param: str) -> np.ndarray:
    """The decoded (and resampled) chunks as one clip, the resampler flushed; none decoded: refused."""
    if decoded == 0:
        raise InvalidInputError("audio has no decodable samples", param=param)
    if resampler is not None:
        chunks.append(resampler.resample_chunk(np.zeros(0, np.float32), last=True))
    return np.concatenate(chunks)


def _decode_mono(container: av.container.InputContainer, stream: av.audio.stream.AudioStream,
                 sampling_rate_hz: int, limits: AudioLimits, param: str) -> np.ndarray:
    """Decode, mix down and resample frame by frame, stopping as soon as the samples decoded pass the
    duration limit, whatever the header said.

    soxr's stream resampler gives the very samples `soxr.resample(whole, in_rate, out_rate, "HQ")`
    gives (chunking does not change its output), without holding the input rate's samples."""
    in_rate = stream.codec_context.sample_rate
    max_samples = limits.max_duration_s * in_rate
    resampler = _resampler(in_rate, sampling_rate_hz)
    chunks: list[np.ndarray] = []
    decoded = 0
    for frame in container.decode(stream):
        if frame.sample_rate != in_rate:
            raise InvalidInputError(f"audio changes its sampling rate mid-stream ({in_rate} -> "
                                    f"{frame.sample_rate} Hz)", param=param)
        channels = len(frame.layout.channels)
        if channels > limits.max_channels:
            raise InvalidInputError(f"audio has a frame of {channels} channels, over the limit of "
                                    f"{limits.max_channels}", param=param)
        decoded += frame.samples
        if decoded > max_samples:
            raise InvalidInputError(f"audio is longer than the limit of {limits.max_duration_s:g} s "
                                    f"(decoded past it)", param=param)
        mono = _mono_float32(frame, param)
        chunks.append(mono if resampler is None else resampler.resample_chunk(mono))
    return _joined(chunks, decoded, resampler, param)


def _decode_mono_libsndfile(data: bytes, sampling_rate_hz: int, limits: AudioLimits, param: str) -> np.ndarray:
    """`_decode_mono` with libsndfile as the decoder (MP3, as transformers' loader reads it), block by block
    under the same duration limit."""
    with soundfile.SoundFile(io.BytesIO(data)) as sound:
        in_rate = sound.samplerate
        resampler = _resampler(in_rate, sampling_rate_hz)
        chunks: list[np.ndarray] = []
        decoded = 0
        for block in sound.blocks(blocksize=_SNDFILE_BLOCK_FRAMES, dtype="float32", always_2d=True):
            decoded += len(block)
            if decoded > limits.max_duration_s * in_rate:
                raise InvalidInputError(f"audio is longer than the limit of {limits.max_duration_s:g} s "
                                        f"(decoded past it)", param=param)
            mono = _mix_down(block.T, param)
            chunks.append(mono if resampler is None else resampler.resample_chunk(mono))
    return _joined(chunks, decoded, resampler, param)


def _libsndfile_decodes(container_name: str, codec_name: str) -> bool:
    """libsndfile decodes what PyAV opened and checked: MP3 (transformers' decoder), and PCM in WAV, whose
    samples are the same from either but come in 64k-frame blocks instead of PyAV's 1k-frame frames (a 30 s
    clip: 469 frames, ~15 ms of per-frame work). Any other codec in a WAV stays PyAV's."""
    return container_name == "mp3" or (container_name == "wav" and codec_name.startswith("pcm_"))


def _short(exc: BaseException) -> str:
    """FFmpeg's own words for a failure, without errno numbers or a traceback; at most 200 characters."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return str(text).splitlines()[0][:200]


@contextmanager
def _opened(data: bytes, param: str) -> Iterator[av.container.InputContainer]:
    try:
        # metadata is never used: a tag in Latin-1 (common in ID3 and RIFF INFO) must not fail the file
        container = av.open(io.BytesIO(data), mode="r", container_options={"format_whitelist": _DEMUXERS},
                            metadata_errors="ignore")
    except _DECODE_ERRORS as exc:
        # the demuxer whitelist answers "invalid argument" to a container it recognised but refuses
        detail = "not an audio container" if isinstance(exc, av.error.ArgumentError) else _short(exc)
        raise InvalidInputError(f"the data is not a readable audio file ({detail})", param=param) from exc
    with container:
        yield container


def decode_audio(data: bytes, *, param: str, sampling_rate_hz: int, limits: AudioLimits,
                 format: str | None = None) -> AudioClip:
    """The bytes of an audio file -> mono float32 samples at `sampling_rate_hz`.

    `param` names the request field the bytes came from (errors carry it); `format`, when the request
    gives one, must be one of AUDIO_FORMATS and match the bytes (errors name `param.format`). A
    non-positive `sampling_rate_hz` is the caller's bug, not the request's: ValueError."""
    if sampling_rate_hz <= 0:
        raise ValueError(f"sampling_rate_hz must be positive, not {sampling_rate_hz}")
    if len(data) > limits.max_bytes:
        raise InvalidInputError(f"audio is {len(data)} bytes, over the limit of {limits.max_bytes} bytes",
                                param=param)
    if not data:
        raise InvalidInputError("audio is empty (0 bytes)", param=param)
    name = _check_format_name(format, param)
    try:
        with _opened(data, param) as container:
            _check_container(container, name, param)
            stream = _audio_stream(data, container, limits, param)
            if _libsndfile_decodes(container.format.name, stream.codec_context.name):
                samples = _decode_mono_libsndfile(data, sampling_rate_hz, limits, param)
            else:
                samples = _decode_mono(container, stream, sampling_rate_hz, limits, param)
    except InvalidInputError:
        raise
    except _DECODE_ERRORS as exc:
        raise InvalidInputError(f"audio could not be decoded (corrupt or truncated): {_short(exc)}",
                                param=param) from exc
    if len(samples) == 0:
        raise InvalidInputError(f"audio is too short to resample to {sampling_rate_hz} Hz", param=param)
    return AudioClip(samples=samples, sampling_rate_hz=sampling_rate_hz)


# numpy dtypes of integer PCM -> the sample format whose scale they take (floats are cast as they are)
_ARRAY_FORMATS = {"uint8": "u8", "int16": "s16", "int32": "s32", "int64": "s64"}


def _check_rate(rate_hz: Any, limits: AudioLimits, param: str) -> float:
    number = isinstance(rate_hz, (int, float, np.integer, np.floating)) and not isinstance(rate_hz, bool)
    if not number or not 1 <= float(rate_hz) <= limits.max_sampling_rate_hz:  # NaN fails the comparison too
        raise InvalidInputError(f"audio sampling rate {rate_hz!r:.40} is not a number of Hz in "
                                f"1..{limits.max_sampling_rate_hz}", param=param)
    return float(rate_hz) if float(rate_hz) != int(rate_hz) else int(rate_hz)


def _channels_first(samples: Any, limits: AudioLimits, param: str) -> tuple[np.ndarray, str]:
    """`samples` (an array, or what numpy makes an array of) as (channels, samples) and the sample format
    its dtype is. A 2-D array's channels are on
    its shorter axis: (channels, samples) as librosa and torchaudio give it, (samples, channels) as
    soundfile does; vLLM's `normalize_audio` reads them the same way."""
    if not isinstance(samples, np.ndarray):  # a list of floats, a CPU tensor: what numpy makes of it
        try:
            samples = np.asarray(samples)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidInputError(f"audio samples must be an array of numbers, got "
                                    f"{type(samples).__name__}", param=param) from exc
    base = "flt" if samples.dtype.kind == "f" else _ARRAY_FORMATS.get(samples.dtype.name)
    if base is None:
        raise InvalidInputError(f"audio samples must be floats in [-1, 1] or integer PCM, got dtype "
                                f"{samples.dtype}", param=param)
    if samples.ndim not in (1, 2):
        raise InvalidInputError(f"audio samples must be 1-D (mono) or 2-D (channels and samples), got shape "
                                f"{samples.shape}", param=param)
    if samples.ndim == 1:
        array = samples[None, :]
    else:
        array = samples.T if samples.shape[0] > samples.shape[1] else samples
    if not 0 < array.shape[0] <= limits.max_channels:
        raise InvalidInputError(f"audio has {array.shape[0]} channels, not 1..{limits.max_channels}",
                                param=param)
    return array, base


def clip_from_samples(samples: Any, rate_hz: Any, *, param: str, sampling_rate_hz: int,
                      limits: AudioLimits) -> AudioClip:
    """Samples a caller holds (vLLM's `(array, sampling_rate)`) -> mono float32 at `sampling_rate_hz`, made
    as `decode_audio` makes a file's: integer PCM scaled alike, channels averaged alike, resampled by the
    same soxr stream; so the samples of a WAV file given as an array become the very samples the file does.

    The array is 1-D (mono) or 2-D with its channels on the shorter axis (`_channels_first`). The duration
    limit is checked before anything is resampled; the result never aliases the caller's array."""
    if sampling_rate_hz <= 0:
        raise ValueError(f"sampling_rate_hz must be positive, not {sampling_rate_hz}")
    rate = _check_rate(rate_hz, limits, param)
    array, base = _channels_first(samples, limits, param)
    if array.shape[1] == 0:
        raise InvalidInputError("audio has no samples", param=param)
    if array.shape[1] > limits.max_duration_s * rate:
        raise InvalidInputError(f"audio is {array.shape[1] / rate:.1f} s long, over the limit of "
                                f"{limits.max_duration_s:g} s", param=param)
    mono = _mix_down(_as_float32(array, base, param), param)
    resampler = _resampler(rate, sampling_rate_hz)
    if resampler is None:
        out = np.array(mono, dtype=np.float32)  # a copy: the caller may reuse its buffer
    else:
        out = np.concatenate([resampler.resample_chunk(np.ascontiguousarray(mono)),
                              resampler.resample_chunk(np.zeros(0, np.float32), last=True)])
    if len(out) == 0:
        raise InvalidInputError(f"audio is too short to resample to {sampling_rate_hz} Hz", param=param)
    return AudioClip(samples=out, sampling_rate_hz=sampling_rate_hz)

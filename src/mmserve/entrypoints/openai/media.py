"""Turn a request's OpenAI content parts into what the processor accepts, under the server's rules.

Role: count media items against `--limit-mm-per-prompt` before any fetching; fetch http(s) URLs
with `inputs/fetch.py` (the safety rules live there); decode `video_url` files with
`inputs/video.py` into sampled frames (the sampler from `mm_processor_kwargs.video_sampling`); take
vLLM's `data:video/jpeg;base64,<JPEG>,<JPEG>,...` video data URL as its frames;
fetch the frames of a `video_frames` part (`{"urls": [...], "fps": x}`: a video sent as its
frames, e.g. a growing stream); fetch an `audio_url` part's http(s) URL under the same rules, capped at
`max_audio_bytes`; check an `input_audio` part (format name, base64) and decode its base64; leave
data-URI and local-path images and audio to the processor (which enforces the local-path allowlist and
the image and audio limits, and decodes the audio). Each part's `uuid` is kept; a part with a `uuid`
and no media (absent, null, or a null url or data) goes on as None: the media sent before under that
uuid (the processor's `MediaRefs`).
Runs in a worker thread (it blocks on the network and on decoding).

What it does not know: the engine, HTTP routing, the response format.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mmserve.errors import InvalidInputError, at_param
from mmserve.inputs.audio_sources import input_audio
from mmserve.inputs.chat import check_message
from mmserve.inputs.fetch import FetchPolicy, fetch_url
from mmserve.inputs.frame_sampling import SAMPLING_KWARG, check_fps, check_sampling
from mmserve.inputs.items import AUDIO, IMAGE, VIDEO
from mmserve.inputs.media import MediaLimits, VideoFrames, decode_data_uri, read_local_file
from mmserve.inputs.video import decode_video

SUPPORTED_PARTS = ("text", "image_url", "video_url", "video_frames", "input_audio", "audio_url")
VIDEO_PARTS = ("video_url", "video_frames")
AUDIO_PARTS = ("input_audio", "audio_url")
MEDIA_PARTS = {IMAGE: ("image_url",), VIDEO: VIDEO_PARTS, AUDIO: AUDIO_PARTS}
HTTP_SCHEMES = ("http://", "https://")


@dataclass(frozen=True)
class MediaRules:
    limits: MediaLimits  # the engine's: bytes and pixels per image, frames per video, local root
    fetch: FetchPolicy = field(default_factory=FetchPolicy)
    max_video_bytes: int = 64 * 1024 * 1024  # encoded size of one video file
    limit_per_prompt: dict[str, int] = field(default_factory=lambda: {IMAGE: 16, VIDEO: 4, AUDIO: 4})
    default_video_fps: float = 2.0  # frames sampled per second of a video file: the served family's default

    def __post_init__(self) -> None:
        if self.max_video_bytes <= 0:
            raise ValueError("max_video_bytes must be positive")
        unknown = sorted(set(self.limit_per_prompt) - set(MEDIA_PARTS))
        if unknown or any(v < 0 for v in self.limit_per_prompt.values()):
            raise ValueError(f"limit_per_prompt takes image=N,video=M,audio=K with N, M, K >= 0; got "
                             f"{self.limit_per_prompt}")


@dataclass
class ResolvedMedia:
    """Media of a completions prompt, in placeholder order, with per-item uuids."""

    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    audios: list[Any] = field(default_factory=list)
    uuids: dict[str, list[str | None]] = field(default_factory=lambda: {m: [] for m in MEDIA_PARTS})
    params: dict[str, list[str]] = field(default_factory=lambda: {m: [] for m in MEDIA_PARTS})  # field paths


def _url_of(part: dict[str, Any], kind: str, where: str) -> str:
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else None  # a bare string is refused, as OpenAI does
    if not isinstance(url, str) or not url:
        article = "an" if kind[0] in "aeiou" else "a"
        raise InvalidInputError(f"{where}.{kind}: {article} {kind} part needs {{'{kind}': {{'url': '...'}}}}",
                                param=f"{where}.{kind}")
    return url


def _check_counts(parts: list[tuple[str, dict[str, Any]]], rules: MediaRules) -> None:
    for modality, kinds in MEDIA_PARTS.items():
        located = [(where, p["type"]) for where, p in parts if p.get("type") in kinds]
        limit = rules.limit_per_prompt.get(modality)
        if limit is not None and len(located) > limit:
            where, kind = located[limit]
            raise InvalidInputError(f"at most {limit} {modality}(s) may be provided in one prompt; got "
                                    f"{len(located)} (--limit-mm-per-prompt)", param=f"{where}.{kind}")


def _listed_frames(part: dict[str, Any], rules: MediaRules, where: str) -> VideoFrames:
    """A `video_frames` part: each frame's URL fetched (http) or kept (data URI, local path: the
    processor decodes those under the image limits), with the part's fps."""
    where = f"{where}.video_frames"
    value = part.get("video_frames")
    urls = value.get("urls") if isinstance(value, dict) else None
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u for u in urls):
        raise InvalidInputError(f"{where}: a video_frames part needs {{'video_frames': {{'urls': ['...', ...], "
                                "'fps': <number>}}", param=where)
    unknown = sorted(set(value) - {"urls", "fps"})
    if unknown:
        raise InvalidInputError(f"{where} has unknown keys {unknown}", param=where)
    if len(urls) > rules.limits.max_video_frames:
        raise InvalidInputError(f"{where} has {len(urls)} frames, over the limit of "
                                f"{rules.limits.max_video_frames} (max_video_frames)", param=f"{where}.urls",
                                setting="max_video_frames")
    fps = value.get("fps")
    fps = None if fps is None else check_fps(fps, f"{where}.fps", f"{where}.fps")
    frames = []
    for k, url in enumerate(urls):
        with at_param(f"{where}.urls[{k}]"):
            frames.append(fetch_url(url, rules.limits.max_image_bytes, rules.fetch, f"{where}.urls[{k}]")
                          if url.startswith(HTTP_SCHEMES) else url)
    return VideoFrames(frames, fps)


JPEG_FRAMES_PREFIX = "data:video/jpeg;base64,"


def _jpeg_frames(url: str, rules: MediaRules, what: str) -> VideoFrames:
    """vLLM's video data URL, `data:video/jpeg;base64,<JPEG>,<JPEG>,...`: each base64 JPEG one frame, all of
    them taken (as vLLM does: no sampling), at the request's `fps` (mm_processor_kwargs), else the family's
    default. The frames go on as image data URIs: the processor decodes them under the image limits."""
    payloads = url[len(JPEG_FRAMES_PREFIX):].split(",")
    if len(payloads) > rules.limits.max_video_frames:
        raise InvalidInputError(f"{what} holds {len(payloads)} JPEG frames, over the limit of "
                                f"{rules.limits.max_video_frames} (max_video_frames)", setting="max_video_frames")
    for k, payload in enumerate(payloads):
        if not payload:
            raise InvalidInputError(f"{what}: JPEG frame {k} of the data URL is empty (frames are base64 JPEGs "
                                    "joined by commas)")
    return VideoFrames(["data:image/jpeg;base64," + payload for payload in payloads])


def _video_frames(url: str, rules: MediaRules, fps: float, sampling: str, where: str) -> list[Any] | VideoFrames:
    what = f"{where}.video_url"
    if url[:len(JPEG_FRAMES_PREFIX)].lower() == JPEG_FRAMES_PREFIX:
        return _jpeg_frames(url, rules, what)
    if url.startswith("data:"):
        data = decode_data_uri(url, what)
        if len(data) > rules.max_video_bytes:
            raise InvalidInputError(f"{what} is {len(data)} bytes, over the limit of {rules.max_video_bytes} bytes "
                                    "(--max-video-bytes)")
    elif url.startswith(HTTP_SCHEMES):
        data = fetch_url(url, rules.max_video_bytes, rules.fetch, what)
    else:
        data = read_local_file(url, dataclasses.replace(rules.limits, max_image_bytes=rules.max_video_bytes), what)
    return decode_video(data, fps, rules.limits.max_video_frames, rules.limits.max_image_pixels, what, sampling)


def _no_media(kind: str, value: Any) -> bool:
    """A media part's value that holds no media: absent, null, `{"url": null}` or (input_audio)
    `{"data": null}`."""
    if kind == "input_audio":
        return value is None or (isinstance(value, dict) and value.get("data") is None)
    return value is None or (isinstance(value, dict) and value.get("url", value.get("urls")) is None
                             and not value.get("frames"))


def _resolve_part(part: dict[str, Any], rules: MediaRules, fps: float, sampling: str,
                  where: str) -> dict[str, Any]:
    """A processor part of the same type (so that an error about it names the client's field), its
    media fetched or decoded."""
    kind = part.get("type")
    uuid = part.get("uuid")
    if uuid is not None and not isinstance(uuid, str):
        raise InvalidInputError(f"{where}.uuid must be a string", param=f"{where}.uuid")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise InvalidInputError(f"{where}.text: a text part needs a string 'text'", param=f"{where}.text")
        return {"type": "text", "text": part["text"]}
    if kind not in SUPPORTED_PARTS:
        raise InvalidInputError(f"{where}.type {kind!r:.40} is not a supported content part type; supported: "
                                f"{', '.join(SUPPORTED_PARTS)}", param=f"{where}.type")
    with at_param(f"{where}.{kind}"):
        if uuid is not None and _no_media(kind, part.get(kind)):  # media sent before under this uuid
            return {"type": kind, kind: None, "uuid": uuid}
        if kind in ("image_url", "audio_url"):
            url = _url_of(part, kind, where)
            if url.startswith(HTTP_SCHEMES):
                cap = rules.limits.max_image_bytes if kind == "image_url" else rules.limits.max_audio_bytes
                url = fetch_url(url, cap, rules.fetch, f"{where}.{kind}")
            return {"type": kind, kind: {"url": url}, "uuid": uuid}
        if kind == "input_audio":  # its format name and base64 checked now, before anything else is fetched
            encoded = input_audio(part.get(kind), f"{where}.{kind}", rules.limits.max_audio_bytes)
            return {"type": kind, kind: encoded, "uuid": uuid}
        if kind == "video_url":
            return {"type": kind, kind: _video_frames(_url_of(part, kind, where), rules, fps, sampling, where),
                    "uuid": uuid}
        return {"type": kind, kind: _listed_frames(part, rules, where), "uuid": uuid}


def _video_sampling(mm_processor_kwargs: dict[str, Any] | None, default_fps: float) -> tuple[float, str]:
    """(fps, sampler) a request's video files are decoded with."""
    kwargs = mm_processor_kwargs or {}
    fps = check_fps(kwargs.get("fps", default_fps), "mm_processor_kwargs.fps", "mm_processor_kwargs.fps")
    return fps, check_sampling(kwargs.get(SAMPLING_KWARG))


def resolve_messages(messages: list[dict[str, Any]], rules: MediaRules,
                     mm_processor_kwargs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Chat messages with every media part replaced by a processor part (fetched, decoded)."""
    if not messages:
        raise InvalidInputError("messages must not be empty", param="messages")
    located: list[tuple[str, dict[str, Any]]] = []
    for i, message in enumerate(messages):
        check_message(message, f"messages[{i}]")  # before anything is fetched
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise InvalidInputError(f"messages[{i}].content[{j}] must be an object",
                                            param=f"messages[{i}].content[{j}]")
                located.append((f"messages[{i}].content[{j}]", part))
    _check_counts(located, rules)
    fps, sampling = _video_sampling(mm_processor_kwargs, rules.default_video_fps)
    resolved = iter([_resolve_part(part, rules, fps, sampling, where) for where, part in located])
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": [next(resolved) for _ in content]}
        out.append(message)
    return out


def resolve_media(parts: list[dict[str, Any]], rules: MediaRules,
                  mm_processor_kwargs: dict[str, Any] | None = None) -> ResolvedMedia:
    """The completions extension field `media`: image_url / video_url parts in placeholder order."""
    located = [(f"media[{j}]", p) for j, p in enumerate(parts)]
    for where, part in located:
        if not isinstance(part, dict) or part.get("type") not in ("image_url", *VIDEO_PARTS, *AUDIO_PARTS):
            raise InvalidInputError(f"{where}: media parts must be image_url, video_url, video_frames, "
                                    "input_audio or audio_url objects",
                                    param=f"{where}.type" if isinstance(part, dict) else where)
    _check_counts(located, rules)
    fps, sampling = _video_sampling(mm_processor_kwargs, rules.default_video_fps)
    out = ResolvedMedia()
    for where, part in located:
        item = _resolve_part(part, rules, fps, sampling, where)
        kind = item["type"]
        modality = next(m for m, kinds in MEDIA_PARTS.items() if kind in kinds)
        has_url = kind in ("image_url", "audio_url") and item[kind] is not None
        media = item[kind]["url"] if has_url else item[kind]
        {IMAGE: out.images, VIDEO: out.videos, AUDIO: out.audios}[modality].append(media)
        out.uuids[modality].append(item["uuid"])
        out.params[modality].append(f"{where}.{kind}")
    return out

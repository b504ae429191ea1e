"""Turn a request's OpenAI content parts into what the processor accepts, under the server's rules.

Role: count media items against `--limit-mm-per-prompt` before any fetching; fetch http(s) URLs
with `inputs/fetch.py` (the safety rules live there); decode `video_url` files with
`inputs/video.py` into sampled frames (the sampler from `mm_processor_kwargs.video_sampling`);
fetch the frames of a `video_frames` part (`{"urls": [...], "fps": x}`: a video sent as its
frames, e.g. a growing stream); leave data-URI and local-path images to the processor (which
enforces the local-path allowlist and the image limits). Each part's `uuid` is kept.
Runs in a worker thread (it blocks on the network and on decoding).

What it does not know: the engine, HTTP routing, the response format.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mmserve.errors import InvalidInputError
from mmserve.inputs.fetch import FetchPolicy, fetch_url
from mmserve.inputs.frame_sampling import SAMPLING_KWARG, check_fps, check_sampling
from mmserve.inputs.items import IMAGE, VIDEO
from mmserve.inputs.media import MediaLimits, VideoFrames, decode_data_uri, read_local_file
from mmserve.inputs.video import decode_video

SUPPORTED_PARTS = ("text", "image_url", "video_url", "video_frames")
VIDEO_PARTS = ("video_url", "video_frames")
HTTP_SCHEMES = ("http://", "https://")


@dataclass(frozen=True)
class MediaRules:
    limits: MediaLimits  # the engine's: bytes and pixels per image, frames per video, local root
    fetch: FetchPolicy = field(default_factory=FetchPolicy)
    max_video_bytes: int = 64 * 1024 * 1024  # encoded size of one video file
    limit_per_prompt: dict[str, int] = field(default_factory=lambda: {IMAGE: 16, VIDEO: 4})
    default_video_fps: float = 2.0  # frames sampled per second of a video file: the served family's default

    def __post_init__(self) -> None:
        if self.max_video_bytes <= 0:
            raise ValueError("max_video_bytes must be positive")
        unknown = sorted(set(self.limit_per_prompt) - {IMAGE, VIDEO})
        if unknown or any(v < 0 for v in self.limit_per_prompt.values()):
            raise ValueError(f"limit_per_prompt takes image=N,video=M with N, M >= 0; got {self.limit_per_prompt}")


@dataclass
class ResolvedMedia:
    """Media of a completions prompt, in placeholder order, with per-item uuids."""

    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    uuids: dict[str, list[str | None]] = field(default_factory=lambda: {IMAGE: [], VIDEO: []})


def _url_of(part: dict[str, Any], kind: str, where: str) -> str:
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidInputError(f"{where}: a {kind} part needs {{'{kind}': {{'url': '...'}}}}")
    return url


def _check_counts(parts: list[tuple[str, dict[str, Any]]], rules: MediaRules) -> None:
    for modality, kinds in ((IMAGE, ("image_url",)), (VIDEO, VIDEO_PARTS)):
        count = sum(1 for _, p in parts if p.get("type") in kinds)
        limit = rules.limit_per_prompt.get(modality)
        if limit is not None and count > limit:
            raise InvalidInputError(f"at most {limit} {modality}(s) may be provided in one prompt; got {count}")


def _listed_frames(part: dict[str, Any], rules: MediaRules, where: str) -> VideoFrames:
    """A `video_frames` part: each frame's URL fetched (http) or kept (data URI, local path: the
    processor decodes those under the image limits), with the part's fps."""
    value = part.get("video_frames")
    urls = value.get("urls") if isinstance(value, dict) else None
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u for u in urls):
        raise InvalidInputError(f"{where}: a video_frames part needs {{'video_frames': {{'urls': ['...', ...], "
                                "'fps': <number>}}")
    unknown = sorted(set(value) - {"urls", "fps"})
    if unknown:
        raise InvalidInputError(f"{where}: video_frames has unknown keys {unknown}")
    if len(urls) > rules.limits.max_video_frames:
        raise InvalidInputError(f"{where}: video_frames has {len(urls)} frames, over the limit of "
                                f"{rules.limits.max_video_frames}")
    fps = value.get("fps")
    fps = None if fps is None else check_fps(fps, f"{where}: video_frames.fps")
    frames = [fetch_url(u, rules.limits.max_image_bytes, rules.fetch, f"{where} frame {k}")
              if u.startswith(HTTP_SCHEMES) else u for k, u in enumerate(urls)]
    return VideoFrames(frames, fps)


def _video_frames(url: str, rules: MediaRules, fps: float, sampling: str, where: str) -> list[Any]:
    what = f"{where} (video)"
    if url.startswith("data:"):
        data = decode_data_uri(url, what)
        if len(data) > rules.max_video_bytes:
            raise InvalidInputError(f"{what} is {len(data)} bytes, over the limit of {rules.max_video_bytes} bytes")
    elif url.startswith(HTTP_SCHEMES):
        data = fetch_url(url, rules.max_video_bytes, rules.fetch, what)
    else:
        data = read_local_file(url, dataclasses.replace(rules.limits, max_image_bytes=rules.max_video_bytes), what)
    return decode_video(data, fps, rules.limits.max_video_frames, rules.limits.max_image_pixels, what, sampling)


def _resolve_part(part: dict[str, Any], rules: MediaRules, fps: float, sampling: str,
                  where: str) -> dict[str, Any]:
    kind = part.get("type")
    uuid = part.get("uuid")
    if uuid is not None and not isinstance(uuid, str):
        raise InvalidInputError(f"{where}: uuid must be a string")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise InvalidInputError(f"{where}: a text part needs a string 'text'")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        url = _url_of(part, kind, where)
        if url.startswith(HTTP_SCHEMES):
            data = fetch_url(url, rules.limits.max_image_bytes, rules.fetch, f"{where} (image)")
            return {"type": "image", "image": data, "uuid": uuid}
        return {"type": "image_url", "image_url": {"url": url}, "uuid": uuid}
    if kind == "video_url":
        return {"type": "video", "video": _video_frames(_url_of(part, kind, where), rules, fps, sampling, where),
                "uuid": uuid}
    if kind == "video_frames":
        return {"type": "video", "video": _listed_frames(part, rules, where), "uuid": uuid}
    raise InvalidInputError(f"{where}: unsupported content part type {kind!r}; supported: "
                            f"{', '.join(SUPPORTED_PARTS)}")


def _video_sampling(mm_processor_kwargs: dict[str, Any] | None, default_fps: float) -> tuple[float, str]:
    """(fps, sampler) a request's video files are decoded with."""
    kwargs = mm_processor_kwargs or {}
    fps = check_fps(kwargs.get("fps", default_fps), "mm_processor_kwargs.fps", "mm_processor_kwargs.fps")
    return fps, check_sampling(kwargs.get(SAMPLING_KWARG))


def resolve_messages(messages: list[dict[str, Any]], rules: MediaRules,
                     mm_processor_kwargs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Chat messages with every media part replaced by a processor part (fetched, decoded)."""
    if not messages:
        raise InvalidInputError("messages must not be empty")
    located: list[tuple[str, dict[str, Any]]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidInputError(f"messages[{i}] must be an object with a 'role' and 'content'")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise InvalidInputError(f"messages[{i}].content[{j}] must be an object")
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
        if not isinstance(part, dict) or part.get("type") not in ("image_url", *VIDEO_PARTS):
            raise InvalidInputError(f"{where}: media parts must be image_url, video_url or video_frames objects")
    _check_counts(located, rules)
    fps, sampling = _video_sampling(mm_processor_kwargs, rules.default_video_fps)
    out = ResolvedMedia()
    for where, part in located:
        item = _resolve_part(part, rules, fps, sampling, where)
        if item["type"] == "video":
            out.videos.append(item["video"])
            out.uuids[VIDEO].append(item["uuid"])
        else:
            out.images.append(item["image"] if item["type"] == "image" else item["image_url"]["url"])
            out.uuids[IMAGE].append(item["uuid"])
    return out

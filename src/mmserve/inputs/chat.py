"""OpenAI-format chat messages -> template messages plus the media they carry, in order.

Role: check each message, turn every media content part into a bare `{"type": "image"}`,
`{"type": "video"}` or `{"type": "audio"}` part for the chat template (the family's template writes its
own placeholder there), and collect the media, any per-part `uuid` and each part's field path
(`messages[i].content[j].image_url`, which errors about that item name) in placeholder order.
A `video_url` part is taken only as the server leaves it: with its frames already decoded. Audio comes
as OpenAI's `input_audio` (`{"data": <base64>, "format": "wav"}`: its format name and base64 checked
here) or vLLM's `audio_url` (a data URL, a local path, or the bytes the server fetched).
What it does not know: templates, tokenizers, models, how media are decoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmserve.errors import InvalidInputError
from mmserve.inputs.audio_sources import EncodedAudio, input_audio
from mmserve.inputs.items import AUDIO, IMAGE, VIDEO

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")
VIDEO_PART_TYPES = ("video", "video_frames", "video_url")
AUDIO_PART_TYPES = ("input_audio", "audio_url")


@dataclass
class ChatInput:
    """A chat rendered to a prompt string, with its media in placeholder order."""

    prompt: str
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    audios: list[Any] = field(default_factory=list)
    # each part's "uuid", and its field path, per modality
    uuids: dict[str, list[str | None]] = field(default_factory=lambda: {IMAGE: [], VIDEO: [], AUDIO: []})
    params: dict[str, list[str]] = field(default_factory=lambda: {IMAGE: [], VIDEO: [], AUDIO: []})


def require_unicode(text: str, param: str | None) -> str:
    """`text`, if it can be encoded (a lone surrogate such as JSON's "\\ud800" cannot): else a clear error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"{param or 'the text'} is not valid Unicode: {exc.reason} at position {exc.start} "
                                "(a lone surrogate?)", param=param) from exc
    return text


def normalize_messages(messages: list[dict[str, Any]], media: ChatInput) -> list[dict[str, Any]]:
    """Template-ready messages; media parts are appended to `media` in order, each with its field path."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError(f"messages must be a non-empty list of messages, got {messages!r:.80}", param="messages")
    return [_normalize_message(m, media, f"messages[{i}]") for i, m in enumerate(messages)]


def check_message(message: Any, where: str) -> str:
    """The role of `message` (the one at `where`), which must be an object with a role. Any role is passed
    to the chat template, as transformers and vLLM pass it (a template renders custom roles such as
    `ipython` or `observation`, or refuses them itself)."""
    if not isinstance(message, dict) or "role" not in message:
        raise InvalidInputError(f"{where} must be an object with a 'role', got {message!r:.80}", param=where)
    role = message["role"]
    if not isinstance(role, str) or not role:
        raise InvalidInputError(f"{where}.role must be a non-empty string, got {role!r:.40}", param=f"{where}.role")
    return role


def _normalize_message(message: dict[str, Any], media: ChatInput, where: str) -> dict[str, Any]:
    role = check_message(message, where)
    content = message.get("content")
    # the message's other fields (name, reasoning_content, ...) go to the template as transformers passes them
    rest = {k: v for k, v in message.items() if k not in ("role", "content")}
    if content is None:  # as transformers: the template sees no content key
        return {"role": role, **rest}
    if isinstance(content, str):
        return {"role": role, "content": require_unicode(content, f"{where}.content"), **rest}
    if not isinstance(content, list):
        raise InvalidInputError(f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
    return {"role": role, "content": [_normalize_part(part, media, f"{where}.content[{j}]")
                                      for j, part in enumerate(content)], **rest}


def _normalize_part(part: Any, media: ChatInput, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        return {"type": "text", "text": require_unicode(str(part.get("text", "")), f"{where}.text")}
    if kind in IMAGE_PART_TYPES:
        value = part.get(kind)
        media.images.append(value.get("url") if kind == "image_url" and isinstance(value, dict) else value)
        media.uuids[IMAGE].append(part.get("uuid"))
        media.params[IMAGE].append(f"{where}.{kind}")
        return {"type": "image"}
    if kind in VIDEO_PART_TYPES:
        value = part.get(kind)
        if kind == "video_url" and isinstance(value, (dict, str)):
            raise InvalidInputError(f"{where}: a video file (video_url) is decoded only by the server; offline, "
                                    "give its frames as a 'video' part", param=f"{where}")
        media.videos.append(value)
        media.uuids[VIDEO].append(part.get("uuid"))
        media.params[VIDEO].append(f"{where}.{kind}")
        return {"type": "video"}
    if kind in AUDIO_PART_TYPES:
        media.audios.append(_audio_source(part, kind, where))
        media.uuids[AUDIO].append(part.get("uuid"))
        media.params[AUDIO].append(f"{where}.{kind}")
        return {"type": "audio"}
    if not isinstance(part, dict):
        raise InvalidInputError(f"{where} must be an object with a 'type'", param=where)
    raise InvalidInputError(f"{where}.type {kind!r:.40} is not a supported content part type; supported: text, "
                            f"{', '.join(IMAGE_PART_TYPES + VIDEO_PART_TYPES + AUDIO_PART_TYPES)}",
                            param=f"{where}.type")


def _audio_source(part: dict[str, Any], kind: str, where: str) -> Any:
    """An audio part's source for the processor; None: a uuid alone names audio sent before."""
    value = part.get(kind)
    held = value.get("data" if kind == "input_audio" else "url") if isinstance(value, dict) else value
    if value is None or (held is None and part.get("uuid") is not None):
        return None
    if kind == "input_audio":  # the server has checked and decoded it already: an EncodedAudio
        return value if isinstance(value, EncodedAudio) else input_audio(value, f"{where}.input_audio")
    url = value.get("url") if isinstance(value, dict) else value  # a bare URL too, as image_url takes one
    if not isinstance(url, (str, bytes)) or not url:
        raise InvalidInputError(f"{where}.audio_url: an audio_url part needs "
                                "{'audio_url': {'url': '...'}}", param=f"{where}.audio_url")
    return url

"""OpenAI-format chat messages -> template messages plus the media they carry, in order.

Role: check each message, turn every media content part into a bare `{"type": "image"}` or
`{"type": "video"}` part for the chat template (the family's template writes its own
placeholder there), and collect the media and any per-part `uuid` in placeholder order.
What it does not know: templates, tokenizers, models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmserve.errors import InvalidInputError
from mmserve.inputs.items import IMAGE, VIDEO

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")
VIDEO_PART_TYPES = ("video", "video_frames")


@dataclass
class ChatInput:
    """A chat rendered to a prompt string, with its media in placeholder order."""

    prompt: str
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    uuids: dict[str, list[str | None]] = field(default_factory=lambda: {IMAGE: [], VIDEO: []})  # per-part "uuid"


def require_unicode(text: str, param: str | None) -> str:
    """`text`, if it can be encoded (a lone surrogate such as JSON's "\\ud800" cannot): else a clear error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"{param or 'the text'} is not valid Unicode: {exc.reason} at position {exc.start} "
                                "(a lone surrogate?)", param=param) from exc
    return text


def normalize_messages(messages: list[dict[str, Any]], media: ChatInput) -> list[dict[str, Any]]:
    """Template-ready messages; media parts are appended to `media` in order."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError(f"a conversation must be a non-empty list of messages, got {messages!r:.80}")
    return [_normalize_message(m, media, f"messages[{i}]") for i, m in enumerate(messages)]


def _normalize_message(message: dict[str, Any], media: ChatInput, where: str) -> dict[str, Any]:
    if not isinstance(message, dict) or "role" not in message:
        raise InvalidInputError(f"a chat message must be a dict with a 'role', got {message!r:.80}")
    content = message.get("content")
    # the message's other fields (name, reasoning_content, ...) go to the template as transformers passes them
    rest = {k: v for k, v in message.items() if k not in ("role", "content")}
    if content is None:  # as transformers: the template sees no content key
        return {"role": message["role"], **rest}
    if isinstance(content, str):
        return {"role": message["role"], "content": require_unicode(content, f"{where}.content"), **rest}
    if not isinstance(content, list):
        raise InvalidInputError("message content must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": require_unicode(str(part.get("text", "")), f"{where}.content[{j}].text")})
        elif kind in IMAGE_PART_TYPES:
            value = part.get(kind)
            media.images.append(value.get("url") if kind == "image_url" and isinstance(value, dict) else value)
            media.uuids[IMAGE].append(part.get("uuid"))
            parts.append({"type": "image"})
        elif kind in VIDEO_PART_TYPES:
            media.videos.append(part.get(kind))
            media.uuids[VIDEO].append(part.get("uuid"))
            parts.append({"type": "video"})
        else:
            raise InvalidInputError(f"unsupported content part type {kind!r}; supported: text, image_url, "
                                    "image_pil, image, video")
    return {"role": message["role"], "content": parts, **rest}

"""Qwen2-VL input processor: chat template, media, placeholder expansion, M-RoPE positions.

Role: turn a prompt (text with one `<|image_pad|>` / `<|video_pad|>` per item, or token ids
holding one pad id per item) plus media into a `ProcessedPrompt`: token ids with each
placeholder expanded to the item's embedding-row count, one `MMItem` per item, the placeholder
masks and embed cumsum, and the (3, num_tokens) M-RoPE positions with the decode rope delta.
Also renders OpenAI-style chat messages into a prompt and its media list.

What it does not know: devices, KV caches, scheduling.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserve.errors import InvalidInputError
from mmserve.inputs.hashing import hash_item
from mmserve.inputs.items import IMAGE, VIDEO, MMItem, ProcessedPrompt
from mmserve.inputs.media import MediaLimits, load_image, load_video
from mmserve.inputs.placeholders import check_item_rows, compute_masks, embeds_in_range
from mmserve.inputs.tokenizer import TextTokenizer
from mmserve.models.qwen2_vl.config import Qwen2VLConfig
from mmserve.models.qwen2_vl.image_processor import (
    ImageProcessorConfig,
    PatchifiedItem,
    Qwen2VLImageProcessor,
)
from mmserve.models.qwen2_vl.mrope import VisionSpan, mrope_positions

DEFAULT_VIDEO_FPS = 2.0


@dataclass
class ChatInput:
    """A chat rendered to a prompt string, with its media in placeholder order."""

    prompt: str
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    uuids: dict[str, list[str | None]] = field(default_factory=lambda: {IMAGE: [], VIDEO: []})  # per-part "uuid"


class Qwen2VLProcessor:
    def __init__(self, model_dir: str | Path, config: Qwen2VLConfig, limits: MediaLimits | None = None,
                 num_threads: int | None = None) -> None:
        root = Path(model_dir)
        self.config = config
        self.limits = limits or MediaLimits()
        self.tokenizer = TextTokenizer(root)
        pre = root / "preprocessor_config.json"
        raw = json.loads(pre.read_text()) if pre.is_file() else {}
        self.image_processor = Qwen2VLImageProcessor(ImageProcessorConfig.from_dict(raw), num_threads)
        self.merge = config.vision.spatial_merge_size
        self.pad_ids = {IMAGE: config.image_token_id, VIDEO: config.video_token_id}
        self.pad_text = {m: self.tokenizer.id_to_token(i) or "" for m, i in self.pad_ids.items()}
        self._pad_re = re.compile("(" + "|".join(re.escape(t) for t in self.pad_text.values() if t) + ")")
        self._modality_of = {t: m for m, t in self.pad_text.items()}
        # the model's identity in every content key: its config and its preprocessing config
        self.model_key = hash_item({"config": (root / "config.json").read_bytes()
                                    if (root / "config.json").is_file() else b"", "preprocessor": raw})

    # ---- chat ---------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> ChatInput:
        """OpenAI-format messages -> prompt with one placeholder per item, media in order."""
        out = ChatInput(prompt="")
        normalized = [self._normalize_message(m, out) for m in messages]
        out.prompt = self.tokenizer.apply_chat_template(normalized, add_generation_prompt, **template_kwargs)
        return out

    def _normalize_message(self, message: dict[str, Any], media: ChatInput) -> dict[str, Any]:
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidInputError(f"a chat message must be a dict with a 'role', got {message!r:.80}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            return {"role": message["role"], "content": content or ""}
        if not isinstance(content, list):
            raise InvalidInputError("message content must be a string or a list of content parts")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind in ("image_url", "image_pil", "image"):
                value = part.get(kind)
                media.images.append(value.get("url") if kind == "image_url" and isinstance(value, dict) else value)
                media.uuids[IMAGE].append(part.get("uuid"))
                parts.append({"type": "image"})
            elif kind in ("video", "video_frames"):
                media.videos.append(part.get(kind))
                media.uuids[VIDEO].append(part.get("uuid"))
                parts.append({"type": "video"})
            else:
                raise InvalidInputError(f"unsupported content part type {kind!r}; supported: text, image_url, "
                                        "image_pil, image, video")
        return {"role": message["role"], "content": parts}

    # ---- prompts ------------------------------------------------------------------------------
    def process(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                images: list[Any] | None = None, videos: list[Any] | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None,
                uuids: dict[str, list[str | None]] | None = None) -> ProcessedPrompt:
        """Process a prompt (text or token ids) with its media into a ProcessedPrompt.

        `uuids` ({"image": [...], "video": [...]}, None entries allowed) replace content hashing for
        those items; the key still covers the processor kwargs and the model."""
        images, videos = list(images or []), list(videos or [])
        kwargs = dict(mm_processor_kwargs or {})
        fps = float(kwargs.pop("fps", DEFAULT_VIDEO_FPS))
        if fps <= 0:
            raise InvalidInputError(f"fps must be positive, got {fps}")
        if prompt is None and prompt_token_ids is None:
            raise InvalidInputError("need a prompt or prompt_token_ids")
        pieces = self._split_prompt(prompt) if prompt is not None else self._split_ids(prompt_token_ids)
        self._check_counts(pieces, len(images), len(videos))
        ids = self._item_uuids(uuids, len(images), len(videos))
        cfg = self.image_processor.cfg.with_overrides(kwargs)  # validates kwargs once
        shaping = {"min_pixels": cfg.min_pixels, "max_pixels": cfg.max_pixels}
        patched: dict[str, list[tuple[PatchifiedItem, str]]] = {IMAGE: [], VIDEO: []}
        for i, source in enumerate(images):
            img = load_image(source, self.limits, f"image {i}")
            key = self._key(IMAGE, ids[IMAGE][i], img, shaping)
            patched[IMAGE].append((self.image_processor.preprocess_image(img, kwargs), key))
        for i, source in enumerate(videos):
            frames = load_video(source, self.limits, f"video {i}")
            key = self._key(VIDEO, ids[VIDEO][i], frames, {**shaping, "fps": fps})
            patched[VIDEO].append((self.image_processor.preprocess_video(frames, kwargs), key))
        token_ids, items = self._expand(pieces, patched, fps)
        return self._finish(prompt, token_ids, items)

    def _key(self, modality: str, uuid: str | None, content: Any, shaping: dict[str, Any]) -> str:
        """Content key: what the model sees (pixels or the caller's uuid), how it is shaped, which model."""
        what = {"uuid": uuid} if uuid is not None else content
        return hash_item({"modality": modality, "content": what, "processing": shaping, "model": self.model_key})

    @staticmethod
    def _item_uuids(uuids: dict[str, list[str | None]] | None, num_images: int,
                    num_videos: int) -> dict[str, list[str | None]]:
        uuids = uuids or {}
        unknown = sorted(set(uuids) - {IMAGE, VIDEO})
        if unknown:
            raise InvalidInputError(f"multi_modal_uuids has unknown modalities {unknown}")
        out = {}
        for modality, count in ((IMAGE, num_images), (VIDEO, num_videos)):
            given = uuids.get(modality)
            given = [given] if isinstance(given, str) else list(given or [None] * count)
            if len(given) != count:
                raise InvalidInputError(f"multi_modal_uuids['{modality}'] has {len(given)} entries for {count} "
                                        f"{modality}(s)")
            if any(u is not None and not isinstance(u, str) for u in given):
                raise InvalidInputError("multi_modal_uuids entries must be strings or None")
            out[modality] = given
        return out

    def _split_prompt(self, prompt: str) -> list[str | list[int]]:
        """Text -> pieces: a placeholder's modality name or a list of token ids."""
        out: list[str | list[int]] = []
        for chunk in self._pad_re.split(prompt):
            if chunk in self._modality_of:
                out.append(self._modality_of[chunk])
            elif chunk:
                out.append(self.tokenizer.encode(chunk))
        return out

    def _split_ids(self, ids: list[int]) -> list[str | list[int]]:
        """Token ids -> pieces. Each run of one pad id is one item: a single pad id to expand, or a
        run already expanded to the item's row count (checked in `_expand`)."""
        out: list[str | list[int]] = []
        by_id = {v: k for k, v in self.pad_ids.items()}
        for tid in (int(t) for t in ids):
            modality = by_id.get(tid)
            if modality is None:
                if not out or not isinstance(out[-1], list):
                    out.append([])
                out[-1].append(tid)
            elif out and isinstance(out[-1], _Run) and out[-1] == modality:
                out[-1].length += 1
            else:
                out.append(_Run(modality))
        return out

    def _check_counts(self, pieces: list[str | list[int]], num_images: int, num_videos: int) -> None:
        for modality, given in ((IMAGE, num_images), (VIDEO, num_videos)):
            found = sum(1 for p in pieces if p == modality)
            if found != given:
                raise InvalidInputError(
                    f"the prompt has {found} {modality} placeholder(s) ({self.pad_text[modality]!r}) but {given} "
                    f"{modality}(s) were given; put one placeholder per {modality} in the prompt"
                )

    def _expand(self, pieces: list[str | list[int]], patched: dict[str, list[tuple[PatchifiedItem, str]]],
                fps: float) -> tuple[list[int], list[MMItem]]:
        ids: list[int] = []
        items: list[MMItem] = []
        seen = {IMAGE: 0, VIDEO: 0}
        unit = self.merge * self.merge
        for piece in pieces:
            if isinstance(piece, list):
                ids.extend(piece)
                continue
            index = seen[piece]
            seen[piece] += 1  # a _Run compares and hashes as its modality
            p, key = patched[piece][index]
            rows = p.num_patches // unit
            if isinstance(piece, _Run) and piece.length not in (1, rows):
                check_item_rows(f"{piece} {index}", piece.length, rows)
            interval = 1.0
            if piece == VIDEO and self.config.is_qwen2_5:
                interval = self.config.vision.tokens_per_second * self.config.vision.temporal_patch_size / fps
            items.append(MMItem(str(piece), index, len(ids), rows, p.grid_thw, p.num_patches, rows,
                                key, p.pixel_values, interval))
            ids.extend([self.pad_ids[piece]] * rows)
        return ids, items

    def _finish(self, prompt: str | None, token_ids: list[int], items: list[MMItem]) -> ProcessedPrompt:
        vocab = self.config.text.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidInputError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        masks = compute_masks(token_ids, list(self.pad_ids.values()))
        for item in items:  # invariant 1, checked where the prompt is built
            found = embeds_in_range(masks.embed_cumsum, item.offset, item.offset + item.length)
            check_item_rows(f"{item.modality} {item.index}", found, item.output_rows)
        total = int(masks.embed_cumsum[-1]) if token_ids else 0
        check_item_rows("the prompt's items together", total, sum(i.output_rows for i in items))
        spans = [VisionSpan(i.offset, i.grid_thw, i.time_interval) for i in items]
        positions, delta = mrope_positions(len(token_ids), spans, self.merge)
        return ProcessedPrompt(prompt, token_ids, items, masks.mm_mask, masks.embed_mask, masks.embed_cumsum,
                               positions, delta)


class _Run(str):
    """A run of one pad id in token-id input; behaves as its modality name."""

    length: int

    def __new__(cls, modality: str) -> _Run:
        run = super().__new__(cls, modality)
        run.length = 1
        return run

"""The shared half of every family's processor: prompt in, `ProcessedPrompt` out.

Role: accept a text prompt (one placeholder per item, e.g. `<|image_pad|>`) or token ids (one
placeholder id per item, or a run already expanded to the item's span), load the media under the
limits (or take what a uuid alone names: media_refs.py), key every item by content, ask the family how
each item expands, splice the spans in, and build the placeholder masks, the embed cumsum and the
positions. Invariant 1 is checked here:
each span holds exactly as many placeholder ids as the encoder will produce rows (a family that reads
items through cross-attention, `fuses_rows = False`: each span is one placeholder token).

A family subclasses `MultimodalProcessor` and supplies its hooks: `processing_key` (validates
mm_processor_kwargs and says what shapes the pixels or samples: part of the content key), `expand_image`,
`expand_video`, `expand_audio` (an `ItemExpansion` each: the span's token ids, the rows, the encoder
tokens, the payload its model reads, and any text the placeholder becomes around the span) for the
`modalities` it takes and, unless positions are token indices, `positions`. A family that takes audio
names the rate its feature extractor reads (`audio_sampling_rate_hz`): every clip reaches `expand_audio`
as mono float32 samples at that rate (audio_sources.py), keyed by those samples (item_keys.py).

The placeholder a prompt holds per item (`placeholder_ids`) and the token that marks an encoder row in
the expanded prompt (`embed_ids`) are the same token in most families, not in all (Gemma 3:
`<start_of_image>` in the prompt, `<image_soft_token>` rows). Text around a span is tokenized together
with the prompt's neighbouring text, as the family's own processor does when it rewrites the prompt
string (a newline run there may merge with the text before it).

What it does not know: any family's resize rules, spans or positions; devices; the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmserve.errors import InvalidInputError, at_param, out_of_vocabulary
from mmserve.inputs.chat import ChatInput, normalize_messages
from mmserve.inputs.frame_sampling import SAMPLING_KWARG, check_fps, check_sampling
from mmserve.inputs.hashing import hash_item
from mmserve.inputs.item_keys import item_keys, item_uuids
from mmserve.inputs.items import AUDIO, IMAGE, VIDEO, MMItem, ProcessedPrompt, PromptPositions
from mmserve.inputs.media import MediaLimits, PixelBudget
from mmserve.inputs.media_refs import MediaRefs
from mmserve.inputs.placeholders import check_item_rows, embeds_in_range
from mmserve.inputs.tokenizer import TextTokenizer

DEFAULT_VIDEO_FPS = 2.0


@dataclass(frozen=True)
class ItemPart:
    """One independently encoded part of an item: a video's temporal group, in families whose vision
    tower never attends across groups. Each part is its own engine item — keyed, scheduled and
    cached alone — so a video that extends an earlier one shares its leading parts."""

    offset: int  # the part's first embed row, counted from the start of the item's span
    rows: int  # its embed rows: a contiguous run of the span
    encoder_tokens: int
    payload: Any  # the family's encoder input for this part alone
    content: Any  # the part's source pixels (its frames), hashed into its content key
    shape: Any  # what else decides its encoder input (the frames' target size, how many are real): in the key


@dataclass(frozen=True)
class ItemExpansion:
    """What one item becomes in the prompt, and what its encoder needs."""

    token_ids: list[int]  # the item's whole span; its placeholder ids are the encoder's rows
    rows: int  # rows the encoder produces for the item (checked against the span's placeholder ids)
    encoder_tokens: int  # pre-merge patches the encoder runs
    payload: Any  # the family's encoder input
    # what else decided this item's encoder input (a mode the family picked): in the content key
    key_extra: dict[str, Any] = field(default_factory=dict)
    # text the placeholder becomes around the span, merged into the neighbouring prompt text (token ids: alone)
    text_before: str = ""
    text_after: str = ""
    # when given, the item becomes one engine item per part (their rows add up to `rows`); the span's
    # other tokens (timestamps, frame markers) are ordinary prompt text
    parts: tuple[ItemPart, ...] = ()


class _Run(str):
    """A run of one placeholder (or embed) id in token-id input; behaves as its modality name."""

    length: int
    expanded: bool  # a run of embed ids that differ from the placeholder: the span as given

    def __new__(cls, modality: str, expanded: bool = False) -> _Run:
        run = super().__new__(cls, modality)
        run.length = 1
        run.expanded = expanded
        return run


class _Text(str):  # a piece of prompt text, tokenized once its items' surrounding text is merged in
    pass


class MultimodalProcessor:
    default_video_fps: float = DEFAULT_VIDEO_FPS
    # False: the family reads items through cross-attention (Llama 3.2 Vision): each placeholder is one
    # token that keeps its text embedding, no prompt row is an encoder row, and `cross_attention_items`
    # says which positions see each item
    fuses_rows: bool = True
    modalities: tuple[str, ...] = (IMAGE, VIDEO)  # what the family takes; others are refused up front
    audio_sampling_rate_hz: int | None = None  # the rate its audio feature extractor reads (AUDIO only)

    def __init__(self, model_dir: str | Path, placeholder_ids: Mapping[str, int], vocab_size: int,
                 limits: MediaLimits | None = None, embed_ids: Mapping[str, int] | None = None,
                 tokenizer: TextTokenizer | None = None) -> None:  # tokenizer: --tokenizer's; None: the model's
        if (AUDIO in self.modalities) != (self.audio_sampling_rate_hz is not None):
            raise ValueError(f"{type(self).__name__}: a family that takes audio names its "
                             "audio_sampling_rate_hz, and only such a family")
        root = Path(model_dir)
        self.limits = limits or MediaLimits()
        self.media_refs = MediaRefs(self.limits.media_uuid_cache_bytes)  # media a later request names by uuid alone
        self.tokenizer = tokenizer or TextTokenizer(root)
        self.vocab_size = vocab_size
        self.pad_ids = dict(placeholder_ids)
        self.embed_ids = dict(embed_ids or placeholder_ids)
        self.pad_text = {m: self.tokenizer.id_to_token(i) or "" for m, i in self.pad_ids.items()}
        self._pad_re = re.compile("(" + "|".join(re.escape(t) for t in self.pad_text.values() if t) + ")")
        self._modality_of = {t: m for m, t in self.pad_text.items()}
        pre = root / "preprocessor_config.json"
        self.preprocessor_config: dict[str, Any] = json.loads(pre.read_text()) if pre.is_file() else {}
        # the model's identity in every content key: its config and its preprocessing config
        config = root / "config.json"
        self.model_key = hash_item({"config": config.read_bytes() if config.is_file() else b"",
                                    "preprocessor": self.preprocessor_config})

    # ---- family hooks -------------------------------------------------------------------------
    def processing_key(self, modality: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Validate mm_processor_kwargs (InvalidInputError if bad) and return what, besides the pixels,
        decides what the encoder sees for this modality."""
        if kwargs:
            raise InvalidInputError(f"unsupported mm_processor_kwargs {sorted(kwargs)}",
                                    param=f"mm_processor_kwargs.{sorted(kwargs)[0]}")
        return {}

    def expand_image(self, image: Image.Image, kwargs: dict[str, Any], num_images: int) -> ItemExpansion:
        """`num_images`: the prompt's images (a family may process one image alone unlike one of several)."""
        raise InvalidInputError(f"{type(self).__name__} does not take images")

    def expand_video(self, frames: list[Image.Image], fps: float, kwargs: dict[str, Any]) -> ItemExpansion:
        raise InvalidInputError(f"{type(self).__name__} does not take videos")

    def expand_audio(self, samples: np.ndarray, kwargs: dict[str, Any]) -> ItemExpansion:
        """`samples`: one clip, mono float32 at `audio_sampling_rate_hz` (at least one sample)."""
        raise InvalidInputError(f"{type(self).__name__} does not take audio")

    def positions(self, token_ids: list[int], items: list[MMItem]) -> PromptPositions:
        """Rotary positions of the prompt: by default a token's index (1-D RoPE)."""
        return PromptPositions(1)

    def cross_attention_items(self, token_ids: list[int], items: list[MMItem]) -> list[MMItem]:
        raise NotImplementedError  # a family that does not fuse rows: the items with their cross_attention spans

    # ---- chat ---------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_kwargs: Any) -> ChatInput:
        """OpenAI-format messages -> prompt with one placeholder per item, media in order.
        `continue_final_message`: the prompt ends inside the last message, which the model continues (as
        transformers does it: the rendered text cut after that message's last text)."""
        if continue_final_message and add_generation_prompt:
            raise InvalidInputError("continue_final_message and add_generation_prompt cannot both be true",
                                    param="continue_final_message")
        out = ChatInput(prompt="")
        normalized = normalize_messages(messages, out)
        counts = {IMAGE: len(out.images), VIDEO: len(out.videos), AUDIO: len(out.audios)}
        self._check_modalities(counts, out.params)
        out.prompt = self.tokenizer.apply_chat_template(normalized, add_generation_prompt, **template_kwargs)
        if continue_final_message:
            out.prompt = _cut_after_final_message(out.prompt, normalized[-1] if normalized else {})
        return out

    # ---- prompts ------------------------------------------------------------------------------
    def process(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                images: list[Any] | None = None, videos: list[Any] | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None,
                uuids: dict[str, list[str | None]] | None = None,
                item_params: dict[str, list[str]] | None = None,
                audios: list[Any] | None = None) -> ProcessedPrompt:
        """Process a prompt (text or token ids) with its media into a ProcessedPrompt.

        `uuids` ({"image": [...], "video": [...], "audio": [...]}, None entries allowed) replace content
        hashing for those items; the key still covers the processor kwargs and the model. `item_params`
        (shaped the same) are the request fields the items came from, which an error about an item names
        (default: `multi_modal_data.image[i]`). `audios`: audio_sources.py's forms."""
        media = {IMAGE: list(images or []), VIDEO: list(videos or []), AUDIO: list(audios or [])}
        counts = {m: len(items) for m, items in media.items()}
        params = {m: list((item_params or {}).get(m) or [f"multi_modal_data.{m}[{i}]" for i in range(count)])
                  for m, count in counts.items()}
        self._check_modalities(counts, params)
        if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, dict):
            raise InvalidInputError(f"mm_processor_kwargs must be an object, got {type(mm_processor_kwargs).__name__}",
                                    param="mm_processor_kwargs")
        kwargs = dict(mm_processor_kwargs or {})
        fps = check_fps(kwargs.pop("fps", self.default_video_fps), "mm_processor_kwargs.fps", "mm_processor_kwargs.fps")
        check_sampling(kwargs.pop(SAMPLING_KWARG, None))  # it chose the frames of a decoded file
        if prompt is None and prompt_token_ids is None:
            raise InvalidInputError("need a prompt or prompt_token_ids", param="prompt")
        pieces = self._split_prompt(prompt) if prompt is not None else self._split_ids(prompt_token_ids)
        self._check_counts(pieces, counts)
        expanded = self._expand_media(media, item_uuids(uuids, counts), params, kwargs, fps)
        token_ids, items = self._expand(pieces, expanded, params)
        return self._finish(prompt, token_ids, items)

    def _expand_media(self, media: dict[str, list[Any]], ids: dict[str, list[str | None]],
                      params: dict[str, list[str]], kwargs: dict[str, Any],
                      fps: float) -> dict[str, list[tuple[ItemExpansion, list[str]]]]:
        """Each item loaded under the limits (or what its uuid alone names), expanded by the family, keyed."""
        image_shaping = self.processing_key(IMAGE, kwargs)
        video_shaping = self.processing_key(VIDEO, kwargs)
        expanded: dict[str, list[tuple[ItemExpansion, list[str]]]] = {m: [] for m in media}
        pixels = PixelBudget(self.limits)
        for i, source in enumerate(media[IMAGE]):
            with at_param(where := params[IMAGE][i]):
                img = self.media_refs.image(source, ids[IMAGE][i], self.limits, where)
                pixels.take([img], where)
                exp = self.expand_image(img, kwargs, len(media[IMAGE]))
            expanded[IMAGE].append((exp, self._keys(IMAGE, ids[IMAGE][i], img, {**image_shaping, **exp.key_extra}, exp)))
        for i, source in enumerate(media[VIDEO]):
            with at_param(where := params[VIDEO][i]):
                frames, stated_fps = self.media_refs.video(source, ids[VIDEO][i], self.limits, where)
                pixels.take(frames, where)
                video_fps = stated_fps or fps
                exp = self.expand_video(frames, video_fps, kwargs)
            shaping = {**video_shaping, "fps": video_fps, **exp.key_extra}
            expanded[VIDEO].append((exp, self._keys(VIDEO, ids[VIDEO][i], frames, shaping, exp)))
        # the samples are keyed at the model's rate: the same clip keys alike however it was sent
        rate = self.audio_sampling_rate_hz
        audio_shaping = {**self.processing_key(AUDIO, kwargs), "sampling_rate_hz": rate} \
            if media[AUDIO] else {}
        for i, source in enumerate(media[AUDIO]):
            with at_param(where := params[AUDIO][i]):
                samples = self.media_refs.audio(source, ids[AUDIO][i], self.limits, rate, where)
                exp = self.expand_audio(samples, kwargs)
            shaping = {**audio_shaping, **exp.key_extra}
            expanded[AUDIO].append((exp, self._keys(AUDIO, ids[AUDIO][i], samples, shaping, exp)))
        return expanded

    def _check_modalities(self, counts: dict[str, int], params: dict[str, list[str]] | None = None) -> None:
        for modality, count in counts.items():
            if count and modality not in self.modalities:
                where = (params or {}).get(modality) or [None]
                raise InvalidInputError(f"this model does not take {modality}s ({count} given); it takes: "
                                        f"{', '.join(self.modalities)}", param=where[0])

    def _keys(self, modality: str, uuid: str | None, content: Any, shaping: dict[str, Any],
              exp: ItemExpansion) -> list[str]:
        """One content key per engine item (item_keys.py), of this model."""
        return item_keys(modality, uuid, content, shaping, exp.parts, self.model_key)

    def _split_prompt(self, prompt: str) -> list[str | list[int]]:
        """Text -> pieces: a placeholder's modality name or a `_Text` chunk."""
        out: list[str | list[int]] = []
        for chunk in self._pad_re.split(prompt):
            if chunk in self._modality_of:
                out.append(self._modality_of[chunk])
            elif chunk:
                out.append(_Text(chunk))
        return out

    def _split_ids(self, ids: list[int]) -> list[str | list[int]]:
        """Token ids -> pieces. Each run of one placeholder id is one item: a single id to expand, or a
        run already expanded to the item's span (checked in `_expand`); so is a run of an embed id that
        differs from the placeholder (the item's span as given)."""
        out: list[str | list[int]] = []
        by_id = {v: (k, False) for k, v in self.pad_ids.items()}
        by_id.update({v: (k, True) for k, v in self.embed_ids.items() if v != self.pad_ids.get(k)})
        for tid in (int(t) for t in ids):
            found = by_id.get(tid)
            if found is None:
                if not out or not isinstance(out[-1], list):
                    out.append([])
                out[-1].append(tid)
            elif self.fuses_rows and out and isinstance(out[-1], _Run) and (out[-1], out[-1].expanded) == found:
                out[-1].length += 1
            elif found[1] and out and isinstance(out[-1], _Run) and not out[-1].expanded \
                    and out[-1].length == 1 and out[-1] == found[0]:
                # the placeholder right before its span given expanded (Gemma 3's <start_of_image>) is text
                out.pop()
                if out and isinstance(out[-1], list):
                    out[-1].append(self.pad_ids[found[0]])
                else:
                    out.append([self.pad_ids[found[0]]])
                out.append(_Run(*found))
            else:
                out.append(_Run(*found))
        return out

    def _check_counts(self, pieces: list[str | list[int]], counts: dict[str, int]) -> None:
        for modality, given in counts.items():
            found = sum(1 for p in pieces if not isinstance(p, (_Text, list)) and p == modality)
            if found != given:
                what = repr(self.pad_text.get(modality, "")) if modality in self.pad_ids else "none: not supported"
                raise InvalidInputError(
                    f"the prompt has {found} {modality} placeholder(s) ({what}) but {given} "
                    f"{modality}(s) were given; put one placeholder per {modality} in the prompt", param="prompt")

    def _expand(self, pieces: list[str | list[int]], expanded: dict[str, list[tuple[ItemExpansion, list[str]]]],
                params: dict[str, list[str]]) -> tuple[list[int], list[MMItem]]:
        ids: list[int] = []
        items: list[MMItem] = []
        seen = dict.fromkeys(expanded, 0)
        text = ""  # prompt text not yet tokenized: it may still gain an item's text_before

        def flush() -> None:
            nonlocal text
            if text:
                ids.extend(self.tokenizer.encode(text))
            text = ""

        for piece in pieces:
            if isinstance(piece, _Text):
                text += piece
                continue
            if isinstance(piece, list):
                flush()
                ids.extend(piece)
                continue
            index = seen[piece]
            seen[piece] += 1  # a _Run compares and hashes as its modality
            exp, keys = expanded[piece][index]
            span = exp.token_ids
            given = isinstance(piece, _Run) and (piece.length != 1 or piece.expanded)
            if given:  # input already expanded: keep it as given, surrounding text included
                where = params[str(piece)][index]
                if span != [self.embed_ids[piece]] * len(span):
                    raise InvalidInputError(f"{where}: give one placeholder id per {piece}; this "
                                            f"model's {piece} spans hold more than placeholder ids", param="prompt")
                with at_param(where):
                    check_item_rows(where, piece.length, exp.rows)
            else:
                text += exp.text_before
            flush()
            if exp.parts:
                items.extend(MMItem(str(piece), index, len(ids) + part.offset, part.rows, part.encoder_tokens,
                                    part.rows, key, part.payload, part=k)
                             for k, (part, key) in enumerate(zip(exp.parts, keys, strict=True)))
            else:
                items.append(MMItem(str(piece), index, len(ids), len(span), exp.encoder_tokens, exp.rows, keys[0],
                                    exp.payload))
            ids.extend(span)
            text = "" if given else exp.text_after
        flush()
        return ids, items

    def _finish(self, prompt: str | None, token_ids: list[int], items: list[MMItem]) -> ProcessedPrompt:
        if message := out_of_vocabulary(token_ids, self.vocab_size, shown=10):
            raise InvalidInputError(f"prompt: {message}", param="prompt")
        ids = np.asarray(token_ids, dtype=np.int64)
        if not self.fuses_rows:
            return self._finish_cross_attention(prompt, token_ids, items)
        embed_mask = np.isin(ids, np.asarray(list(self.embed_ids.values()), dtype=np.int64))
        mm_mask = np.zeros(len(token_ids), dtype=bool)
        embed_cumsum = np.cumsum(embed_mask, dtype=np.int64)
        for item in items:  # invariant 1, checked where the prompt is built
            mm_mask[item.offset:item.offset + item.length] = True
            found = embeds_in_range(embed_cumsum, item.offset, item.offset + item.length)
            check_item_rows(f"{item.modality} {item.index}" + (f" part {item.part}" if item.part else ""), found,
                            item.output_rows)
        total = int(embed_cumsum[-1]) if token_ids else 0
        check_item_rows("the prompt's items together", total, sum(i.output_rows for i in items))
        return ProcessedPrompt(prompt, token_ids, items, mm_mask, embed_mask, embed_cumsum,
                               self.positions(token_ids, items))

    def _finish_cross_attention(self, prompt: str | None, token_ids: list[int], items: list[MMItem]) -> ProcessedPrompt:
        """No prompt row is an encoder row: the masks mark each item's one placeholder token, the embed
        cumsum stays 0, and the family sets each item's cross-attention span."""
        mm_mask = np.zeros(len(token_ids), dtype=bool)
        for item in items:
            if item.length != 1:
                raise InvalidInputError(f"{item.modality} {item.index}: this model takes one placeholder token per "
                                        f"{item.modality}, got a span of {item.length}", param="prompt")
            mm_mask[item.offset] = True
        zeros = np.zeros(len(token_ids), dtype=np.int64)
        return ProcessedPrompt(prompt, token_ids, self.cross_attention_items(token_ids, items), mm_mask,
                               zeros.astype(bool), zeros, self.positions(token_ids, items))


def _cut_after_final_message(rendered: str, final: dict[str, Any]) -> str:
    content = final.get("content")
    if isinstance(content, list):  # the last text part, as transformers takes it
        content = next((p.get("text") for p in reversed(content) if isinstance(p, dict) and "text" in p), None)
    text = content.strip() if isinstance(content, str) else ""
    if not text or text not in rendered:
        raise InvalidInputError("continue_final_message needs a last message with text the template renders",
                                param="continue_final_message")
    return rendered[:rendered.rindex(text) + len(text)]

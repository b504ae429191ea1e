"""Gemma 4 input processor: images, video frames and audio clips into spans, as transformers' processor.

Role: the family's hooks on `MultimodalProcessor`, producing what transformers' `Gemma4Processor` produces.
A prompt holds one `<|image|>`, `<|video|>` or `<|audio|>` per item (what Gemma 4's chat template writes);
transformers rewrites each into
- an image: `<|image>` + one `<|image|>` per soft token + `<image|>`;
- a video: per frame, its timestamp "mm:ss" (the frame's index over the video's fps), a space and the
  frame as an image of `<|video|>` soft tokens, the frames joined by spaces;
- a clip: `<|audio>` + one `<|audio|>` per soft token + `<audio|>`.
The soft tokens are the encoder rows. The text before the first row and after the last (the opening
marker and the first timestamp; the closing marker) is the expansion's `text_before` / `text_after`,
tokenized with the neighbouring prompt text; a video's markers and timestamps between frames lie inside
its span, tokenized alone (they sit between special tokens, so they tokenize the same in context).

Settings are read from processor_config.json's `image_processor`, `video_processor` and `feature_extractor`
sections (the hub's layout), or from a preprocessor_config.json. Pixels and features: `image_processing.py`
and `audio_features.py`, both equal to transformers' bit for bit.

What it does not know: devices, KV caches, scheduling, the model's weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.inputs.items import AUDIO, IMAGE, VIDEO
from mmserve.inputs.media import MediaLimits
from mmserve.inputs.processing import ItemExpansion, MultimodalProcessor
from mmserve.inputs.tokenizer import TextTokenizer, read_json
from mmserve.models.gemma4.audio_config import parse_audio_config
from mmserve.models.gemma4.audio_features import Gemma4AudioFeatureConfig, Gemma4AudioFeatures
from mmserve.models.gemma4.audio_input import audio_input, audio_seq_length
from mmserve.models.gemma4.config import Gemma4Config
from mmserve.models.gemma4.image_processing import (
    Gemma4ImageSettings,
    max_soft_tokens_per_image,
    preprocess_image,
    preprocess_video_frames,
)
from mmserve.models.spec import ItemSize

TIMESTAMP_TOKENS_BOUND = 8  # tokens a "mm:ss" timestamp and its spaces take at most, for the span bound


def timestamp(seconds: float) -> str:
    """transformers' frame timestamp: whole minutes and seconds, "mm:ss"."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


class Gemma4Processor(MultimodalProcessor):
    def __init__(self, model_dir: str | Path, config: Gemma4Config, limits: MediaLimits | None = None,
                 tokenizer: TextTokenizer | None = None) -> None:
        root = Path(model_dir)
        processor_config = read_json(root / "processor_config.json")
        pre = read_json(root / "preprocessor_config.json") if (root / "preprocessor_config.json").is_file() else {}
        self.modalities = ((IMAGE, VIDEO) if config.vision else ()) + ((AUDIO,) if config.audio else ())
        self.features = None
        if config.audio:
            feature_config = dict(processor_config.get("feature_extractor") or pre)
            self.features = Gemma4AudioFeatures(Gemma4AudioFeatureConfig.from_preprocessor_config(feature_config))
            self.audio_sampling_rate_hz = self.features.config.sampling_rate_hz
            self.audio_config = parse_audio_config(config.audio)
        placeholders = {m: i for m, i in ((IMAGE, config.image_token_id), (VIDEO, config.video_token_id),
                                          (AUDIO, config.audio_token_id)) if m in self.modalities}
        super().__init__(model_dir, placeholders, config.text.vocab_size, limits, tokenizer=tokenizer)
        self.config = config
        self.image_settings = Gemma4ImageSettings.from_dict(dict(processor_config.get("image_processor") or pre))
        self.video_settings = Gemma4ImageSettings.from_dict(dict(processor_config.get("video_processor") or {}),
                                                            video=True)
        self.max_audio_tokens = audio_seq_length(processor_config)
        texts = {name: self.tokenizer.id_to_token(getattr(config, f"{name}_token_id"))
                 for name in ("boi", "eoi", "boa", "eoa")}
        missing = sorted(name for name, text in texts.items() if not text)
        if missing and self.modalities:
            raise ModelLoadError(f"the tokenizer lacks Gemma 4's {', '.join(missing)} token(s)")
        self.boi, self.eoi, self.boa, self.eoa = (texts[n] or "" for n in ("boi", "eoi", "boa", "eoa"))

    # ---- hooks --------------------------------------------------------------------------------
    def processing_key(self, modality: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        super().processing_key(modality, kwargs)  # no mm_processor_kwargs of its own: any given is refused
        if modality == AUDIO and self.features is not None:
            return {"features": dataclasses.asdict(self.features.config), "max_tokens": self.max_audio_tokens}
        settings = self.video_settings if modality == VIDEO else self.image_settings
        return {"settings": dataclasses.asdict(settings)}

    def expand_image(self, image: Image.Image, kwargs: dict[str, Any], num_images: int) -> ItemExpansion:
        payload = preprocess_image(image, self.image_settings)
        rows = payload.num_soft_tokens
        return ItemExpansion([self.config.image_token_id] * rows, rows, len(payload.pixel_values), payload,
                             text_before=self.boi, text_after=self.eoi)

    def expand_video(self, frames: list[Image.Image], fps: float, kwargs: dict[str, Any]) -> ItemExpansion:
        payload = preprocess_video_frames(frames, self.video_settings)
        per_frame = payload.num_soft_tokens_per_frame
        soft = [self.config.video_token_id] * per_frame
        span = list(soft)
        for i in range(1, len(frames)):
            gap = self.tokenizer.encode(f" {timestamp(i / fps)} ")
            span += [self.config.eoi_token_id, *gap, self.config.boi_token_id, *soft]
        return ItemExpansion(span, per_frame * len(frames), len(payload.pixel_values), payload,
                             text_before=f"{timestamp(0.0)} {self.boi}", text_after=self.eoi)

    def expand_audio(self, samples: np.ndarray, kwargs: dict[str, Any]) -> ItemExpansion:
        payload = audio_input(samples, self.features, self.audio_config, self.max_audio_tokens)
        rows = payload.num_soft_tokens
        if rows == 0:
            raise InvalidInputError(f"the audio clip is too short: {len(samples)} samples at "
                                    f"{self.audio_sampling_rate_hz} Hz make no audio token")
        return ItemExpansion([self.config.audio_token_id] * rows, rows, payload.num_frames, payload,
                             text_before=self.boa, text_after=self.eoa)

    # ---- sizes ----------------------------------------------------------------------------------
    def largest_items(self, max_video_frames: int) -> dict[str, ItemSize]:
        """Per modality, the largest item a request can bring (its encoder tokens, rows and span)."""
        out = {}
        if IMAGE in self.modalities:
            rows = max_soft_tokens_per_image(self.image_settings)
            out[IMAGE] = ItemSize(self.image_settings.max_patches, rows)
            per_frame = max_soft_tokens_per_image(self.video_settings)
            gaps = (max_video_frames - 1) * (2 + TIMESTAMP_TOKENS_BOUND)
            out[VIDEO] = ItemSize(self.video_settings.max_patches * max_video_frames, per_frame * max_video_frames,
                                  per_frame * max_video_frames + gaps)
        if AUDIO in self.modalities and self.features is not None:
            # the extractor truncates a clip to max_length_samples (30 s); without one, the decoder's limit holds
            max_samples = self.features.config.max_length_samples or int(
                self.limits.audio.max_duration_s * self.audio_sampling_rate_hz)
            out[AUDIO] = ItemSize(self.features.num_frames(max_samples), self.max_audio_tokens)
        return out

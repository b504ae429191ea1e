"""What Gemma 4's audio tower reads for one clip, and how many soft tokens the clip becomes.

Role: the CPU side of an audio item. `audio_input` runs the feature extractor (`audio_features.py`) on
one mono clip and counts the clip's soft tokens as transformers' `Gemma4Processor.replace_audio_token`
does: the frame mask subsampled twice by the tower's stride-2 convs (`mask[::2]`, twice), its True
entries counted. That is the number of rows the tower keeps for the clip (it strips padding with the
same subsampled mask) and the number of placeholders a prompt holds for it. The count is capped at the
processor's `audio_seq_length` (750 by default, which is exactly what 30 s, the extractor's maximum,
gives), as `Gemma4Processor._compute_audio_num_tokens` caps the count it budgets with; with the default
extractor and processor the cap never bites.

What it does not know: decoding or resampling audio (samples arrive mono at the extractor's rate), the
tower's weights, prompts, devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserve.errors import ModelLoadError
from mmserve.models.gemma4.audio_config import Gemma4AudioConfig, subsampled_length
from mmserve.models.gemma4.audio_features import Gemma4AudioFeatures

# transformers' Gemma4Processor `audio_seq_length` default: soft tokens one clip may become
AUDIO_SEQ_LENGTH = 750
SUBSAMPLING_LAYERS = 2  # the tower's stride-2 convs (one per subsampling_conv_channels entry)


@dataclass(frozen=True, eq=False)
class Gemma4AudioInput:
    """One clip, ready for the tower: its log-mel features, which frames are real, and how many soft
    tokens (rows) it becomes. Arrays are not compared by `==` (eq=False): compare the fields."""

    features: np.ndarray  # (frames, mel_bins) float32; padding frames are zero
    frame_mask: np.ndarray  # (frames,) bool, True on real frames
    num_soft_tokens: int

    def __post_init__(self) -> None:
        if self.features.ndim != 2 or self.features.dtype != np.float32:
            raise ValueError(f"features must be (frames, mel_bins) float32, got {self.features.shape} "
                             f"{self.features.dtype}")
        if self.frame_mask.shape != self.features.shape[:1] or self.frame_mask.dtype != np.bool_:
            raise ValueError(f"frame_mask must be ({self.features.shape[0]},) bool, got "
                             f"{self.frame_mask.shape} {self.frame_mask.dtype}")
        if not 0 <= self.num_soft_tokens <= audio_soft_tokens(self.frame_mask, max_soft_tokens=None):
            raise ValueError(f"num_soft_tokens {self.num_soft_tokens} is not within what the frame mask "
                             f"gives ({audio_soft_tokens(self.frame_mask, max_soft_tokens=None)})")

    @property
    def num_frames(self) -> int:
        return int(self.features.shape[0])


def audio_soft_tokens(frames: int | np.ndarray, max_soft_tokens: int | None = AUDIO_SEQ_LENGTH) -> int:
    """Soft tokens of a clip: its frame mask (frames,) bool subsampled as the tower subsamples it
    (`mask[::2]` per stride-2 conv) and counted, capped at `max_soft_tokens` (None: no cap).

    An int is a count of real frames followed only by padding (the extractor's right padding): the
    count is then ceil(ceil(frames / 2) / 2), transformers' `_compute_audio_num_tokens` arithmetic."""
    if isinstance(frames, np.ndarray):
        if frames.ndim != 1:
            raise ValueError(f"a frame mask is 1-D, got shape {frames.shape}")
        mask = frames.astype(bool, copy=False)
        for _ in range(SUBSAMPLING_LAYERS):
            mask = mask[::2]
        count = int(mask.sum())
    else:
        if frames < 0:
            raise ValueError(f"frame count must be >= 0, got {frames}")
        count = int(frames)
        for _ in range(SUBSAMPLING_LAYERS):
            count = subsampled_length(count)
    return count if max_soft_tokens is None else min(count, max_soft_tokens)


def audio_seq_length(processor_config: Mapping[str, Any]) -> int:
    """The soft-token cap per clip from a `processor_config.json` dict (`audio_seq_length`, 750 when
    absent), for budgeting and for `audio_input`."""
    value = processor_config.get("audio_seq_length")
    if value is None:
        return AUDIO_SEQ_LENGTH
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"processor audio_seq_length must be a positive integer, got {value!r}")
    return value


def audio_input(samples: np.ndarray, features: Gemma4AudioFeatures, config: Gemma4AudioConfig,
                max_soft_tokens: int = AUDIO_SEQ_LENGTH) -> Gemma4AudioInput:
    """One mono clip (float32 samples at the extractor's rate, 16 kHz for Gemma 4) as the tower's input.

    Raises `InvalidInputError` for samples that are not 1-D (from the extractor), and `ModelLoadError`
    when the extractor's mel bins do not fit the tower's input projection (a checkpoint whose
    preprocessor and audio config disagree)."""
    mel_bins = features.config.mel_bins
    if not config.accepts_mel_bins(mel_bins):
        raise ModelLoadError(f"the audio tower's input projection takes {config.projection_input_dims} "
                             f"values per frame; {mel_bins} mel bins give "
                             f"{subsampled_length(subsampled_length(mel_bins))} x "
                             f"{config.subsampling_conv_channels[1]}")
    log_mel, frame_mask = features(samples)
    return Gemma4AudioInput(log_mel, frame_mask, audio_soft_tokens(frame_mask, max_soft_tokens))

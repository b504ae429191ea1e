"""transformers' `Gemma4ForConditionalGeneration.generate` inputs made from mmserve's processed prompt.

Role: the engine tests feed transformers mmserve's own token ids, pixels and audio features (processor
parity against transformers' `Gemma4Processor` is asserted in tests/models/test_gemma4.py): each image's
patches padded to the image processor's `max_patches` with (-1, -1) positions as transformers pads them,
each video's frames the same way under `pixel_values_videos` with the frames per video, and the clips'
log-mel features padded to the longest with their frame masks.

What it does not know: mmserve's engine; it reads processed prompts and the checkpoint's processor config.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from mmserve.inputs.items import AUDIO, IMAGE, VIDEO, ProcessedPrompt


def _max_patches(section: dict, default_tokens: int) -> int:
    tokens = int(section.get("max_soft_tokens", default_tokens))
    return tokens * int(section.get("pooling_kernel_size", 3)) ** 2


def _padded_frames(payloads: list, max_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every frame of `payloads` as (frames, max_patches, values) pixels and (frames, max_patches, 2)
    positions, padding patches zero with positions -1."""
    pixels, positions = [], []
    for p in payloads:
        per_frame = p.pixel_values.shape[0] // p.num_frames
        for f in range(p.num_frames):
            rows = slice(f * per_frame, (f + 1) * per_frame)
            pad = max_patches - per_frame
            pixels.append(np.pad(p.pixel_values[rows], ((0, pad), (0, 0))))
            positions.append(np.pad(p.position_ids[rows], ((0, pad), (0, 0)), constant_values=-1))
    return torch.from_numpy(np.stack(pixels)), torch.from_numpy(np.stack(positions))


def _audio_inputs(payloads: list) -> dict:
    longest = max(p.features.shape[0] for p in payloads)
    features = np.stack([np.pad(p.features, ((0, longest - p.features.shape[0]), (0, 0))) for p in payloads])
    masks = np.stack([np.pad(p.frame_mask, (0, longest - p.frame_mask.shape[0])) for p in payloads])
    return {"input_features": torch.from_numpy(features), "input_features_mask": torch.from_numpy(masks)}


def gemma4_reference_kwargs(model_dir: Path, messages: list[dict], prompt: ProcessedPrompt) -> dict:
    processor = json.loads((Path(model_dir) / "processor_config.json").read_text())
    ids = torch.tensor([prompt.prompt_token_ids])
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    by_modality = {m: [i.payload for i in prompt.items if i.modality == m] for m in (IMAGE, VIDEO, AUDIO)}
    if by_modality[IMAGE]:
        out["pixel_values"], out["image_position_ids"] = _padded_frames(
            by_modality[IMAGE], _max_patches(processor.get("image_processor") or {}, 280))
    if by_modality[VIDEO]:
        out["pixel_values_videos"], out["video_position_ids"] = _padded_frames(
            by_modality[VIDEO], _max_patches(processor.get("video_processor") or {}, 70))
        out["num_frames_per_video"] = torch.tensor([p.num_frames for p in by_modality[VIDEO]])
    if by_modality[AUDIO]:
        out.update(_audio_inputs(by_modality[AUDIO]))
    return out

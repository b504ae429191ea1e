"""The SigLIP vision tower's config, as LLaVA-OneVision and Gemma 3 both read it.

Role: the fields `siglip.py`'s tower reads and the check they share; each family reads its section
with its own defaults (`config_reader.read` with the family's keys) and adds its own checks.

What it does not know: weights, pixels, devices, which family reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.errors import ModelLoadError


@dataclass(frozen=True)
class SiglipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int  # edge of one square tile in pixels
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelLoadError("vision hidden_size is not divisible by num_attention_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def patch_input_dim(self) -> int:
        return self.num_channels * self.patch_size * self.patch_size

"""Typed view of the `vision_config` of Qwen3-VL and Qwen3.5 checkpoints (their shared vision tower's shape), and
the fields both families' configs have around it (`Qwen3StyleConfig`: the tower, the media token ids).

Role: the fields `qwen3_vision.py` and `qwen3_processor.py` read, with the checks that would otherwise fail
deep inside a forward (heads dividing the width, a square position grid, deepstack taps inside the tower);
`VISION_KEYS` says how a family's parser reads them (Qwen3.5 writes no deepstack taps: an empty tuple).

What it does not know: any family's text side, weights, devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import Key


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int  # width of the vision blocks
    intermediate_size: int
    num_heads: int
    hidden_act: str
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int  # width after the mergers (= the language model's hidden size)
    num_position_embeddings: int  # a square grid of learned position embeddings
    deepstack_visual_indexes: tuple[int, ...]  # blocks whose output a deepstack merger taps
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ModelLoadError(f"vision hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        side = int(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise ModelLoadError(f"num_position_embeddings {self.num_position_embeddings} is not a square")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ModelLoadError(f"deepstack_visual_indexes {bad} are outside the {self.depth} vision blocks")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_input_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def num_grid_per_side(self) -> int:
        return int(self.num_position_embeddings ** 0.5)


VISION_KEYS = MappingProxyType({
    "hidden_act": Key(default="gelu_pytorch_tanh"), "patch_size": Key(default=16), "temporal_patch_size": Key(default=2),
    "spatial_merge_size": Key(default=2), "in_channels": Key(default=3), "num_position_embeddings": Key(default=2304),
    "deepstack_visual_indexes": Key(default=(8, 16, 24)),
})


@dataclass(frozen=True)
class Qwen3StyleConfig:
    """A Qwen3-VL-style checkpoint: a text config (the family's), the vision tower, the media token ids."""

    architecture: str
    text: Any
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    def __post_init__(self) -> None:
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ModelLoadError(f"vision out_hidden_size {self.vision.out_hidden_size} != text hidden_size "
                                 f"{self.text.hidden_size}")

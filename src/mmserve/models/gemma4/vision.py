"""Gemma 4's vision encoder: the patches of images and video frames in, soft tokens in the text width out.

Role: transformers' `Gemma4VisionModel` followed by its `embed_vision` projector
(`Gemma4MultimodalEmbedder`), for a batch of payloads from `image_processing.py`. Every frame (an image
is one) is one sequence; all of a call's frames run as one batch padded to the longest, the padding
patches at positions (-1, -1) and masked as keys, as transformers pads. The tower: patches mapped to
[-1, 1] and through a linear, plus learned x and y position embeddings; layers of pre- and post-normed
attention (q/k RMS-normed with scale, v without, an axial 2-D rope — the first half of each head turned
by x, the second by y — softmax scale 1) and a gated MLP; every linear optionally clamps its input and
output to bounds stored in the checkpoint. The pooler averages each kernel x kernel cell of a frame's
grid into one soft token (cells row by row), scales by sqrt(hidden) in float32, optionally standardizes
((x - std_bias) * std_scale); the projector RMS-normalizes without scale and maps to the text width.

Padding never reaches a real row: padded keys are masked, and the pooler reads real patches only (its
cells are gathered through an index built on the host from the payloads' positions, so no device sync).

Weights: `state_dict()` keys are transformers' with `model.vision_tower.` -> `tower.` and
`model.embed_vision.` -> `embedder.` (the clipped linears' bounds are buffers in both); the rope's
frequencies are not weights. `vision_weight_name` maps a checkpoint name.

What it does not know: pixels and resizing (`image_processing.py`), prompts and placeholders, the
text model, where its weights come from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmserve.errors import InvalidInputError
from mmserve.models.gemma4.blocks import ClippableLinear, Gemma4RMSNorm, tower_weight_name
from mmserve.models.gemma4.image_processing import Gemma4VisionInput
from mmserve.models.gemma4.vision_config import Gemma4VisionConfig
from mmserve.models.layers.activations import get_activation
from mmserve.models.layers.rotary import inverse_frequencies

__all__ = ["Gemma4VisionEncoder", "Gemma4VisionInput", "vision_weight_name"]

def vision_weight_name(hf_name: str) -> str | None:
    """Our name for a checkpoint's vision tower or projector tensor; None for any other tensor."""
    return tower_weight_name(hf_name, "vision_tower", "embed_vision")


def apply_axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, L, heads, head_dim); cos, sin (B, L, 1, 2, head_dim / 4): each half of a head turns by one axis's
    angles (rows, then columns), rotate-half style within its half (transformers' apply_multidimensional_rope)."""
    halves = x.unflatten(-1, (2, -1))  # (B, L, heads, 2, head_dim / 2)
    quarter = halves.shape[-1] // 2
    rotated = torch.cat((-halves[..., quarter:], halves[..., :quarter]), dim=-1)
    return (halves * torch.cat((cos, cos), dim=-1) + rotated * torch.cat((sin, sin), dim=-1)).flatten(-2)


class Gemma4VisionAttention(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        heads, kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.kv_groups = heads // kv_heads
        clip = cfg.use_clipped_linears
        self.q_proj = ClippableLinear(cfg.hidden_size, heads * self.head_dim, clip)
        self.k_proj = ClippableLinear(cfg.hidden_size, kv_heads * self.head_dim, clip)
        self.v_proj = ClippableLinear(cfg.hidden_size, kv_heads * self.head_dim, clip)
        self.o_proj = ClippableLinear(heads * self.head_dim, cfg.hidden_size, clip)
        self.q_norm = Gemma4RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.v_norm = Gemma4RMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, L, hidden); key_mask (B, 1, 1, L) bool, True for real keys (None: no padding)."""
        b, n, _ = x.shape
        shape = (b, n, -1, self.head_dim)
        q = apply_axial_rope(self.q_norm(self.q_proj(x).view(shape)), cos, sin).transpose(1, 2)
        k = apply_axial_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin).transpose(1, 2)
        v = self.v_norm(self.v_proj(x).view(shape)).transpose(1, 2)
        if self.kv_groups > 1:  # query head h reads kv head h // groups, as transformers' repeat_kv
            k = k.repeat_interleave(self.kv_groups, dim=1)
            v = v.repeat_interleave(self.kv_groups, dim=1)
        # q and k are RMS-normed with learned scales: the logits take no 1/sqrt(head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=1.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class Gemma4VisionMLP(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        clip = cfg.use_clipped_linears
        self.gate_proj = ClippableLinear(cfg.hidden_size, cfg.intermediate_size, clip)
        self.up_proj = ClippableLinear(cfg.hidden_size, cfg.intermediate_size, clip)
        self.down_proj = ClippableLinear(cfg.intermediate_size, cfg.hidden_size, clip)
        self.act = get_activation(cfg.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma4VisionLayer(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.self_attn = Gemma4VisionAttention(cfg)
        self.mlp = Gemma4VisionMLP(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            self.add_module(name, Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, key_mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4PatchEmbedder(nn.Module):
    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=False)
        # rows of x embeddings, then rows of y embeddings
        table_shape = (2, cfg.position_embedding_size, cfg.hidden_size)
        self.position_embedding_table = nn.Parameter(torch.ones(table_shape))

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """pixels (N, patch_dim) float32 in [0, 1]; positions (N, 2) real (x, y) -> (N, hidden)."""
        x = self.input_proj((2 * (pixels - 0.5)).to(self.input_proj.weight.dtype))  # the tower reads [-1, 1]
        table = self.position_embedding_table
        return x + (F.embedding(positions[:, 0], table[0]) + F.embedding(positions[:, 1], table[1]))


class Gemma4VisionStack(nn.Module):
    """The layers, under transformers' module name (`encoder.layers.N`)."""

    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Gemma4VisionLayer(cfg) for _ in range(cfg.num_hidden_layers))


class Gemma4VisionTower(nn.Module):
    """transformers' Gemma4VisionModel's weights: the patch embedder, the layers, the standardization."""

    def __init__(self, cfg: Gemma4VisionConfig) -> None:
        super().__init__()
        self.patch_embedder = Gemma4PatchEmbedder(cfg)
        self.encoder = Gemma4VisionStack(cfg)
        if cfg.standardize:
            self.register_buffer("std_bias", torch.zeros(cfg.hidden_size))
            self.register_buffer("std_scale", torch.ones(cfg.hidden_size))


class Gemma4VisionProjector(nn.Module):
    """transformers' Gemma4MultimodalEmbedder: an RMSNorm without scale, a bias-free linear to the text
    width."""

    def __init__(self, vision_hidden_size: int, text_hidden_size: int, eps: float) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = Gemma4RMSNorm(vision_hidden_size, eps, with_scale=False)
        self.embedding_projection = nn.Linear(vision_hidden_size, text_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


@dataclass(frozen=True)
class _Layout:
    """Where a batch's real patches sit in the padded (frames, longest, ...) batch, built on the host."""

    num_frames: int
    longest: int  # patches of the longest frame: the padded sequence length
    padded_rows: np.ndarray  # (real patches,) each real patch's row in the flattened padded batch
    frame_patches: np.ndarray  # (frames,) real patches per frame
    pool_rows: np.ndarray  # (soft tokens * kernel^2,) padded rows, grouped by the soft token they pool into
    item_rows: tuple[int, ...]  # soft tokens per payload


def _layout(payloads: Sequence[Gemma4VisionInput], kernel: int) -> _Layout:
    frame_patches = np.concatenate([np.full(p.num_frames, p.patches_per_frame) for p in payloads])
    positions = np.concatenate([p.position_ids for p in payloads])
    longest = int(frame_patches.max())
    starts = np.cumsum(frame_patches) - frame_patches
    frame = np.repeat(np.arange(len(frame_patches)), frame_patches)
    padded_rows = frame * longest + np.arange(len(positions)) - starts[frame]
    # transformers' pooling cell: x // k + (width // k) * (y // k), width = the frame's largest x + 1
    width = np.maximum.reduceat(positions[:, 0], starts) + 1
    cell = positions[:, 0] // kernel + (width // kernel)[frame] * (positions[:, 1] // kernel)
    frame_tokens = frame_patches // kernel ** 2
    token = (np.cumsum(frame_tokens) - frame_tokens)[frame] + cell
    counts = np.bincount(token, minlength=int(frame_tokens.sum()))
    if len(counts) != frame_tokens.sum() or (counts != kernel ** 2).any():
        raise InvalidInputError(f"the patch positions do not tile whole {kernel}x{kernel} pooling cells")
    pool_rows = padded_rows[np.argsort(token, kind="stable")]
    item_rows = tuple(p.num_frames * (p.patches_per_frame // kernel ** 2) for p in payloads)
    return _Layout(len(frame_patches), longest, padded_rows, frame_patches, pool_rows, item_rows)


class Gemma4VisionEncoder(nn.Module):
    """The vision tower and its projector; `encode` turns payloads into soft tokens in the text width."""

    def __init__(self, config: Gemma4VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.config = config
        self.tower = Gemma4VisionTower(config)
        self.embedder = Gemma4VisionProjector(config.hidden_size, text_hidden_size, config.rms_norm_eps)
        # transformers' axial frequencies: head_dim / 4 of them, over half the head (float32, not a weight)
        self.register_buffer("inv_freq", inverse_frequencies(config.head_dim // 2, config.rope_theta),
                             persistent=False)

    def _check(self, payloads: Sequence[Gemma4VisionInput]) -> None:
        cfg = self.config
        for p in payloads:
            if p.pixel_values.shape[1] != cfg.patch_dim:
                raise InvalidInputError(f"patches of {p.pixel_values.shape[1]} values; the tower reads "
                                        f"{cfg.patch_dim}")
            if p.patches_per_frame % cfg.patches_per_soft_token:
                raise InvalidInputError(f"{p.patches_per_frame} patches a frame do not pool by "
                                        f"{cfg.patches_per_soft_token}")
            if p.position_ids.min() < 0 or p.position_ids.max() >= cfg.position_embedding_size:
                raise InvalidInputError(f"patch positions must lie in [0, {cfg.position_embedding_size})")

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, L, 2) -> cos, sin (B, L, 1, 2, head_dim / 4) in the tower's dtype, as transformers
        computes them (float32 angles, cast last)."""
        angles = positions.unsqueeze(-1).float() * self.inv_freq.float()
        return angles.cos().to(dtype).unsqueeze(2), angles.sin().to(dtype).unsqueeze(2)

    def _pool(self, hidden: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """(frames * longest, hidden) -> (soft tokens, hidden) float32: each cell's mean, scaled by
        sqrt(hidden), standardized if the config says so."""
        k2 = self.config.patches_per_soft_token
        rows = torch.from_numpy(layout.pool_rows).to(hidden.device)
        cells = hidden.index_select(0, rows).view(-1, k2, hidden.shape[-1])
        # transformers pools with a float32 matmul by 1/k^2 weights, returned in the tower's dtype
        pooled = (cells.float() * (1.0 / k2)).sum(dim=1).to(hidden.dtype) if k2 > 1 else cells[:, 0]
        pooled = pooled.float() * self.config.hidden_size ** 0.5
        if self.config.standardize:
            pooled = (pooled - self.tower.std_bias.float()) * self.tower.std_scale.float()
        return pooled

    @torch.inference_mode()
    def encode(self, payloads: Sequence[Gemma4VisionInput]) -> list[torch.Tensor]:
        """One (soft tokens, text hidden) tensor per payload (a video's frames in order), all payloads run
        as one batch."""
        if not payloads:
            return []
        self._check(payloads)
        layout = _layout(payloads, self.config.pooling_kernel_size)
        weight = self.tower.patch_embedder.input_proj.weight
        device, dtype = weight.device, weight.dtype
        pixels = torch.from_numpy(np.concatenate([p.pixel_values for p in payloads])).to(device)
        real_positions = torch.from_numpy(np.concatenate([p.position_ids for p in payloads])).to(device)
        rows = torch.from_numpy(layout.padded_rows).to(device)
        b, n = layout.num_frames, layout.longest
        hidden = torch.zeros(b * n, self.config.hidden_size, device=device, dtype=dtype)
        hidden.index_copy_(0, rows, self.tower.patch_embedder(pixels, real_positions))
        positions = torch.full((b * n, 2), -1, device=device, dtype=torch.long)  # transformers' padding
        positions.index_copy_(0, rows, real_positions)
        cos, sin = self._rope(positions.view(b, n, 2), dtype)
        key_mask = None
        if (layout.frame_patches != n).any():
            lengths = torch.from_numpy(layout.frame_patches).to(device)
            key_mask = (torch.arange(n, device=device) < lengths[:, None]).view(b, 1, 1, n)
        hidden = hidden.view(b, n, -1)
        for layer in self.tower.encoder.layers:
            hidden = layer(hidden, cos, sin, key_mask)
        tokens = self.embedder(self._pool(hidden.view(b * n, -1), layout).to(dtype))
        return list(torch.split(tokens, layout.item_rows))

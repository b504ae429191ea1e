"""Rotary position embeddings: M-RoPE (sectioned, or interleaved as Qwen3-VL and Qwen3.5 have it) and plain 1-D
RoPE for language models, 2-D axial RoPE for the vision tower.

Positions arrive as CPU-built integer tensors; angles are computed in float32 (as the reference
does) and rotate the full head dim ("rotate half" convention).
"""

from __future__ import annotations

import math

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (num_tokens, num_heads, head_dim); cos/sin: (num_tokens, head_dim)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


def inverse_frequencies(dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def llama3_scaled(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_positions: int) -> torch.Tensor:
    """Llama 3.1's rope scaling of plain inverse frequencies (transformers' `_compute_llama3_parameters`):
    long wavelengths divided by `factor`, short ones kept, the band between interpolated."""
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class MRotaryEmbedding(torch.nn.Module):
    """Multimodal RoPE: the head dim's frequency bands are split into (t, h, w) sections.

    forward(positions (3, num_tokens) int64) -> cos, sin of shape (num_tokens, head_dim).
    A text token has equal t/h/w positions, which reduces this to ordinary 1-D RoPE.
    """

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta), persistent=False)
        # For each frequency band, which of the three position rows drives it.
        axis = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(mrope_section)])
        self.register_buffer("band_axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # (3, num_tokens, head_dim/2): angle of every band under every position row
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        # pick, per band, the row of its section -> (num_tokens, head_dim/2)
        freqs = freqs.gather(0, self.band_axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)).squeeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class VisionRotaryEmbedding(torch.nn.Module):
    """2-D axial RoPE: half the bands follow the patch row, half the patch column.

    forward(hw_positions (num_patches, 2)) -> float32 cos, sin of shape (num_patches, head_dim).
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim // 2, theta), persistent=False)

    def forward(self, hw_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (num_patches, 2, head_dim/4) -> (num_patches, head_dim/2)
        freqs = (hw_positions.to(torch.float32).unsqueeze(-1) * self.inv_freq).flatten(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class RotaryEmbedding(torch.nn.Module):
    """Plain 1-D RoPE over the full head dim.

    forward(positions (1, num_tokens) or (num_tokens,) int64) -> cos, sin of shape (num_tokens, head_dim).
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.reshape(-1, 1).to(torch.float32) * self.inv_freq  # (num_tokens, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """M-RoPE with the (t, h, w) sections interleaved over the frequency bands, as Qwen3-VL does:
    band j follows h when j % 3 == 1 and j < 3 * h_section, w when j % 3 == 2 and j < 3 * w_section,
    and t otherwise."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, int, int]) -> None:
        super().__init__(head_dim, theta, mrope_section)
        axis = torch.zeros(head_dim // 2, dtype=torch.long)
        for row, offset in ((1, 1), (2, 2)):
            axis[offset:3 * mrope_section[row]:3] = row
        self.register_buffer("band_axis", axis, persistent=False)

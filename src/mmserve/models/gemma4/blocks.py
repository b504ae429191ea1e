"""Gemma 4's shared building blocks: its RMSNorm, the clippable linear of its towers, their weight names.

Role: `Gemma4RMSNorm`, `x * (mean(x^2) + eps) ** -0.5 * w` in float32, cast back last: every norm of the
Gemma 4 decoder (the four per layer, q/k/v per head, PLE's), of its vision and audio towers, and of the
projectors in front of the language model. Unlike Gemma 3's, the weight is the
scale itself (not an offset from one), and a norm may have none (`with_scale=False`: the v norm, the
projectors' pre-norms). The power -0.5 is taken as transformers takes it (`torch.pow`, not `rsqrt`),
so float32 results are the same bits. `ClippableLinear`: a bias-free linear whose input and output are
clamped to bounds the checkpoint stores (the towers', when their config says so). `tower_weight_name`:
a checkpoint's tower or projector tensor name under this module's prefixes.

What it does not know: where they are used.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Gemma4RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            normed = normed * self.weight.float()
        return normed.type_as(x)


class ClippableLinear(nn.Module):
    """A bias-free linear whose input and output are clamped to bounds the checkpoint stores (buffers,
    +-inf until loaded), when the config says so."""

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.clipped = clipped
        self.linear = nn.Linear(in_features, out_features, bias=False)
        if clipped:
            for name, bound in (("input_min", -math.inf), ("input_max", math.inf),
                                ("output_min", -math.inf), ("output_max", math.inf)):
                self.register_buffer(name, torch.tensor(bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = self.linear(x)
        return torch.clamp(x, self.output_min, self.output_max) if self.clipped else x


def tower_weight_name(hf_name: str, tower: str, embedder: str) -> str | None:
    """`model.{tower}.X` or `{tower}.X` -> `tower.X`, the same for the projector `{embedder}` ->
    `embedder.X`; None for any other tensor."""
    for prefix, ours in ((tower, "tower."), (embedder, "embedder.")):
        for name in (f"model.{prefix}.", f"{prefix}."):
            if hf_name.startswith(name):
                return ours + hf_name[len(name):]
    return None

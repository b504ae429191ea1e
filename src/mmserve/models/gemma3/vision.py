"""Gemma 3's image encoder: the SigLIP tower, its post-layernorm, and the pooled multimodal projector.

Role: square crops (num_crops, C, S, S) in, rows out (num_crops, mm_tokens_per_image, text hidden).
The tower is the shared SigLIP tower (models/vision/siglip.py) run through all its layers (conv patch
embedding as one matmul, learned position embeddings, pre-LN layers with biased q/k/v/out and a
gelu-tanh MLP), followed by SigLIP's post-layernorm (Gemma 3 reads the last hidden state after it;
the pooling head is never built). The projector, as transformers' Gemma3MultiModalProjector: the patch grid
average-pooled to tokens_per_side^2 rows, a Gemma RMSNorm (`mm_soft_emb_norm`), then a matmul by
`mm_input_projection_weight`, stored (vision hidden, text hidden) — not transposed like a Linear.
Every crop has the same shape, so the crops of many items run as one batch.

What it does not know: pan-and-scan, prompts, the language model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.gemma3.config import Gemma3Config
from mmserve.models.gemma3.norm import GemmaRMSNorm
from mmserve.models.vision.siglip import SiglipVisionTower


class Gemma3Projector(nn.Module):
    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        v = config.vision
        self.side = v.patches_per_side
        self.kernel = v.patches_per_side // config.tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(v.hidden_size, config.text.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(v.hidden_size, v.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (crops, side^2, vision hidden) -> (crops, tokens_per_side^2, text hidden)."""
        n, _, d = x.shape
        grid = x.transpose(1, 2).reshape(n, d, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).to(x.dtype)


class Gemma3VisionEncoder(nn.Module):
    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        v = config.vision
        self.tower = SiglipVisionTower(v, (v.num_hidden_layers,))  # the last layer's hidden state
        self.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.projector = Gemma3Projector(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (crops, C, S, S) -> (crops, mm_tokens_per_image, text hidden)."""
        return self.projector(self.post_layernorm(self.tower(pixels)))

"""Gemma's RMSNorm: the weight is stored as an offset from one, `x_hat * (1 + w)`.

Role: the norm of every Gemma 3 decoder sublayer, of q/k per head, and of the projector's pooled
vision rows. It computes in float32 and multiplies by (1 + w) *before* casting back, as transformers'
Gemma3RMSNorm does (Llama-style norms cast first, then scale: the two round differently in
half precision). What it does not know: where it is used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))  # zero: the identity scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm without a weight is x * rsqrt(mean(x^2) + eps) in one kernel
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

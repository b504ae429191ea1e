"""Normalization layers. RMSNorm computes in float32 and casts back, as the reference does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused kernel, the same numbers as the formula below in float32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # the reference: normalise in float32, cast back, then scale by the weight in the weight's dtype
        normed = F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)

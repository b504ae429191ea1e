"""Bidirectional attention within contexts given by device-side cumulative lengths (`cu_seqlens`).

Role: the attention of a captured vision-tower graph, whose kernels may depend only on static
shapes: the number of tokens and of contexts. Where the contexts begin is device data, so a replay
with other contexts runs the same kernels. On CUDA in float16/bfloat16 it is the varlen flash kernel
(`torch.nn.attention.varlen.varlen_attn`, given the largest context length the bucket allows);
elsewhere (float32, the CPU) one masked SDPA over the whole bucket, the mask built on the device
from `cu_seqlens` (quadratic in the bucket's tokens: the price of float32 graphs).

What it does not know: buckets, padding, which contexts are dummies, models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # torch >= 2.9 on CUDA builds; absent or unusable: the masked path
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch build
    varlen_attn = None

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def uses_varlen_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    return varlen_attn is not None and device.type == "cuda" and dtype in FLASH_DTYPES


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_context_tokens: int) -> torch.Tensor:
    """q, k, v: (num_tokens, heads, head_dim); cu_seqlens: (num_contexts + 1,) int32 on q's device, the
    last entry num_tokens; every context non-empty. Returns (num_tokens, heads * head_dim)."""
    num_tokens = q.shape[0]
    if uses_varlen_kernel(q.device, q.dtype):
        q, k, v = (x.contiguous() for x in (q, k, v))  # v is a strided view of the fused qkv projection
        out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_context_tokens, max_context_tokens)
        return out.reshape(num_tokens, -1)
    token = torch.arange(num_tokens, device=q.device, dtype=cu_seqlens.dtype)
    # context index of every token, computed on the device: no host sync, nothing baked into a graph
    context = torch.searchsorted(cu_seqlens, token, right=True)
    mask = (context[:, None] == context[None, :])[None, None]  # (1, 1, tokens, tokens)
    qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, heads, tokens, head_dim)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
    return out[0].transpose(0, 1).reshape(num_tokens, -1)

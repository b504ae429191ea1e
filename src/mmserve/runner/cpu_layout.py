"""Weight layouts that suit the CPU's matmul kernels, chosen once after loading.

Role: `F.linear(x, W)` with W stored (out, in) row-major, as checkpoints and `nn.Linear` have it,
takes a slow path on the CPU in float32 when the batch is small: a decode step's LM head (32000 x
320) streamed its weights at ~10 GB/s against the ~34 GB/s this machine reads, and inside a step
(weights cold in cache) the layers' projections fared as badly. The same product with W's storage
transposed — the (out, in) weight a view of a contiguous (in, out) tensor — takes the gemm path:
3.1x faster for that head at batch 1 and 1.14x at batch 32 alone, with bitwise-identical results
from batch 8 up (batch 1 differs in the last bits: another summation order). `relayout_for_cpu`
re-stores the float32 weights of the language model's linear layers that way; modules and math are
unchanged. A decode step of the 30M bench model went from 10.9/9.6 ms to 6.2/7.1 ms at batch 1 and
from 28.7/23.8 ms to 21.2/21.7 ms at batch 32 (two alternating rounds), greedy tokens identical.
Embeddings tied to the head are left as they are (a strided row gather would cost more than it
saves), and so is bfloat16, whose kernels are the other way round (the transposed layout measured
10x slower).

What it does not know: families, the engine, other devices (it does nothing off the CPU).
"""

from __future__ import annotations

import torch
from torch import nn

MIN_OUT_FEATURES = 0  # every projection: the narrow ones gained too once their weights were cold in cache


def relayout_for_cpu(module: nn.Module, min_out_features: int = MIN_OUT_FEATURES) -> int:
    """Re-store the float32 CPU weights of `module`'s linear layers with at least `min_out_features`
    outputs as transposed views of contiguous (in, out) tensors. Returns how many were re-stored."""
    count = 0
    for layer in module.modules():
        if not isinstance(layer, nn.Linear):
            continue
        weight = layer.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.shape[0] < min_out_features:
            continue
        if weight.stride() == (1, weight.shape[0]):  # already re-stored (a weight shared with another layer)
            continue
        weight.data = weight.data.t().contiguous().t()
        count += 1
    return count

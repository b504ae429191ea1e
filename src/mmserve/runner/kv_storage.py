"""Paged KV storage: the engine's key/value blocks, in a dtype of their own.

Role: own one key and one value tensor per layer, shaped (num_blocks, block_size, kv_heads,
head_dim), in the storage dtype (today the model dtype; independent of it by design, so a
quantized storage can replace this one). Write a step's new keys/values at their flat slots, and
hand the attention backend whole blocks back in the compute dtype.

What it does not know: attention, masks, sequences, requests — only slots and block ids.
"""

from __future__ import annotations

import torch


class PagedKVStorage:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (num_tokens, kv_heads, head_dim) at flat slots (block * block_size + offset)."""
        key, value = self.key[layer_idx], self.value[layer_idx]
        key.view(-1, *key.shape[2:]).index_copy_(0, slot_mapping, k.to(self.dtype))
        value.view(-1, *value.shape[2:]).index_copy_(0, slot_mapping, v.to(self.dtype))

    def gather(self, layer_idx: int, block_ids: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks `block_ids` (n,) of one layer as (n, block_size, kv_heads, head_dim) keys and values in
        `dtype`. index_select on a flat id list: several times faster on the CPU than advanced indexing."""
        keys = self.key[layer_idx].index_select(0, block_ids)
        values = self.value[layer_idx].index_select(0, block_ids)
        return keys.to(dtype), values.to(dtype)

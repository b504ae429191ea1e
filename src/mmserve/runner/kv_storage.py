"""Paged KV storage: the engine's key/value blocks, in a format of their own.

Role: own one key and one value tensor per layer, shaped (num_blocks, block_size, kv_heads,
head_dim), in the storage format (`kv_quant.KVFormat`: the model dtype, or int8 / fp8 codes with
a float16 scale per token per kv head beside them). Write a step's new keys/values at their flat
slots (quantizing them on the way in), and hand the attention backend the blocks it asks for
back in the compute dtype (dequantized on the way out: only those blocks, never a full-precision
copy of the cache).

What it does not know: attention, masks, sequences, requests — only slots and block ids.

Under `torch.compile` (the CPU's compiled decode step, runner/graphs/decode_graphs.py) the slot writes go
through `mmserve::write_slots`, an operator that declares it mutates the cache: traced as a plain
`index_copy_`, the compiler functionalizes it into a copy of the whole layer's cache per write.
"""

from __future__ import annotations

import torch

from mmserve.runner.kv_quant import SCALE_DTYPE, KVFormat, dequantize, fp8_decode_table, quantize


@torch.library.custom_op("mmserve::write_slots", mutates_args=("flats",))
def write_slots(flats: list[torch.Tensor], slots: torch.Tensor, rows: list[torch.Tensor]) -> None:
    """flats[j][slots[i]] = rows[j][i], in place, copied as bytes (index_copy_ has no float8 kernel on the
    CPU, and the bits are what we store): the cache writes a compiled step keeps in place, one call for
    a layer's keys and values (and their scales)."""
    for flat, part in zip(flats, rows):
        flat.view(torch.uint8).index_copy_(0, slots, part.view(torch.uint8))


def _write_rows(flats: list[torch.Tensor], slots: torch.Tensor, rows: list[torch.Tensor]) -> None:
    if torch.compiler.is_compiling():  # the byte views stay inside the operator, out of the compiler's sight
        write_slots(flats, slots, rows)
        return
    for flat, part in zip(flats, rows):  # eager: the direct calls, without the operator's dispatch
        if flat.dtype == torch.float8_e4m3fn:
            flat.view(torch.uint8).index_copy_(0, slots, part.view(torch.uint8))
        else:
            flat.index_copy_(0, slots, part)


class PagedKVStorage:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 fmt: KVFormat, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.fmt = fmt
        self.key = torch.zeros(shape, dtype=fmt.element_dtype, device=device)
        self.value = torch.zeros(shape, dtype=fmt.element_dtype, device=device)
        self.key_scale = self.value_scale = None
        if fmt.quantized:
            self.key_scale = torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=device)
            self.value_scale = torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._table = fp8_decode_table(device) if fmt.element_dtype == torch.float8_e4m3fn else None

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, fmt: KVFormat) -> int:
        """Bytes one token's KV takes over all layers, K and V, scales included."""
        return 2 * num_layers * num_kv_heads * fmt.bytes_per_head(head_dim)

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (num_tokens, kv_heads, head_dim) at flat slots (block * block_size + offset)."""
        flats, rows = [], []
        for store, scales, x in ((self.key, self.key_scale, k), (self.value, self.value_scale, v)):
            flats.append(store[layer_idx].flatten(0, 1))
            if not self.fmt.quantized:
                rows.append(x.to(self.fmt.element_dtype))
                continue
            codes, scale = quantize(x, self.fmt)
            rows.append(codes)
            flats.append(scales[layer_idx].flatten(0, 1))
            rows.append(scale)
        _write_rows(flats, slot_mapping, rows)

    def gather(self, layer_idx: int, block_ids: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks `block_ids` (n,) of one layer as (n, block_size, kv_heads, head_dim) keys and values in
        `dtype`. index_select on a flat id list: several times faster on the CPU than advanced indexing."""
        keys = self.key[layer_idx].index_select(0, block_ids)
        values = self.value[layer_idx].index_select(0, block_ids)
        if not self.fmt.quantized:
            return keys.to(dtype), values.to(dtype)
        return (dequantize(keys, self.key_scale[layer_idx].index_select(0, block_ids), dtype, self._table),
                dequantize(values, self.value_scale[layer_idx].index_select(0, block_ids), dtype, self._table))

    # ---- hand-offs: blocks as bytes ---------------------------------------------------------------
    def _byte_parts(self) -> list[torch.Tensor]:
        parts = [self.key, self.value]
        if self.fmt.quantized:
            parts += [self.key_scale, self.value_scale]
        return [p.view(torch.uint8) for p in parts]  # codes and scales as stored, whatever their dtype

    def block_part_shapes(self) -> list[tuple[int, ...]]:
        """The byte shape of one block in each stored tensor (keys, values, and their scales when
        quantized), layers first: (num_layers, block_size, kv_heads, bytes per head...)."""
        return [(p.shape[0], *p.shape[2:]) for p in self._byte_parts()]

    def read_blocks(self, block_ids: list[int], outs: list[torch.Tensor]) -> None:
        """Copy blocks `block_ids` into `outs` (one per part, (num_layers, n, ...) bytes): bit for bit."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.key.device)
        for part, out in zip(self._byte_parts(), outs, strict=True):
            if out.device == part.device:
                torch.index_select(part, 1, ids, out=out)
            else:
                out.copy_(part.index_select(1, ids))

    def write_blocks(self, block_ids: list[int], parts: list[torch.Tensor]) -> None:
        """Store blocks read by another storage's `read_blocks` at `block_ids`."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.key.device)
        for part, src in zip(self._byte_parts(), parts, strict=True):
            part.index_copy_(1, ids, src.to(part.device))

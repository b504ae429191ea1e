"""Paged KV storage: the engine's key/value blocks, in a format of their own.

Role: own one key and one value tensor per layer, shaped (num_blocks, block_size, kv_heads,
head_dim), in the storage format (`kv_quant.KVFormat`: the model dtype, or int8 / fp8 codes with
a float16 scale per token per kv head beside them). Write a step's new keys/values at their flat
slots (quantizing them on the way in), and hand the attention backend the blocks it asks for
back in the compute dtype (dequantized on the way out: only those blocks, never a full-precision
copy of the cache).

Layers may differ (`KVLayerShape`): a model whose layers have different head sizes or kv heads (Gemma 4's
sliding and full layers) keeps one stacked tensor per shape, and a layer that reads another layer's cache
(Gemma 4's KV-shared layers) owns nothing: `key[i]` is its source's tensor, and it never writes. Block ids
are the same in every layer, except where the sliding layers keep their blocks in a window pool of their own
(`num_window_blocks`, core/window_kv.py): their tensors have that many blocks, `in_window[i]` says so, and
the attention backend addresses them through the batch's window tables.

What it does not know: attention, masks, sequences, requests — only slots and block ids.

Under `torch.compile` (the CPU's compiled decode step, runner/graphs/decode_graphs.py) the slot writes go
through `mmserve::write_slots`, an operator that declares it mutates the cache: traced as a plain
`index_copy_`, the compiler functionalizes it into a copy of the whole layer's cache per write.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmserve.models.spec import KVLayerShape
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
                 fmt: KVFormat, device: torch.device | str = "cpu", *,
                 layers: Sequence[KVLayerShape] | None = None, num_window_blocks: int | None = None) -> None:
        """`layers`: each layer's own shape (then `num_kv_heads` and `head_dim` are unused); None: all alike.
        `num_window_blocks`: the window pool's blocks (core/window_kv.py), where the sliding layers keep
        theirs apart (its null block included); None: every layer's blocks are `num_blocks`."""
        shapes = tuple(layers) if layers is not None else (KVLayerShape(num_kv_heads, head_dim),) * num_layers
        if len(shapes) != num_layers:
            raise ValueError(f"{len(shapes)} layer shapes for {num_layers} layers")
        self.fmt = fmt
        self.num_blocks = num_blocks
        self.num_window_blocks = num_window_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.layer_shapes = shapes
        self._table = fp8_decode_table(device) if fmt.element_dtype == torch.float8_e4m3fn else None
        owners: dict[tuple[int, int, bool], list[int]] = {}
        for i, shape in enumerate(shapes):
            if shape.reads_layer is None:
                in_window = num_window_blocks is not None and shape.sliding_window is not None
                owners.setdefault((shape.num_kv_heads, shape.head_dim, in_window), []).append(i)
        # one stacked (layers, num_blocks, block_size, kv_heads, head_dim) tensor per shape and pool, key and
        # value (and their scales): the parts a hand-off copies
        self._groups: list[list[torch.Tensor]] = []
        self._group_in_window: list[bool] = []
        per_layer: dict[int, list[torch.Tensor]] = {}
        in_window_of: dict[int, bool] = {}
        for (kv_heads, dim, in_window), members in owners.items():
            group = self._allocate(len(members), kv_heads, dim, num_window_blocks if in_window else num_blocks)
            self._groups.append(group)
            self._group_in_window.append(in_window)
            for j, layer in enumerate(members):
                per_layer[layer], in_window_of[layer] = [part[j] for part in group], in_window
        for i, shape in enumerate(shapes):
            if shape.reads_layer is not None:
                per_layer[i], in_window_of[i] = per_layer[shape.reads_layer], in_window_of[shape.reads_layer]
        # per layer: do its blocks live in the window pool (the attention backend then reads the window tables)
        self.in_window = tuple(in_window_of[i] for i in range(num_layers))
        if len(self._groups) == 1 and len(next(iter(owners.values()))) == num_layers and not any(self.in_window):
            self.key, self.value = self._groups[0][:2]  # all alike: the stacked tensors themselves
            self.key_scale, self.value_scale = (self._groups[0][2:] if fmt.quantized else (None, None))
            return
        self.key = [per_layer[i][0] for i in range(num_layers)]
        self.value = [per_layer[i][1] for i in range(num_layers)]
        self.key_scale = [per_layer[i][2] for i in range(num_layers)] if fmt.quantized else None
        self.value_scale = [per_layer[i][3] for i in range(num_layers)] if fmt.quantized else None

    @classmethod
    def for_layers(cls, layers: Sequence[KVLayerShape], num_blocks: int, block_size: int, fmt: KVFormat,
                   device: torch.device | str = "cpu", num_window_blocks: int | None = None) -> PagedKVStorage:
        """Storage for layers of the given shapes (a family's `FamilySpec.kv_layer_shapes`)."""
        first = layers[0]
        return cls(len(layers), num_blocks, block_size, first.num_kv_heads, first.head_dim, fmt, device,
                   layers=layers, num_window_blocks=num_window_blocks)

    def _allocate(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int) -> list[torch.Tensor]:
        shape = (num_layers, num_blocks, self.block_size, kv_heads, head_dim)
        parts = [torch.zeros(shape, dtype=self.fmt.element_dtype, device=self.device) for _ in range(2)]
        if self.fmt.quantized:
            parts += [torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=self.device) for _ in range(2)]
        return parts

    @property
    def dtype(self) -> torch.dtype:
        return self.fmt.element_dtype

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, fmt: KVFormat) -> int:
        """Bytes one token's KV takes over all layers, K and V, scales included."""
        return 2 * num_layers * num_kv_heads * fmt.bytes_per_head(head_dim)

    @staticmethod
    def bytes_per_token_of(layers: Sequence[KVLayerShape], fmt: KVFormat, in_window: bool | None = None) -> int:
        """The same over layers of their own shapes; a layer that reads another's cache costs nothing.
        `in_window`: only the layers with a sliding window (True) or without (False); None: all."""
        return sum(2 * s.num_kv_heads * fmt.bytes_per_head(s.head_dim) for s in layers if s.reads_layer is None
                   and (in_window is None or in_window == (s.sliding_window is not None)))

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
        """Every stored tensor as bytes, codes and scales as stored whatever their dtype: per shape group,
        its keys, values (and their scales), each (layers, num_blocks, ...)."""
        return [p.view(torch.uint8) for group in self._groups for p in group]

    def block_part_shapes(self) -> list[tuple[int, ...]]:
        """The byte shape of one block in each stored tensor (keys, values, and their scales when
        quantized), layers first: (num_layers, block_size, kv_heads, bytes per head...)."""
        return [(p.shape[0], *p.shape[2:]) for p in self._byte_parts()]

    def read_blocks(self, block_ids: list[int], outs: list[torch.Tensor],
                    window_block_ids: list[int] | None = None) -> None:
        """Copy blocks `block_ids` into `outs` (one per part, (num_layers, n, ...) bytes): bit for bit. The
        window pool's parts read `window_block_ids` (the same logical blocks, aligned)."""
        for (part, ids), out in zip(self._parts_with_ids(block_ids, window_block_ids), outs, strict=True):
            if out.device == part.device:
                torch.index_select(part, 1, ids, out=out)
            else:
                out.copy_(part.index_select(1, ids))

    def write_blocks(self, block_ids: list[int], parts: list[torch.Tensor],
                     window_block_ids: list[int] | None = None) -> None:
        """Store blocks read by another storage's `read_blocks` at `block_ids` (and `window_block_ids`)."""
        for (part, ids), src in zip(self._parts_with_ids(block_ids, window_block_ids), parts, strict=True):
            part.index_copy_(1, ids, src.to(part.device))

    def _parts_with_ids(self, block_ids: list[int],
                        window_block_ids: list[int] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        window_ids = None if window_block_ids is None else torch.tensor(window_block_ids, dtype=torch.long,
                                                                       device=self.device)
        if any(self._group_in_window) and (window_ids is None or len(window_block_ids) != len(block_ids)):
            raise ValueError("a window pool's blocks need their window table, aligned with the blocks")
        return [(p.view(torch.uint8), window_ids if in_window else ids)
                for group, in_window in zip(self._groups, self._group_in_window) for p in group]

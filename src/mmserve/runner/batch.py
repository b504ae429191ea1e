"""Build one step's flattened ragged batch on the CPU.

Role: for every scheduled request, in batch order, append its new tokens' ids, positions
and KV slots; plan which encoder rows each prefill chunk fuses and where; note which rows are
sampled; build the paged-attention metadata (block tables, decode padding masks). Everything is
numpy/ints until `build()`, which ships tensors to the device with non_blocking copies (from
pinned memory on CUDA).

What it does not know: the model, the sampler, scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmserve.runner.attention import DecodeGroup, PagedAttentionMetadata
from mmserve.runner.fusion import ChunkPiece, gather_chunk_rows

if TYPE_CHECKING:
    from mmserve.runner.model_runner import RunnerRequest

# A decode joins a length bucket while its block count is at least this share of the bucket's
# longest: bounds the padded (wasted) keys per bucket to 1 - this share.
DECODE_BUCKET_FILL = 0.75
# The CPU attention kernel attends a request's prefill chunks while its prompt has at most this many
# tokens (and no bidirectional spans): it reads every key once per query, where SDPA's flash kernel
# reuses a block of keys across a block of queries. Measured here, one sequence (10 query / 2 kv heads
# of 64): the kernel 0.84x SDPA's time at 128 keys, 1.1x at 512, 2.3x at 2048; with 12 / 12 heads 1.4x
# at 128. Below it, one call for the step saves more than that (no per-chunk gathers, masks and calls).
# Decided per request, by its prompt, so a token's path depends neither on the requests sharing its
# step nor on how its prompt is chunked. Decodes take the kernel at any length (reading each key once
# is all a decode does).
TOKEN_KERNEL_MAX_PROMPT_TOKENS = 256


@dataclass
class Batch:
    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_position_rows, num_tokens)
    attn: PagedAttentionMetadata
    fusion: list[tuple[torch.Tensor, torch.Tensor]]  # (rows view, batch token positions)
    sample_index: torch.Tensor  # (num_sampled,) rows of the batch whose logits are sampled
    sample_rows: list[RunnerRequest] = field(default_factory=list)


class BatchBuilder:
    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.ids: list[np.ndarray] = []
        self.pos: list[np.ndarray] = []
        self.slots: list[np.ndarray] = []
        self.query_lens: list[int] = []
        self.context_lens: list[int] = []
        self.spans: list[tuple[tuple[int, int], ...]] = []
        self.prefill_tables: list[list[int] | None] = []
        self.decode_rows: list[int] = []
        self.decode_tables: list[list[int]] = []
        # the CPU attention kernel's sequences (`kernel_sequences`): blocks up to the last new token, positions
        self.tables: list[list[int]] = []
        self.token_positions: list[np.ndarray] = []
        self.kernel_sequences: list[bool] = []  # per sequence: does the CPU kernel attend its tokens?
        self.fusion: list[tuple[torch.Tensor, np.ndarray]] = []
        self.sample_index: list[int] = []
        self.sample_rows: list[RunnerRequest] = []
        self.num_tokens = 0

    def add(self, state: RunnerRequest, num: int, pieces: list[ChunkPiece],
            item_outputs: dict[int, torch.Tensor]) -> None:
        """Append `num` tokens of `state`; `pieces` are the encoder rows the chunk fuses (its plan) and
        `item_outputs` maps each piece's item index -> that item's encoder rows."""
        start, end = state.num_computed_tokens, state.num_computed_tokens + num
        offset = self.num_tokens
        self.ids.append(np.asarray(state.token_ids[start:end], dtype=np.int64))
        self.pos.append(state.position_columns(start, end))
        num_blocks = -(-end // self.block_size)
        idx = np.arange(start, end, dtype=np.int64)
        if num == 1:  # a decode, most rows of most steps: its one slot without array indexing
            self.slots.append(np.array([state.block_ids[start // self.block_size] * self.block_size
                                        + start % self.block_size], dtype=np.int64))
        else:
            blocks = np.asarray(state.block_ids[:num_blocks], dtype=np.int64)
            self.slots.append(blocks[idx // self.block_size] * self.block_size + idx % self.block_size)
        row = len(self.query_lens)
        self.query_lens.append(num)
        self.context_lens.append(start)
        # the bidirectional spans this chunk's queries lie in (the chunk policy keeps each one whole)
        spans = state.prompt.attention_spans
        self.spans.append(tuple(s for s in spans if s[0] < end and s[1] > start)
                          if spans and start < state.num_prompt_tokens else ())  # decodes lie in no span
        if num == 1 and start > 0:
            self.decode_rows.append(row)
            self.decode_tables.append(state.block_ids[:num_blocks])
            self.prefill_tables.append(None)
            self.kernel_sequences.append(True)
        else:
            self.prefill_tables.append(state.block_ids[:num_blocks] if start > 0 else None)
            self.kernel_sequences.append(not state.prompt.attention_spans
                                         and state.num_prompt_tokens <= TOKEN_KERNEL_MAX_PROMPT_TOKENS)
        if self.kernel_sequences[-1]:
            self.tables.append(state.block_ids[:num_blocks])
            self.token_positions.append(idx)
        for rows, piece in zip(gather_chunk_rows(pieces, item_outputs), pieces):
            self.fusion.append((rows, piece.token_positions + offset))
        if end == len(state.token_ids):  # the chunk reaches the last known token: sample the next
            self.sample_index.append(offset + num - 1)
            self.sample_rows.append(state)
        self.num_tokens += num

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _decode_groups(self) -> list[DecodeGroup]:
        starts = np.cumsum([0] + self.query_lens[:-1])
        order = sorted(range(len(self.decode_rows)), key=lambda i: -len(self.decode_tables[i]))
        groups, current = [], []
        for i in order:
            if current and len(self.decode_tables[i]) < DECODE_BUCKET_FILL * len(self.decode_tables[current[0]]):
                groups.append(current)
                current = []
            current.append(i)
        if current:
            groups.append(current)
        out = []
        for members in groups:
            width = len(self.decode_tables[members[0]])
            table = np.zeros((len(members), width), dtype=np.int64)
            query_positions = np.empty((len(members), 1), dtype=np.int64)
            for j, i in enumerate(members):
                table[j, :len(self.decode_tables[i])] = self.decode_tables[i]
                query_positions[j] = self.context_lens[self.decode_rows[i]]
            index = starts[[self.decode_rows[i] for i in members]].astype(np.int64)
            key_positions = np.arange(width * self.block_size, dtype=np.int64)[None, :]
            out.append(DecodeGroup(self._to_device(table), self._to_device(key_positions),
                                   self._to_device(query_positions), self._to_device(index)))
        return out

    def _token_queries(self) -> dict[str, Any]:
        """The tokens of the kernel's sequences as queries over their blocks (PagedAttentionMetadata.token_*),
        for the CPU's attention kernel."""
        if self.device.type != "cpu" or not self.tables:
            return {}
        width = max(len(t) for t in self.tables)
        tables = np.zeros((len(self.tables), width), dtype=np.int64)
        for row, blocks in enumerate(self.tables):
            tables[row, :len(blocks)] = blocks
        lens = [n for n, kernel in zip(self.query_lens, self.kernel_sequences) if kernel]
        out = {"token_tables": torch.from_numpy(tables),
               "token_rows": torch.from_numpy(np.repeat(np.arange(len(self.tables), dtype=np.int64), lens)),
               "token_positions": torch.from_numpy(np.concatenate(self.token_positions)),
               "kernel_sequences": self.kernel_sequences}
        if not all(self.kernel_sequences):
            starts = np.cumsum([0] + self.query_lens[:-1])
            out["token_index"] = torch.from_numpy(np.concatenate(
                [np.arange(s, s + n, dtype=np.int64) for s, n, kernel in
                 zip(starts, self.query_lens, self.kernel_sequences) if kernel]))
        return out

    def build(self) -> Batch:
        dev = self._to_device
        attn = PagedAttentionMetadata(
            query_lens=self.query_lens, context_lens=self.context_lens,
            spans=self.spans if any(self.spans) else [],
            slot_mapping=dev(np.concatenate(self.slots)),
            prefill_block_tables=[None if t is None else dev(np.asarray(t, dtype=np.int64))
                                  for t in self.prefill_tables],
            decode_rows=self.decode_rows, decode_groups=self._decode_groups(), **self._token_queries(),
        )
        fusion = [(rows, dev(positions)) for rows, positions in self.fusion]
        return Batch(dev(np.concatenate(self.ids)), dev(np.concatenate(self.pos, axis=1)), attn, fusion,
                     dev(np.asarray(self.sample_index, dtype=np.int64)), self.sample_rows)

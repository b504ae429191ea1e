"""Build one step's flattened ragged batch on the CPU.

Role: for every scheduled request, in batch order, append its new tokens' ids, positions
and KV slots; plan which encoder rows each prefill chunk fuses and where; note which rows are
sampled; build the paged-attention metadata (block tables, decode padding masks, and the tokens the
CPU attention kernel takes, as its `CpuAttentionPlan` says). Everything is numpy/ints until
`build()`, which ships tensors to the device with non_blocking copies (from pinned memory on CUDA).

What it does not know: the model, the sampler, scheduling, which tokens suit the CPU kernel (the plan
decides).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from mmserve.runner.attention import DecodeGroup, PagedAttentionMetadata
from mmserve.runner.cpu.attention_plan import CpuAttentionPlan, KernelTokenTables
from mmserve.runner.fusion import ChunkPiece, gather_chunk_rows
from mmserve.runner.speculation import DraftRows
from mmserve.runner.state import PromptLogprobRows, RunnerRequest

# A decode joins a length bucket while its block count is at least this share of the bucket's
# longest: bounds the padded (wasted) keys per bucket to 1 - this share.
DECODE_BUCKET_FILL = 0.75


class PoolTables:
    """One block pool's side of a step: each new token's cache slot, the block table of each prefill chunk
    with context and of each decode, and the CPU kernel's tokens over them. A model whose sliding layers keep
    only their window (core/window_kv.py) has a second pool: the same sequences over their window tables."""

    def __init__(self, block_size: int, cpu_attention: CpuAttentionPlan | None) -> None:
        self.block_size = block_size
        self.slots: list[np.ndarray] = []
        self.prefill_tables: list[list[int] | None] = []
        self.decode_tables: list[list[int]] = []
        self.kernel_tokens = (KernelTokenTables(cpu_attention) if cpu_attention is not None and cpu_attention.enabled
                              else None)

    def add(self, block_ids: list[int], start: int, idx: np.ndarray, is_decode: bool, past_prompt: bool,
            num_prompt_tokens: int, has_spans: bool) -> None:
        """A sequence's new tokens at positions `idx` (from `start`), over its blocks `block_ids`."""
        bs = self.block_size
        num_blocks = -(-(start + len(idx)) // bs)
        if len(idx) == 1:  # a decode, most rows of most steps: its one slot without array indexing
            self.slots.append(np.array([block_ids[start // bs] * bs + start % bs], dtype=np.int64))
        else:
            blocks = np.asarray(block_ids[:num_blocks], dtype=np.int64)
            self.slots.append(blocks[idx // bs] * bs + idx % bs)
        if is_decode:
            self.decode_tables.append(block_ids[:num_blocks])
            self.prefill_tables.append(None)
        else:
            self.prefill_tables.append(block_ids[:num_blocks] if start > 0 else None)
        if self.kernel_tokens is not None:  # tokens past the prompt (a decode's, a draft verification's) as decodes
            self.kernel_tokens.add(block_ids[:num_blocks], idx, is_decode or past_prompt, num_prompt_tokens, has_spans)


@dataclass
class Batch:
    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_position_rows, num_tokens)
    attn: PagedAttentionMetadata
    fusion: list[tuple[torch.Tensor, torch.Tensor]]  # (rows view, batch token positions)
    sample_index: torch.Tensor  # (num_sampled,) rows of the batch whose logits are sampled
    sample_rows: list[RunnerRequest] = field(default_factory=list)
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)


class BatchBuilder:
    def __init__(self, block_size: int, device: torch.device, cpu_attention: CpuAttentionPlan | None = None,
                 window_pool: bool = False) -> None:
        """`cpu_attention`: which tokens the CPU attention kernel takes (None, or a plan with it off: none);
        `window_pool`: the sliding layers' blocks are a pool of their own (each request's `window_block_ids`)."""
        self.block_size = block_size
        self.device = device
        self.ids: list[np.ndarray] = []
        self.pos: list[np.ndarray] = []
        self.query_lens: list[int] = []
        self.context_lens: list[int] = []
        self.spans: list[tuple[tuple[int, int], ...]] = []
        self.decode_rows: list[int] = []
        self.tables = PoolTables(block_size, cpu_attention)
        self.window_tables = PoolTables(block_size, cpu_attention) if window_pool else None
        self.fusion: list[tuple[torch.Tensor, np.ndarray]] = []
        self.sample_index: list[int] = []
        self.sample_rows: list[RunnerRequest] = []
        self.draft_rows: list[DraftRows] = []  # speculative decoding's rows to verify
        self.prompt_logprob_rows: list[PromptLogprobRows] = []
        self.state_slots: list[int] = []  # a hybrid model's: each sequence's recurrent-state slot
        self.num_tokens = 0

    def add(self, state: RunnerRequest, num: int, pieces: list[ChunkPiece],
            item_outputs: dict[int, torch.Tensor], num_drafts: int = 0) -> None:
        """Append `num` tokens of `state`; `pieces` are the encoder rows the chunk fuses (its plan) and
        `item_outputs` maps each piece's item index -> that item's encoder rows. `num_drafts`: a decode whose
        last `num_drafts` tokens are drafts (runner/speculation.py verifies them instead of sampling)."""
        start, end = state.num_computed_tokens, state.num_computed_tokens + num
        offset = self.num_tokens
        self.ids.append(np.asarray(state.token_ids[start:end], dtype=np.int64))
        self.pos.append(state.position_columns(start, end))
        idx = np.arange(start, end, dtype=np.int64)
        row = len(self.query_lens)
        if state.state_slot is not None:
            self.state_slots.append(state.state_slot)
        self.query_lens.append(num)
        self.context_lens.append(start)
        # the bidirectional spans this chunk's queries lie in (the chunk policy keeps each one whole)
        spans = state.prompt.attention_spans
        self.spans.append(tuple(s for s in spans if s[0] < end and s[1] > start)
                          if spans and start < state.num_prompt_tokens else ())  # decodes lie in no span
        is_decode = num == 1 and start > 0
        if is_decode:
            self.decode_rows.append(row)
        facts = (start, idx, is_decode, start >= state.num_prompt_tokens, state.num_prompt_tokens,
                 bool(state.prompt.attention_spans))
        self.tables.add(state.block_ids, *facts)
        if self.window_tables is not None:
            self.window_tables.add(state.window_block_ids, *facts)
        for rows, piece in zip(gather_chunk_rows(pieces, item_outputs), pieces):
            self.fusion.append((rows, piece.token_positions + offset))
        if num_drafts:  # its last known token's row and each draft's give the greedy token after it
            self.draft_rows.append(DraftRows(state.request_id, offset + num - 1 - num_drafts,
                                             tuple(state.token_ids[end - num_drafts:end]), state.sampling_params,
                                             row, state.state_slot))
        elif end == len(state.token_ids):  # the chunk reaches the last known token: sample the next
            self.sample_index.append(offset + num - 1)
            self.sample_rows.append(state)
        # prompt logprobs: positions before the last prompt token predict a prompt token
        last = min(end, state.num_prompt_tokens - 1)
        if state.sampling_params.prompt_logprobs is not None and start < last:
            self.prompt_logprob_rows.append(PromptLogprobRows(state, offset, start, last - start))
        self.num_tokens += num

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _decode_groups(self, decode_tables: list[list[int]]) -> list[DecodeGroup]:
        starts = np.cumsum([0] + self.query_lens[:-1])
        order = sorted(range(len(self.decode_rows)), key=lambda i: -len(decode_tables[i]))
        groups, current = [], []
        for i in order:
            if current and len(decode_tables[i]) < DECODE_BUCKET_FILL * len(decode_tables[current[0]]):
                groups.append(current)
                current = []
            current.append(i)
        if current:
            groups.append(current)
        out = []
        for members in groups:
            width = len(decode_tables[members[0]])
            table = np.zeros((len(members), width), dtype=np.int64)
            query_positions = np.empty((len(members), 1), dtype=np.int64)
            for j, i in enumerate(members):
                table[j, :len(decode_tables[i])] = decode_tables[i]
                query_positions[j] = self.context_lens[self.decode_rows[i]]
            index = starts[[self.decode_rows[i] for i in members]].astype(np.int64)
            key_positions = np.arange(width * self.block_size, dtype=np.int64)[None, :]
            out.append(DecodeGroup(self._to_device(table), self._to_device(key_positions),
                                   self._to_device(query_positions), self._to_device(index)))
        return out

    def _pool_tables(self, tables: PoolTables) -> dict:
        """The attention metadata's fields of one pool's tables."""
        dev = self._to_device
        return dict(slot_mapping=dev(np.concatenate(tables.slots)),
                    prefill_block_tables=[None if t is None else dev(np.asarray(t, dtype=np.int64))
                                          for t in tables.prefill_tables],
                    decode_groups=self._decode_groups(tables.decode_tables),
                    kernel_tokens=None if tables.kernel_tokens is None else tables.kernel_tokens.build())

    def build(self) -> Batch:
        dev = self._to_device
        attn = PagedAttentionMetadata(
            query_lens=self.query_lens, context_lens=self.context_lens,
            spans=self.spans if any(self.spans) else [],
            decode_rows=self.decode_rows, **self._pool_tables(self.tables),
            state_slots=self.state_slots,
            state_slot_index=dev(np.asarray(self.state_slots, dtype=np.int64)) if self.state_slots else None,
            record_states=frozenset(d.sequence for d in self.draft_rows if d.state_slot is not None),
        )
        if self.window_tables is not None:  # the sliding layers' view of the same sequences
            attn.window = dataclasses.replace(attn, **self._pool_tables(self.window_tables))
        fusion = [(rows, dev(positions)) for rows, positions in self.fusion]
        return Batch(dev(np.concatenate(self.ids)), dev(np.concatenate(self.pos, axis=1)), attn, fusion,
                     dev(np.asarray(self.sample_index, dtype=np.int64)), self.sample_rows, self.prompt_logprob_rows)

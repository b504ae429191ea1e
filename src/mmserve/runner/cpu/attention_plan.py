"""Which of a step's tokens mmserve's CPU attention kernel attends: the one place that decides it.

Role: `CpuAttentionPlan` is decided once per engine from its KV storage (a float32, unquantized cache
on the CPU, on a machine where the kernel runs) and then per request, by its prompt: a request's
prefill tokens are the kernel's when its prompt has no bidirectional spans and at most
`max_prompt_tokens` tokens; tokens past the prompt (decodes, and the chunk of a decode with its drafts to
verify) are the kernel's at any length, so a verified draft takes a decode's numerical path. Deciding per request means a
token's path depends neither on the requests sharing its step nor on how its prompt is chunked.
`KernelTokenTables` gathers, while the batch builder walks a step's sequences, the kernel's tokens as
queries over their sequences' blocks, and ships them as `KernelTokens`, which the attention backend
reads.

What it does not know: requests beyond the facts it is handed, scheduling, models, what the kernel
computes (`attention.py` beside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mmserve.runner.cpu import attention as cpu_attention

# The kernel reads every key once per query, where SDPA's flash kernel reuses a block of keys across a
# block of queries: past a few hundred keys a prompt is faster on SDPA. Below it, one call for the
# step's tokens saves more (no per-chunk gathers, masks and calls). Reading each key once is all a
# decode does, so decodes take the kernel at any length.
KERNEL_MAX_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class CpuAttentionPlan:
    """Whether the kernel serves this engine, and which prompts' prefill tokens it takes."""

    enabled: bool = False
    max_prompt_tokens: int = KERNEL_MAX_PROMPT_TOKENS

    @classmethod
    def for_storage(cls, device: torch.device, dtype: torch.dtype, quantized: bool) -> CpuAttentionPlan:
        """The plan for a KV cache of this device, dtype and format (the kernel reads float32 codes only)."""
        return cls(enabled=device.type == "cpu" and dtype == torch.float32 and not quantized
                   and cpu_attention.available())

    def takes_prefill(self, num_prompt_tokens: int, has_spans: bool) -> bool:
        return self.enabled and not has_spans and num_prompt_tokens <= self.max_prompt_tokens

    @property
    def takes_decodes(self) -> bool:
        return self.enabled


@dataclass
class KernelTokens:
    """The step's tokens the kernel attends, each a query over its sequence's blocks (all on the CPU)."""

    tables: torch.Tensor  # (kernel sequences, width) int64 block tables, padded with block 0
    rows: torch.Tensor  # (num kernel tokens,) int64: each token's table row
    positions: torch.Tensor  # (num kernel tokens,) int64: each token's position in its sequence
    index: torch.Tensor | None  # (num kernel tokens,) int64 rows of the flat batch; None: every token
    sequences: list[bool] = field(default_factory=list)  # per sequence of the step: are its tokens the kernel's?


class KernelTokenTables:
    """Collects a step's kernel tokens sequence by sequence, in batch order."""

    def __init__(self, plan: CpuAttentionPlan) -> None:
        self.plan = plan
        self.sequences: list[bool] = []
        self.query_lens: list[int] = []
        self.tables: list[list[int]] = []
        self.positions: list[np.ndarray] = []

    def add(self, block_ids: list[int], positions: np.ndarray, is_decode: bool, num_prompt_tokens: int,
            has_spans: bool) -> None:
        """One sequence's tokens of the step: `positions` (its new tokens' positions), the blocks up to its
        last new token; `is_decode`: they lie past its prompt."""
        takes = self.plan.takes_decodes if is_decode else self.plan.takes_prefill(num_prompt_tokens, has_spans)
        self.sequences.append(takes)
        self.query_lens.append(len(positions))
        if takes:
            self.tables.append(block_ids)
            self.positions.append(positions)

    def build(self) -> KernelTokens | None:
        """The kernel's tokens, or None when it takes none of this step's."""
        if not self.tables:
            return None
        width = max(len(t) for t in self.tables)
        tables = np.zeros((len(self.tables), width), dtype=np.int64)
        for row, blocks in enumerate(self.tables):
            tables[row, :len(blocks)] = blocks
        lens = [n for n, takes in zip(self.query_lens, self.sequences) if takes]
        index = None
        if not all(self.sequences):
            starts = np.cumsum([0] + self.query_lens[:-1])
            index = torch.from_numpy(np.concatenate(
                [np.arange(s, s + n, dtype=np.int64) for s, n, takes in
                 zip(starts, self.query_lens, self.sequences) if takes]))
        return KernelTokens(torch.from_numpy(tables),
                            torch.from_numpy(np.repeat(np.arange(len(self.tables), dtype=np.int64), lens)),
                            torch.from_numpy(np.concatenate(self.positions)), index, self.sequences)

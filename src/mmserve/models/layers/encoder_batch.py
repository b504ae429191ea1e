"""The encoder-batch types a family's vision tower and the runner's encoder graphs share.

Role: `EncoderBucket` keys one captured encoder graph (total encoder tokens, and per attention kind
the number of contexts); `EncoderPlan` says how one batch is padded up to a bucket; `EncoderGraphBatch`
is a batch as a family lays it out. A family's graph layout (e.g. `qwen2_vl/vision_graph.py`, the
runner's `EncoderGraphAdapter`) builds these from its payloads; the runner's graphs
(`runner/graphs/`) plan, capture and replay them. Pure Python, like the planner that reads them.

What it does not know: torch, devices, how graphs are captured, any family.
A "context" is a run of tokens that attend to each other; which runs those are is the family's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class EncoderBucket:
    """The key of one captured encoder graph: its static shapes."""

    total_tokens: int  # encoder tokens (pre-merge patches), real and padding
    num_contexts: tuple[int, ...]  # per attention kind, in the family's kind order: real and dummy contexts

    def __post_init__(self) -> None:
        if self.total_tokens <= 0 or not self.num_contexts or min(self.num_contexts) < 2:
            raise ValueError(f"an encoder bucket needs tokens > 0 and >= 2 contexts per kind (one real, one "
                             f"dummy); got {self}")
        if max(self.num_contexts) > self.total_tokens:
            raise ValueError(f"{self}: more contexts than tokens (every context holds at least one token)")


@dataclass(frozen=True)
class EncoderPlan:
    """How one encoder batch is padded up to `bucket`."""

    bucket: EncoderBucket
    real_tokens: int
    # per attention kind: the context lengths, the real ones in order, then the dummies (each >= 1 token)
    context_tokens: tuple[tuple[int, ...], ...]

    num_real_contexts: tuple[int, ...]  # per attention kind

    @property
    def pad_tokens(self) -> int:
        return self.bucket.total_tokens - self.real_tokens

    def dummy_context_tokens(self, kind: int) -> tuple[int, ...]:
        return self.context_tokens[kind][self.num_real_contexts[kind]:]

    def cu_seqlens(self, kind: int) -> list[int]:
        """(num_contexts + 1) cumulative context starts of `kind`, the varlen kernel's layout."""
        out = [0]
        for length in self.context_tokens[kind]:
            out.append(out[-1] + length)
        return out


@dataclass(frozen=True)
class EncoderGraphBatch:
    """One encoder batch as a family lays it out for a captured graph: what the planner reads (the
    context lengths per attention kind, the output rows per item) and the family's own host-side
    arrays, which only the family reads."""

    context_tokens: tuple[tuple[int, ...], ...]  # per attention kind, in the family's kind order
    item_rows: tuple[int, ...]  # output rows of each item, in order
    arrays: dict[str, Any]  # the family's CPU tensors (pixels, positions, orders, ...)

    @property
    def num_rows(self) -> int:
        return sum(self.item_rows)

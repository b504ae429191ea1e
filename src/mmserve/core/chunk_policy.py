"""Where a prefill chunk may end: the policy object beside the scheduler (docs/architecture.md §5).

Role: a family may declare its items' spans indivisible for the language model (Gemma 3's image
tokens attend to each other in both directions, so the KV of a span's first tokens depends on its
last ones). Then no chunk ends strictly inside such a span: a chunk that would is cut back to the
span's start, or to nothing when the span began before the chunk (a prefix-cache hit that ended
inside it: the rest of the span must come in one chunk). A hybrid model that snapshots its recurrent state
(core/state_snapshots.py) has chunks end at the prompt's last full-block boundary when they would cross it,
so its state is taken exactly there, and with `state_snapshot_interval` at every multiple of it. At start, `resolve_token_budget` lifts
`max_num_batched_tokens` to the longest span, so every span fits one step, and says so in one line.

What it does not know: tensors, attention, encoder budgets, KV blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mmserve.core.request import Request

logger = logging.getLogger("mmserve.budget")


@dataclass(frozen=True)
class ChunkBoundaryPolicy:
    indivisible_items: bool = False  # no chunk ends strictly inside an item's span
    snapshot_block_size: int | None = None  # a chunk crossing the prompt's last full block of this size ends there
    snapshot_interval: int | None = None  # and a chunk crossing a multiple of this many tokens ends at the first

    def cut(self, request: Request, start: int, end: int) -> int:
        """The end of the chunk [start, end) after the policy: end itself, or earlier (>= start)."""
        if self.snapshot_block_size is not None:
            boundary = request.num_prompt_tokens // self.snapshot_block_size * self.snapshot_block_size
            end = boundary if start < boundary < end else end
            if self.snapshot_interval:
                boundary = (start // self.snapshot_interval + 1) * self.snapshot_interval
                end = boundary if boundary < end else end
        if not self.indivisible_items:
            return end
        for item in request.items:
            if item.offset < end < item.end:  # items are in prompt order and disjoint: at most one
                return max(start, item.offset)
        return end


def resolve_token_budget(configured: int, largest_span: int, indivisible_items: bool) -> tuple[int, list[str]]:
    """The effective max_num_batched_tokens and the warning line it logged, if it lifted the budget."""
    if configured < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {configured}")
    if not indivisible_items or configured >= largest_span:
        return configured, []
    line = (f"max_num_batched_tokens lifted: configured={configured} effective={largest_span} "
            f"largest_span={largest_span} (an image span is prefilled in one chunk)")
    logger.warning(line)
    return largest_span, [line]

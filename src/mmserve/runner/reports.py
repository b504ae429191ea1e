"""What the model runner reports of itself: its last step's timing, its encoder's and graphs' counters, and
each request as it holds it.

Role: plain read-only values the engine (and `Engine.inspect()`) takes copies of.
What it does not know: how the runner computes anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.runner.graphs.decode_graphs import DecodeGraphStats
from mmserve.runner.graphs.encoder_graphs import EncoderGraphStats


@dataclass
class StepTiming:
    """Wall time of the last step, and of the part spent in the model forward (incl. logits)."""

    total_s: float = 0.0
    forward_s: float = 0.0
    num_tokens: int = 0


@dataclass(frozen=True)
class EncoderCounts:
    """What the runner's encoder has done over its life."""

    items_encoded: int
    tokens_encoded: int  # pre-merge patches


@dataclass(frozen=True)
class GraphStats:
    """The captured graphs the runner holds (None: that kind is off) and how often each kind replayed."""

    encoder: EncoderGraphStats | None
    decode: DecodeGraphStats | None


@dataclass(frozen=True)
class RunnerRequestView:
    """A request as the runner holds it, read-only."""

    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: tuple[int, ...]

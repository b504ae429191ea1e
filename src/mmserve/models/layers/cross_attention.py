"""A sequence's cross-attention state: its images' K/V, built once, and each step's masks.

Role: for a family whose language model reads items through cross-attention (`FamilySpec.cross_attention`),
`CrossKV` holds one sequence's keys and values of every cross-attention layer, computed from its items'
encoder outputs joined in item order (`build`: the runner does it the first time a chunk of a request
runs, and again after a preemption dropped the request's runner state). `step_inputs` builds a sequence's
`CrossAttentionInputs` for the queries at positions [start, end): the bias that hides the rows a
query does not see, and the row gate. The mask is transformers' (`_prepare_cross_attention_mask`):
a query sees the attended rows of every item whose span covers it; a query that sees no row at all
gets no mask (it attends to every row, padding included) and a row gate of 0. Masks are built on the
CPU with numpy and shipped with non_blocking copies.

What it does not know: scheduling and budgets (core/ counts the bytes), what a family does with the
inputs (models/layers/attention.py's `CrossAttentionInputs` is the contract), which family it serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmserve.inputs.items import CrossAttentionSpan
from mmserve.models.layers.attention import CrossAttentionInputs


@dataclass(frozen=True)
class CrossItem:
    """One item as cross-attention reads it: its rows' place among the request's rows, and who sees them."""

    first_row: int
    span: CrossAttentionSpan


@dataclass
class CrossKV:
    """A request's cross-attention keys and values (per layer, each (num_kv_heads, rows, head_dim))."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    items: tuple[CrossItem, ...]
    num_rows: int
    # one query's inputs at any position past every span's start and end (what each decode step reads;
    # the same for all of them), made at the first such step
    steady: CrossAttentionInputs | None = None

    @property
    def steady_from(self) -> int:
        """The first position from which which rows a query sees no longer changes."""
        ends = [i.span.visible_until or 0 for i in self.items]
        return max([i.span.visible_from for i in self.items] + ends)

    @property
    def num_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)

    @classmethod
    def build(cls, model: Any, outputs: Sequence[torch.Tensor], spans: Sequence[CrossAttentionSpan]) -> CrossKV:
        """From the items' encoder outputs (each (streams, rows, hidden), in item order) through the model's
        `cross_attention_kv((rows, hidden)) -> [(keys, values)] per cross-attention layer`."""
        rows = [o.shape[1] for o in outputs]
        states = torch.cat([o[0] for o in outputs])  # (rows, hidden)
        return cls(model.cross_attention_kv(states), cross_items(spans, rows), sum(rows))


def cross_items(spans: Sequence[CrossAttentionSpan], rows: Sequence[int]) -> tuple[CrossItem, ...]:
    """Items in prompt order with the row each starts at."""
    firsts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(int) if rows else []
    return tuple(CrossItem(int(first), span) for first, span in zip(firsts, spans))


def visibility(items: Sequence[CrossItem], num_rows: int, start: int, end: int) -> np.ndarray:
    """(end - start, num_rows) bool: which rows each query at positions [start, end) sees."""
    positions = np.arange(start, end)[:, None]
    seen = np.zeros((end - start, num_rows), dtype=bool)
    for item in items:
        span = item.span
        until = np.iinfo(np.int64).max if span.visible_until is None else span.visible_until
        rows = slice(item.first_row, item.first_row + span.attended_rows)
        seen[:, rows] |= (positions >= span.visible_from) & (positions < until)
    return seen


def step_inputs(cross: CrossKV, start: int, end: int, device: torch.device) -> CrossAttentionInputs:
    """The sequence's cross-attention inputs for its queries at positions [start, end)."""
    if end == start + 1 and start >= cross.steady_from:  # a decode step: built once per request
        if cross.steady is None:
            cross.steady = _inputs(cross, start, end, device)
        return cross.steady
    return _inputs(cross, start, end, device)


def _inputs(cross: CrossKV, start: int, end: int, device: torch.device) -> CrossAttentionInputs:
    seen = visibility(cross.items, cross.num_rows, start, end)
    sees_any = seen.any(axis=1)
    if seen.all():
        return CrossAttentionInputs(cross.kv)
    seen[~sees_any] = True  # transformers: a query that sees nothing is not masked at all
    bias = torch.from_numpy(np.where(seen, 0.0, -np.inf).astype(np.float32))
    gate = None if sees_any.all() else torch.from_numpy(sees_any.astype(np.float32)[:, None])
    return CrossAttentionInputs(cross.kv, bias.to(device, non_blocking=True),
                                None if gate is None else gate.to(device, non_blocking=True))

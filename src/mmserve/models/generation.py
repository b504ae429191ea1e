"""Single-request generation over a contiguous KV cache, for any family.

Role: the shortest honest path from a `ProcessedPrompt` to tokens — encode the items, fuse
their rows (every embedding stream) at the embed-mask positions, prefill, then decode with the
prompt's positions. Used by `mmserve generate` and as a check on the model; the engine does the
same work batched.
What it does not know: scheduling, batching, paged KV, any family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from mmserve.inputs.items import ProcessedPrompt
from mmserve.models.layers.attention import AttentionMetadata, ContiguousKVCache
from mmserve.models.layers.cross_attention import CrossKV, step_inputs
from mmserve.models.spec import FamilyModel, FamilySpec

# Picks the next token from (vocab,) logits given the tokens generated so far.
TokenPicker = Callable[[torch.Tensor, list[int]], int]


def greedy(logits: torch.Tensor, generated: list[int]) -> int:
    return int(torch.argmax(logits))


class SequenceCache(ContiguousKVCache):
    """One sequence's KV (slot 0), and a hybrid model's recurrent states (one slot, float32, zero at start)."""

    def __init__(self, spec: FamilySpec, max_len: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(spec.num_layers, 1, max_len, spec.num_kv_heads, spec.head_dim, dtype, device,
                         layers=spec.kv_layer_shapes)
        layout = spec.linear_state
        self.states = [] if layout is None else [
            (torch.zeros((1, *layout.conv_shape), device=device), torch.zeros((1, *layout.recurrent_shape),
                                                                              device=device))
            for _ in range(layout.num_layers)]

    def linear_states(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.states[layer_idx]


def prefill_inputs(model: FamilyModel, prompt: ProcessedPrompt,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(num_tokens, hidden) input embeddings with every item's main rows fused in, and the extra
    embedding streams (streams - 1, num_tokens, hidden), zero at text rows, or None."""
    ids = torch.tensor(prompt.prompt_token_ids, dtype=torch.long, device=device)
    embeds = model.embed(ids)
    if not prompt.items or _cross_attends(prompt):  # cross-attended items fuse no rows
        return embeds, None
    rows = torch.cat(model.encode_items([i.payload for i in prompt.items]), dim=1)  # (streams, rows, hidden)
    positions = torch.from_numpy(np.flatnonzero(prompt.embed_mask)).to(device)  # built on the CPU
    embeds = embeds.index_copy(0, positions, rows[0].to(embeds.dtype))
    if rows.shape[0] == 1:
        return embeds, None
    extra = embeds.new_zeros(rows.shape[0] - 1, *embeds.shape)
    return embeds, extra.index_copy_(1, positions, rows[1:].to(embeds.dtype))


def _cross_attends(prompt: ProcessedPrompt) -> bool:
    return any(item.cross_attention is not None for item in prompt.items)


def prompt_cross_kv(model: FamilyModel, prompt: ProcessedPrompt) -> CrossKV | None:
    """The prompt's cross-attention K/V (its items encoded), or None when no item is cross-attended."""
    if not _cross_attends(prompt):
        return None
    return CrossKV.build(model, model.encode_items([i.payload for i in prompt.items]),
                         [i.cross_attention for i in prompt.items])


def step_metadata(query_len: int, context_len: int, cross: CrossKV | None, device: torch.device,
                  spans: tuple = ()) -> AttentionMetadata:
    """One sequence's metadata for its tokens [context_len, context_len + query_len)."""
    meta = AttentionMetadata([query_len], [context_len], [spans], state_slots=[0])
    if cross is not None:
        meta.cross = [step_inputs(cross, context_len, context_len + query_len, device)]
    return meta


def prefill_metadata(prompt: ProcessedPrompt, spec: FamilySpec, cross: CrossKV | None = None) -> AttentionMetadata:
    """Attention metadata of a whole prompt prefilled at once: its bidirectional spans, if the family has any,
    and its cross-attention inputs, if it has cross-attended items (`cross`: their K/V)."""
    spans = spec.bidirectional_spans(prompt)
    device = cross.kv[0][0].device if cross is not None else torch.device("cpu")
    return step_metadata(prompt.num_tokens, 0, cross, device, spans)


def prompt_positions(prompt: ProcessedPrompt, start: int, end: int, device: torch.device) -> torch.Tensor:
    cols = prompt.positions.columns(start, end, prompt.num_tokens)
    return torch.from_numpy(np.array(cols, dtype=np.int64)).to(device)  # a copy: cols may be a read-only view


@torch.inference_mode()
def generate(model: FamilyModel, spec: FamilySpec, prompt: ProcessedPrompt, max_new_tokens: int,
             stop_token_ids: tuple[int, ...] = (), min_new_tokens: int = 0,
             pick: TokenPicker = greedy) -> Iterator[int]:
    """Yield generated token ids one at a time (stop tokens are yielded, then generation ends)."""
    device = next(model.parameters()).device
    n = prompt.num_tokens
    cache = SequenceCache(spec, n + max_new_tokens, next(model.parameters()).dtype, device)
    embeds, extra = prefill_inputs(model, prompt, device)
    cross = prompt_cross_kv(model, prompt)
    ids = torch.tensor(prompt.prompt_token_ids, dtype=torch.long, device=device)
    hidden = model(embeds, prompt_positions(prompt, 0, n, device), cache, prefill_metadata(prompt, spec, cross),
                   extra, **spec.forward_kwargs(ids))
    logits = model.compute_logits(hidden[-1:])[0]
    generated: list[int] = []
    for step in range(max_new_tokens):
        if step < min_new_tokens and stop_token_ids:
            logits[list(stop_token_ids)] = float("-inf")
        token = pick(logits, generated)
        generated.append(token)
        yield token
        if token in stop_token_ids and step >= min_new_tokens or step + 1 == max_new_tokens:
            return
        ids = torch.tensor([token], dtype=torch.long, device=device)
        pos = prompt_positions(prompt, n + step, n + step + 1, device)
        hidden = model(model.embed(ids), pos, cache, step_metadata(1, n + step, cross, device), None,
                       **spec.forward_kwargs(ids))
        logits = model.compute_logits(hidden)[0]

"""Single-request generation over a contiguous KV cache.

Role: the shortest honest path from a `ProcessedPrompt` to tokens — encode the items, fuse
their rows at the embed-mask positions, prefill, then decode with the rope delta. Used by
`mmserve generate` and as a check on the model; the engine does the same work batched.
What it does not know: scheduling, batching, paged KV.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from mmserve.inputs.items import ProcessedPrompt
from mmserve.models.layers.attention import AttentionMetadata, ContiguousKVCache
from mmserve.models.qwen2_vl.model import Qwen2VLForConditionalGeneration
from mmserve.models.qwen2_vl.mrope import decode_positions

# Picks the next token from (vocab,) logits given the tokens generated so far.
TokenPicker = Callable[[torch.Tensor, list[int]], int]


def greedy(logits: torch.Tensor, generated: list[int]) -> int:
    return int(torch.argmax(logits))


def prefill_embeds(model: Qwen2VLForConditionalGeneration, prompt: ProcessedPrompt,
                   device: torch.device) -> torch.Tensor:
    """(num_tokens, hidden) input embeddings with every item's rows fused in."""
    ids = torch.tensor(prompt.prompt_token_ids, dtype=torch.long, device=device)
    if not prompt.items:
        return model.embed(ids)
    pixels = torch.from_numpy(np.concatenate([i.pixel_values for i in prompt.items])).to(device)
    rows = model.encode(pixels, [i.grid_thw for i in prompt.items])
    positions = torch.from_numpy(np.flatnonzero(prompt.embed_mask)).to(device)  # built on the CPU
    return model.embed(ids, rows, positions)


@torch.inference_mode()
def generate(model: Qwen2VLForConditionalGeneration, prompt: ProcessedPrompt, max_new_tokens: int,
             stop_token_ids: tuple[int, ...] = (), min_new_tokens: int = 0,
             pick: TokenPicker = greedy) -> Iterator[int]:
    """Yield generated token ids one at a time (stop tokens are yielded, then generation ends)."""
    device = next(model.parameters()).device
    text = model.config.text
    n = prompt.num_tokens
    cache = ContiguousKVCache(text.num_hidden_layers, 1, n + max_new_tokens, text.num_key_value_heads,
                              text.head_dim, next(model.parameters()).dtype, device)
    positions = torch.from_numpy(prompt.mrope_positions).to(device)
    hidden = model(prefill_embeds(model, prompt, device), positions, cache, AttentionMetadata([n], [0]))
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
        pos = torch.from_numpy(decode_positions(n + step, 1, prompt.rope_delta).copy()).to(device)
        ids = torch.tensor([token], dtype=torch.long, device=device)
        hidden = model(model.embed(ids), pos, cache, AttentionMetadata([1], [n + step]))
        logits = model.compute_logits(hidden)[0]

"""The offline benchmark's systems and checks besides mmserve: transformers' `generate` one
conversation at a time and in left-padded batches, and the greedy comparisons.

Role: `SystemResult` (one system's wall, tokens and extras), running transformers on prepared
inputs, padding a batch of any family's inputs, and locating the first greedy divergence with the
reference's logit margin there. What it does not know: mmserve, workloads, checkpoints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

HF_BATCH_SIZE = 8


@dataclass
class SystemResult:
    name: str
    wall_s: float
    output_tokens: int
    tokens: list[list[int]]  # greedy output ids per request (of the requests that ran)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"wall_s": round(self.wall_s, 3), "output_tokens": self.output_tokens,
                "tokens_per_s": round(self.tokens_per_s, 2), **self.extra}


def _generate(model: torch.nn.Module, inputs: dict[str, torch.Tensor], num_tokens: int,
              pad_id: int) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                             pad_token_id=pad_id)
    return out[:, inputs["input_ids"].shape[1]:].tolist()


def run_hf_single(model: torch.nn.Module, inputs: list[dict[str, torch.Tensor]], output_tokens: int,
                  pad_id: int, subset: int | None) -> SystemResult:
    """`generate` per conversation; with `subset`, only the first `subset` and tokens/s extrapolated."""
    chosen = inputs[:subset] if subset else inputs
    _generate(model, inputs[0], 2, pad_id)  # warm-up
    tokens = []
    started = time.perf_counter()
    for one in chosen:
        tokens.extend(_generate(model, one, output_tokens, pad_id))
    wall_s = time.perf_counter() - started
    extra: dict[str, Any] = {"subset": len(chosen) if len(chosen) < len(inputs) else None}
    if extra["subset"]:
        extra["extrapolated_full_wall_s"] = round(wall_s * len(inputs) / len(chosen), 3)
    return SystemResult("hf_single", wall_s, sum(len(t) for t in tokens), tokens, extra)


# media inputs with one row per prompt token (Llama 3.2 Vision's cross-attention mask)
TOKEN_ALIGNED = frozenset({"cross_attention_mask"})


def _stack_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0, zero-padding the other dims to the largest (as processors pad tiles)."""
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        pad = [x for d in reversed(range(1, t.dim())) for x in (0, shape[d - 1] - t.shape[d])]
        padded.append(torch.nn.functional.pad(t, pad) if any(pad) else t)
    return torch.cat(padded)


def left_pad(batch: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """One left-padded batch from per-request inputs; every media tensor (pixels, grids, sizes)
    concatenated in request order."""
    width = max(one["input_ids"].shape[1] for one in batch)
    out = {"input_ids": torch.full((len(batch), width), pad_id, dtype=torch.long),
           "attention_mask": torch.zeros((len(batch), width), dtype=torch.long)}
    if "mm_token_type_ids" in batch[0]:
        out["mm_token_type_ids"] = torch.zeros((len(batch), width), dtype=batch[0]["mm_token_type_ids"].dtype)
    for row, one in enumerate(batch):
        n = one["input_ids"].shape[1]
        out["input_ids"][row, width - n:] = one["input_ids"][0]
        out["attention_mask"][row, width - n:] = 1
        if "mm_token_type_ids" in out:
            out["mm_token_type_ids"][row, width - n:] = one["mm_token_type_ids"][0]
    media = sorted({k for one in batch for k in one} - set(out))
    for key in media:
        present = [one[key] for one in batch if key in one]
        if key in TOKEN_ALIGNED:  # (1, tokens, ...): left-padded along the tokens, as the ids are
            present = [torch.nn.functional.pad(t, [0, 0] * (t.dim() - 2) + [width - t.shape[1], 0]) for t in present]
        out[key] = _stack_padded(present)
    return out


def run_hf_batched(model: torch.nn.Module, inputs: list[dict[str, torch.Tensor]], output_tokens: int,
                   pad_id: int, batch_size: int = HF_BATCH_SIZE) -> SystemResult:
    batches = [left_pad(inputs[i:i + batch_size], pad_id) for i in range(0, len(inputs), batch_size)]
    _generate(model, batches[0], 2, pad_id)  # warm-up
    tokens = []
    started = time.perf_counter()
    for batch in batches:
        tokens.extend(_generate(model, batch, output_tokens, pad_id))
    wall_s = time.perf_counter() - started
    return SystemResult("hf_batched", wall_s, sum(len(t) for t in tokens), tokens, {"batch_size": batch_size})


# ---- greedy checks -------------------------------------------------------------------------------
def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence_margin(model: torch.nn.Module, inputs: dict[str, torch.Tensor], reference: list[int],
                      got: list[int]) -> dict[str, Any]:
    """At the first differing output token: transformers' top-1 minus top-2 logit and the logit gap
    between its token and mmserve's. A gap near float32 noise (< ~1e-3) is a near-tie, not a bug."""
    index = first_divergence(reference, got)
    if index is None or index >= min(len(reference), len(got)):
        return {"first_diff": index}
    extra = torch.tensor([reference[:index]], dtype=torch.long)
    ids = torch.cat([inputs["input_ids"], extra], dim=1)
    feed = dict(inputs, input_ids=ids, attention_mask=torch.ones_like(ids))
    if "mm_token_type_ids" in inputs:
        feed["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(extra).int()], dim=1)
    with torch.no_grad():
        logits = model(**feed).logits[0, -1].double()
    top = logits.topk(2).values
    return {"first_diff": index, "top2_margin": float(top[0] - top[1]),
            "reference_minus_mmserve_logit": float(logits[reference[index]] - logits[got[index]])}


def count_identical(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[int]]:
    mismatched = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return min(len(a), len(b)) - len(mismatched), mismatched

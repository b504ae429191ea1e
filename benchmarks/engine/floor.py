"""The FLOP floor of the offline benchmark: a lower bound on the wall of the work mmserve did.

Role: count a Qwen2-VL checkpoint's weight-matrix parameters by where they run, measure the
machine's peak fp32 matmul rate, and turn mmserve's own work counters into the seconds no engine
doing the same work could beat. What it does not know: engines, other families' layouts.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch


def matmul_param_counts(model_dir: Path) -> dict[str, int]:
    """Weight-matrix parameters (ndim >= 2, so no norms or biases) by where they run: per vision patch
    (blocks + patch embedding), per merged vision row (merger), per language-model token (decoder
    layers), per sampled token (lm_head). Embedding tables do no matmul work."""
    from safetensors import safe_open

    counts = {"vision_per_patch": 0, "vision_per_row": 0, "lm_per_token": 0, "lm_head": 0}
    # (only Qwen2-VL's layout is counted: the floor is printed for the Qwen2-VL models)
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                if len(shape) < 2 or "embed_tokens" in key:
                    continue
                n = math.prod(shape)
                if "visual.merger" in key:
                    counts["vision_per_row"] += n
                elif "visual." in key:
                    counts["vision_per_patch"] += n
                elif "lm_head" in key:
                    counts["lm_head"] += n
                elif ".layers." in key:
                    counts["lm_per_token"] += n
    return counts


def matmul_peak_gflops(size: int = 1536, reps: int = 7) -> float:
    """The machine's best fp32 matmul rate at the current torch threads (a large square product)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = math.inf
    for _ in range(reps):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def attention_work(processed: list[Any], outputs: list[Any]) -> dict[str, Any]:
    """`compute_floor`'s attention terms for one call: the patches of each distinct item of the
    processed prompts, and per request its prompt length, prefix-cache hit and output length."""
    item_patches = {item.content_hash: item.encoder_tokens for p in processed for item in p.items}
    return {"item_patches": sorted(item_patches.values()),
            "requests": [(len(o.prompt_token_ids), o.num_cached_tokens, len(o.outputs[0].token_ids))
                         for o in outputs]}


def compute_floor(model_dir: Path, stats: dict[str, int], attention_work: dict[str, Any],
                  peak_gflops: float) -> dict[str, Any]:
    """A lower bound on the wall of the work mmserve did, at the machine's peak matmul rate: weight-
    matrix FLOPs (encoder patches it encoded, prompt tokens it computed, decode tokens, lm_head per
    sampled token) plus attention score/value FLOPs (full vision attention within each encoded item,
    the smallest items counted when fewer were encoded than are distinct; causal attention of every
    computed query over its context). Norms, activations, rotary and everything else are ignored.
    No engine that does the same work can be faster; with reuse and prefix caching counted in, it
    bounds any speedup from above."""
    counts = matmul_param_counts(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    vision, text = config["vision_config"], config.get("text_config", config)
    merge = vision.get("spatial_merge_size", 2)
    patches = stats["encoder_tokens_encoded"]
    requests = attention_work["requests"]
    lm_tokens = stats["prompt_tokens_computed"] + stats["generation_tokens"] - len(requests)
    flops = {"encoder": 2 * (patches * counts["vision_per_patch"] + patches // merge**2 * counts["vision_per_row"]),
             "lm": 2 * lm_tokens * counts["lm_per_token"],
             "lm_head": 2 * stats["generation_tokens"] * counts["lm_head"]}
    if config.get("model_type") == "qwen2_vl":  # every vision block attends over the whole item
        encoded = attention_work["item_patches"][:stats["encoder_items_encoded"]]
        flops["encoder_attention"] = 4 * vision["depth"] * vision["embed_dim"] * sum(s * s for s in encoded)
    pairs = 0  # (query, key) pairs over computed queries: prompt after its cached prefix, then decodes
    for prompt, cached, outputs in requests:
        pairs += (prompt * (prompt + 1) - cached * (cached + 1)) // 2
        pairs += sum(prompt + j + 1 for j in range(outputs - 1))
    flops["lm_attention"] = 4 * text["num_hidden_layers"] * text["hidden_size"] * pairs
    total = sum(flops.values())
    return {"peak_matmul_gflops": round(peak_gflops, 1), "gflop": {k: round(v / 1e9, 1) for k, v in flops.items()},
            "floor_s": round(total / (peak_gflops * 1e9), 3)}

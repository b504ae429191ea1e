"""Shared pieces of the KV-cache dtype benchmark (`benchmarks/engine/kv_cache_dtype.py`): its constants, a
fresh engine per measurement, number formatting, and the scaling study (section 5): real K/V of
prefills quantized with one scale per token per KV head (the engine's format) vs one per tensor.

What it does not know: the other sections' measurements.
"""

from __future__ import annotations

import gc
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoints import EAGER, greedy
from benchmarks.workload import build_workload

KV_DTYPES = ("auto", "int8", "fp8_e4m3")
MODEL_DTYPES = ("float32", "bfloat16")
AGREEMENT_DTYPE = "float32"
STANDARD_WORKLOAD_REQUESTS = 64  # capacity and scaling study use the standard workload, whatever --num-requests says
MIB = 1024 * 1024


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _log(msg: str) -> None:
    print(f"[kv_cache_dtype] {msg}", file=sys.stderr, flush=True)


def _fresh_llm(model_dir: Path, **engine_args: Any) -> Any:
    from mmserve import LLM

    gc.collect()  # the previous LLM's KV pool goes back before the next one is allocated
    return LLM(str(model_dir), **{**EAGER, **engine_args})


# ---- 5. scaling study ----------------------------------------------------------------------------
def capture_kv(model_dir: Path, conversations: list[list[dict[str, Any]]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the float32 K and V (tokens, kv_heads, head_dim) the prefill of `conversations` writes."""
    llm = _fresh_llm(model_dir, dtype="float32", enable_prefix_caching=False)
    storage = llm.engine.inspect().kv_storage
    inner, seen = storage.write, {}

    def write(layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        ks, vs = seen.setdefault(layer_idx, ([], []))
        ks.append(k.detach().float().clone())
        vs.append(v.detach().float().clone())
        inner(layer_idx, slot_mapping, k, v)

    storage.write = write  # instance attribute: this LLM only
    llm.chat(conversations, greedy(1), use_tqdm=False)
    return [(torch.cat(ks), torch.cat(vs)) for _, (ks, vs) in sorted(seen.items())]


def _reconstruct(x: torch.Tensor, fmt: Any, per_tensor: bool) -> torch.Tensor:
    """x through the engine's quantize/dequantize; per tensor = the whole tensor as one 'token, head'."""
    from mmserve.runner.kv_quant import dequantize, quantize

    codes, scale = quantize(x.reshape(1, 1, -1) if per_tensor else x, fmt)
    return dequantize(codes, scale, torch.float32).reshape(x.shape)


def _scheme_errors(layers: list[torch.Tensor], fmt: Any, per_tensor: bool) -> dict[str, Any]:
    """Relative error ||x' - x|| / ||x|| per layer (mean, worst), the largest absolute error, and the
    median over (token, head) vectors of their own relative error (averaged over layers)."""
    rel, max_abs, vec = [], [], []
    for x in layers:
        err = _reconstruct(x, fmt, per_tensor) - x
        rel.append(float(err.norm() / x.norm()))
        max_abs.append(float(err.abs().max()))
        vec.append(float((err.norm(dim=-1) / x.norm(dim=-1).clamp(min=1e-12)).median()))
    return {"rel_mean": _sig(statistics.mean(rel)), "rel_max": _sig(max(rel)), "max_abs": _sig(max(max_abs)),
            "vector_rel_median": _sig(statistics.mean(vec))}


def scaling_errors(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """fp8_e4m3 (and int8, for contrast): one scale per token per KV head vs one per tensor (layer)."""
    from mmserve.runner.kv_quant import kv_format

    out: dict[str, Any] = {"tokens": kv[0][0].shape[0], "layers": len(kv),
                           "amax": {kind: _sig(max(float(layer[w].abs().max()) for layer in kv))
                                    for kind, w in (("k", 0), ("v", 1))}}
    for name in KV_DTYPES[1:]:
        fmt = kv_format(name, torch.float32)
        for kind, w in (("k", 0), ("v", 1)):
            layers = [layer[w] for layer in kv]
            out[f"{name}/{kind}"] = {"per_token_head": _scheme_errors(layers, fmt, False),
                                     "per_tensor": _scheme_errors(layers, fmt, True)}
    out["fp8_per_token_head_beats_per_tensor"] = {
        kind: out[f"fp8_e4m3/{kind}"]["per_token_head"]["rel_mean"] < out[f"fp8_e4m3/{kind}"]["per_tensor"]["rel_mean"]
        for kind in ("k", "v")}
    return out


def measure_scaling(model_dir: Path, num_prompts: int, seed: int) -> dict[str, Any]:
    """On the 100m model (random weights: the first prompts of the standard workload) and, for K/V of
    trained weights, the bundled demo model (4x as many of its short shapes conversations)."""
    from mmserve.config import DEMO_MODEL_DIR
    from mmserve.demo import shapes

    workload = build_workload(STANDARD_WORKLOAD_REQUESTS, seed=seed)
    sources = {"100m": (model_dir, [c.messages for c in workload.conversations[:num_prompts]]),
               "demo": (DEMO_MODEL_DIR, [s.messages for s in shapes.make_samples(0, 4 * num_prompts)])}
    out: dict[str, Any] = {"prompts": num_prompts}
    for name, (path, conversations) in sources.items():
        out[name] = scaling_errors(capture_kv(path, conversations))
    return out



"""A constructed target/drafter pair for draft-model speculative decoding: two Qwen2-VL checkpoints whose
greedy next token is `succ(current token)` whatever the context, so the drafter agrees with its target on
every token (acceptance K + 1) at a fraction of the target's cost.

Role: `ensure_pair(target_src)` builds (once, in `.bench/speculative_draft/pair-<hash>/`, the hash of the
construction's parameters and the source's folder name) and returns the target's and the drafter's folders.
`successor(...)`: a random cycle (seeded) through the vocabulary's ids that are not the tokenizer's special
tokens, each special token its own successor. Target: `target_src`'s tensors (the 30m bench checkpoint: its
shapes, so a decode step costs what that model's does) with every decoder layer's attention output
projection (o_proj) and MLP down_proj zero (the residual stream is then the token's embedding; the matmuls
still run), the final norm's weight 1 and an untied head whose row succ(t) is embed[t] / |embed[t]|.
Drafter: the same construction on a Qwen2-VL of `DRAFTER` sizes (its own random embeddings, the smallest
vision tower), the target's tokenizer and processor files. Each is checked as it is built: over the whole
vocabulary its head's argmax on each token's normalized embedding is `succ` (the least cosine margin is kept
in `pair.json`), and transformers' greedy decoding of it follows `succ` for `CHECK_STEPS` tokens.

What it does not know: mmserve; any benchmark's workload or measurements.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from benchmarks.card import BENCH_DIR

SEED = 0
CHECK_STEPS = 300
DRAFTER = {"text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                    "num_attention_heads": 1, "num_key_value_heads": 1},  # head_dim 64: mrope's 8+12+12
           "vision": {"depth": 1, "embed_dim": 32, "num_heads": 1, "mlp_ratio": 1, "hidden_size": 64}}
VERSION = 1  # the construction's; a change writes a new folder


def successor(vocab_size: int, special: list[int], seed: int = SEED) -> torch.Tensor:
    """succ[t]: one random cycle through the ids that are not special tokens; a special token is its own."""
    succ, fixed = torch.arange(vocab_size), set(special)
    ids = torch.tensor([t for t in range(vocab_size) if t not in fixed])
    cycle = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))]
    succ[cycle] = cycle.roll(-1)
    return succ


def _construct(tensors: dict[str, torch.Tensor], succ: torch.Tensor) -> dict[str, torch.Tensor]:
    """The successor construction on a Qwen2-VL's tensors (either naming), in place; the head untied."""
    embed = next(v for k, v in tensors.items() if k.endswith("embed_tokens.weight"))
    for name, tensor in tensors.items():
        if "visual" in name:
            continue
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor.zero_()
        elif name.endswith("norm.weight") and "layers." not in name:  # the final norm
            tensor.fill_(1.0)
    head = torch.empty_like(embed)
    head[succ] = embed / embed.norm(dim=1, keepdim=True)
    tensors["lm_head.weight"] = head
    return tensors


def _margin(tensors: dict[str, torch.Tensor], succ: torch.Tensor) -> float:
    """The least gap, over every token, between the cosine of its successor's head row and the next best:
    positive when the head's argmax on each embedding is its successor (else an AssertionError)."""
    embed = next(v for k, v in tensors.items() if k.endswith("embed_tokens.weight"))
    head, least = tensors["lm_head.weight"], float("inf")
    for rows in torch.arange(len(embed)).split(2048):
        cos = (embed[rows] / embed[rows].norm(dim=1, keepdim=True)) @ head.T
        top = cos.topk(2, dim=1)
        assert torch.equal(top.indices[:, 0], succ[rows]), "the head's argmax is not the successor"
        least = min(least, float((top.values[:, 0] - top.values[:, 1]).min()))
    return least


def _follows(model_dir: Path, succ: torch.Tensor, start: list[int]) -> None:
    """transformers' greedy decoding of the checkpoint, `CHECK_STEPS` tokens after `start`, follows succ."""
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([start])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CHECK_STEPS,
                         min_new_tokens=CHECK_STEPS, do_sample=False)[0].tolist()
    chain = out[len(start) - 1:]
    bad = next((i for i in range(len(chain) - 1) if chain[i + 1] != succ[chain[i]]), None)
    assert bad is None, f"{model_dir.name}: greedy token {bad + 1} after the prompt is not succ of the last"


def _copy_files(src: Path, dst: Path, config: dict[str, Any]) -> None:
    """Every file of `src` but its weights and config (tokenizer, processor, template), and `config`."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(path, dst / path.name)
    for section in (config, config["text_config"]):
        section["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def _drafter_tensors(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random tensors (seeded: normal, std 0.02; embeddings std 1) of every name and shape transformers'
    Qwen2-VL of `config` has."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig.from_dict(config))
    gen, out = torch.Generator().manual_seed(seed), {}
    for name, tensor in model.state_dict().items():
        scale = 1.0 if name.endswith("embed_tokens.weight") else 0.02
        out[name] = scale * torch.randn(tensor.shape, generator=gen)
    return out


def _drafter_config(target: dict[str, Any]) -> dict[str, Any]:
    config = json.loads(json.dumps(target))
    config["text_config"] |= DRAFTER["text"]
    config["text_config"]["layer_types"] = ["full_attention"] * DRAFTER["text"]["num_hidden_layers"]
    config["vision_config"] |= DRAFTER["vision"]
    return config


def ensure_pair(target_src: Path) -> tuple[Path, Path, dict[str, Any]]:
    """(target, drafter, what pair.json records), built and checked on first use."""
    params = {"source": target_src.name, "seed": SEED, "drafter": DRAFTER, "version": VERSION}
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:8]
    root = BENCH_DIR / "speculative_draft" / f"pair-{digest}"
    target, drafter, record = root / "target", root / "drafter", root / "pair.json"
    if record.is_file():
        return target, drafter, json.loads(record.read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_src)
    config = json.loads((target_src / "config.json").read_text())
    special = sorted(set(tok.all_special_ids) | set(tok.get_added_vocab().values()))
    succ = successor(config["text_config"]["vocab_size"], special)
    start = tok("a photo of the red square")["input_ids"]
    margins = {}
    small = _drafter_config(config)
    source = lambda: load_file(target_src / "model.safetensors")  # noqa: E731
    for name, dst, tensors, cfg in (("target", target, source, config),
                                    ("drafter", drafter, lambda: _drafter_tensors(small, SEED + 1), small)):
        built = _construct(tensors(), succ)
        margins[name] = _margin(built, succ)
        _copy_files(target_src, dst, cfg)
        save_file({k: v.contiguous() for k, v in built.items()}, dst / "model.safetensors",
                  metadata={"format": "pt"})
        _follows(dst, succ, start)
    info = params | {"digest": digest, "cosine_margin": margins, "checked_steps": CHECK_STEPS,
                     "vocab_size": len(succ), "special": special}
    record.write_text(json.dumps(info, indent=2))
    return target, drafter, info

"""The benchmarks' checkpoints and the engine arguments they share.

Role: build (once, under `.bench/`) and find the random-weight checkpoints the benchmarks run: the
tiny Qwen2-VL test model, the sized Qwen2-VL bench models of `benchmarks/configs/bench_<name>_qwen2_vl.json`
(30m, 100m, and 1b: hidden 2048, 20 layers, the size where decode streams weights from memory), and the
tiny test model of every other served family (`testkit/`); count their parameters; the greedy
sampling and the KV cache size every benchmark uses.

What it does not know: any benchmark's workload or measurements.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import torch

from benchmarks.card import BENCH_DIR, ROOT
from testkit.families import FAMILIES
from testkit.tiny_checkpoints import QWEN_SPECIAL_TOKENS, build_checkpoint, build_tokenizer

CONFIG_100M = ROOT / "benchmarks" / "configs" / "bench_100m_qwen2_vl.json"
# the sized bench models (random Qwen2-VL weights): ~30M, ~109M and ~1.0B parameters
BENCH_CONFIGS = {name: ROOT / "benchmarks" / "configs" / f"bench_{name}_qwen2_vl.json" for name in ("30m", "100m", "1b")}
# a sized checkpoint's folder names its config's digest, so a changed config never reuses a stale build
MODEL_DIRS = {"tiny": BENCH_DIR / "tiny-qwen2-vl",
              **{name: BENCH_DIR / f"bench-{name}-qwen2-vl-{hashlib.sha256(path.read_bytes()).hexdigest()[:8]}"
                 for name, path in BENCH_CONFIGS.items()},
              **{name: BENCH_DIR / f"tiny-{name.replace('_', '-')}" for name in FAMILIES if name != "qwen2_vl"}}

def _randomize_scaled(model: torch.nn.Module, seed: int) -> None:
    """Random weights scaled by fan-in (like `_randomize`, but sized for a 768-wide, 12-layer model) so
    activations neither vanish nor explode and greedy text is varied rather than one repeated token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight") or "norm" in name.split(".")[-2]:
                param.copy_(1.0 + 0.1 * noise)
            elif param.ndim == 1:  # biases
                param.copy_(0.02 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                gain = 4.0 if "lm_head" in name else 1.0  # logits with std ~4: clear greedy margins
                param.copy_(noise * gain / param[0].numel() ** 0.5)


def build_100m_checkpoint(out_dir: Path, config_path: Path = CONFIG_100M, seed: int = 0) -> Path:
    """Write the ~100M random Qwen2-VL described by `config_path` (token ids from our tokenizer)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    raw = json.loads(config_path.read_text())
    raw.pop("model_type", None)
    text = dict(raw.pop("text_config"), bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    config = Qwen2VLConfig(text_config=text, vision_config=raw.pop("vision_config"),
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], **raw)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    _randomize_scaled(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 256).save_pretrained(out_dir)
    generation = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out_dir


def ensure_checkpoint(name: str) -> Path:
    """The named bench checkpoint (tiny, 30m, 100m, 1b, or a family's tiny one), built on first use."""
    out_dir = MODEL_DIRS[name]
    weights = (out_dir / "model.safetensors").is_file() or (out_dir / "model.safetensors.index.json").is_file()
    if weights and (out_dir / "preprocessor_config.json").is_file():
        return out_dir
    print(f"building {name} checkpoint in {out_dir} ...", file=sys.stderr)
    if name == "tiny":
        return build_checkpoint(out_dir, family="qwen2_vl", seed=0)
    if name in BENCH_CONFIGS:
        return build_100m_checkpoint(out_dir, config_path=BENCH_CONFIGS[name])
    return FAMILIES[name].build(out_dir, 0)


def ensure_model(name: str) -> Path:
    """A benchmark's --model: a bench checkpoint's name, or a checkpoint directory."""
    return ensure_checkpoint(name) if name in MODEL_DIRS else Path(name)


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


# the benchmarks that build several engines in one process run them eagerly, as their figures always
# were: a background compile would outlive its engine's measurement (README "Compiled decode")
EAGER = {"compile_cpu_decode": False}


def greedy(output_tokens: int):
    from mmserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=output_tokens, min_tokens=output_tokens)


def kv_cache_bytes(model_dir: Path, num_requests: int, output_tokens: int) -> int:
    """Room for every request at once (prompts are < 1200 tokens here), so nothing is preempted."""
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    per_token_bytes = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * 4
    return max(num_requests * (1200 + output_tokens) * per_token_bytes, 64 * 1024 * 1024)

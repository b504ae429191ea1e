"""A tiny random Qwen3.5 checkpoint built at test time with transformers.

Role: give the hybrid-model tests a real Hugging Face checkpoint directory (the files of
`tiny_qwen3_vl.py`, with Qwen3.5's config): a decoder whose `layer_types` mix Gated DeltaNet and gated
full-attention layers in an irregular order (not the released three-to-one repeat), GQA, grouped value heads
in the DeltaNet layers, partial rotary with interleaved M-RoPE, and the Qwen3-VL vision tower without
deepstack. `mtp=True` adds a multi-token-prediction head's tensors (`mtp.*`), as hub checkpoints carry.

What it does not know: anything about mmserve; it only writes files the way Hugging Face does.
"""

from __future__ import annotations

from pathlib import Path

from testkit.tiny_checkpoints import _randomize
from testkit.tiny_qwen3_vl import fuse_experts, media_token_ids, write_processor_files, write_tokenizer

LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention")


MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def build_qwen3_5_checkpoint(out_dir: Path, seed: int = 0, layer_types: tuple[str, ...] = LAYER_TYPES,
                             mtp: bool = False, moe: bool = False, fused_experts: bool = False,
                             text_overrides: dict | None = None, randomize=None) -> Path:
    """`moe`: Qwen3.5-MoE (8 experts, top 2, a shared expert), its experts stored one by one
    (`experts.{e}.gate_proj.weight`, ...) as transformers saves them and the hub has them, or with
    `fused_experts` as transformers holds them in memory (`experts.gate_up_proj`, `experts.down_proj`). `text_overrides`: text config fields to change (a sized
    benchmark model); `randomize(model, seed)`: instead of the tests' weights."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    out_dir = Path(out_dir)
    vocab_size, ids = write_tokenizer(out_dir)
    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                rms_norm_eps=1e-6, layer_types=list(layer_types), linear_conv_kernel_dim=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [3, 3, 2], "mrope_interleaved": True},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=64,
                  hidden_act="gelu_pytorch_tanh")
    if moe:
        text = {k: v for k, v in text.items() if k != "intermediate_size"} | MOE
    text |= {k: v for k, v in (text_overrides or {}).items() if not (moe and k == "intermediate_size")}
    vision["out_hidden_size"] = text["hidden_size"]
    config_class, model_class = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe
                                 else (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=False, **media_token_ids(ids))
    torch.manual_seed(seed)
    model = model_class(config)
    (randomize or _randomize)(model, seed)
    with torch.no_grad():  # decays of a trained model's range (A in [1, 16], dt_bias small): a stable recurrence
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(0.0, 2.7)
                layer.linear_attn.dt_bias.uniform_(-1.0, 1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    if mtp or fused_experts:
        weights = load_file(out_dir / "model.safetensors")
        if mtp:  # a hub checkpoint's MTP head, which transformers' model does not hold
            weights |= mtp_head(model.config.text_config, seed) if not moe else {
                "mtp.fc.weight": torch.randn(64, 128), "mtp.layers.0.input_layernorm.weight": torch.zeros(64)}
        if fused_experts:
            weights = fuse_experts(weights)
        save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    write_processor_files(out_dir, ids)
    _write_hub_pretokenizer(out_dir)
    return out_dir


def _write_hub_pretokenizer(out_dir: Path) -> None:
    """tokenizer.json with the pre-tokenizer transformers' Qwen3.5 tokenizer builds (the hub's: digits split
    one by one), as the hub's file has it: the trained tokenizer's plain byte-level one would read " 0" as a
    token where transformers and vLLM read two."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(out_dir).backend_tokenizer.save(str(out_dir / "tokenizer.json"))


def mtp_head(text_config, seed: int) -> dict:
    """A dense Qwen3.5 checkpoint's multi-token-prediction head as the hub stores it: `mtp.fc` (hidden x 2 hidden),
    one full-attention decoder layer `mtp.layers.0.*`, and its three norms, random."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    full = text_config.layer_types.index("full_attention")
    layer = Qwen3_5DecoderLayer(text_config, full)
    _randomize(layer, seed + 1)
    hidden = text_config.hidden_size
    generator = torch.Generator().manual_seed(seed + 2)
    head = {f"mtp.layers.0.{name}": tensor.detach().clone() for name, tensor in layer.state_dict().items()}
    head["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * (2 * hidden) ** -0.5
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        head[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=generator) * 0.1
    return head

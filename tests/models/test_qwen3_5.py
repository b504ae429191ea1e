"""Qwen3.5 checkpoints as the hub lays them out: experts stored one by one or fused give the same model, an
`mtp.*` head is skipped, and a config mmserve cannot serve fails at load naming the field (the engine-level
fidelity of the family runs with every served family: tests/models/test_engine_parity.py and the rest)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from mmserve import LLM
from mmserve.errors import ModelLoadError
from testkit.models import full_logits, load_family
from testkit.tiny_qwen3_5 import build_qwen3_5_checkpoint
from tests.models.helpers import image_part, random_image, text_part


def _logits(model_dir) -> torch.Tensor:
    model, processor, spec = load_family(model_dir)
    chat = [{"role": "user", "content": [image_part(random_image(np.random.default_rng(1), 80, 64)),
                                         text_part("What is here?")]}]
    rendered = processor.render_chat(chat)
    return full_logits(model, processor.process(rendered.prompt, images=rendered.images), spec)


def test_experts_stored_one_by_one_or_fused_load_the_same_model(tmp_path):
    per_expert = build_qwen3_5_checkpoint(tmp_path / "per_expert", seed=4, moe=True)
    fused = build_qwen3_5_checkpoint(tmp_path / "fused", seed=4, moe=True, fused_experts=True)
    torch.testing.assert_close(_logits(per_expert), _logits(fused), rtol=0, atol=0)


def _with_text_config(model_dir, tmp_path, **changes):
    out = tmp_path / "edited"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["text_config"].update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(("changes", "field"), [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "linear_attention",
                       "full_attention"]), "layer_types has unknown entries"),
    (dict(layer_types=["linear_attention", "full_attention"]), "layer_types has 2 entries"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads 3 is not a multiple of linear_num_key_heads"),
    (dict(num_key_value_heads=3), "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.0}),
     "partial_rotary_factor"),
    (dict(num_experts=4, num_experts_per_tok=8, moe_intermediate_size=32), "num_experts_per_tok 8 must be in"),
])
def test_a_config_it_cannot_serve_fails_at_load_naming_the_field(tmp_path, changes, field):
    model_dir = build_qwen3_5_checkpoint(tmp_path / "base", seed=0)
    with pytest.raises(ModelLoadError, match=field):
        LLM(str(_with_text_config(model_dir, tmp_path, **changes)))


def test_the_state_budget_is_logged_and_taken_from_the_kv_budget(tmp_path, caplog):
    model_dir = build_qwen3_5_checkpoint(tmp_path / "m", seed=0)
    with caplog.at_level("INFO", logger="mmserve.engine"):
        llm = LLM(str(model_dir), kv_cache_bytes=8 << 20, max_num_seqs=4)
    line = next(r.getMessage() for r in caplog.records if "state slots" in r.getMessage())
    assert line.startswith("hybrid model: 4 state slots and ") and "in the KV budget of 8388608 bytes" in line
    stats = llm.get_stats()
    # the KV blocks got what the slots and snapshots left: 2 full-attention layers of 2 kv heads x 32 dims
    per_block = 2 * 2 * 2 * 32 * 4 * 16
    assert stats["kv_blocks_total"] * per_block <= (8 << 20) - 4 * llm.engine.scheduler.states.slots.layout.bytes_per_slot


def test_two_long_prompts_sharing_a_prefix_resume_from_a_chunk_boundary_snapshot(all_checkpoints):
    """Two ~1.8k-token prompts sharing all but their last words, prefilled in 64-token chunks: the second resumes
    from the state the first left at a chunk boundary inside the shared part, and answers as transformers
    does (and as an engine without the prefix cache does)."""
    from testkit.conversations import GREEDY
    from testkit.families import FAMILIES
    from tests.models.helpers import reference_inputs

    model_dir = all_checkpoints["qwen3_5"]
    shared = " ".join(f"item {i} is {'red' if i % 3 else 'blue'}" for i in range(180))
    chats = [[{"role": "user", "content": shared + ending}] for ending in (" What is item 7?", " Count the blue.")]
    llm = LLM(str(model_dir), max_num_batched_tokens=64)
    first = llm.chat(chats[:1], GREEDY, use_tqdm=False)[0]
    second = llm.chat(chats[1:], GREEDY, use_tqdm=False)[0]
    llm.check_integrity()
    assert len(first.prompt_token_ids) > 1000 and 0 < second.num_cached_tokens < len(second.prompt_token_ids)
    assert second.num_cached_tokens % 64 == 0, second.num_cached_tokens  # a chunk boundary, not the prompt end
    fresh = LLM(str(model_dir), enable_prefix_caching=False).chat(chats[1:], GREEDY, use_tqdm=False)[0]
    assert list(second.outputs[0].token_ids) == list(fresh.outputs[0].token_ids)
    inputs = reference_inputs(model_dir, "qwen3_5", chats[1])
    reference = FAMILIES["qwen3_5"].reference_class().from_pretrained(model_dir).eval()
    num = len(fresh.outputs[0].token_ids)
    with torch.no_grad():
        want = reference.generate(**inputs, max_new_tokens=num, min_new_tokens=num, do_sample=False)
    assert list(second.outputs[0].token_ids) == want[0, inputs["input_ids"].shape[1]:].tolist()

"""The engine with a quantized KV cache (`kv_cache_dtype` int8 and fp8_e4m3) on every family's tiny
checkpoint: mixed batches with chunked prefill, preemption and prefix caching complete, nothing
leaks, and the pool holds more tokens at the same bytes. On the bundled demo model (a trained
model) int8 keeps every question type's accuracy at the demo floors."""

import pytest

from mmserve import LLM
from mmserve.demo.eval import evaluate
from testkit.conversations import GREEDY, NUM_TOKENS, parity_workload

# of the parity workload: text only, one image, a very wide one, two images, a shared image twice, the
# video (or a third image question), multi-turn
MIXED = (0, 3, 6, 8, 10, 12, 13, 14)
# blocks small enough that the mixed batch preempts: an mllama image is one prompt token, so its prompts are short
# (a hybrid model's prefix hit needs its state snapshot's block still cached: 24 blocks evict every one of them)
NUM_KV_BLOCKS = {"mllama": 8, "qwen3_5": 40, "qwen3_5_moe": 40}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_serves_every_family(served_family, served_model_dir, kv_cache_dtype):
    blocks = NUM_KV_BLOCKS.get(served_family, 24)
    llm = LLM(str(served_model_dir), kv_cache_dtype=kv_cache_dtype, num_kv_blocks=blocks, max_num_batched_tokens=32)
    conversations = [c for i, c in enumerate(parity_workload(served_family)) if i in MIXED]
    for _ in range(2):  # the second run is served largely from the prefix cache
        outputs = llm.chat(conversations, GREEDY, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == NUM_TOKENS and o.outputs[0].finish_reason == "length"
                   for o in outputs)
        llm.check_integrity()
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["kv_cache_dtype"] == kv_cache_dtype
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == blocks
    assert stats["kv_capacity_tokens"] == blocks * 16


def test_same_bytes_hold_more_tokens(model_dir):
    budget = 4 << 20
    stats = {kv: LLM(str(model_dir), kv_cache_dtype=kv, kv_cache_bytes=budget).get_stats()
             for kv in ("auto", "int8", "fp8_e4m3")}
    spec = LLM(str(model_dir)).engine.spec
    heads = 2 * spec.num_layers * spec.num_kv_heads  # K and V of every layer
    assert stats["auto"]["kv_bytes_per_token"] == heads * spec.head_dim * 4  # float32
    for kv in ("int8", "fp8_e4m3"):
        assert stats[kv]["kv_bytes_per_token"] == heads * (spec.head_dim + 2)  # codes + a float16 scale
        assert stats[kv]["kv_capacity_tokens"] == budget // (16 * stats[kv]["kv_bytes_per_token"]) * 16
        assert stats[kv]["kv_capacity_tokens"] >= 3.5 * stats["auto"]["kv_capacity_tokens"]


def test_int8_keeps_the_demo_model_at_its_floors():
    # 200 conversations (the benchmark runs 500); floors 0.95 short answers / 0.90 describe and compare,
    # less a 0.03 margin for the smaller sample
    result = evaluate(n=200, seed=3, kv_cache_dtype="int8")
    for qtype, accuracy in result.accuracy.items():
        floor = 0.90 if qtype in ("describe", "compare") else 0.95
        assert accuracy >= floor - 0.03, (qtype, accuracy, result.accuracy)

"""The routing simulation (testkit/routing_sim.py) on a small workload: its baseline, its caches and
the ordering of the policies it simulates with mmserve's own router. No torch, no processes."""

from __future__ import annotations

import numpy as np

from testkit.routing_sim import (
    Costs,
    ReplicaLimits,
    Shape,
    Simulation,
    Workload,
    block_hashes,
    prompt_tokens,
    zipf_images,
)

COSTS = Costs(encode_s=0.05, prefill_s_per_token=1e-4, decode_s=((1, 0.01), (32, 0.02)), step_overhead_s=0.005)
SHAPE = Shape(lead_tokens=21, image_tokens=192, question_tokens=24, answer_tokens=8)
WORKLOAD = Workload(num_images=200, zipf_s=1.0, num_conversations=600, turns=2, conversations_per_s=60.0,
                    think_s=0.2, seed=1)
LIMITS = ReplicaLimits(max_num_seqs=32, max_batched_tokens=2048, encoder_cache_images=16, kv_blocks=400)


def run(policy: str, replicas: int = 8) -> dict:
    return Simulation(replicas, policy, COSTS, SHAPE, WORKLOAD, LIMITS).run()


def test_the_infinite_engine_baseline_is_one_minus_distinct_over_occurrences():
    distinct = len(set(zipf_images(np.random.default_rng(WORKLOAD.seed), WORKLOAD).tolist()))
    result = run("round_robin")
    assert result["infinite_engine_image_reuse"] == round(1 - distinct / (600 * 2), 4)
    assert 0 <= result["image_reuse"] <= result["infinite_engine_image_reuse"]


def test_cache_aware_reuses_more_and_stays_balanced():
    aware, rr = run("cache_aware"), run("round_robin")
    assert aware["image_reuse"] > rr["image_reuse"] + 0.05, (aware, rr)
    assert aware["prefix_hit_rate"] > rr["prefix_hit_rate"]
    assert aware["load_imbalance"] <= 1.5
    assert aware == run("cache_aware")  # deterministic for a seed


def test_later_turns_share_their_history_blocks():
    first, second = prompt_tokens(SHAPE, 7, 3, 0), prompt_tokens(SHAPE, 7, 3, 1)
    a, b = block_hashes(first, 16), block_hashes(second, 16)
    assert b[:len(first) // 16] == a  # the second turn starts with the first turn's full blocks
    other = block_hashes(prompt_tokens(SHAPE, 8, 4, 0), 16)
    assert other[0] == a[0] and other[1] != a[1]  # the shared lead, then another image

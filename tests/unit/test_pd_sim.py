"""The P/D simulation (testkit/pd_sim.py) on a small workload: every request is answered with all its
tokens in both setups; image bursts stall a colocated replica's decodes and not a decode replica's;
without images nothing is gained, and the transfers are what the prompts hold. No torch, no processes."""

from __future__ import annotations

from testkit.pd_sim import PDSimulation, PDWorkload, Transfer
from testkit.routing_sim import Costs

COSTS = Costs(encode_s=0.07, prefill_s_per_token=1.5e-4, decode_s=((1, 0.013), (32, 0.022)), step_overhead_s=0.01)
TRANSFER = Transfer(kv_bytes_per_token=3072, read_bytes_per_s=2e9, write_bytes_per_s=2e9)
WORKLOAD = PDWorkload(text_streams=2, text_tokens=32, burst_images=3, burst_interval_s=2.0, num_bursts=4)


def run(prefill: int, decode: int, workload: PDWorkload = WORKLOAD, size: int = 2) -> dict:
    return PDSimulation(prefill, decode, COSTS, TRANSFER, workload, 64, 2048, size).run()


def test_bursts_stall_colocated_decodes_and_not_disaggregated_ones():
    colocated, split = run(2, 0), run(1, 1)
    assert colocated["text_itl_ms_in_bursts"]["p99"] > 4 * split["text_itl_ms_in_bursts"]["p99"]
    assert split["image_ttft_ms"]["p50"] > colocated["image_ttft_ms"]["p50"]  # one prefill replica, not two
    assert split["kv_mib_per_s"] > 0 and colocated["kv_mib_per_s"] == 0


def test_without_images_disaggregation_buys_no_latency():
    text_only = PDWorkload(text_streams=2, text_tokens=32, burst_images=0, burst_interval_s=2.0, num_bursts=4)
    colocated, split = run(2, 0, text_only), run(1, 1, text_only)
    assert split["text_itl_ms"]["p99"] >= colocated["text_itl_ms"]["p99"] * 0.9
    assert split["output_tokens_per_s"] <= colocated["output_tokens_per_s"] * 1.05


def test_every_request_gets_all_its_tokens():
    sim = PDSimulation(1, 1, COSTS, TRANSFER, WORKLOAD, 64, 2048, 2)
    sim.run()
    assert sim.done and all(len(r.token_times) == r.answer_tokens for r in sim.done)
    assert all(a <= b for r in sim.done for a, b in zip(r.token_times, r.token_times[1:]))
    images = [r for r in sim.done if r.image]
    assert len(images) == WORKLOAD.burst_images * 2 * WORKLOAD.num_bursts
    moved = sum(r.prompt_tokens for r in sim.done) * TRANSFER.kv_bytes_per_token
    assert sim.bytes_moved == moved

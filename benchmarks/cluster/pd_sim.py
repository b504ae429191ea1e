"""Prefill/decode disaggregation at scale, on paper: N colocated replicas against P prefill + D decode
replicas on the same cores (P + D = N), under steady text chats and bursts of large images.

Role: take the per-replica costs `benchmarks/cluster/routing_costs.py` measured on this machine, measure
the KV transfer's cost now through mmserve's own path (`PagedKVStorage.read_blocks` into a
`SharedMemoryConnector` segment on one side, `write_blocks` out of it on the other), run the
discrete-event simulation of `testkit/pd_sim.py` for each setup, and print a card, a table (text ITL
p50/p99, also inside burst windows, text and image TTFT, output tokens/s, KV moved per second), the
ratios against colocated, and one JSON line last: `python -m benchmarks.cluster.pd_sim --replicas 2,8,32`.
What it does not know: engines, HTTP; the simulation itself (it only measures, drives and prints).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks.card import json_line
from testkit.pd_sim import PDSimulation, PDWorkload, Transfer
from testkit.routing_sim import load_costs


def measure_transfer(kv_bytes_per_token: int, block_size: int = 16, num_blocks: int = 2048,
                     rounds: int = 5) -> tuple[float, float]:
    """Bytes per second of mmserve's own shared-memory path, each way: read_blocks into a segment, and
    write_blocks out of it (medians of `rounds`, `num_blocks` scattered blocks of a float32 cache)."""
    import torch

    from mmserve.cluster.kv_connector import SharedMemoryConnector
    from mmserve.runner.kv_quant import kv_format
    from mmserve.runner.kv_storage import PagedKVStorage

    head_dim = 64
    layers = max(1, kv_bytes_per_token // (2 * head_dim * 4))
    storage = PagedKVStorage(layers, num_blocks * 2, block_size, 1, head_dim, kv_format("auto", torch.float32))
    ids = list(range(0, num_blocks * 2, 2))
    connector, reads, writes = SharedMemoryConnector(), [], []
    for _ in range(rounds):
        started = time.perf_counter()
        transfer = connector.send("m", storage.block_part_shapes(), len(ids), lambda outs: storage.read_blocks(ids, outs))
        reads.append(time.perf_counter() - started)
        started = time.perf_counter()
        connector.receive(transfer, lambda parts: storage.write_blocks(ids, parts))
        writes.append(time.perf_counter() - started)
    moved = len(ids) * block_size * layers * 2 * head_dim * 4
    return moved / float(np.median(reads)), moved / float(np.median(writes))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="2,8,32", help="setup sizes N: N colocated vs P + D = N")
    parser.add_argument("--costs", type=Path, default=None, help="routing_costs.py's JSON (default: measured on --model)")
    parser.add_argument("--model", default="30m")
    parser.add_argument("--kv-bytes-per-token", type=int, default=3072, help="the 30m model, float32 (default)")
    parser.add_argument("--bursts", type=int, default=PDWorkload.num_bursts)
    args = parser.parse_args(argv)
    from benchmarks.cluster.routing_costs import ensure_costs

    costs_path = args.costs or ensure_costs(args.model)
    costs, _, limits, data = load_costs(costs_path)
    read_bps, write_bps = measure_transfer(args.kv_bytes_per_token)
    transfer = Transfer(args.kv_bytes_per_token, read_bps, write_bps)
    workload = PDWorkload(num_bursts=args.bursts)
    card = {"bench": "pd_sim", "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "costs": str(costs_path), "measured_on": data.get("model"), "costs_s": asdict(costs),
            "transfer": {"kv_bytes_per_token": transfer.kv_bytes_per_token,
                         "read_gib_per_s": round(read_bps / 2**30, 2), "write_gib_per_s": round(write_bps / 2**30, 2)},
            "workload": asdict(workload), "max_num_seqs": limits.max_num_seqs}
    print("== prefill/decode disaggregation simulation ==")
    for key, value in card.items():
        print(f"  {key:12} {value}")
    results = []
    print(f"\n{'N':>4} {'setup':10} {'ITL p50':>8} {'p99':>7} | {'in bursts p50':>13} {'p99':>7} | "
          f"{'text TTFT p50':>13} {'p99':>7} | {'image TTFT p50':>14} {'p99':>7} | {'tok/s':>7} {'KV MiB/s':>8}")
    for n in [int(v) for v in args.replicas.split(",")]:
        setups = [("colocated", n, 0)] + [(f"{p}P+{n - p}D", p, n - p) for p in sorted({n // 2, max(1, n // 4)})
                                          if 0 < p < n]
        for name, p, d in setups:
            res = PDSimulation(p, d, costs, transfer, workload, limits.max_num_seqs, limits.max_batched_tokens, n).run()
            res.update(replicas=n, setup=name, prefill=p, decode=d)
            results.append(res)
            print(f"{n:>4} {name:10} {res['text_itl_ms']['p50']:>8} {res['text_itl_ms']['p99']:>7} | "
                  f"{res['text_itl_ms_in_bursts']['p50']:>13} {res['text_itl_ms_in_bursts']['p99']:>7} | "
                  f"{res['text_ttft_ms']['p50']:>13} {res['text_ttft_ms']['p99']:>7} | "
                  f"{res['image_ttft_ms']['p50']:>14} {res['image_ttft_ms']['p99']:>7} | "
                  f"{res['output_tokens_per_s']:>7} {res['kv_mib_per_s']:>8}", flush=True)
    ratios = []
    for n in dict.fromkeys(r["replicas"] for r in results):
        base = next(r for r in results if r["replicas"] == n and r["setup"] == "colocated")
        for r in results:
            if r["replicas"] == n and r["setup"] != "colocated":
                ratios.append({"replicas": n, "setup": r["setup"], "itl_p99_in_bursts_ratio": round(
                    r["text_itl_ms_in_bursts"]["p99"] / base["text_itl_ms_in_bursts"]["p99"], 3),
                    "throughput_ratio": round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 3)})
    for ratio in ratios:
        print(f"  {ratio['replicas']:>3} {ratio['setup']:10} text ITL p99 in bursts {ratio['itl_p99_in_bursts_ratio']}x "
              f"colocated, throughput {ratio['throughput_ratio']}x")
    json_line({**card, "results": results, "ratios": ratios})


if __name__ == "__main__":
    main()

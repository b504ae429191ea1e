"""Routing benchmark: two replicas behind one server, `cache_aware` against `round_robin` (and `least_loaded`).

Role: for each policy, start `mmserve serve MODEL --data-parallel-size 2 --routing POLICY`, send a
workload of `--images` distinct images each asked about `--asks` times (different questions, shuffled
with a fixed seed) as streaming chat completions from `--clients` concurrent clients, then read
/v1/stats: encoder items encoded (the target: cache_aware encodes each image once, at most distinct
images + 1), the requests each replica finished (both busy), prefix-cache hits, and the router's
counters; with TTFT p50/p99 and throughput from the clients. Policies run alternately, `--rounds`
times, fresh servers each time; figures are medians over rounds.

Prints a card, a table, and one JSON line last.
What it does not know: mmserve internals; it only speaks HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.card import ROOT, json_line
from benchmarks.checkpoints import ensure_model
from benchmarks.server.serve import Job, RequestRecord, image_data_uri, local_server_process, summarize
from benchmarks.workload import synthetic_image

QUESTIONS = ("What is in this picture?", "Describe the colors.", "Is there any text in it?",
             "What would you call this image?", "Where might this have been taken?", "Count the objects.")


def build_jobs(num_images: int, asks: int, output_tokens: int, seed: int) -> list[Job]:
    rng = np.random.default_rng(seed)
    uris = [image_data_uri(synthetic_image(rng, 448, 336)) for _ in range(num_images)]
    jobs = [Job([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uris[i]}},
                                              {"type": "text", "text": QUESTIONS[k % len(QUESTIONS)]}]}],
                max_tokens=output_tokens, min_tokens=output_tokens)
            for i in range(num_images) for k in range(asks)]
    random.Random(seed).shuffle(jobs)
    return jobs


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, str]:
    """(seconds to the first event, the answer's text) of one streamed chat completion. The first event
    comes once the engine has the request's first token (a random model's first tokens may carry no
    text, so this is not the first text)."""
    sent, first, pieces = time.perf_counter(), None, []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            first = first or time.perf_counter()
            for choice in json.loads(line[6:]).get("choices", []):
                pieces.append(choice.get("delta", {}).get("content") or "")
    return (first or time.perf_counter()) - sent, "".join(pieces)


async def _play(url: str, model: str, jobs: list[Job], clients: int) -> tuple[list[RequestRecord], float]:
    todo = list(jobs)
    records: list[RequestRecord] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while todo:
            job = todo.pop(0)
            started = time.perf_counter()
            ttft_s, _ = await stream_chat(client, {"model": model, "messages": job.messages, "temperature": 0,
                                                   "max_tokens": job.max_tokens, "min_tokens": job.min_tokens})
            records.append(RequestRecord(ttft_s, time.perf_counter() - started, job.max_tokens))

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        return records, time.perf_counter() - started


def measure(model_dir: Path, policy: str, jobs: list[Job], clients: int, extra: list[str]) -> dict[str, Any]:
    # eager steps: a short run would otherwise share its two cores with each replica's background compile
    args = ["--data-parallel-size", "2", "--routing", policy, "--no-compile-cpu-decode", *extra]
    log = ROOT / ".bench" / f"replicas-{policy}.log"
    with local_server_process(model_dir, args, log) as server:
        records, wall_s = asyncio.run(_play(server.url, str(model_dir), jobs, clients))
        stats = httpx.get(server.url + "/v1/stats", timeout=30).json()
    summary = summarize(records, wall_s)
    return {
        "policy": policy,
        "encoder_items_encoded": stats["encoder_items_encoded"],
        "encoder_cache_hits": stats["encoder_cache_hits"],
        "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"],
        "requests_per_replica": [r["requests_finished"] for r in stats["replicas"]],
        "routed": {row["reason"]: row["requests"] for row in stats["router"]["routed"]},
        "expected_encoder_cache_hits": stats["router"]["expected_encoder_cache_hits"],
        "ttft_ms": summary["ttft_ms"],
        "output_tokens_per_s": summary["output_token_throughput_per_s"],
        "wall_s": summary["wall_s"],
    }


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    last = rounds[-1]
    return {
        "policy": last["policy"],
        "encoder_items_encoded": statistics.median(r["encoder_items_encoded"] for r in rounds),
        "encoder_cache_hits": statistics.median(r["encoder_cache_hits"] for r in rounds),
        "prefix_cache_hit_tokens": statistics.median(r["prefix_cache_hit_tokens"] for r in rounds),
        "requests_per_replica": [r["requests_per_replica"] for r in rounds],
        "routed": [r["routed"] for r in rounds],
        "ttft_p50_ms": round(statistics.median(r["ttft_ms"]["p50"] for r in rounds), 1),
        "ttft_p99_ms": round(statistics.median(r["ttft_ms"]["p99"] for r in rounds), 1),
        "output_tokens_per_s": round(statistics.median(r["output_tokens_per_s"] for r in rounds), 1),
        "encoded_per_round": [r["encoder_items_encoded"] for r in rounds],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="30m", help="a bench model (tiny, 30m, 100m, 1b) or a directory")
    parser.add_argument("--policies", default="cache_aware,round_robin")
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--asks", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="extra `mmserve serve` flags, space separated")
    args = parser.parse_args(argv)
    model_dir = Path(args.model) if Path(args.model).is_dir() else ensure_model(args.model)
    policies = args.policies.split(",")
    jobs = build_jobs(args.images, args.asks, args.output_tokens, args.seed)
    card = {"bench": "replicas", "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "model": str(model_dir), "replicas": 2, "images": args.images, "asks_per_image": args.asks,
            "requests": len(jobs), "clients": args.clients, "output_tokens": args.output_tokens,
            "rounds": args.rounds}
    print("== replicas: routing benchmark ==")
    for key, value in card.items():
        print(f"  {key:16} {value}")
    rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    started = time.perf_counter()
    for r in range(args.rounds):
        order = policies if r % 2 == 0 else policies[::-1]  # alternate who goes first
        for policy in order:
            result = measure(model_dir, policy, jobs, args.clients, args.server_args.split())
            rounds[policy].append(result)
            print(f"[round {r + 1}/{args.rounds}] {policy}: encoded {result['encoder_items_encoded']}, per replica "
                  f"{result['requests_per_replica']}, TTFT p50 {result['ttft_ms']['p50']} ms", flush=True)
    results = {p: median_of(rs) for p, rs in rounds.items()}
    print(f"\n{'policy':14} {'encoded':>8} {'enc hits':>9} {'prefix hit tok':>15} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'tok/s':>8}")
    for res in results.values():
        print(f"{res['policy']:14} {res['encoder_items_encoded']:>8} {res['encoder_cache_hits']:>9} "
              f"{res['prefix_cache_hit_tokens']:>15} {res['ttft_p50_ms']:>9} {res['ttft_p99_ms']:>9} "
              f"{res['output_tokens_per_s']:>8}")
    targets = []
    if "cache_aware" in results:
        ca = results["cache_aware"]
        busy = all(min(per) > 0 for per in ca["requests_per_replica"])
        targets.append({"name": "cache_aware encodes each image once (<= distinct images + 1), both replicas busy",
                        "encoded": ca["encoder_items_encoded"], "limit": args.images + 1, "both_busy": busy,
                        "met": ca["encoder_items_encoded"] <= args.images + 1 and busy})
    if "cache_aware" in results and "round_robin" in results:
        targets.append({"name": "round_robin encodes more than cache_aware",
                        "cache_aware": results["cache_aware"]["encoder_items_encoded"],
                        "round_robin": results["round_robin"]["encoder_items_encoded"],
                        "met": results["round_robin"]["encoder_items_encoded"]
                        > results["cache_aware"]["encoder_items_encoded"]})
    for t in targets:
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['name']}")
    json_line({**card, "results": results, "targets": targets,
                      "wall_s": round(time.perf_counter() - started, 1)})


if __name__ == "__main__":
    main()

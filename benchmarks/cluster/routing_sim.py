"""Routing at scale, on paper: N simulated replicas behind mmserve's own router, per routing policy.

Role: load (or measure once, `benchmarks/cluster/routing_costs.py`) this machine's per-replica costs, run
the discrete-event simulation of `testkit/routing_sim.py` (Zipf-popular images, multi-turn conversations,
LRU encoder and prefix caches, continuous batching) for each replica count and policy at a fraction of the
replicas' capacity, and print a card, a table (image reuse against one infinite engine's, encoder and
prefix hit rates, TTFT p50/p99, load imbalance), a plot and one JSON line last:
`python -m benchmarks.cluster.routing_sim --replicas 8,16,32,64,128`. `--validate` first runs the same
workload scaled down against a real two-replica server and reports the simulator's error
(`benchmarks/cluster/routing_validate.py`).
What it does not know: engines, tensors; the simulation itself (it only drives and prints it).
"""

from __future__ import annotations

import argparse
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.card import ROOT, json_line
from mmserve.cluster.router import ROUTING_POLICIES, RouterConfig
from testkit.routing_sim import Simulation, Workload, load_costs


def write_plot(results: list[dict[str, Any]], path: Path) -> str:
    """Image reuse over one infinite engine's, TTFT p50 and load imbalance against replicas, per policy."""
    from benchmarks.reports import plots

    plt = plots.pyplot()
    if plt is None:
        return plots.NOT_INSTALLED
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for policy in dict.fromkeys(r["policy"] for r in results):
        rows = [r for r in results if r["policy"] == policy]
        n = [r["replicas"] for r in rows]
        for ax, key in zip(axes, ("reuse_vs_infinite", "ttft_p50_ms", "load_imbalance"), strict=True):
            ax.plot(n, [r[key] for r in rows], marker="o", label=policy)
    titles = ("image reuse / one infinite engine's", "TTFT p50 (ms)", "load imbalance (max / mean held)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].axhline(0.9, color="grey", linestyle="--", linewidth=1)
    axes[2].axhline(1.3, color="grey", linestyle="--", linewidth=1)
    axes[0].legend()
    return plots.save(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="8,16,32,64,128")
    parser.add_argument("--policies", default=",".join(ROUTING_POLICIES))
    parser.add_argument("--costs", type=Path, default=None,
                        help="the JSON routing_costs.py wrote (default: measured now on --model, then cached)")
    parser.add_argument("--model", default="30m")
    parser.add_argument("--images", type=int, default=Workload.num_images)
    parser.add_argument("--zipf", type=float, default=Workload.zipf_s)
    parser.add_argument("--conversations", type=int, default=None, help="default: 60 per replica of the largest N")
    parser.add_argument("--turns", type=int, default=Workload.turns)
    parser.add_argument("--load", type=float, default=0.6,
                        help="offered load: conversations per second as this fraction of what the replicas serve")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-load-gap", type=int, default=RouterConfig.max_load_gap)
    parser.add_argument("--load-gap-fraction", type=float, default=RouterConfig.load_gap_fraction)
    parser.add_argument("--min-hit-fraction", type=float, default=RouterConfig.min_hit_fraction)
    parser.add_argument("--plot", type=Path, default=ROOT / ".bench" / "routing_sim.png")
    parser.add_argument("--validate", action="store_true", help="first validate against a real 2-replica server")
    args = parser.parse_args(argv)
    from benchmarks.cluster.routing_costs import capacity_conversations_per_s, ensure_costs

    costs_path = args.costs or ensure_costs(args.model)
    costs, shape, limits, data = load_costs(costs_path)
    validation = None
    if args.validate:
        from benchmarks.cluster.routing_validate import validate

        validation = validate(costs_path)
    router = RouterConfig(max_load_gap=args.max_load_gap, load_gap_fraction=args.load_gap_fraction,
                          min_hit_fraction=args.min_hit_fraction)
    sizes = [int(n) for n in args.replicas.split(",")]
    policies = args.policies.split(",")
    per_replica_rate = capacity_conversations_per_s(costs, shape, limits, args.turns)
    print("== routing simulation ==")
    card = {"bench": "routing_sim", "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "costs": str(costs_path), "measured_on": data.get("model"), "shape": asdict(shape),
            "limits": asdict(limits), "costs_s": asdict(costs), "zipf": args.zipf, "images": args.images,
            "turns": args.turns, "load": args.load, "router": asdict(router),
            "replica_capacity_conversations_per_s": round(per_replica_rate, 3)}
    for key, value in card.items():
        print(f"  {key:38} {value}")
    results = []
    print(f"\n{'N':>4} {'policy':13} {'reuse':>7} {'vs inf':>7} {'enc hit':>8} {'prefix':>7} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'imbal':>6}")
    for n in sizes:
        conversations = args.conversations or 60 * max(sizes)
        workload = Workload(args.images, args.zipf, conversations, args.turns, args.load * per_replica_rate * n,
                            seed=args.seed)
        for policy in policies:
            res = Simulation(n, policy, costs, shape, workload, limits, router).run()
            results.append(res)
            print(f"{n:>4} {policy:13} {res['image_reuse']:>7} {res['reuse_vs_infinite']:>7} "
                  f"{res['encoder_cache_hit_rate']:>8} {res['prefix_hit_rate']:>7} {res['ttft_p50_ms']:>9} "
                  f"{res['ttft_p99_ms']:>9} {res['load_imbalance']:>6}", flush=True)
    targets = [{"name": f"{r['replicas']} replicas, cache_aware: image reuse >= 0.9x one infinite engine's, "
                        f"imbalance <= 1.3", "reuse_vs_infinite": r["reuse_vs_infinite"],
                "load_imbalance": r["load_imbalance"],
                "met": r["reuse_vs_infinite"] >= 0.9 and r["load_imbalance"] <= 1.3}
               for r in results if r["policy"] == "cache_aware" and r["replicas"] == 64]
    for t in targets:
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['name']}")
    plot = write_plot(results, args.plot)
    print(f"plot: {plot}")
    json_line({**card, "validation": validation, "results": results, "targets": targets, "plot": plot})


if __name__ == "__main__":
    main()

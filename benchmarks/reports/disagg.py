"""The encoder disaggregation benchmark's report: statistics, targets, the card, the table, the JSON line.

Role: turn what `disagg.py` measured (each request's send time and token arrivals, the burst send
times, CPU seconds) into percentiles inside and outside burst windows, combine rounds by medians,
judge the fixed targets (ratios to inline) and render them.
What it does not know: how it was measured.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

import numpy as np

from benchmarks.card import machine_line
from benchmarks.server.serve import percentiles_ms

ITL_P99_IN_BURSTS_MAX_RATIO = 0.5  # text ITL p99 during image bursts, vs inline
THROUGHPUT_MIN_RATIO = 0.9  # total output tokens/s, vs inline
OUTSIDE_WARN_SHARE = 0.1  # of the machine's CPU, taken by processes outside the benchmark: say so


def _pct(values: list[float]) -> dict[str, float | None]:
    """serve.py's p50/p99/mean in ms; None (null in the JSON) where there is no sample."""
    return percentiles_ms(values) if values else {"p50": None, "p99": None, "mean": None}


def _overlaps(start: float, end: float, windows: list[tuple[float, float]]) -> bool:
    return any(start < w_end and end > w_start for w_start, w_end in windows)


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Latency percentiles overall and in burst windows, throughput, CPU split."""
    windows = [(at, max(t.started + t.record.ttft_s for t in burst)) for at, burst in raw["bursts"]]
    images = [t for _, burst in raw["bursts"] for t in burst]
    itl_all, itl_in = [], []
    ttft_in = []
    for t in raw["text"]:
        arrivals = t.arrivals()
        for gap, a, b in zip(t.record.itl_s, arrivals, arrivals[1:]):
            itl_all.append(gap)
            if _overlaps(a, b, windows):
                itl_in.append(gap)
        if _overlaps(t.started, arrivals[0], windows):
            ttft_in.append(t.record.ttft_s)
    text_tokens = sum(t.record.output_tokens for t in raw["text"])
    image_tokens = sum(t.record.output_tokens for t in images)
    wall = raw["wall_s"]
    return {
        "wall_s": round(wall, 2), "text_requests": len(raw["text"]), "image_requests": len(images),
        "output_tokens": text_tokens + image_tokens,
        "output_token_throughput_per_s": round((text_tokens + image_tokens) / wall, 2),
        "text_token_throughput_per_s": round(text_tokens / wall, 2),
        "text_itl_ms": _pct(itl_all), "text_itl_ms_in_bursts": _pct(itl_in),
        "text_ttft_ms": _pct([t.record.ttft_s for t in raw["text"]]),
        "text_ttft_ms_in_bursts": _pct(ttft_in),
        "image_ttft_ms": _pct([t.record.ttft_s for t in images]),
        "burst_window_s_mean": round(float(np.mean([e - s for s, e in windows])), 2),
        "burst_share_of_wall": round(sum(e - s for s, e in windows) / wall, 3),
        "cpu": raw["cpu"],
    }


def median_tree(items: list[Any]) -> Any:
    """The per-leaf median over rounds of equally shaped results (numbers; None where a round had no
    sample); other leaves come from the first round."""
    first = items[0]
    if isinstance(first, dict):
        return {k: median_tree([i[k] for i in items if k in i]) for k in first}
    numbers = [i for i in items if isinstance(i, (int, float)) and not isinstance(i, bool)]
    if numbers and all(i is None or i in numbers for i in items):
        value = statistics.median(numbers)
        if all(isinstance(i, int) for i in numbers) and float(value).is_integer():
            return int(value)  # counts stay counts
        return round(value, 3)
    return first


def targets(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per worker mode: its ratios to inline and whether each target is met."""
    base = results.get("inline", {})
    if "error" in base or not base or not base["text_itl_ms_in_bursts"]["p99"]:
        return {}
    out = {}
    for mode, r in results.items():
        if mode == "inline" or "error" in r or r["text_itl_ms_in_bursts"]["p99"] is None:
            continue
        itl = r["text_itl_ms_in_bursts"]["p99"] / base["text_itl_ms_in_bursts"]["p99"]
        tput = r["output_token_throughput_per_s"] / base["output_token_throughput_per_s"]
        out[mode] = {"itl_p99_in_bursts_ratio": round(itl, 3), "itl_target_met": itl <= ITL_P99_IN_BURSTS_MAX_RATIO,
                     "throughput_ratio": round(tput, 3), "throughput_target_met": tput >= THROUGHPUT_MIN_RATIO}
    return out


def core_split(machine: dict[str, Any], workers: int) -> dict[str, int]:
    """The engine's rule: each worker gets max(1, cores // (workers + 1)) torch threads; the server keeps
    torch's default (the same as this client's, which never sets it) unless --server-threads."""
    cores = machine["usable_cpus"]
    per_worker = max(1, cores // (workers + 1)) if workers else 0
    engine = machine["server_torch_threads"]
    return {"cores": cores, "engine_threads": engine, "worker_threads": per_worker,
            "total_threads": engine + workers * per_worker}


def print_card(machine: dict[str, Any], model: dict[str, Any], settings: dict[str, Any],
               results: dict[str, dict[str, Any]]) -> None:
    print("== mmserve encoder disaggregation benchmark ==")
    print(f"machine   : {machine_line(machine)}, torch {machine['torch']}")
    print(f"model     : {model['name']}: {model['dir']}, {model['params'] / 1e6:.1f}M params, float32; the bench "
          "checkpoint with the lm_head rows of ids that print nothing zeroed (every token streams; same shapes and FLOPs)")
    print("server    : engine defaults; a fresh `mmserve serve` per mode and round, warmed up (1 text request, "
          "max(2, workers) image requests) before the clock")
    print(f"workload  : {settings['clients']} streaming text-only clients, {settings['text_tokens']} greedy tokens per "
          "request (min_tokens = max_tokens), back to back;")
    print(f"            {settings['num_bursts']} bursts of {settings['burst_size']} image requests every "
          f"{settings['burst_interval_s']:g}s (first at {settings['burst_interval_s'] / 2:g}s), one fresh image each "
          f"({settings['side_px'][0]}-{settings['side_px'][1]} px sides), {settings['image_tokens']} tokens each; "
          f"load {settings['num_bursts'] * settings['burst_interval_s']:g}s per mode (text runs on until the last "
          "burst is answered)")
    print(f"rounds    : {settings['rounds']} (modes alternate, order reversed every other round); medians reported")
    engine = "torch's default" if settings["server_threads"] is None else "OMP_NUM_THREADS (--server-threads)"
    print(f"cores     : engine torch threads = {engine}; each worker max(1, cores // (workers + 1)):")
    for mode, r in results.items():
        split = core_split(machine, r.get("encoder_workers", 0))
        workers = r.get("encoder_workers", 0)
        where = "inline in the engine step" if not workers else f"{workers} x {split['worker_threads']} thread(s)"
        if r.get("replicas"):  # P/D: the server process holds no engine
            print(f"            {mode:<10} {r['replicas']} replica process(es), max(1, cores // 2) thread(s) each, "
                  "encoders inline in the prefill replica; the API server in its own process ('workers' CPU: "
                  "the replicas)")
            continue
        print(f"            {mode:<10} engine {split['engine_threads']} thread(s) + encoders {where} = "
              f"{split['total_threads']} compute threads on {split['cores']} cores")
    print("windows   : a burst window runs from its send to its last image's first token; 'in bursts' = text ITL "
          "gaps / TTFTs overlapping a window")
    print()


def _ms(d: dict[str, float | None]) -> str:
    return " ".join("      -" if d[k] is None else f"{d[k]:>7.1f}" for k in ("p50", "p99"))


def print_table(results: dict[str, dict[str, Any]], verdicts: dict[str, dict[str, Any]], cores: int) -> None:
    head = (f"{'mode':<10} {'tok/s':>7} | {'text ITL p50':>12} {'p99':>7} | {'in bursts p50':>13} {'p99':>7} | "
            f"{'text TTFT p50':>13} {'p99':>7} | {'in bursts p50':>13} {'p99':>7} | {'image TTFT p50':>14} {'p99':>7}")
    print(head + "\n" + "-" * len(head))
    for mode, r in results.items():
        if "error" in r:
            print(f"{mode:<10} not run: {r['error']}")
            continue
        print(f"{mode:<10} {r['output_token_throughput_per_s']:>7.1f} | {'':>5}{_ms(r['text_itl_ms'])} | "
              f"{'':>6}{_ms(r['text_itl_ms_in_bursts'])} | {'':>6}{_ms(r['text_ttft_ms'])} | "
              f"{'':>6}{_ms(r['text_ttft_ms_in_bursts'])} | {'':>7}{_ms(r['image_ttft_ms'])}")
    print("(ms; tok/s = all output tokens, text and image, over the load's wall)\n")
    head = (f"{'mode':<10} {'wall s':>7} {'engine':>7} {'workers':>8} {'other':>6} {'client':>7} {'outside':>8} "
            f"{'busy':>6} {'util':>5}  windows  server")
    print(head + "\n" + "-" * len(head))
    for mode, r in results.items():
        if "error" in r:
            continue
        c = r["cpu"]
        print(f"{mode:<10} {c['wall_s']:>7.1f} {c['engine_s']:>7.1f} {c['encoder_worker_s']:>8.1f} {c['other_s']:>6.1f} "
              f"{c['client_s']:>7.1f} {c['outside_s']:>8.1f} {c['machine_busy_s']:>6.1f} {c['machine_utilization']:>5.0%}"
              f"  {r['burst_window_s_mean']:>4.1f}s ({r['burst_share_of_wall']:.0%})  "
              + ", ".join(f"{k} {v}" for k, v in r["server"].items()))
    print("(CPU seconds during the load: engine = the server process, workers = encoder worker processes / the Ray "
          "actor, other = the rest of the server's tree (Ray's daemons, the resource tracker), client = this "
          "benchmark, outside = the rest of the machine; util = busy / (wall x cores); windows: mean burst window "
          "(share of the wall))\n")
    busy = [f"{m} {r['cpu']['outside_s'] / (r['cpu']['wall_s'] * cores):.0%}" for m, r in results.items()
            if "error" not in r and r["cpu"]["outside_s"] > OUTSIDE_WARN_SHARE * r["cpu"]["wall_s"] * cores]
    if busy:
        print(f"NOTE: other processes on the machine took a share of its CPU during the load ({', '.join(busy)}); "
              "the modes competed with them too, so compare with care\n")
    for mode, v in verdicts.items():
        itl = "met" if v["itl_target_met"] else "MISSED"
        tput = "met" if v["throughput_target_met"] else "MISSED"
        print(f"target {mode:<10}: text ITL p99 in bursts {v['itl_p99_in_bursts_ratio']:.2f}x inline (<= "
              f"{ITL_P99_IN_BURSTS_MAX_RATIO}x: {itl}); throughput {v['throughput_ratio']:.2f}x inline (>= "
              f"{THROUGHPUT_MIN_RATIO}x: {tput})")


def json_line(machine: dict[str, Any], model: dict[str, Any], settings: dict[str, Any],
              results: dict[str, dict[str, Any]], verdicts: dict[str, dict[str, Any]], run_s: float) -> str:
    splits = {mode: core_split(machine, r.get("encoder_workers", 0)) for mode, r in results.items()}
    return json.dumps({"bench": "disagg", "machine": machine, "model": model, "settings": settings,
                       "core_split": splits, "results": results,
                       "targets": {"itl_p99_in_bursts_max_ratio": ITL_P99_IN_BURSTS_MAX_RATIO,
                                   "throughput_min_ratio": THROUGHPUT_MIN_RATIO, "by_mode": verdicts},
                       "run_s": round(run_s, 1)}, separators=(",", ":"))

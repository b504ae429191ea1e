"""Tokens per second over the first 60 s of a fresh process, against the same engine once warm.

Run: python -m benchmarks.engine.cold_start [--model 30m|100m|1b|DIR] [--rounds 3] [--window-s 60] [--batch 1]

Role: what a user meets when they start mmserve and send work at once. Each measurement is a fresh
process (torch threads = the machine's usable cores) that sends requests back to back, `--batch` at a
time (1: one request at a time), `--output-tokens` greedy tokens each, from the moment it starts:
- window tok/s: the tokens of the requests that finished within `--window-s` seconds of the process's
  start (imports, loading and any compile count, as for a user), divided by the window;
- from the first request: the same over the `--window-s` seconds after `LLM(...)` returned (the rate
  a user's first requests see, start-up not counted);
- warm tok/s: the same requests once the process is warm (after the windows, and after its background
  compile, if any, has finished), the rate the windows are compared with.
Settings (compile_cases.SETTINGS): `default` (what a user gets: eager), `startup` (compile_cpu_decode=True:
compiled, or loaded from the cache, before serving) and `background` (MMSERVE_COMPILE_CPU_DECODE=1: compiled
in a thread while serving eagerly), the compiled ones with a cold TorchInductor cache (an empty one: the
first start on a machine) and a warm one (filled by an earlier run: every later start). The settings'
order is rotated each round; medians. The target: window ≥ 0.95 × the warm process's rate (of the same
setting, and the best warm rate of any setting). Prints a card, a table and one JSON line last.

What it does not know: mmserve internals beyond the offline API, `LLMEngine.get_stats` and
`LLMEngine.wait_for_compiled_decode`.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

PROCESS_START = time.perf_counter()  # as early as this process can read a clock: imports count

from benchmarks.card import json_line  # noqa: E402 (after the clock on purpose)
from benchmarks.engine.compile_cases import SETTINGS, median_of, run_cases  # noqa: E402

CASES = (("default", "warm"), ("background", "cold"), ("background", "warm"), ("startup", "cold"), ("startup", "warm"))
PROMPTS = ("Describe a sunny beach in detail.", "Write a short story about a robot.", "List ten colours.",
           "Explain how a bicycle works.", "What is the capital of France?", "Count from one to twenty.")
WARM_REQUESTS = 6  # calls measured once warm


def _call(llm: Any, prompts: list[str], output_tokens: int) -> int:
    from mmserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_tokens, min_tokens=output_tokens, ignore_eos=True)
    return sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False))


def measure(model_dir: str, setting: str, batch: int, output_tokens: int, window_s: float) -> dict[str, Any]:
    """One measurement, in this process (the harness starts a fresh one for each)."""
    import torch

    from mmserve import LLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    llm = LLM(model_dir, compile_cpu_decode=SETTINGS[setting].kwarg, max_num_seqs=max(batch, 1), max_model_len=512)
    ready_s = time.perf_counter() - PROCESS_START
    in_window, after_ready, calls = 0, 0, 0
    while True:
        prompts = [PROMPTS[(calls * batch + i) % len(PROMPTS)] for i in range(batch)]
        tokens = _call(llm, prompts, output_tokens)
        calls += 1
        finished_s = time.perf_counter() - PROCESS_START
        in_window += tokens if finished_s <= window_s else 0
        after_ready += tokens if finished_s <= ready_s + window_s else 0
        if finished_s > ready_s + window_s:
            break
    state_at_window_end = llm.engine.get_stats()["cpu_decode_compile"]
    llm.engine.wait_for_compiled_decode(timeout_s=None)  # warm: whatever the default compiles is built
    compiled_s = time.perf_counter() - PROCESS_START if state_at_window_end == "compiling" else None
    _call(llm, PROMPTS[:1], 4)  # the first step after a switch off the clock
    started, warm_tokens = time.perf_counter(), 0
    for call in range(WARM_REQUESTS):
        warm_tokens += _call(llm, [PROMPTS[(call * batch + i) % len(PROMPTS)] for i in range(batch)], output_tokens)
    return {"ready_s": ready_s, "window_tokens_per_s": in_window / window_s,
            "first_requests_tokens_per_s": after_ready / window_s,
            "warm_tokens_per_s": warm_tokens / (time.perf_counter() - started),
            "compile_at_window_end": state_at_window_end, "compiled_s": compiled_s}


def _describe(args: argparse.Namespace) -> Any:
    return lambda r: (f"ready {r['ready_s']:.1f} s, first {args.window_s:.0f} s {r['window_tokens_per_s']:.1f} tok/s, "
                      f"warm {r['warm_tokens_per_s']:.1f} tok/s, compile at the window's end: "
                      f"{r['compile_at_window_end']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="30m", help="30m, 100m, 1b or a checkpoint directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1, help="requests per call (1: one at a time)")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--worker", choices=tuple(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        json_line(measure(args.model, args.worker, args.batch, args.output_tokens, args.window_s))
        return

    from benchmarks.card import machine_info, print_card
    from benchmarks.checkpoints import ensure_model, parameter_count

    model_dir = ensure_model(args.model)
    worker_args = ["--model", str(model_dir), "--batch", str(args.batch), "--output-tokens", str(args.output_tokens),
                   "--window-s", str(args.window_s)]
    runs = run_cases("benchmarks.engine.cold_start", CASES, args.rounds, worker_args, _describe(args))
    keys = ("ready_s", "window_tokens_per_s", "first_requests_tokens_per_s", "warm_tokens_per_s", "compiled_s")
    results: dict[str, dict[str, Any]] = {name: {k: median_of(rs, k) for k in keys} for name, rs in runs.items()}
    best_warm = max(res["warm_tokens_per_s"] for res in results.values())
    for name, res in results.items():
        res["window_over_own_warm"] = round(res["window_tokens_per_s"] / res["warm_tokens_per_s"], 3)
        res["first_requests_over_own_warm"] = round(res["first_requests_tokens_per_s"] / res["warm_tokens_per_s"], 3)
        res["window_over_best_warm"] = round(res["window_tokens_per_s"] / best_warm, 3)
        res["first_requests_over_best_warm"] = round(res["first_requests_tokens_per_s"] / best_warm, 3)
        res["compile_at_window_end"] = sorted({r["compile_at_window_end"] for r in runs[name]})

    machine = machine_info(len(os.sched_getaffinity(0)))
    print_card("mmserve cold start: the first seconds of a fresh process against a warm one", {
        "machine": f"{machine['usable_cpus']} usable CPUs, {machine['platform']}, torch {machine['torch']}",
        "model": f"{model_dir} ({parameter_count(model_dir) / 1e6:.1f}M params), float32",
        "work": f"{args.batch} request(s) at a time, {args.output_tokens} greedy tokens each, back to back from "
                f"the process's start; window {args.window_s:.0f} s; {args.rounds} rounds, fresh process each, "
                "medians; cold = an empty TorchInductor cache",
        "target": "window tok/s >= 0.95 x the warm process's (its own setting's, and the best setting's)",
        "columns": "start = counted from the process's start; 1st req = from the first request; x own / x best = "
                   "over the setting's own warm rate / the best warm rate of any setting"})
    print(f"{'setting':18s} {'ready s':>7s} {'start tok/s':>11s} {'x own':>6s} {'x best':>6s} {'1st req tok/s':>13s} "
          f"{'x own':>6s} {'x best':>6s} {'warm tok/s':>10s} {'compiled s':>10s}")
    for name, res in results.items():
        compiled = "—" if res["compiled_s"] is None else res["compiled_s"]
        print(f"{name:18s} {res['ready_s']:>7} {res['window_tokens_per_s']:>11} {res['window_over_own_warm']:>6} "
              f"{res['window_over_best_warm']:>6} {res['first_requests_tokens_per_s']:>13} "
              f"{res['first_requests_over_own_warm']:>6} {res['first_requests_over_best_warm']:>6} "
              f"{res['warm_tokens_per_s']:>10} {compiled:>10}")
    json_line({"bench": "cold_start", "model": str(model_dir), "batch": args.batch,
               "output_tokens": args.output_tokens, "window_s": args.window_s, "rounds": args.rounds,
               "machine": machine, "results": results}, compact=True)


if __name__ == "__main__":
    main()

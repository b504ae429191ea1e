"""Does a compile in the serving process slow the steps served beside it when it has a core of its own?

Run: python -m benchmarks.engine.compile_beside [--model 30m|100m|DIR] [--rounds 2] [--seconds 40]

Role: the measurement behind the compile policy (docs/performance.md, "Compile policy") for machines with
cores to spare, on a machine with two. Each measurement is a fresh process whose serving thread is pinned
to the first usable CPU with one torch thread; with `background` (MMSERVE_COMPILE_CPU_DECODE=1, an empty
TorchInductor cache) the compile thread pins itself, and so the compilers it starts, to the second CPU
(the benchmark wraps the engine's `_lower_this_threads_priority`, which that thread calls first). So the
compile never takes the serving core: what remains of a slowdown is the interpreter the two threads share.
It sends one request at a time, `--output-tokens` greedy tokens each, for `--seconds`, and reports the
median tok/s of the requests served while compiling, after the compiled step took over, and with the
compile off (`default`, eager), settings alternating each round; medians. Prints a card, a table and
one JSON line last.

What it does not know: mmserve internals beyond the offline API, `get_stats` and the compile thread's hook.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.card import ROOT, json_line

PROMPT = "Describe a sunny beach in detail."


def measure(model_dir: str, setting: str, seconds: float, output_tokens: int) -> dict[str, Any]:
    """One fresh process: requests back to back, each one's tok/s and the compile's state when it ended."""
    serving_cpu, compile_cpu = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, {serving_cpu})
    import torch

    import mmserve.runner.graphs.decode_graphs as decode_graphs
    from mmserve import LLM, SamplingParams

    torch.set_num_threads(1)
    lower = decode_graphs._lower_this_threads_priority

    def pin_then_lower(niceness: int) -> None:  # runs first in the compile thread: it and its compilers
        os.sched_setaffinity(0, {compile_cpu})
        lower(niceness)
    decode_graphs._lower_this_threads_priority = pin_then_lower
    llm = LLM(model_dir, max_num_seqs=1, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=output_tokens, min_tokens=output_tokens, ignore_eos=True)
    started, rates = time.perf_counter(), {"compiling": [], "ready": [], "off": []}
    while time.perf_counter() - started < seconds:
        t = time.perf_counter()
        llm.generate([PROMPT], params, use_tqdm=False)
        rate = output_tokens / (time.perf_counter() - t)
        rates[llm.engine.get_stats()["cpu_decode_compile"]].append(rate)  # a request ending at the switch
    return {k: statistics.median(v) if v else None for k, v in rates.items()} | {
        "compiling_s": sum(output_tokens / r for r in rates["compiling"]) if rates["compiling"] else None}


def _fresh(setting: str, args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="mmserve-inductor-cold-"))
    env["MMSERVE_COMPILE_CPU_DECODE"] = "1" if setting == "background" else "0"
    cmd = [sys.executable, "-m", "benchmarks.engine.compile_beside", "--worker", setting, "--model", model_dir,
           "--seconds", str(args.seconds), "--output-tokens", str(args.output_tokens)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{setting} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="30m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--worker", choices=("default", "background"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        json_line(measure(args.model, args.worker, args.seconds, args.output_tokens))
        return
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("compile_beside needs two usable CPUs: one serving, one compiling")
    from benchmarks.card import machine_info, print_card
    from benchmarks.checkpoints import ensure_model

    model_dir = str(ensure_model(args.model))
    runs: dict[str, list[dict[str, Any]]] = {"default": [], "background": []}
    for round_index in range(args.rounds):
        for setting in (("default", "background") if round_index % 2 == 0 else ("background", "default")):
            runs[setting].append(_fresh(setting, args, model_dir))
            print(f"round {round_index + 1}: {setting}: {runs[setting][-1]}", file=sys.stderr, flush=True)

    def med(setting: str, key: str) -> float | None:
        values = [r[key] for r in runs[setting] if r[key] is not None]
        return round(statistics.median(values), 1) if values else None
    eager = med("default", "off")
    result = {"eager_tokens_per_s": eager, "while_compiling_tokens_per_s": med("background", "compiling"),
              "compiled_tokens_per_s": med("background", "ready"), "compiling_s": med("background", "compiling_s")}
    result["while_compiling_over_eager"] = round(result["while_compiling_tokens_per_s"] / eager, 3)
    result["compiled_over_eager"] = round(result["compiled_tokens_per_s"] / eager, 3)
    machine = machine_info(1)
    print_card("mmserve: a compile in the serving process, on a core of its own", {
        "machine": f"{machine['usable_cpus']} usable CPUs, {machine['platform']}, torch {machine['torch']}",
        "model": model_dir,
        "work": f"one request at a time, {args.output_tokens} greedy tokens, {args.seconds:.0f} s a process; serving "
                f"on one CPU with one torch thread, the compile (cold cache) pinned to another; {args.rounds} rounds",
    })
    print(f"{'eager tok/s':>11s} {'while compiling':>15s} {'x eager':>7s} {'compiling s':>11s} {'compiled tok/s':>14s} "
          f"{'x eager':>7s}")
    print(f"{eager:>11} {result['while_compiling_tokens_per_s']:>15} {result['while_compiling_over_eager']:>7} "
          f"{result['compiling_s']:>11} {result['compiled_tokens_per_s']:>14} {result['compiled_over_eager']:>7}")
    json_line({"bench": "compile_beside", "model": model_dir, "rounds": args.rounds, "seconds": args.seconds,
               "machine": machine, "results": result}, compact=True)


if __name__ == "__main__":
    main()

"""Where one engine step's time goes: a profile of decode steps at batch sizes 1 and 32.

Run: python -m benchmarks.engine.step_profile [--model 30m|100m|tiny|DIR] [--dtype float32] [--batches 1,32]
     [--compile-cpu-decode]

Role: the measured reason behind the speed targets of `benchmarks/peers/compare.py`. For each batch size it
starts B requests of the peers workload's shape (one 160-192 px image, a short question), lets
their prefills pass, then times `--steps` pure decode steps with `LLMEngine.step()` and splits each
step's wall time into:
- matmuls: the self time of aten::mm / aten::addmm / oneDNN linear / mmserve's panel kernel (the
  weights' work: a floor a peer with the same kernels shares);
- attention: the SDPA kernels, mmserve's paged attention kernel;
- other ops: every other op of the step (norms, rotary, KV writes and gathers, indexing, sampling;
  with `--compile-cpu-decode`, the compiled program's own fused loops) — a compiled or hand-fused
  step removes most of these;
- Python: the rest of the step's wall time (scheduler, batch building, runner bookkeeping, outputs).
Self times come from torch.profiler over the timed steps; the shares are of the profiled wall time.
Prints a card, a table and one JSON line last.

What it does not know: the peers; it only reads mmserve's own step.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from benchmarks.card import json_line

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::matmul",
              "mmserve::panel_linear")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                 "mmserve::paged_attention")
# profiler events that are kernels' own time: ATen, oneDNN/MKL, mmserve's operators, and a compiled step's
# program (its fused loops; the operators it calls are counted as themselves)
OP_PREFIXES = ("aten::", "mkldnn::", "mkl::", "mmserve::", "## Call CompiledFxGraph")


def _requests(batch: int, seed: int) -> list[list[dict[str, Any]]]:
    from benchmarks.workload import synthetic_image

    rng = np.random.default_rng(seed)
    images = [synthetic_image(rng, int(rng.integers(160, 193)), int(rng.integers(160, 193))) for _ in range(batch)]
    return [[{"role": "user", "content": [{"type": "image_pil", "image_pil": im},
                                          {"type": "text", "text": "Describe the image."}]}] for im in images]


def profile_batch(llm: Any, batch: int, steps: int, seed: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    from mmserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 8, min_tokens=steps + 8, ignore_eos=True)
    for i, conv in enumerate(_requests(batch, seed)):
        engine.add_request(f"p{batch}-{i}", engine.process_chat(conv), params)
    while len(requests := engine.inspect().runner_requests) < batch or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in requests.values()):
        engine.step()
    engine.step()  # the first all-decode step
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - started)
    while engine.has_unfinished_requests():
        engine.step()
    llm.check_integrity()
    totals = {"matmuls": 0.0, "attention": 0.0, "other_ops": 0.0}
    for event in prof.key_averages():
        if not event.key.startswith(OP_PREFIXES):
            continue
        seconds = event.self_cpu_time_total / 1e6
        kind = "matmuls" if event.key in MATMUL_OPS else "attention" if event.key in ATTENTION_OPS else "other_ops"
        totals[kind] += seconds
    wall = sum(walls)
    ops = sum(totals.values())
    top = sorted(((e.key, e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in prof.key_averages()
                  if e.key.startswith(OP_PREFIXES)), key=lambda t: -t[1])[:12]
    per_step = {k: v / steps * 1e3 for k, v in totals.items()}
    per_step["python"] = max(0.0, (wall - ops) / steps * 1e3)
    return {"batch": batch, "steps": steps, "step_ms_profiled": wall / steps * 1e3,
            "tokens_per_s_profiled": batch * steps / wall, **{f"{k}_ms": round(v, 3) for k, v in per_step.items()},
            **{f"{k}_share": round(v / (wall / steps * 1e3), 3) for k, v in per_step.items()},
            "top_ops": [{"op": k, "ms_per_step": round(ms, 3), "calls_per_step": n} for k, ms, n in top]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="30m", help="30m (default), 100m, tiny, or a checkpoint directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-cpu-decode", action="store_true",
                        help="profile the compiled decode step (what benchmarks/peers/compare.py runs)")
    args = parser.parse_args(argv)
    from benchmarks.card import machine_info
    from benchmarks.checkpoints import ensure_model
    from mmserve import LLM

    model_dir = ensure_model(args.model)
    llm = LLM(str(model_dir), dtype=args.dtype, compile_cpu_decode=args.compile_cpu_decode)
    llm.chat(_requests(1, args.seed + 1)[0], use_tqdm=False)  # warm-up
    rows = [profile_batch(llm, int(b), args.steps, args.seed) for b in args.batches.split(",")]
    machine = machine_info(torch.get_num_threads())
    print("== mmserve decode step profile ==")
    print(f"machine : {machine['usable_cpus']} CPUs, torch {machine['torch']}, {torch.get_num_threads()} threads")
    print(f"model   : {model_dir} ({args.dtype}, compile_cpu_decode={args.compile_cpu_decode}); "
          f"{args.steps} decode steps per batch size, profiled")
    print("split   : matmuls / attention = self time of those kernels; other ops = every other ATen op; "
          "python = the rest of the step's wall time")
    print(f"{'batch':>5} {'step ms':>8} {'tok/s':>7} | {'matmuls':>8} {'attention':>9} {'other ops':>9} "
          f"{'python':>7}  (ms per step, share)")
    for r in rows:
        cells = " ".join(f"{r[k + '_ms']:>5.2f} {r[k + '_share']:>4.0%}" for k in
                         ("matmuls", "attention", "other_ops", "python"))
        print(f"{r['batch']:>5} {r['step_ms_profiled']:>8.2f} {r['tokens_per_s_profiled']:>7.0f} | {cells}")
    for r in rows:
        print(f"batch {r['batch']}: top ops by self time (ms per step, calls per step): " + ", ".join(
            f"{t['op'].split('::')[-1]} {t['ms_per_step']:.2f} ({t['calls_per_step']})" for t in r["top_ops"][:8]))

    json_line({"bench": "step_profile", "machine": machine, "model_dir": str(model_dir), "dtype": args.dtype,
                      "compile_cpu_decode": args.compile_cpu_decode, "rows": rows}, compact=True)


if __name__ == "__main__":
    main()

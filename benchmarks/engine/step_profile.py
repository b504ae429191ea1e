"""Where one engine step's time goes: a profile of decode steps at batch sizes 1 and 32.

Run: python -m benchmarks.engine.step_profile [--model 30m|100m|1b|tiny|DIR] [--dtype float32] [--batches 1,32]
     [--quantization int8|int4|w8a8|w4a8] [--compile-cpu-decode]

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
The same steps are first timed without the profiler (its own cost per op would count): `step ms` is
their median, `outside matmuls ms` that minus the matmuls' self time (the issue's <= 0.5 ms target).
The bandwidth floor: the bytes of the language model's linear weights (decoder layers and head, as
stored: float32 panels, int8/int4 codes and scales) are read once per step; the card prints the
machine's read bandwidth (`torch.sum` over 1 GiB, all threads, best of 5) and, per batch size, those
bytes over the matmuls' time and over the whole step, in GB/s and as a share of it.
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
              "mmserve::panel_linear", "mmserve::bf16_panel_linear", "mmserve::quant_linear", "mmserve::w8a8_linear",
              "mmserve::w4a8_linear")
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


def weight_bytes_per_step(language_model: torch.nn.Module) -> int:
    """The bytes a decode step's matmuls read: every tensor of the linear layers (modules with
    `out_features`: dense, panel and quantized layouts alike) of the decoder and its head, each once."""
    seen: dict[int, int] = {}
    for module in language_model.modules():
        if hasattr(module, "out_features") and not isinstance(module, torch.nn.Embedding):
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def read_bandwidth_gbs(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """The machine's read bandwidth as this process sees it: `torch.sum` over a buffer far beyond the
    caches, with the process's torch threads; best of `repeats`."""
    buffer = torch.ones(size_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.sum(buffer)
        best = min(best, time.perf_counter() - started)
    return size_bytes / best / 1e9


def op_dispatch_us(repeats: int = 20000) -> float:
    """The least an eager op launched from Python costs here: an in-place add of two one-element tensors
    (dispatch, argument checks, no work worth the name), median of 5 loops of `repeats`."""
    a, b = torch.zeros(1), torch.ones(1)
    loops = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            a.add_(b)
        loops.append((time.perf_counter() - started) / repeats)
    return float(np.median(loops)) * 1e6


def _time_steps(engine: Any, steps: int) -> list[float]:
    walls = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - started)
    return walls


def profile_batch(llm: Any, batch: int, steps: int, seed: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    from mmserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, min_tokens=2 * steps + 8, ignore_eos=True)
    for i, conv in enumerate(_requests(batch, seed)):
        engine.add_request(f"p{batch}-{i}", engine.process_chat(conv), params)
    while len(requests := engine.inspect().runner_requests) < batch or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in requests.values()):
        engine.step()
    engine.step()  # the first all-decode step
    step_ms = float(np.median(_time_steps(engine, steps))) * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        walls = _time_steps(engine, steps)
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
    # ops the step launches itself (not those nested inside another op): each pays the eager dispatch
    launched = sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith(OP_PREFIXES)) / steps
    top = sorted(((e.key, e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in prof.key_averages()
                  if e.key.startswith(OP_PREFIXES)), key=lambda t: -t[1])[:12]
    per_step = {k: v / steps * 1e3 for k, v in totals.items()}
    per_step["python"] = max(0.0, (wall - ops) / steps * 1e3)
    weight_bytes = weight_bytes_per_step(engine.runner.model.language_model)
    return {"batch": batch, "steps": steps, "step_ms": round(step_ms, 3),
            "outside_matmuls_ms": round(step_ms - per_step["matmuls"], 3), "weight_bytes_per_step": weight_bytes,
            "matmul_gbs": round(weight_bytes / per_step["matmuls"] / 1e6, 2),
            "step_gbs": round(weight_bytes / step_ms / 1e6, 2), "step_ms_profiled": wall / steps * 1e3,
            "tokens_per_s_profiled": batch * steps / wall, "ops_launched_per_step": round(launched, 1), **{f"{k}_ms": round(v, 3) for k, v in per_step.items()},
            **{f"{k}_share": round(v / (wall / steps * 1e3), 3) for k, v in per_step.items()},
            "top_ops": [{"op": k, "ms_per_step": round(ms, 3), "calls_per_step": n} for k, ms, n in top]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="30m", help="30m (default), 100m, tiny, or a checkpoint directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantization", default=None, help="int8, int4, w8a8 or w4a8 (weights quantized at load)")
    parser.add_argument("--compile-cpu-decode", action="store_true",
                        help="profile the compiled decode step (what benchmarks/peers/compare.py runs)")
    args = parser.parse_args(argv)
    from benchmarks.card import machine_info
    from benchmarks.checkpoints import ensure_model
    from mmserve import LLM

    model_dir = ensure_model(args.model)
    extra = {"quantization": args.quantization} if args.quantization else {}
    llm = LLM(str(model_dir), dtype=args.dtype, compile_cpu_decode=args.compile_cpu_decode or None, **extra)
    llm.chat(_requests(1, args.seed + 1)[0], use_tqdm=False)  # warm-up
    rows = [profile_batch(llm, int(b), args.steps, args.seed) for b in args.batches.split(",")]
    bandwidth_gbs = read_bandwidth_gbs()
    dispatch_us = op_dispatch_us()
    for r in rows:
        r["dispatch_floor_ms"] = round(r["ops_launched_per_step"] * dispatch_us / 1e3, 3)
        r["matmul_share_of_bandwidth"] = round(r["matmul_gbs"] / bandwidth_gbs, 3)
        r["step_share_of_bandwidth"] = round(r["step_gbs"] / bandwidth_gbs, 3)
    machine = machine_info(torch.get_num_threads())
    print("== mmserve decode step profile ==")
    print(f"machine : {machine['usable_cpus']} CPUs, torch {machine['torch']}, {torch.get_num_threads()} threads")
    print(f"model   : {model_dir} ({args.dtype}, quantization={args.quantization}, compile_cpu_decode={args.compile_cpu_decode or None}); "
          f"{args.steps} decode steps per batch size, profiled")
    print("split   : matmuls / attention = self time of those kernels; other ops = every other ATen op; "
          "python = the rest of the step's wall time")
    print(f"floor   : read bandwidth {bandwidth_gbs:.1f} GB/s (torch.sum over 1 GiB, best of 5); linear weights "
          f"{rows[0]['weight_bytes_per_step'] / 1e6:.1f} MB read per step")
    print(f"dispatch: an eager op launched from Python costs at least {dispatch_us:.2f} us here (in-place add of "
          f"one-element tensors); ops launched x that = the step's dispatch floor")
    print(f"{'batch':>5} {'step ms':>8} {'outside matmuls ms':>18} {'matmul GB/s':>11} {'x bw':>5} {'step GB/s':>9} "
          f"{'x bw':>5} {'ops':>5} {'floor ms':>8}  (unprofiled)")
    for r in rows:
        print(f"{r['batch']:>5} {r['step_ms']:>8.2f} {r['outside_matmuls_ms']:>18.2f} {r['matmul_gbs']:>11.1f} "
              f"{r['matmul_share_of_bandwidth']:>5.2f} {r['step_gbs']:>9.1f} {r['step_share_of_bandwidth']:>5.2f} "
              f"{r['ops_launched_per_step']:>5.0f} {r['dispatch_floor_ms']:>8.2f}")
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
               "quantization": args.quantization, "read_bandwidth_gbs": round(bandwidth_gbs, 2),
               "op_dispatch_us": round(dispatch_us, 3), "compile_cpu_decode": args.compile_cpu_decode, "rows": rows}, compact=True)


if __name__ == "__main__":
    main()

"""Offline throughput benchmark: mmserve's `LLM.chat` against transformers' `generate`.

Role: on the same random-weight checkpoints (the tiny Qwen2-VL test model, a ~100M Qwen2-VL built
from `benchmarks/configs/bench_100m_qwen2_vl.json`, and the tiny test model of every other served
family: `--model qwen2_5_vl|qwen3_vl|llava_onevision|gemma3|mistral3|mllama`; all written under `.bench/` on first use, no
downloads), run one fixed multimodal workload (`benchmarks/workload.py`) through
- mmserve: every conversation submitted at once to a fresh `LLM` (continuous batching, prefix
  caching, encoder reuse);
- transformers, one conversation at a time (`generate` per request);
- transformers, batches of 8 with left padding;
all greedy with exactly `--output-tokens` new tokens, float32, torch threads = the machine's cores.
It checks that mmserve's greedy tokens equal transformers' one-at-a-time tokens (a mismatch is a
bug and is printed loudly, with the reference's logit margin at the first divergence), then times
engine overhead: the share of a batch-32 decode `engine.step()` spent outside the model forward.

Prints a card (machine, models, dtype, workload), a human table, and one JSON line last.
transformers' input preprocessing is done before its clock starts; mmserve's is inside its clock
(`llm.chat` processes the images), so the comparison leans towards transformers. For the Qwen2-VL
models transformers' own processor makes its inputs (and its preprocessing time is reported); for
the other families transformers is fed mmserve's processed token ids and pixels (the test suite
asserts the two processors agree), so no end-to-end preprocessing ratio is printed for them.

What it does not know: mmserve internals beyond the public offline API, `Engine.step` and
`Engine.inspect().last_step`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.card import ROOT, machine_info
from benchmarks.checkpoints import (
    EAGER,
    MODEL_DIRS,
    ensure_checkpoint,
    greedy,
    kv_cache_bytes,
    parameter_count,
)
from benchmarks.engine.floor import attention_work, compute_floor, matmul_peak_gflops
from benchmarks.engine.hf_systems import (
    SystemResult,
    count_identical,
    divergence_margin,
    run_hf_batched,
    run_hf_single,
)
from benchmarks.reports.offline import (
    DTYPE,
    json_line,
    print_card,
    print_overhead,
    print_table,
)
from benchmarks.workload import LONG_SYSTEM_PROMPT, Workload, build_workload
from testkit.families import FAMILIES
from testkit.tiny_checkpoints import reference_inputs

QWEN2_VL_MODELS = ("tiny", "100m")  # transformers' own Qwen2-VL processor makes their reference inputs
QUICK_SUBSET = 16
OVERHEAD_BATCH = 32
OVERHEAD_STEPS = 10
DEFAULT_REPEATS = {"100m": 1}  # the 100m round takes ~5 minutes; tiny models: 3


# ---- systems -------------------------------------------------------------------------------------
def run_mmserve(model_dir: Path, workload: Workload, output_tokens: int) -> SystemResult:
    """Fresh LLM, every conversation submitted at once. A throwaway LLM runs 2 requests first so
    one-time costs (allocator, kernels' first calls) are not on the clock; load time is timed apart."""
    from mmserve import LLM

    convs = workload.conversations
    engine_args = dict(max_num_seqs=len(convs), max_num_batched_tokens=2048, enable_prefix_caching=True,
                       dtype=DTYPE, kv_cache_bytes=kv_cache_bytes(model_dir, len(convs), output_tokens), **EAGER)
    warm = LLM(str(model_dir), **engine_args)
    warm.chat([c.messages for c in convs[:2]], greedy(4), use_tqdm=False)
    del warm
    started = time.perf_counter()
    llm = LLM(str(model_dir), **engine_args)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    outputs = llm.chat([c.messages for c in convs], greedy(output_tokens), use_tqdm=False)
    wall_s = time.perf_counter() - started
    stats = llm.get_stats()
    started = time.perf_counter()  # the share of the wall that is input processing, measured apart
    processed = [llm.engine.process_chat(c.messages) for c in convs]
    preprocess_s = time.perf_counter() - started
    prompt_lens = [p.num_tokens for p in processed]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    keep = ("prompt_tokens", "prompt_tokens_computed", "prefix_cache_hit_tokens", "generation_tokens",
            "encoder_items_encoded", "encoder_tokens_encoded", "num_preemptions")
    extra = {"load_s": round(load_s, 3), "preprocess_s": round(preprocess_s, 3),
             "stats": {k: stats[k] for k in keep if k in stats},
             "prompt_tokens": {"min": min(prompt_lens), "max": max(prompt_lens),
                               "mean": round(sum(prompt_lens) / len(prompt_lens), 1)},
             "attention_work": attention_work(processed, outputs)}
    return SystemResult("mmserve", wall_s, sum(len(t) for t in tokens), tokens, extra)


def load_reference(name: str, model_dir: Path) -> torch.nn.Module:
    family = "qwen2_vl" if name in QWEN2_VL_MODELS else name
    return FAMILIES[family].reference_class().from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_inputs_of(name: str, model_dir: Path, workload: Workload) -> list[dict[str, torch.Tensor]]:
    """transformers' inputs per conversation: its own processor for Qwen2-VL, else mmserve's processed
    prompt turned into the reference's arguments."""
    if name in QWEN2_VL_MODELS:
        return [reference_inputs(model_dir, c.reference_messages, list(c.images))[0] for c in workload.conversations]
    from testkit.models import load_processor

    processor = load_processor(model_dir)
    out = []
    for conv in workload.conversations:
        chat = processor.render_chat(conv.messages)
        prompt = processor.process(chat.prompt, images=chat.images, videos=chat.videos)
        out.append(FAMILIES[name].reference_kwargs(model_dir, conv.messages, prompt))
    return out


# ---- one model -----------------------------------------------------------------------------------
def _speedups(mm: SystemResult, others: list[SystemResult]) -> dict[str, float]:
    """mmserve tokens/s over each transformers mode (the one-at-a-time rate may come from a subset)."""
    out = {f"vs_{o.name}": round(mm.tokens_per_s / o.tokens_per_s, 3) for o in others if o.tokens_per_s}
    best = max((o.tokens_per_s for o in others), default=0.0)
    if best:
        out["vs_best_hf"] = round(mm.tokens_per_s / best, 3)
    return out


def _greedy_report(model: torch.nn.Module, inputs: list[dict[str, torch.Tensor]], mm: SystemResult,
                   single: SystemResult, batched: SystemResult) -> dict[str, Any]:
    compared = len(single.tokens)
    identical, mismatched = count_identical(mm.tokens[:compared], single.tokens)
    report: dict[str, Any] = {"mmserve_vs_hf_single": {"identical": identical, "compared": compared}}
    if mismatched:
        print(f"\n!!! GREEDY MISMATCH: mmserve differs from transformers one-at-a-time on {len(mismatched)}/"
              f"{compared} requests: {mismatched} !!!\n", file=sys.stderr)
        report["mmserve_vs_hf_single"]["mismatches"] = [
            {"request": i, **divergence_margin(model, inputs[i], single.tokens[i], mm.tokens[i])}
            for i in mismatched[:8]]
    same, _ = count_identical(batched.tokens, mm.tokens)
    report["hf_batched_vs_mmserve"] = {"identical": same, "compared": len(batched.tokens)}
    same, _ = count_identical(batched.tokens[:compared], single.tokens)
    report["hf_batched_vs_hf_single"] = {"identical": same, "compared": compared}
    distinct = [len(set(t)) for t in mm.tokens]
    report["distinct_tokens_per_output_mean"] = round(sum(distinct) / max(len(distinct), 1), 1)
    return report


def _best_of(rounds: list[SystemResult]) -> SystemResult:
    """The fastest round (the machine is shared and noisy); every round's wall and whether all rounds
    produced the same tokens go into its extras."""
    best = min(rounds, key=lambda r: r.wall_s)
    best.extra["rounds_wall_s"] = [round(r.wall_s, 3) for r in rounds]
    best.extra["rounds_identical_tokens"] = all(r.tokens == rounds[0].tokens for r in rounds)
    return best


def bench_model(name: str, model_dir: Path, workload: Workload, output_tokens: int,
                subset: int | None, repeats: int) -> dict[str, Any]:
    """`repeats` interleaved rounds of (mmserve, transformers 1-at-a-time, transformers batched); best kept."""
    from transformers import AutoTokenizer

    log = lambda msg: print(f"[{name}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    log("preparing transformers inputs ...")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    inputs = reference_inputs_of(name, model_dir, workload)
    hf_preprocess_s = time_hf_preprocessing(model_dir, workload) if name in QWEN2_VL_MODELS else None
    model = load_reference(name, model_dir)
    rounds: dict[str, list[SystemResult]] = {"mmserve": [], "hf_single": [], "hf_batched": []}
    for i in range(repeats):
        rounds["mmserve"].append(run_mmserve(model_dir, workload, output_tokens))
        rounds["hf_single"].append(run_hf_single(model, inputs, output_tokens, pad_id, subset))
        rounds["hf_batched"].append(run_hf_batched(model, inputs, output_tokens, pad_id))
        log(f"round {i + 1}/{repeats}: " + ", ".join(f"{k} {v[-1].wall_s:.1f}s" for k, v in rounds.items()))
    mm, single, batched = (_best_of(rounds[k]) for k in ("mmserve", "hf_single", "hf_batched"))
    attention_work = mm.extra.pop("attention_work")
    floor = None
    if name in QWEN2_VL_MODELS:  # the FLOP count knows Qwen2-VL's layout only
        floor = compute_floor(model_dir, mm.extra["stats"], attention_work, matmul_peak_gflops())
        best_hf_s_per_token = min(r.wall_s / r.output_tokens for r in (single, batched))
        floor.update(mmserve_wall_over_floor=round(mm.wall_s / floor["floor_s"], 2),
                     max_possible_speedup_vs_best_hf=round(best_hf_s_per_token * mm.output_tokens
                                                           / floor["floor_s"], 2))
    end_to_end = None
    if hf_preprocess_s is not None:
        end_to_end = _speedups(mm, [SystemResult(r.name, r.wall_s + hf_preprocess_s, r.output_tokens, r.tokens,
                                                 r.extra) for r in (single, batched)])
    return {
        "model_dir": str(model_dir.relative_to(ROOT)),
        "params": parameter_count(model_dir),
        "repeats": repeats,
        "systems": {r.name: r for r in (mm, single, batched)},
        "speedup": _speedups(mm, [single, batched]),
        # users pay for preprocessing too: transformers' image processor time added to its walls
        "hf_preprocess_s": None if hf_preprocess_s is None else round(hf_preprocess_s, 3),
        "speedup_end_to_end": end_to_end,
        "greedy": _greedy_report(model, inputs, mm, single, batched),
        "floor": floor,
    }


def time_hf_preprocessing(model_dir: Path, workload: Workload) -> float:
    """Seconds transformers' image processor takes for the workload's images (loaded once, median of 3)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    walls = []
    for _ in range(3):
        started = time.perf_counter()
        for conv in workload.conversations:
            if conv.images:
                processor(images=list(conv.images), return_tensors="pt")
        walls.append(time.perf_counter() - started)
    return sorted(walls)[1]


# ---- engine overhead -----------------------------------------------------------------------------
def measure_overhead(model_dir: Path, batch: int = OVERHEAD_BATCH, steps: int = OVERHEAD_STEPS) -> dict[str, Any]:
    """Batch-`batch` decode steps of short text requests: `engine.step()` wall vs the model forward."""
    from benchmarks.workload import QUESTIONS
    from mmserve import LLM

    engine = LLM(str(model_dir), max_num_seqs=batch, max_num_batched_tokens=2048, dtype=DTYPE, **EAGER).engine
    ids = [f"overhead-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        text = QUESTIONS[i % len(QUESTIONS)] + f" Request {i}."
        engine.add_request(rid, engine.process_chat([{"role": "user", "content": text}]), greedy(steps + 16))
    decoding: set[str] = set()
    while len(decoding) < batch:  # prefill until every request has its first token
        decoding.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(2):  # warm the decode path
        engine.step()
    walls, forwards, runner_totals = [], [], []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - started)
        last = engine.inspect().last_step
        assert last.num_tokens == batch, f"expected a pure decode step of {batch} tokens, got {last.num_tokens}"
        forwards.append(last.forward_s)
        runner_totals.append(last.total_s)
    engine.abort_request(ids)
    outside = 1 - sum(forwards) / sum(walls)
    median = lambda xs: sorted(xs)[len(xs) // 2] * 1000  # noqa: E731
    return {
        "model": "100m", "batch": batch, "steps": steps,
        "step_ms_median": round(median(walls), 2), "forward_ms_median": round(median(forwards), 2),
        "runner_outside_forward_ms_median": round(median([t - f for t, f in zip(runner_totals, forwards)]), 2),
        "engine_outside_runner_ms_median": round(median([w - t for w, t in zip(walls, runner_totals)]), 2),
        "outside_forward_share": round(outside, 4), "target_share": 0.15, "meets_target": outside <= 0.15,
    }


# ---- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "100m", "both", *(n for n in MODEL_DIRS if n not in
                                                                      QWEN2_VL_MODELS)], default="both",
                        help="tiny / 100m: Qwen2-VL; a family name: that family's tiny test model")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-subset", type=int, default=None,
                        help="run transformers one-at-a-time on the first K requests only, extrapolate tokens/s")
    parser.add_argument("--quick", action="store_true",
                        help=f"transformers one-at-a-time on the first {QUICK_SUBSET} requests only")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved rounds per system, fastest kept (default: 3 for tiny, 1 for 100m)")
    parser.add_argument("--no-overhead", action="store_true", help="skip the engine-overhead measurement")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every system (default: the usable CPUs); 1 on a busy machine")
    parser.add_argument("--encoder", action="store_true",
                        help="also run benchmarks/engine/encoder_cache.py (on 100m unless --model tiny); its results go "
                             "under \"encoder_cache\" in the JSON line")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_started = time.perf_counter()
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    subset = args.hf_subset or (QUICK_SUBSET if args.quick else None)
    if subset is not None and subset >= args.num_requests:
        subset = None
    names = ["tiny", "100m"] if args.model == "both" else [args.model]
    system_with_images = all(FAMILIES[n].system_with_images for n in names if n in FAMILIES)
    workload = build_workload(args.num_requests, seed=args.seed, system_with_images=system_with_images)
    summary = workload.summary()
    models = {name: bench_model(name, ensure_checkpoint(name), workload, args.output_tokens, subset,
                                args.repeats or DEFAULT_REPEATS.get(name, 3)) for name in names}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIRS[names[0]])
    summary["shared_system_prompt_tokens"] = len(tok(LONG_SYSTEM_PROMPT, add_special_tokens=False)["input_ids"])
    overhead = None
    if not args.no_overhead:
        print("[overhead] batch-32 decode steps ...", file=sys.stderr, flush=True)
        overhead = measure_overhead(ensure_checkpoint("100m"))
    encoder = None
    if args.encoder:
        from benchmarks.engine import encoder_cache

        print("[encoder] encoder-cache measurements ...", file=sys.stderr, flush=True)
        encoder = encoder_cache.run("tiny" if args.model == "tiny" else "100m", args.quick, args.seed)
    machine = machine_info(threads)
    print_card(machine, summary, models, args.output_tokens, subset)
    print_table(models)
    if overhead:
        print_overhead(overhead)
    if encoder:
        print()
        encoder_cache.print_card(machine, encoder)
        encoder_cache.print_table(encoder)
    line = json_line(machine, summary, models, overhead, args.output_tokens, subset, time.perf_counter() - run_started)
    if encoder:
        line = json.dumps(dict(json.loads(line), encoder_cache=encoder), separators=(",", ":"))
    print(line)


if __name__ == "__main__":
    main()

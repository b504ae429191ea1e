"""KV-cache dtype benchmark: what int8 / fp8_e4m3 KV storage buys (capacity) and costs (accuracy, speed).

Run: python -m benchmarks.engine.kv_cache_dtype [--quick] [--kv-cache-mib 256] [--rounds 5]

Role: one run over kv_cache_dtype auto (the model dtype), int8 and fp8_e4m3, torch threads = the
machine's usable cores, five measurements:
1. capacity: KV bytes per token (`get_stats()`) and how many 1-image requests fit in a fixed
   `kv_cache_bytes`, for the ~100M Qwen2-VL bench checkpoint (built under `.bench/` by
   `benchmarks/engine/offline.py`) loaded in float32 and in bfloat16. A 1-image request = the median prompt
   (measured with the engine's processor) of the standard 64-request workload's 1-image
   conversations + its output tokens, rounded up to whole KV blocks.
2. demo accuracy: `mmserve.demo.eval.evaluate` per question type on the bundled demo model.
3. greedy agreement with auto on the 100m model (float32) over the bench workload
   (`benchmarks/workload.py`): identical outputs, first divergence, and KL(auto || quantized) of the
   next-token distribution wherever both runs had the same context (up to and including the first
   divergence). The logits come from wrapping this run's runner (`model.compute_logits` paired
   with the `_sampling_metadata` call that follows it); float32 log-softmax on the CPU.
4. speed: output tokens/s of `LLM.chat` on that workload, a fresh LLM per dtype per round (load off
   the clock), the dtype order rotated each round, medians. The untimed runs of 3. warm every
   dtype's kernels first.
5. scaling study (no target): real K/V of the 100m model on a few workload prompts, and of the
   trained demo model on a few of its conversations (captured at `PagedKVStorage.write`), quantized
   with one scale per token per KV head (the engine's format) vs one scale per tensor (per layer);
   relative and max reconstruction error.

Prints a card (machine, models, settings), a table per section, and one JSON line last.

What it does not know: mmserve internals beyond the offline API, `Engine.process_chat` /
`add_request` / `step`, `runner/kv_quant.py`'s quantize/dequantize, and the three hooks above
(wrapped on one instance for one run; the code is untouched).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.card import ROOT, json_line, machine_info
from benchmarks.checkpoints import ensure_checkpoint, greedy, kv_cache_bytes, parameter_count
from benchmarks.engine.kv_scaling import (
    AGREEMENT_DTYPE,
    KV_DTYPES,
    MIB,
    MODEL_DTYPES,
    STANDARD_WORKLOAD_REQUESTS,
    _fresh_llm,
    _log,
    _sig,
    measure_scaling,
)
from benchmarks.reports.kv_cache import print_card, print_tables
from benchmarks.workload import Workload, build_workload

TARGETS = {"capacity_int8_over_auto_float32": 3.5, "capacity_int8_over_auto_bfloat16": 1.8,
           "demo_accuracy_max_abs_delta": 0.01, "tokens_per_s_int8_over_auto": 0.9}
QUICK = {"demo_n": 100, "num_requests": 8, "rounds": 1}


# ---- 1. capacity ---------------------------------------------------------------------------------
def typical_one_image_prompt_tokens(llm: Any, seed: int) -> dict[str, int]:
    """Prompt tokens of the standard workload's 1-image conversations, through the engine's processor."""
    workload = build_workload(STANDARD_WORKLOAD_REQUESTS, seed=seed)
    lens = sorted(llm.engine.process_chat(c.messages).num_tokens for c in workload.conversations
                  if len(c.images) == 1)
    return {"median": lens[len(lens) // 2], "min": lens[0], "max": lens[-1], "num_prompts": len(lens)}


def measure_capacity(model_dir: Path, kv_cache_bytes: int, output_tokens: int, seed: int) -> dict[str, Any]:
    """Per model dtype and KV dtype: bytes per token, blocks, and whole 1-image requests that fit."""
    prompt, per_model = None, {}
    for model_dtype in MODEL_DTYPES:
        rows = {}
        for kv_dtype in KV_DTYPES:
            llm = _fresh_llm(model_dir, dtype=model_dtype, kv_cache_dtype=kv_dtype, kv_cache_bytes=kv_cache_bytes)
            prompt = prompt or typical_one_image_prompt_tokens(llm, seed)
            stats = llm.get_stats()
            block_tokens = stats["kv_capacity_tokens"] // stats["kv_blocks_total"]
            blocks_per_request = math.ceil((prompt["median"] + output_tokens) / block_tokens)
            rows[kv_dtype] = {"kv_bytes_per_token": stats["kv_bytes_per_token"],
                              "kv_blocks_total": stats["kv_blocks_total"], "block_tokens": block_tokens,
                              "kv_capacity_tokens": stats["kv_capacity_tokens"],
                              "blocks_per_request": blocks_per_request,
                              "requests_fit": stats["kv_blocks_total"] // blocks_per_request}
            del llm
        for row in rows.values():
            row["requests_ratio_vs_auto"] = round(row["requests_fit"] / rows["auto"]["requests_fit"], 3)
            row["bytes_ratio_vs_auto"] = round(rows["auto"]["kv_bytes_per_token"] / row["kv_bytes_per_token"], 3)
        per_model[model_dtype] = rows
    return {"kv_cache_bytes": kv_cache_bytes, "prompt_tokens": prompt, "output_tokens": output_tokens,
            "per_model_dtype": per_model}


# ---- 2. demo accuracy ----------------------------------------------------------------------------
def measure_demo_accuracy(n: int, seed: int) -> dict[str, Any]:
    """The bundled demo model's exact-match accuracy per question type, per KV dtype, vs auto."""
    from mmserve.demo.eval import evaluate

    results = {}
    for kv_dtype in KV_DTYPES:
        gc.collect()
        results[kv_dtype] = evaluate(None, n=n, seed=seed, kv_cache_dtype=kv_dtype)
    auto = results["auto"]
    per_dtype = {}
    for kv_dtype, res in results.items():
        delta = {t: res.accuracy[t] - auto.accuracy[t] for t in auto.accuracy}
        per_dtype[kv_dtype] = {
            "accuracy": {t: round(a, 4) for t, a in res.accuracy.items()},
            "delta_vs_auto": {t: round(d, 4) for t, d in delta.items()},
            "max_abs_delta": round(max(abs(d) for d in delta.values()), 4),
            "answers_changed_vs_auto": sum(a != b for a, b in zip(res.answers, auto.answers)),
            "wall_s": round(res.wall_s, 2)}
    # one flipped answer moves a type's accuracy by 1/count: coarser than the 1-point target when count < 100
    return {"model": auto.model, "n": n, "seed": seed, "counts": auto.counts,
            "one_answer_points": {t: round(1 / c, 4) for t, c in auto.counts.items() if c}, "per_dtype": per_dtype}


# ---- 3. greedy agreement and KL ------------------------------------------------------------------
def tap_logits(llm: Any, on_rows: Callable[[list[Any], torch.Tensor], None]) -> None:
    """Call on_rows(runner requests, float32 log-softmax rows (n, vocab)) at every sampling step of this
    LLM: compute_logits' output is paired with the `_sampling_metadata(rows)` call that follows it."""
    runner = llm.engine.runner
    inner_logits, inner_metadata, pending = runner.model.compute_logits, runner._sampling_metadata, []

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = inner_logits(hidden)
        pending.append(logits)
        return logits

    def sampling_metadata(rows: list[Any]) -> Any:
        logits = pending.pop()
        assert not pending and logits.shape[0] == len(rows), "compute_logits and sampling calls do not pair"
        on_rows(rows, torch.log_softmax(logits.detach().float().cpu(), dim=-1))
        return inner_metadata(rows)

    runner.model.compute_logits = compute_logits  # instance attributes: this LLM only
    runner._sampling_metadata = sampling_metadata


def run_engine(llm: Any, workload: Workload, output_tokens: int) -> list[list[int]]:
    """Every conversation submitted at once under our own ids (`conv-<index>`); greedy tokens in order."""
    engine = llm.engine
    ids = [f"conv-{i}" for i in range(len(workload.conversations))]
    for rid, conv in zip(ids, workload.conversations):
        engine.add_request(rid, engine.process_chat(conv.messages), greedy(output_tokens))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        tokens.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
    return [tokens[rid] for rid in ids]


def _index(rid: str) -> int:
    return int(rid.removeprefix("conv-"))


def _agreement_engine_args(workload: Workload, model_dir: Path, output_tokens: int) -> dict[str, Any]:
    """offline.py's mmserve config: room for every request at once (in auto's bytes), nothing preempted."""
    num = len(workload.conversations)
    return dict(dtype=AGREEMENT_DTYPE, max_num_seqs=num, max_num_batched_tokens=2048, enable_prefix_caching=True,
                kv_cache_bytes=kv_cache_bytes(model_dir, num, output_tokens))


def run_reference(model_dir: Path, workload: Workload, output_tokens: int) -> tuple[list[list[int]], dict]:
    """auto: greedy tokens and the log-softmax row of every (request index, output index)."""
    llm = _fresh_llm(model_dir, kv_cache_dtype="auto", **_agreement_engine_args(workload, model_dir, output_tokens))
    logprobs: dict[tuple[int, int], torch.Tensor] = {}

    def keep(rows: list[Any], lp: torch.Tensor) -> None:
        for row, lp_row in zip(rows, lp):
            logprobs[(_index(row.request_id), row.num_output_tokens)] = lp_row.clone()

    tap_logits(llm, keep)
    return run_engine(llm, workload, output_tokens), logprobs


def run_quantized(model_dir: Path, workload: Workload, output_tokens: int, kv_dtype: str,
                  ref_tokens: list[list[int]], ref_logprobs: dict) -> tuple[list[list[int]], list[tuple[int, float]]]:
    """Greedy tokens, and (output index, KL(auto || this)) wherever the outputs so far equal auto's."""
    llm = _fresh_llm(model_dir, kv_cache_dtype=kv_dtype, **_agreement_engine_args(workload, model_dir, output_tokens))
    kls: list[tuple[int, float]] = []

    def compare(rows: list[Any], lp: torch.Tensor) -> None:
        for row, lp_row in zip(rows, lp):
            i, pos = _index(row.request_id), row.num_output_tokens
            if row.token_ids[row.num_prompt_tokens:] == ref_tokens[i][:pos]:
                ref = ref_logprobs[(i, pos)]
                kls.append((pos, float((ref.exp() * (ref - lp_row)).sum())))

    tap_logits(llm, compare)
    tokens = run_engine(llm, workload, output_tokens)
    stats = llm.get_stats()
    assert stats["num_preemptions"] == 0, "a preemption would recompute under a different batch"
    return tokens, kls


def _divergence(ref: list[int], out: list[int]) -> int | None:
    return next((p for p, (a, b) in enumerate(zip(ref, out)) if a != b), None if len(ref) == len(out) else
                min(len(ref), len(out)))


def agreement_summary(ref_tokens: list[list[int]], ref_logprobs: dict, tokens: list[list[int]],
                      kls: list[tuple[int, float]]) -> dict[str, Any]:
    firsts = {i: _divergence(r, t) for i, (r, t) in enumerate(zip(ref_tokens, tokens))}
    diverged = {i: p for i, p in firsts.items() if p is not None}
    # how close auto itself was, at the divergence, between its token and the quantized run's token
    gaps = [float(ref_logprobs[(i, p)][ref_tokens[i][p]] - ref_logprobs[(i, p)][tokens[i][p]])
            for i, p in diverged.items() if p < min(len(ref_tokens[i]), len(tokens[i]))]
    values = [kl for _, kl in kls]
    first = [kl for pos, kl in kls if pos == 0]
    later = [kl for pos, kl in kls if pos > 0]
    return {"requests": len(tokens), "identical": len(tokens) - len(diverged),
            "identical_share": round(1 - len(diverged) / len(tokens), 4),
            "first_divergence": {"mean": round(statistics.mean(diverged.values()), 2) if diverged else None,
                                 "min": min(diverged.values()) if diverged else None,
                                 "positions": sorted(diverged.values())},
            "auto_logprob_gap_at_divergence_mean": round(statistics.mean(gaps), 4) if gaps else None,
            "kl": {"positions": len(values), "mean": _sig(statistics.mean(values)),
                   "median": _sig(statistics.median(values)), "max": _sig(max(values)),
                   "first_token_mean": _sig(statistics.mean(first)) if first else None,
                   "later_tokens_mean": _sig(statistics.mean(later)) if later else None}}


def measure_agreement(model_dir: Path, workload: Workload, output_tokens: int) -> tuple[dict, dict]:
    """Per quantized dtype, agreement with auto; and every dtype's tokens (to check the timed runs)."""
    _log(f"(3) agreement: auto reference run, {len(workload.conversations)} requests ...")
    ref_tokens, ref_logprobs = run_reference(model_dir, workload, output_tokens)
    out, all_tokens = {}, {"auto": ref_tokens}
    for kv_dtype in KV_DTYPES[1:]:
        _log(f"(3) agreement: {kv_dtype} ...")
        tokens, kls = run_quantized(model_dir, workload, output_tokens, kv_dtype, ref_tokens, ref_logprobs)
        out[kv_dtype] = agreement_summary(ref_tokens, ref_logprobs, tokens, kls)
        all_tokens[kv_dtype] = tokens
    return out, all_tokens


# ---- 4. speed ------------------------------------------------------------------------------------
def time_kv_storage(llm: Any) -> dict[str, float]:
    """Seconds this LLM spends in its KV storage's write (quantize) and gather (dequantize): where a
    quantized format's extra cost would show. Two clock reads per layer call."""
    storage, spent = llm.engine.inspect().kv_storage, {"write": 0.0, "gather": 0.0}

    def timed(name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args)
            finally:
                spent[name] += time.perf_counter() - started
        return call

    storage.write, storage.gather = timed("write", storage.write), timed("gather", storage.gather)
    return spent


def timed_chat(model_dir: Path, workload: Workload, output_tokens: int, kv_dtype: str) -> dict[str, Any]:
    """Fresh LLM (load off the clock); the clock covers `LLM.chat`, input processing included."""
    llm = _fresh_llm(model_dir, kv_cache_dtype=kv_dtype, **_agreement_engine_args(workload, model_dir, output_tokens))
    kv_s = time_kv_storage(llm)
    cpu_started, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    outputs = llm.chat([c.messages for c in workload.conversations], greedy(output_tokens), use_tqdm=False)
    wall_s = time.perf_counter() - started
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    num_tokens = sum(len(t) for t in tokens)
    return {"wall_s": wall_s, "cpu_s": cpu.ru_utime + cpu.ru_stime - cpu_started.ru_utime - cpu_started.ru_stime,
            "output_tokens": num_tokens, "tokens_per_s": num_tokens / wall_s, "tokens": tokens,
            "kv_write_s": kv_s["write"], "kv_gather_s": kv_s["gather"]}


def measure_speed(model_dir: Path, workload: Workload, output_tokens: int, rounds: int,
                  expected_tokens: dict[str, list[list[int]]]) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {d: [] for d in KV_DTYPES}
    for r in range(rounds):
        order = KV_DTYPES[r % len(KV_DTYPES):] + KV_DTYPES[:r % len(KV_DTYPES)]
        for kv_dtype in order:
            runs[kv_dtype].append(timed_chat(model_dir, workload, output_tokens, kv_dtype))
        _log(f"(4) speed round {r + 1}/{rounds}: " + ", ".join(f"{d} {runs[d][-1]['wall_s']:.1f}s" for d in order))
    out: dict[str, Any] = {"rounds": rounds, "order": "rotated each round", "llm": "fresh per dtype per round"}
    for kv_dtype, rows in runs.items():
        out[kv_dtype] = {"tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in rows), 2),
                         "wall_s_rounds": [round(x["wall_s"], 2) for x in rows],
                         "cpu_s_rounds": [round(x["cpu_s"], 1) for x in rows],
                         "kv_write_s": round(statistics.median(x["kv_write_s"] for x in rows), 3),
                         "kv_gather_s": round(statistics.median(x["kv_gather_s"] for x in rows), 3),
                         "wall_s": round(statistics.median(x["wall_s"] for x in rows), 3),
                         "cpu_s": round(statistics.median(x["cpu_s"] for x in rows), 2),
                         "output_tokens": rows[0]["output_tokens"],
                         "tokens_match_agreement_run": all(x["tokens"] == expected_tokens[kv_dtype] for x in rows)}
    auto_kv_s = out["auto"]["kv_write_s"] + out["auto"]["kv_gather_s"]
    for kv_dtype in KV_DTYPES:
        # what the quantized storage path (quantize on write, dequantize on gather) adds, as a share of auto's wall
        extra_s = out[kv_dtype]["kv_write_s"] + out[kv_dtype]["kv_gather_s"] - auto_kv_s
        out[kv_dtype]["kv_storage_extra_share_of_auto_wall"] = round(extra_s / out["auto"]["wall_s"], 4)
        pairs = [q["tokens_per_s"] / a["tokens_per_s"] for q, a in zip(runs[kv_dtype], runs["auto"])]
        out[kv_dtype]["ratio_vs_auto"] = round(out[kv_dtype]["tokens_per_s"] / out["auto"]["tokens_per_s"], 3)
        out[kv_dtype]["ratio_per_round"] = [round(p, 3) for p in pairs]
    return out


# ---- targets, report -----------------------------------------------------------------------------
def evaluate_targets(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cap = res["capacity"]["per_model_dtype"]
    measured = {f"capacity_int8_over_auto_{m}": cap[m]["int8"]["requests_ratio_vs_auto"] for m in MODEL_DTYPES}
    measured["demo_accuracy_max_abs_delta"] = max(res["demo_accuracy"]["per_dtype"][d]["max_abs_delta"]
                                                  for d in KV_DTYPES[1:])
    measured["tokens_per_s_int8_over_auto"] = res["speed"]["int8"]["ratio_vs_auto"]
    out = {}
    for name, target in TARGETS.items():
        at_most = name == "demo_accuracy_max_abs_delta"
        met = measured[name] <= target + 1e-9 if at_most else measured[name] >= target
        out[name] = {"target": f"{'<=' if at_most else '>='}{target}", "measured": measured[name], "met": met}
    # the paired view: each round's int8 run over the auto run next to it (less exposed to slow drifts)
    out["tokens_per_s_int8_over_auto"]["per_round_median"] = statistics.median(res["speed"]["int8"]["ratio_per_round"])
    if res["speed"]["rounds"] < 3:
        out["tokens_per_s_int8_over_auto"]["note"] = "fewer than 3 rounds: a smoke test, not a verdict"
    return out


# ---- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: demo-n {QUICK['demo_n']}, {QUICK['num_requests']} requests, 1 round")
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="the KV pool for the capacity section")
    parser.add_argument("--num-requests", type=int, default=32, help="agreement/speed workload size")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7, help="speed rounds per dtype (at least 3 for a verdict)")
    parser.add_argument("--demo-n", type=int, default=500)
    parser.add_argument("--demo-seed", type=int, default=0)
    parser.add_argument("--scaling-prompts", type=int, default=4, help="workload prompts whose K/V the study uses")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable CPUs)")
    args = parser.parse_args(argv)
    if args.quick:
        args.demo_n, args.num_requests, args.rounds = QUICK["demo_n"], QUICK["num_requests"], QUICK["rounds"]
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = ensure_checkpoint("100m")
    workload = build_workload(args.num_requests, seed=args.seed)
    _log(f"(1) capacity at {args.kv_cache_mib} MiB ...")
    capacity = measure_capacity(model_dir, args.kv_cache_mib * MIB, args.output_tokens, args.seed)
    _log(f"(2) demo accuracy, n={args.demo_n} ...")
    demo = measure_demo_accuracy(args.demo_n, args.demo_seed)
    agreement, tokens = measure_agreement(model_dir, workload, args.output_tokens)
    speed = measure_speed(model_dir, workload, args.output_tokens, args.rounds, tokens)
    _log("(5) scaling study ...")
    scaling = measure_scaling(model_dir, args.scaling_prompts, args.seed)
    spec = json.loads((model_dir / "config.json").read_text())["text_config"]
    head_dim = spec.get("head_dim") or spec["hidden_size"] // spec["num_attention_heads"]
    return {"model_dir": str(model_dir.relative_to(ROOT)), "params": parameter_count(model_dir),
            "kv_layout": f"{spec['num_hidden_layers']} layers x {spec['num_key_value_heads']} heads x {head_dim}",
            "settings": {"quick": args.quick, "kv_cache_mib": args.kv_cache_mib, "output_tokens": args.output_tokens,
                         "rounds": args.rounds, "demo_n": args.demo_n, "scaling_prompts": args.scaling_prompts},
            "workload": workload.summary(), "capacity": capacity, "demo_accuracy": demo, "agreement": agreement,
            "speed": speed, "scaling_study": scaling}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    res = run(args)
    res["targets"] = evaluate_targets(res)
    res["run_s"] = round(time.perf_counter() - started, 1)
    machine = machine_info(threads)
    print_card(machine, res)
    print_tables(res)
    json_line({"bench": "kv_cache_dtype", "machine": machine, **res}, compact=True)


if __name__ == "__main__":
    main()

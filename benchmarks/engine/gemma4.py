"""Gemma 4 (tiny, E2B-shaped): throughput against transformers; the encoder cache on a repeated audio clip.

Run: python -m benchmarks.engine.gemma4 [--part throughput|audio|all] [--rounds 3] [--quick]

Role: Gemma 4's two serving targets, measured on `testkit/tiny_gemma4.py`'s checkpoint (built under
`.bench/tiny-gemma4`). Each measurement is a fresh subprocess of this module (`--worker NAME --round R`),
sides alternating order by round, medians reported; float32, torch threads = the usable cores (`--threads`),
mmserve at its defaults (`LLM(dir)`).
- throughput: N conversations cycling text, an image, an audio clip (1-4 s, a seeded wavering tone in
  noise, 16-bit WAV in an `input_audio` part) and both; exactly `--output-tokens` greedy tokens each.
  mmserve: one `LLM.chat` call, its input processing on its clock. transformers: `generate` in
  left-padded batches of 8, and one at a time on the first K, its processor's inputs (of the samples
  mmserve decodes) made off the clock, their time also reported added to its batched wall. Both first
  run the workload for 2 tokens. Target: mmserve >= 3x batched transformers' tokens/s (off its clock);
  checked: prompt ids and greedy tokens equal per conversation.
- audio: one engine; a warm-up pair, then A (a new 30 s, 16 kHz clip and a question) and B (the same clip,
  another question), 1 token each. Question before the clip (headline: no KV prefix past the turn header
  is shared, only the encoder cache helps), and after it (the prefix cache covers the clip too). Per
  request: TTFT from before `process_chat` (and the metrics' arrival to first token), the encoder's
  wall, the prefill forward, encoder-cache hits and misses. Targets: B's hit rate 100%, TTFT <= 0.5x A's.
Prints a card, a table and one JSON line last. What it does not know: mmserve internals beyond `LLM.chat`, `LLM.get_stats`, `Engine.process_chat` /
`add_request` / `step` / `inspect().last_step` and the runner's encoder (wrapped only to time it).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.card import BENCH_DIR, json_line, machine_info, machine_line, print_card
from benchmarks.checkpoints import greedy
from benchmarks.procs import machine_busy_s
from benchmarks.workload import synthetic_image

MODEL_DIR = BENCH_DIR / "tiny-gemma4"
RATE_HZ = 16_000
LONG_CLIP_S = 30.0
KINDS = ("text", "image", "audio", "image+audio")
PROMPTS = ("Tell me a short story about {}.", "Describe this picture; does it remind you of {}?",
           "What do you hear in this clip? Could it be {}?", "Does the sound fit the picture? Think of {}.")
TOPICS = ("the sea", "a city at night", "bread", "the moon", "trains", "winter", "music", "a garden")
QUESTION_A, QUESTION_B = "What do you hear in this recording?", "Is there speech or music in it? Answer briefly."
LAYOUTS = ("question_first", "clip_first")
COUNTS = ("encoder_cache_hits", "encoder_cache_misses", "encoder_items_encoded")  # get_stats() deltas
CONTENDED_CORES = 0.25  # a round in which other work used more CPU s per wall s is left out of the medians
TARGETS = {"throughput_over_hf_batched": 3.0, "audio_hit_rate": 1.0, "audio_ttft_b_over_a": 0.5}
# (default, --quick): rounds, conversations, tokens each, transformers one at a time on the first K, threads
DEFAULTS = {"rounds": (3, 1), "num_requests": (32, 16), "output_tokens": (64, 32), "single_subset": (8, 4),
            "threads": (len(os.sched_getaffinity(0)),) * 2}


def _log(msg: str) -> None:
    print(f"[gemma4] {msg}", file=sys.stderr, flush=True)


def checkpoint() -> Path:
    if not (MODEL_DIR / "model.safetensors").is_file():
        from testkit.tiny_gemma4 import build_gemma4_checkpoint
        _log(f"building the tiny Gemma 4 checkpoint in {MODEL_DIR} ...")
        build_gemma4_checkpoint(MODEL_DIR, seed=0, audio=True)
    return MODEL_DIR


def wav_clip(rng: np.random.Generator, seconds: float) -> tuple[bytes, np.ndarray]:
    """A wavering tone in noise as 16-bit mono WAV bytes, and the float32 samples a decoder reads back."""
    t = np.arange(int(RATE_HZ * seconds)) / RATE_HZ
    wobble = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(0.5, 3.0) * t)
    tone = 0.3 * wobble * np.sin(2 * np.pi * rng.uniform(100, 1000) * t)
    pcm = (np.clip(tone + 0.05 * rng.standard_normal(t.size), -1.0, 1.0) * 32767).astype(np.int16)
    with wave.open(buffer := io.BytesIO(), "wb") as out:  # mono, 16-bit
        out.setparams((1, 2, RATE_HZ, pcm.size, "NONE", "not compressed"))
        out.writeframes(pcm.tobytes())
    return buffer.getvalue(), pcm.astype(np.float32) / 32768


def audio_part(wav: bytes) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, Any]]  # mmserve's (image_pil and input_audio parts)
    reference_messages: list[dict[str, Any]]  # transformers' chat template's ({"type": "image"|"audio"})
    images: list[Any]
    audios: list[np.ndarray]  # the samples mmserve decodes from the WAV bytes


def build_workload(num_requests: int, seed: int) -> list[Conversation]:
    rng, out = np.random.default_rng(seed), []
    for i in range(num_requests):
        kind = KINDS[i % len(KINDS)]
        size = (int(x) for x in rng.integers(64, 257, 2))
        images = [synthetic_image(rng, *size)] if "image" in kind else []
        clips = [wav_clip(rng, float(rng.uniform(1.0, 4.0)))] if "audio" in kind else []
        text = {"type": "text", "text": PROMPTS[i % len(KINDS)].format(TOPICS[i % len(TOPICS)])}
        parts = [{"type": "image_pil", "image_pil": im} for im in images] + [audio_part(d) for d, _ in clips]
        reference = [{"type": "image"}] * len(images) + [{"type": "audio"}] * len(clips)
        out.append(Conversation([{"role": "user", "content": [*parts, text]}],
                                [{"role": "user", "content": [*reference, text]}], images,
                                [samples for _, samples in clips]))
    return out


def _timed_encoder(engine: Any) -> list[float]:
    """Wrap this engine's encoder so each call's wall is recorded (an instance attribute; code untouched)."""
    encoder, walls, inner = engine.runner.encoder, [], engine.runner.encoder.forward_items

    def forward_items(jobs: list[Any]) -> Any:
        started = time.perf_counter()
        out = inner(jobs)
        walls.append(time.perf_counter() - started)
        return out

    encoder.forward_items = forward_items
    return walls


def worker_mmserve(args: argparse.Namespace) -> dict[str, Any]:
    """A throwaway LLM runs the workload for 2 tokens; a fresh one is timed on it."""
    from mmserve import LLM

    messages = [c.messages for c in build_workload(args.num_requests, args.seed)]
    LLM(str(MODEL_DIR)).chat(messages, greedy(2), use_tqdm=False)
    llm = LLM(str(MODEL_DIR))
    walls = _timed_encoder(llm.engine)
    started = time.perf_counter()
    outputs = llm.chat(messages, greedy(args.output_tokens), use_tqdm=False)
    wall_s = time.perf_counter() - started
    stats = llm.get_stats()
    keep = ("prompt_tokens", "prompt_tokens_computed", "encoder_items_encoded", "num_preemptions")
    return {"wall_s": wall_s, "encode_s": sum(walls),
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "prompt_ids": [list(o.prompt_token_ids) for o in outputs], "stats": {k: stats[k] for k in keep}}


def worker_transformers(args: argparse.Namespace) -> dict[str, Any]:
    """generate in left-padded batches of 8 (the whole workload), then one at a time (the first K)."""
    import torch
    from transformers import Gemma4ForConditionalGeneration

    from benchmarks.engine.hf_systems import run_hf_batched, run_hf_single
    from testkit.tiny_gemma4 import gemma4_processor, gemma4_reference_inputs

    processor = gemma4_processor(MODEL_DIR)
    started = time.perf_counter()  # users pay for preprocessing too: reported beside its walls
    inputs = [gemma4_reference_inputs(MODEL_DIR, processor.apply_chat_template(
        c.reference_messages, tokenize=False, add_generation_prompt=True), images=c.images or None,
        audios=c.audios or None) for c in build_workload(args.num_requests, args.seed)]
    preprocess_s, pad_id = time.perf_counter() - started, processor.tokenizer.pad_token_id
    model = Gemma4ForConditionalGeneration.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    run_hf_batched(model, inputs, 2, pad_id)  # the whole workload for 2 tokens, as mmserve's warm-up
    batched = run_hf_batched(model, inputs, args.output_tokens, pad_id)
    single = run_hf_single(model, inputs, args.output_tokens, pad_id, args.single_subset)
    return {"batched_wall_s": batched.wall_s, "batched_tokens": batched.tokens, "preprocess_s": preprocess_s,
            "single_wall_s": single.wall_s, "single_tokens": single.tokens,
            "prompt_ids": [x["input_ids"][0].tolist() for x in inputs]}


def one_ttft(engine: Any, walls: list[float], rid: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Submit one request for 1 token, step until it comes; where its time went, the cache's counts."""
    before, walls_before = engine.get_stats(), len(walls)
    started = time.perf_counter()
    engine.add_request(rid, engine.process_chat(messages), greedy(1))
    process_s = time.perf_counter() - started  # process_chat (decoding, features) and add_request
    forward_s, first = 0.0, None
    while first is None:
        first = next((o for o in engine.step() if o.request_id == rid and o.outputs[0].token_ids), None)
        forward_s += engine.inspect().last_step.forward_s
    ttft_s = time.perf_counter() - started
    while engine.has_unfinished_requests():
        engine.step()
    after, metrics = engine.get_stats(), first.metrics
    delta = {k: after[k] - before[k] for k in COUNTS}
    looked_up = delta["encoder_cache_hits"] + delta["encoder_cache_misses"]
    return {"ttft_s": ttft_s, "metrics_ttft_s": metrics.first_token_time - metrics.arrival_time,
            "process_s": process_s, "encode_s": sum(walls[walls_before:]), "forward_s": forward_s, **delta,
            "hit_rate": delta["encoder_cache_hits"] / looked_up if looked_up else None,
            "prompt_tokens": len(first.prompt_token_ids), "cached_tokens": first.num_cached_tokens,
            "encoder_cached_items": first.num_encoder_cached_mm_items}


def _audio_messages(wav_bytes: bytes, question: str, question_first: bool) -> list[dict[str, Any]]:
    parts = [{"type": "text", "text": question}, audio_part(wav_bytes)]
    return [{"role": "user", "content": parts if question_first else parts[::-1]}]


def worker_audio(args: argparse.Namespace) -> dict[str, Any]:
    """One engine at defaults: a warm-up pair, then (A, B) per layout, each on a new 30 s clip."""
    from mmserve import LLM

    engine = LLM(str(MODEL_DIR)).engine
    walls = _timed_encoder(engine)  # the encoder's wall per call, to split A's TTFT
    rng = np.random.default_rng(1000 + args.round)
    warm_clip = wav_clip(rng, LONG_CLIP_S)[0]
    for i, question in enumerate((QUESTION_A, QUESTION_B, QUESTION_A)):  # miss and hit paths, off the clock
        one_ttft(engine, walls, f"warm-{i}", _audio_messages(warm_clip, question, i < 2))
    out: dict[str, Any] = {}
    for layout in LAYOUTS if args.round % 2 == 0 else LAYOUTS[::-1]:
        clip, first = wav_clip(rng, LONG_CLIP_S)[0], layout == "question_first"
        out[layout] = {x: one_ttft(engine, walls, f"{layout}-{x}", _audio_messages(clip, question, first))
                       for x, question in (("a", QUESTION_A), ("b", QUESTION_B))}
    return out


WORKERS = {"mmserve": worker_mmserve, "transformers": worker_transformers, "audio": worker_audio}


def _run_worker(name: str, args: argparse.Namespace, round_index: int) -> dict[str, Any]:
    sizes = (x for k in DEFAULTS for x in (f"--{k.replace('_', '-')}", str(getattr(args, k))))
    command = [sys.executable, "-m", "benchmarks.engine.gemma4", "--worker", name,
               "--round", str(round_index), "--seed", str(args.seed), *sizes]
    before, started = (machine_busy_s(), resource.getrusage(resource.RUSAGE_CHILDREN)), time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    wall_s, usage = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    own_s = usage.ru_utime + usage.ru_stime - before[1].ru_utime - before[1].ru_stime
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {name} failed: {proc.stderr[-3000:]}")
    # other work's CPU seconds per wall second while the worker lived: above CONTENDED_CORES, times are noise
    return json.loads(lines[-1]) | {"others_cores": max(machine_busy_s() - before[0] - own_s, 0.0) / wall_s}


def _equal(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    differ, compared = [i for i, (x, y) in enumerate(zip(a, b)) if x != y], min(len(a), len(b))
    return {"equal": compared - len(differ), "compared": compared, "differ": differ[:16]}


def measure_throughput(args: argparse.Namespace) -> dict[str, Any]:
    rounds = []
    for r in range(args.rounds):
        sides = ("mmserve", "transformers") if r % 2 == 0 else ("transformers", "mmserve")
        rounds.append({side: _run_worker(side, args, r) for side in sides})
        _log(f"throughput round {r + 1}/{args.rounds}: mmserve {rounds[-1]['mmserve']['wall_s']:.2f} s, "
             f"transformers batched {rounds[-1]['transformers']['batched_wall_s']:.2f} s")
    kept = [r for r in rounds if max(r[side]["others_cores"] for side in r) <= CONTENDED_CORES] or rounds
    subset = min(args.single_subset, args.num_requests)
    n, k = args.num_requests * args.output_tokens, subset * args.output_tokens
    rate = {"mmserve": [n / r["mmserve"]["wall_s"] for r in kept],
            "hf_batched": [n / r["transformers"]["batched_wall_s"] for r in kept],
            "hf_batched_pre": [n / (r["transformers"]["batched_wall_s"] + r["transformers"]["preprocess_s"])
                               for r in kept],
            "hf_single": [k / r["transformers"]["single_wall_s"] for r in kept]}
    med, per_round = {name: statistics.median(v) for name, v in rate.items()}, zip(*rate.values())
    mm, hf = rounds[0]["mmserve"], rounds[0]["transformers"]  # tokens: every round's must equal these
    return {
        "tokens_per_s": {name: round(v, 2) for name, v in med.items()},
        "tokens_per_s_rounds": {name: [round(x, 1) for x in v] for name, v in rate.items()},
        "ratio_over_hf_batched": round(med["mmserve"] / med["hf_batched"], 3),
        "ratio_over_hf_batched_rounds": [round(m / b, 3) for m, b, _, _ in per_round],
        "ratio_over_hf_batched_with_preprocessing": round(med["mmserve"] / med["hf_batched_pre"], 3),
        "prompt_ids_equal": _equal(mm["prompt_ids"], hf["prompt_ids"]),
        "tokens_equal_hf_batched": _equal(mm["tokens"], hf["batched_tokens"]),
        "tokens_equal_hf_single": _equal(mm["tokens"], hf["single_tokens"]),
        "rounds_identical": all((r["mmserve"]["tokens"], r["transformers"]["batched_tokens"])
                                == (mm["tokens"], hf["batched_tokens"]) for r in rounds),
        "others_cores": {side: [round(r[side]["others_cores"], 2) for r in rounds]
                         for side in ("mmserve", "transformers")},
        "mmserve_encode_share": round(statistics.median(r["mmserve"]["encode_s"] / r["mmserve"]["wall_s"]
                                                        for r in kept), 3),
        "mmserve_stats": mm["stats"], "single_subset": subset, "rounds_kept": len(kept)}


def _summarize_request(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k[:-2] + "_ms": round(statistics.median(r[k] for r in rows) * 1000, 2)
                           for k in ("ttft_s", "metrics_ttft_s", "process_s", "encode_s", "forward_s")}
    out |= {k: [r[k] for r in rows] for k in (*COUNTS, "cached_tokens", "encoder_cached_items")}
    hit_rates = [r["hit_rate"] for r in rows if r["hit_rate"] is not None]
    return out | {"hit_rate_min": min(hit_rates, default=None)}


def measure_audio(args: argparse.Namespace) -> dict[str, Any]:
    rounds = [_run_worker("audio", args, r) for r in range(args.rounds)]
    kept = [r for r in rounds if r["others_cores"] <= CONTENDED_CORES] or rounds
    out: dict[str, Any] = {"others_cores": [round(r["others_cores"], 2) for r in rounds],
                           "rounds_kept": len(kept)}
    for layout in LAYOUTS:
        a, b = (_summarize_request([r[layout][x] for r in kept]) for x in ("a", "b"))
        per_round = [r[layout]["b"]["ttft_s"] / r[layout]["a"]["ttft_s"] for r in kept]
        out[layout] = {"a": a, "b": b, "ttft_b_over_a": round(b["ttft_ms"] / a["ttft_ms"], 3),
                       "metrics_ttft_b_over_a": round(b["metrics_ttft_ms"] / a["metrics_ttft_ms"], 3),
                       "ttft_b_over_a_rounds": [round(x, 3) for x in per_round]}
    return out


def verdicts(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if (t := res.get("throughput")) is not None:
        equal, ratio = t["tokens_equal_hf_batched"], t["ratio_over_hf_batched"]
        out |= {"throughput_over_hf_batched": ratio, "tokens_equal": f"{equal['equal']}/{equal['compared']}",
                "throughput_met": ratio >= TARGETS["throughput_over_hf_batched"]}
    if (a := res.get("audio")) is not None:
        hit_rate, ratio = a["question_first"]["b"]["hit_rate_min"], a["question_first"]["ttft_b_over_a"]
        met = hit_rate == TARGETS["audio_hit_rate"] and ratio <= TARGETS["audio_ttft_b_over_a"]
        out |= {"audio_hit_rate_b": hit_rate, "audio_ttft_b_over_a": ratio, "audio_met": met}
    return out


def print_report(res: dict[str, Any], args: argparse.Namespace, machine: dict[str, Any]) -> None:
    lines = {"machine": f"{machine_line(machine)}, torch {machine['torch']}, transformers "
                        f"{machine['transformers']}, torch threads {machine['torch_threads']}",
             "model": f"tiny Gemma 4, E2B-shaped, random weights (.bench/{MODEL_DIR.name}), float32",
             "method": f"{args.rounds} round(s), a fresh process per side, alternating order, medians; "
                       "mmserve at its defaults (LLM(dir))"}
    if (t := res.get("throughput")) is not None:
        lines["workload"] = (f"{args.num_requests} conversations cycling {', '.join(KINDS)} (images 64-256 "
                             f"px, clips 1-4 s WAV), {args.output_tokens} greedy tokens each; transformers: "
                             f"batches of 8, one at a time on the first {t['single_subset']}, its "
                             "preprocessing off its clock (+ its preprocessing: on it)")
        lines["others"] = (f"other work's CPU s per wall s, per round: {t['others_cores']}; medians of the "
                           f"{t['rounds_kept']} round(s) under {CONTENDED_CORES} (all, if none)")
    if (a := res.get("audio")) is not None:
        lines["audio"] = (f"{LONG_CLIP_S:.0f} s clip at {RATE_HZ} Hz as WAV; A then B (same clip, other "
                          "question), max_tokens 1, after a warm-up pair; TTFT from before process_chat; "
                          f"other work's CPU s per wall s, per round: {a['others_cores']}, "
                          f"{a['rounds_kept']} kept")
    print_card("mmserve Gemma 4 benchmark", lines)
    for part, show in ((t, _print_throughput), (a, _print_audio)):
        if part is not None:
            show(part)
    print(f"\nverdicts (targets {json.dumps(TARGETS)}): {json.dumps(verdicts(res))}")


def _print_throughput(t: dict[str, Any]) -> None:
    rates = t["tokens_per_s"]
    print(f"{'throughput':<34} {'tok/s':>9} {'mmserve / it':>13}  rounds (tok/s)")
    for name, label in (("mmserve", "mmserve LLM.chat (all at once)"), ("hf_batched", "transformers "
                        "batched (8)"), ("hf_batched_pre", " + its preprocessing"),
                        ("hf_single", "transformers one at a time")):
        ratio = "" if name == "mmserve" else f"{rates['mmserve'] / rates[name]:.2f}x"
        print(f"{label:<34} {rates[name]:>9.1f} {ratio:>13}  {t['tokens_per_s_rounds'][name]}")
    e, s, p = t["tokens_equal_hf_batched"], t["tokens_equal_hf_single"], t["prompt_ids_equal"]
    print(f"per round mmserve / batched {t['ratio_over_hf_batched_rounds']}; mmserve's encoder "
          f"{t['mmserve_encode_share']:.0%} of its wall\ngreedy tokens equal transformers': batched "
          f"{e['equal']}/{e['compared']}, one at a time {s['equal']}/{s['compared']}; prompt ids "
          f"{p['equal']}/{p['compared']}; every round the same tokens: {t['rounds_identical']}\n")


def _print_audio(a: dict[str, Any]) -> None:
    print(f"{'audio, 30 s clip (ms)':<28} {'TTFT':>8} {'metrics':>8} {'process':>8} {'encode':>8} "
          f"{'prefill':>8} {'hit/miss':>9} {'cached tok':>10}  (hits and misses: kept rounds)")
    for layout, label in (("question_first", "question first [headline]"), ("clip_first", "clip first")):
        for x, r in ((x, a[layout][x]) for x in ("a", "b")):
            hits = f"{sum(r['encoder_cache_hits'])}/{sum(r['encoder_cache_misses'])}"
            print(f"{label + ', ' + x.upper():<28} {r['ttft_ms']:>8.1f} {r['metrics_ttft_ms']:>8.1f} "
                  f"{r['process_ms']:>8.1f} {r['encode_ms']:>8.1f} {r['forward_ms']:>8.1f} {hits:>9} "
                  f"{r['cached_tokens'][0]:>10}")
        print(f"{'':<28} B / A TTFT {a[layout]['ttft_b_over_a']:.3f} (rounds "
              f"{a[layout]['ttft_b_over_a_rounds']}), metrics {a[layout]['metrics_ttft_b_over_a']:.3f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["throughput", "audio", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="16 conversations, 32 tokens, one round")
    for name, (full, quick) in DEFAULTS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, help=f"default {full} (--quick {quick})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, (full, quick) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        import torch
        torch.set_num_threads(args.threads)
        print(json.dumps(WORKERS[args.worker](args)), flush=True)
        return
    started = time.perf_counter()
    checkpoint()
    res = {name: measure(args) for name, measure in (("throughput", measure_throughput), ("audio", measure_audio))
           if args.part in (name, "all")}
    print_report(res, args, machine := machine_info(args.threads))
    run_s = round(time.perf_counter() - started, 1)
    json_line({"bench": "gemma4", "model": f".bench/{MODEL_DIR.name}", "dtype": "float32",
               "quick": args.quick, **{k: getattr(args, k) for k in DEFAULTS}, "targets": TARGETS,
               "verdicts": verdicts(res), **res, "machine": machine, "run_s": run_s}, compact=True)


if __name__ == "__main__":
    main()

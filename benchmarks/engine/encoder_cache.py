"""Encoder-cache benchmark: what reusing an encoded image saves, and what content hashing costs.

Run: python -m benchmarks.engine.encoder_cache [--model tiny|100m] [--quick]

Role: on a random-weight Qwen2-VL checkpoint (`benchmarks/engine/offline.py` builds it under `.bench/`)
three measurements, float32, torch threads = the machine's usable cores:
(a) time to first token of a request whose 448x448 image is already in the encoder cache vs one
    whose image is new. The clock starts before `Engine.process_chat` (preprocessing + hashing,
    which a user pays either way) and stops at the step that returns the first token. Headline:
    prefix caching off and a different question, so only the encoder is reused; also reported:
    the default engine (prefix caching on) asked the same question twice.
(b) tokens/s on the fixed 64-request workload (30% repeated images, 64 greedy tokens each) via
    `LLM.generate` with prompt dicts: "reuse" (content-hashed keys) vs "inline" (a unique
    `multi_modal_uuids` entry per image occurrence, so nothing is shared: the previous inline
    encoding). Fresh LLM per run, interleaved rounds; greedy outputs must be identical. Headline:
    the default config (prefix caching on); also run with prefix caching off to isolate the encoder.
(c) per 1280x720 RGB image: `hash_item(img)` and the processor's full key vs its preprocessing, as
    cost = CPU time of the process (headline: preprocessing runs on a thread pool, so its wall is
    shorter than its cost while hashing runs on one thread) and as wall time.

Prints a card (machine, model, dtype, workload), a human table, and one JSON line last.

What it does not know: mmserve internals beyond the public offline API, `Engine.process_chat` /
`add_request` / `step`, the processor's `render_chat`, `_key` and `image_processor`, and the
runner's encoder (its `forward_items` is wrapped here only to time the encoder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.card import ROOT, json_line, machine_info, machine_line
from benchmarks.checkpoints import EAGER, ensure_checkpoint, greedy, kv_cache_bytes
from benchmarks.reports.offline import DTYPE
from benchmarks.workload import Workload, build_workload, synthetic_image

TTFT_SIDE = 448
HASH_SIZE = (1280, 720)
NUM_REQUESTS = 64
OUTPUT_TOKENS = 64
TARGETS = {"ttft_cached_over_uncached": 0.5, "throughput_reuse_over_inline": 1.2, "hash_over_preprocess": 0.10}
QUESTION_A, QUESTION_B = "Describe the image.", "What colors do you see in this picture?"


def _log(msg: str) -> None:
    print(f"[encoder_cache] {msg}", file=sys.stderr, flush=True)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _engine_args(model_dir: Path, prefix_caching: bool) -> dict[str, Any]:
    """offline.py's mmserve config (room for all 64 requests at once), prefix caching as asked."""
    return dict(max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=2048, enable_prefix_caching=prefix_caching,
                dtype=DTYPE, kv_cache_bytes=kv_cache_bytes(model_dir, NUM_REQUESTS, OUTPUT_TOKENS), **EAGER)


# ---- (a) time to first token ---------------------------------------------------------------------
def _timed_encoder(llm: Any) -> list[float]:
    """Wrap this LLM's encoder so each call's wall is recorded (instance attribute; code untouched)."""
    encoder = llm.engine.runner.encoder
    inner, walls = encoder.forward_items, []

    def forward_items(jobs: list[Any]) -> Any:
        started = time.perf_counter()
        try:
            return inner(jobs)
        finally:
            if jobs:
                walls.append(time.perf_counter() - started)

    encoder.forward_items = forward_items
    return walls


def _one_ttft(llm: Any, encoder_walls: list[float], rid: str, image: Any, question: str) -> dict[str, float]:
    """Submit one single-image request and step until its first token; where the time went."""
    engine = llm.engine
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": question}]}]
    encoded_before, walls_before = engine.get_stats()["encoder_items_encoded"], len(encoder_walls)
    started = time.perf_counter()
    engine.add_request(rid, engine.process_chat(messages), greedy(1))
    submitted = time.perf_counter()
    forward_s, steps = 0.0, 0
    while True:
        outputs = engine.step()
        steps += 1
        forward_s += engine.inspect().last_step.forward_s
        if any(o.request_id == rid and o.outputs[0].token_ids for o in outputs):
            break
    ttft = time.perf_counter() - started
    while engine.has_unfinished_requests():  # max_tokens=1: already finished; drain to be safe
        engine.step()
    return {"ttft_s": ttft, "process_s": submitted - started, "encode_s": sum(encoder_walls[walls_before:]),
            "forward_s": forward_s, "steps": steps,
            "items_encoded": engine.get_stats()["encoder_items_encoded"] - encoded_before}


def measure_ttft(llms: dict[str, Any], reps: int) -> dict[str, Any]:
    """Per rep, a fresh image per engine: uncached then cached, on the "no_prefix" and "default" LLMs."""
    walls = {name: _timed_encoder(llm) for name, llm in llms.items()}
    rng = np.random.default_rng(1234)
    for name, llm in llms.items():  # warm-up: first calls of every kernel off the clock
        warm = synthetic_image(rng, TTFT_SIDE, TTFT_SIDE)
        for j, question in enumerate((QUESTION_A, QUESTION_A, QUESTION_B)):
            _one_ttft(llm, walls[name], f"warm-{j}", warm, question)
    # headline: prefix caching off, different question (only the encoder output is reused);
    # default: prefix caching on, same question (the KV prefix cache covers the image too)
    cached_question = {"no_prefix": QUESTION_B, "default": QUESTION_A}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {n: {"uncached": [], "cached": []} for n in llms}
    for i in range(reps):
        for name, llm in llms.items():
            image = synthetic_image(rng, TTFT_SIDE, TTFT_SIDE)  # never seen by either engine
            runs[name]["uncached"].append(_one_ttft(llm, walls[name], f"u{i}", image, QUESTION_A))
            runs[name]["cached"].append(_one_ttft(llm, walls[name], f"c{i}", image, cached_question[name]))
    return {name: _ttft_summary(r) for name, r in runs.items()}


def _ttft_summary(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, rows in runs.items():
        out[kind] = {k: round(_median([r[k] for r in rows]) * 1000, 2) for k in
                     ("ttft_s", "process_s", "encode_s", "forward_s")}
        out[kind] = {k.replace("_s", "_ms"): v for k, v in out[kind].items()}
        out[kind]["ttft_ms_all"] = [round(r["ttft_s"] * 1000, 1) for r in rows]
        out[kind]["items_encoded"] = [r["items_encoded"] for r in rows]
        out[kind]["steps"] = [r["steps"] for r in rows]
    pairs = [c["ttft_s"] / u["ttft_s"] for u, c in zip(runs["uncached"], runs["cached"])]
    out["ratio_cached_over_uncached"] = round(out["cached"]["ttft_ms"] / out["uncached"]["ttft_ms"], 3)
    out["ratio_per_rep_median"] = round(_median(pairs), 3)
    return out


# ---- (b) throughput ------------------------------------------------------------------------------
def prompt_dicts(llm: Any, workload: Workload, unique_uuids: bool) -> list[dict[str, Any]]:
    """One prompt dict per conversation; with `unique_uuids`, a uuid per image occurrence."""
    out = []
    for i, conv in enumerate(workload.conversations):
        chat = llm.engine.processor.render_chat(conv.messages)
        prompt: dict[str, Any] = {"prompt": chat.prompt, "multi_modal_data": {"image": chat.images}}
        if unique_uuids:
            prompt["multi_modal_uuids"] = {"image": [f"req{i}-img{j}" for j in range(len(chat.images))]}
        out.append(prompt)
    return out


def _generate_run(model_dir: Path, workload: Workload, unique_uuids: bool, prefix_caching: bool) -> dict[str, Any]:
    """Fresh LLM; the clock covers `generate` (input processing included), not the load."""
    from mmserve import LLM

    llm = LLM(str(model_dir), **_engine_args(model_dir, prefix_caching))
    encoder_walls = _timed_encoder(llm)
    prompts = prompt_dicts(llm, workload, unique_uuids)
    started = time.perf_counter()
    outputs = llm.generate(prompts, greedy(OUTPUT_TOKENS), use_tqdm=False)
    wall_s = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    stats = llm.get_stats()
    keep = ("encoder_items_encoded", "encoder_tokens_encoded", "encoder_cache_hits", "encoder_cache_misses",
            "encoder_cache_bytes_used", "prefix_cache_hit_tokens", "prompt_tokens_computed", "num_preemptions")
    num_tokens = sum(len(t) for t in tokens)
    return {"wall_s": wall_s, "encode_s": sum(encoder_walls), "output_tokens": num_tokens,
            "tokens_per_s": num_tokens / wall_s,
            "stats": {k: stats[k] for k in keep}, "tokens": tokens}


def measure_throughput(model_dir: Path, workload: Workload, rounds: int, prefix_caching: bool) -> dict[str, Any]:
    """`rounds` interleaved (reuse, inline) pairs, alternating which goes first; medians and checks."""
    runs: dict[str, list[dict[str, Any]]] = {"reuse": [], "inline": []}
    for r in range(rounds):
        order = ("reuse", "inline") if r % 2 == 0 else ("inline", "reuse")
        for mode in order:
            runs[mode].append(_generate_run(model_dir, workload, mode == "inline", prefix_caching))
            _log(f"throughput prefix_caching={prefix_caching} round {r + 1}/{rounds} {mode}: "
                 f"{runs[mode][-1]['wall_s']:.1f}s")
    reference = runs["reuse"][0]["tokens"]
    identical = all(run["tokens"] == reference for mode in runs for run in runs[mode])
    if not identical:
        bad = sorted({i for mode in runs for run in runs[mode] for i, t in enumerate(run["tokens"])
                      if t != reference[i]})
        print(f"\n!!! GREEDY MISMATCH between reuse and inline encoding on requests {bad} !!!\n", file=sys.stderr)
    out: dict[str, Any] = {"prefix_caching": prefix_caching, "rounds": rounds, "greedy_identical": identical}
    for mode, rows in runs.items():
        out[mode] = {"tokens_per_s": round(_median([x["tokens_per_s"] for x in rows]), 2),
                     "wall_s": round(_median([x["wall_s"] for x in rows]), 3),
                     "rounds_wall_s": [round(x["wall_s"], 2) for x in rows],
                     "encode_s": round(_median([x["encode_s"] for x in rows]), 3),
                     "encode_share": round(_median([x["encode_s"] / x["wall_s"] for x in rows]), 3),
                     "output_tokens": rows[0]["output_tokens"], "stats": rows[0]["stats"]}
    pairs = [a["wall_s"] / b["wall_s"] for a, b in zip(runs["inline"], runs["reuse"])]
    out["ratio_reuse_over_inline"] = round(out["reuse"]["tokens_per_s"] / out["inline"]["tokens_per_s"], 3)
    # Amdahl: what reuse could give if it removed exactly the encoder time of the patches it does not
    # re-encode and changed nothing else (inline's own encoder share; encoder time ~ patches)
    inline, patches = out["inline"], (out["reuse"]["stats"]["encoder_tokens_encoded"],
                                      out["inline"]["stats"]["encoder_tokens_encoded"])
    saved_s = inline["encode_s"] * (1 - patches[0] / max(1, patches[1]))
    out["amdahl_bound_reuse_over_inline"] = round(inline["wall_s"] / max(1e-9, inline["wall_s"] - saved_s), 3)
    out["ratio_per_round"] = [round(p, 3) for p in pairs]
    return out


# ---- (c) hashing vs preprocessing ----------------------------------------------------------------
def measure_hashing(llm: Any, reps: int) -> dict[str, Any]:
    """Interleaved per rep: hash_item(img), the processor's full key, and preprocess_image(img)."""
    from mmserve.inputs.hashing import hash_item
    from mmserve.models.vision.qwen_image_processor import ImageProcessorConfig, Qwen2VLImageProcessor

    processor = llm.engine.processor
    cfg = processor.image_processor.cfg
    shaping = {"min_pixels": cfg.min_pixels, "max_pixels": cfg.max_pixels}
    image = synthetic_image(np.random.default_rng(7), *HASH_SIZE)
    default_cfg = Qwen2VLImageProcessor(ImageProcessorConfig.from_dict({}))  # Qwen2-VL's own max_pixels
    calls = {"hash_item": lambda: hash_item(image),
             "processor_key": lambda: processor._key("image", None, image, shaping),
             "preprocess": lambda: processor.image_processor.preprocess_image(image),
             "preprocess_default_cfg": lambda: default_cfg.preprocess_image(image)}
    for call in calls.values():  # warm-up
        call()
    walls: dict[str, list[float]] = {name: [] for name in calls}
    cpus: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            call()
            cpus[name].append(time.process_time() - cpu_started)  # every thread of the process
            walls[name].append(time.perf_counter() - started)
    out: dict[str, Any] = {f"{name}_ms": round(_median(w) * 1000, 3) for name, w in walls.items()}
    out.update({f"{name}_ms_min": round(min(w) * 1000, 3) for name, w in walls.items()})
    # process_time ticks coarsely per call on some kernels: the mean over reps, not the median
    out.update({f"{name}_cpu_ms": round(sum(c) / len(c) * 1000, 3) for name, c in cpus.items()})
    grid = processor.image_processor.preprocess_image(image).grid_thw
    out.update(image=f"{HASH_SIZE[0]}x{HASH_SIZE[1]} RGB", reps=reps, max_pixels=cfg.max_pixels,
               grid_thw=[int(g) for g in grid], preprocess_threads=processor.image_processor._threads,
               ratio_hash_over_preprocess_cpu=round(out["hash_item_cpu_ms"] / out["preprocess_cpu_ms"], 4),
               ratio_hash_over_preprocess=round(out["hash_item_ms"] / out["preprocess_ms"], 4),
               default_cfg_max_pixels=default_cfg.cfg.max_pixels,
               ratio_key_over_preprocess=round(out["processor_key_ms"] / out["preprocess_ms"], 4),
               ratio_hash_over_preprocess_default_cfg=round(
                   out["hash_item_ms"] / out["preprocess_default_cfg_ms"], 4))
    return out


# ---- run, report ---------------------------------------------------------------------------------
def run(model: str = "100m", quick: bool = False, seed: int = 0, rounds: int | None = None) -> dict[str, Any]:
    """All three measurements on `model`; the dict that goes into the JSON line (minus the machine)."""
    from mmserve import LLM

    model_dir = ensure_checkpoint(model)
    reps = {"ttft": 3 if quick else 7, "rounds": rounds or (1 if quick else 2), "hash": 10 if quick else 20}
    started = time.perf_counter()
    _log(f"(a) TTFT on {model}, {reps['ttft']} reps ...")
    llms = {"no_prefix": LLM(str(model_dir), **_engine_args(model_dir, False)),
            "default": LLM(str(model_dir), **_engine_args(model_dir, True))}
    ttft = measure_ttft(llms, reps["ttft"])
    _log(f"(c) hashing vs preprocessing, {reps['hash']} reps ...")
    hashing = measure_hashing(llms["default"], reps["hash"])
    del llms
    workload = build_workload(NUM_REQUESTS, seed=seed)
    _log(f"(b) throughput on {model}: warm-up ...")
    warm = LLM(str(model_dir), **_engine_args(model_dir, True))
    warm.generate(prompt_dicts(warm, workload, False)[:2], greedy(4), use_tqdm=False)
    del warm
    throughput = {"default": measure_throughput(model_dir, workload, reps["rounds"], True)}
    if not quick:
        throughput["no_prefix"] = measure_throughput(model_dir, workload, reps["rounds"], False)
    head_t, head_b = ttft["no_prefix"], throughput["default"]
    verdicts = {
        "ttft_cached_over_uncached": head_t["ratio_cached_over_uncached"],
        "throughput_reuse_over_inline": head_b["ratio_reuse_over_inline"],
        "throughput_never_slower": all(r >= 1.0 for t in throughput.values() for r in t["ratio_per_round"]),
        "hash_over_preprocess": hashing["ratio_hash_over_preprocess_cpu"],
        "hash_over_preprocess_wall": hashing["ratio_hash_over_preprocess"],
    }
    verdicts["meets"] = {
        "ttft": verdicts["ttft_cached_over_uncached"] <= TARGETS["ttft_cached_over_uncached"],
        "throughput": verdicts["throughput_reuse_over_inline"] >= TARGETS["throughput_reuse_over_inline"]
        and verdicts["throughput_never_slower"],
        "hashing": verdicts["hash_over_preprocess"] <= TARGETS["hash_over_preprocess"]}
    return {"model": model, "model_dir": str(model_dir.relative_to(ROOT)), "quick": quick, "reps": reps,
            "workload": dict(workload.summary(), output_tokens=OUTPUT_TOKENS), "ttft": ttft,
            "throughput": throughput, "hashing": hashing, "targets": TARGETS, "headline": verdicts,
            "run_s": round(time.perf_counter() - started, 1)}


def print_card(machine: dict[str, Any], res: dict[str, Any]) -> None:
    w = res["workload"]
    print("== mmserve encoder-cache benchmark ==")
    print(f"machine   : {machine_line(machine)}, torch {machine['torch']}, torch threads {machine['torch_threads']} "
          "(shared, noisy: medians)")
    print(f"model     : {res['model']} ({res['model_dir']}), dtype {DTYPE}")
    print(f"(a) TTFT  : one {TTFT_SIDE}x{TTFT_SIDE} image + a short question, max_tokens=1, "
          f"{res['reps']['ttft']} reps, fresh image per rep; clock includes process_chat (preprocess + hash)")
    print(f"(b) thru  : N={w['num_requests']} requests, {w['num_images']} images ({w['num_distinct_images']} "
          f"distinct, {w['repeated_image_fraction']:.0%} repeats), {w['output_tokens']} greedy tokens each, fresh "
          f"LLM per run, {res['reps']['rounds']} interleaved round(s); inline = a unique multi_modal_uuid per "
          "image occurrence")
    print(f"(c) hash  : {res['hashing']['image']}, {res['reps']['hash']} interleaved reps; processor max_pixels "
          f"{res['hashing']['max_pixels']}, preprocess threads {res['hashing']['preprocess_threads']}")


def print_table(res: dict[str, Any]) -> None:
    print(f"\n{'measurement':<44} {'value':>12} {'ratio':>8} {'target':>8}  note")
    for name, label in (("no_prefix", "prefix caching off, other question [headline]"),
                        ("default", "prefix caching on, same question")):
        t = res["ttft"][name]
        for kind in ("uncached", "cached"):
            row = t[kind]
            note = (f"process {row['process_ms']:.1f} + encode {row['encode_ms']:.1f} + forward "
                    f"{row['forward_ms']:.1f} ms; encoded {row['items_encoded']}")
            ratio = f"{t['ratio_cached_over_uncached']:.2f}x" if kind == "cached" else ""
            target = "<=0.50" if kind == "cached" and name == "no_prefix" else ""
            label_kind = f"(a) TTFT {kind}, {label}"
            print(f"{label_kind:<44.44} {row['ttft_ms']:>9.1f} ms {ratio:>8} {target:>8}  {note}")
    for name, label in (("default", "prefix caching on [headline]"), ("no_prefix", "prefix caching off")):
        b = res["throughput"].get(name)
        if b is None:
            continue
        for mode in ("inline", "reuse"):
            row = b[mode]
            ratio = f"{b['ratio_reuse_over_inline']:.2f}x" if mode == "reuse" else ""
            target = ">=1.20" if mode == "reuse" and name == "default" else ""
            stats = row["stats"]
            walls = "/".join(f"{x:.1f}" for x in row["rounds_wall_s"])
            note = (f"walls {walls} s; encoder {row['encode_s']:.1f} s "
                    f"({row['encode_share']:.0%}), {stats['encoder_items_encoded']} items; prefix hits "
                    f"{stats['prefix_cache_hit_tokens']}")
            if mode == "reuse":
                note += (f"; greedy identical: {b['greedy_identical']}; at best (Amdahl, inline's encoder "
                         f"share) {b['amdahl_bound_reuse_over_inline']:.2f}x")
            label_mode = f"(b) {mode}, {label}"
            print(f"{label_mode:<44.44} {row['tokens_per_s']:>8.1f} t/s {ratio:>8} {target:>8}  {note}")
    h = res["hashing"]
    print(f"{'(c) preprocess_image 1280x720':<44} {h['preprocess_ms']:>9.2f} ms {'':>8} {'':>8}  "
          f"grid {h['grid_thw']}")
    print(f"{'(c) preprocess_image, Qwen2-VL default cfg':<44} {h['preprocess_default_cfg_ms']:>9.2f} ms {'':>8} "
          f"{'':>8}  max_pixels {h['default_cfg_max_pixels']}; hash is "
          f"{h['ratio_hash_over_preprocess_default_cfg']:.1%} of it")
    print(f"{'(c) hash_item(img), wall':<44} {h['hash_item_ms']:>9.2f} ms {h['ratio_hash_over_preprocess']:>7.1%} "
          f"{'':>8}  min {h['hash_item_ms_min']:.2f} ms")
    print(f"{'(c) hash_item(img), CPU time [headline]':<44} {h['hash_item_cpu_ms']:>9.2f} ms "
          f"{h['ratio_hash_over_preprocess_cpu']:>7.1%} {'<=10%':>8}  preprocessing's CPU time "
          f"{h['preprocess_cpu_ms']:.2f} ms ({h['preprocess_threads']} threads)")
    print(f"{'(c) processor key (dict incl. img)':<44} {h['processor_key_ms']:>9.2f} ms "
          f"{h['ratio_key_over_preprocess']:>7.1%} {'':>8}  what process() computes per image")
    print(f"\nheadline: {json.dumps(res['headline'])}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "100m"], default="100m")
    parser.add_argument("--quick", action="store_true", help="fewer reps, 1 throughput round, no prefix-off run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=None, help="throughput rounds per mode (default 2, quick 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: usable CPUs; 1 is steadier on a shared, oversubscribed box)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    res = run(args.model, args.quick, args.seed, args.rounds)
    machine = machine_info(threads)
    print_card(machine, res)
    print_table(res)
    json_line({"bench": "encoder_cache", "dtype": DTYPE, "machine": machine, **res}, compact=True)


if __name__ == "__main__":
    main()

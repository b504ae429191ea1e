"""The offline benchmark's report: the card, the human table and the one JSON line.

Role: render what `offline.py` measured. What it does not know: how it was measured.
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.card import machine_line
from benchmarks.engine.hf_systems import HF_BATCH_SIZE

DTYPE = "float32"


SYSTEM_LABELS = {"mmserve": "mmserve (all at once)", "hf_single": "transformers 1 at a time",
                 "hf_batched": f"transformers batch {HF_BATCH_SIZE}"}


def print_card(machine: dict[str, Any], workload: dict[str, Any], models: dict[str, dict[str, Any]],
               output_tokens: int, subset: int | None) -> None:
    print("== mmserve offline benchmark ==")
    print(f"machine   : {machine_line(machine)}")
    print(f"software  : torch {machine['torch']}, transformers {machine['transformers']}, "
          f"torch threads {machine['torch_threads']}")
    print(f"dtype     : {DTYPE} (all systems, same checkpoint per model)")
    for name, res in models.items():
        prompt = res["systems"]["mmserve"].extra["prompt_tokens"]
        print(f"model     : {name}: {res['model_dir']}, {res['params'] / 1e6:.2f}M params, prompt tokens "
              f"{prompt['min']}-{prompt['max']} (mean {prompt['mean']}); each system best of {res['repeats']} "
              "interleaved round(s)")
    ipr = workload["images_per_request"]
    print(f"workload  : N={workload['num_requests']} conversations (seed {workload['seed']}), "
          f"{ipr['min']}-{ipr['max']} images each (mean {ipr['mean']}), {workload['num_images']} images of "
          f"{workload['image_side_px']['min']}-{workload['image_side_px']['max']} px/side, "
          f"{workload['repeated_image_fraction']:.0%} repeats of earlier images")
    print(f"            {workload['shared_prefix_fraction']:.0%} share one {workload['shared_system_prompt_tokens']}"
          f"-token system prompt; output {output_tokens} greedy tokens each (min_tokens = max_tokens)")
    print("notes     : transformers inputs are preprocessed before its clock starts; mmserve's wall includes "
          "its input processing (preprocess_s in the JSON). mmserve warm-up ran on a throwaway LLM.")
    if subset:
        print(f"            transformers one-at-a-time ran on the first {subset} requests only; its tokens/s is "
              "extrapolated to all of them (\"subset\" in the JSON)")


def print_table(models: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'model':<15} {'system':<26} {'wall s':>9} {'out tok':>8} {'tok/s':>9} {'mmserve x':>10}  note")
    for name, res in models.items():
        mm = res["systems"]["mmserve"]
        for key, r in res["systems"].items():
            ratio = "" if key == "mmserve" else f"{mm.tokens_per_s / r.tokens_per_s:.2f}x"
            note = f"load {r.extra['load_s']:.2f}s, prep {r.extra['preprocess_s']:.2f}s" if key == "mmserve" else ""
            if len(r.extra["rounds_wall_s"]) > 1:
                note += ("; " if note else "") + "rounds " + "/".join(f"{w:.1f}" for w in r.extra["rounds_wall_s"])
            if r.extra.get("subset"):
                note = f"first {r.extra['subset']} requests; full est. {r.extra['extrapolated_full_wall_s']:.1f}s"
            print(f"{name:<15} {SYSTEM_LABELS[key]:<26} {r.wall_s:>9.2f} {r.output_tokens:>8} "
                  f"{r.tokens_per_s:>9.1f} {ratio:>10}  {note}")
        g = res["greedy"]
        single, batched = g["mmserve_vs_hf_single"], g["hf_batched_vs_hf_single"]
        flag = "" if single["identical"] == single["compared"] else "   <-- MISMATCH (bug)"
        e2e = res["speedup_end_to_end"]
        if e2e is not None:
            print(f"{'':<15} with transformers' image preprocessing ({res['hf_preprocess_s']:.2f}s) in its walls: "
                  f"mmserve x {e2e.get('vs_hf_single', 0):.2f} vs 1-at-a-time, x {e2e.get('vs_hf_batched', 0):.2f} "
                  f"vs batch {HF_BATCH_SIZE}")
        fl = res["floor"]
        if fl is not None:
            print(f"{'':<15} floor: {sum(fl['gflop'].values()):.0f} GFLOP of matmuls and attention ({fl['gflop']}) at "
                  f"the machine's {fl['peak_matmul_gflops']:.0f} GFLOP/s peak = {fl['floor_s']:.2f}s; mmserve's wall "
                  f"is {fl['mmserve_wall_over_floor']:.2f}x that; no engine doing this work beats the best "
                  f"transformers mode by more than {fl['max_possible_speedup_vs_best_hf']:.2f}x here")
        print(f"{'':<15} greedy: mmserve == transformers 1-at-a-time on {single['identical']}/{single['compared']}"
              f"{flag}; batch-{HF_BATCH_SIZE} padded == 1-at-a-time on {batched['identical']}/{batched['compared']}; "
              f"stats {res['systems']['mmserve'].extra['stats']}")


def print_overhead(overhead: dict[str, Any]) -> None:
    verdict = "meets" if overhead["meets_target"] else "MISSES"
    print(f"\nengine overhead ({overhead['model']}, batch-{overhead['batch']} decode, {overhead['steps']} steps): "
          f"step {overhead['step_ms_median']:.1f} ms, forward {overhead['forward_ms_median']:.1f} ms, "
          f"runner outside forward {overhead['runner_outside_forward_ms_median']:.1f} ms, engine outside runner "
          f"{overhead['engine_outside_runner_ms_median']:.1f} ms -> {overhead['outside_forward_share']:.1%} outside "
          f"the forward ({verdict} the {overhead['target_share']:.0%} target)")


def json_line(machine: dict[str, Any], workload: dict[str, Any], models: dict[str, dict[str, Any]],
              overhead: dict[str, Any] | None, output_tokens: int, subset: int | None, run_s: float) -> str:
    out_models = {}
    for name, res in models.items():
        entry = {k: v for k, v in res.items() if k != "systems"}
        entry.update({key: r.as_json() for key, r in res["systems"].items()})
        out_models[name] = entry
    return json.dumps({"bench": "offline", "dtype": DTYPE, "machine": machine,
                       "workload": dict(workload, output_tokens=output_tokens), "hf_single_subset": subset,
                       "models": out_models,
                       "overhead": overhead, "run_s": round(run_s, 1)}, separators=(",", ":"))

"""The report of the KV-cache dtype benchmark (`benchmarks/engine/kv_cache_dtype.py`): the card and one
table per section, from the results dict the benchmark builds.

What it does not know: how anything was measured.
"""

from __future__ import annotations

from typing import Any

from benchmarks.card import machine_line
from benchmarks.engine.kv_scaling import AGREEMENT_DTYPE, KV_DTYPES, MIB, MODEL_DTYPES


def print_card(machine: dict[str, Any], res: dict[str, Any]) -> None:
    s, w = res["settings"], res["workload"]
    print("== mmserve KV-cache dtype benchmark ==")
    print(f"machine   : {machine_line(machine)}, "
          f"torch {machine['torch']}, torch threads {machine['torch_threads']} (shared, noisy: medians)")
    print(f"model     : 100m ({res['model_dir']}), {res['params'] / 1e6:.1f}M params, KV {res['kv_layout']}; "
          f"demo model ({res['demo_accuracy']['model']})")
    print(f"settings  : kv_cache_dtype {', '.join(KV_DTYPES)}; capacity at kv_cache_bytes {s['kv_cache_mib']} MiB, "
          f"model dtype {' and '.join(MODEL_DTYPES)}; agreement and speed in {AGREEMENT_DTYPE}"
          + ("; --quick" if s["quick"] else ""))
    print(f"workload  : N={w['num_requests']} conversations (seed {w['seed']}), {w['num_images']} images, "
          f"{s['output_tokens']} greedy tokens each (min_tokens = max_tokens), prefix caching on")
    print(f"speed     : {s['rounds']} round(s), a fresh LLM per dtype per round (load off the clock), order "
          "rotated each round, medians; the untimed agreement runs warmed every dtype first")


def _print_capacity(cap: dict[str, Any]) -> None:
    p = cap["prompt_tokens"]
    print(f"\n(1) capacity at {cap['kv_cache_bytes'] // MIB} MiB; 1-image request = median prompt {p['median']} "
          f"tokens (of {p['num_prompts']}, {p['min']}-{p['max']}) + {cap['output_tokens']} output tokens")
    print(f"{'model dtype':<12} {'kv dtype':<10} {'B/token':>8} {'blocks':>7} {'blk/req':>8} {'requests':>9} "
          f"{'x auto':>7} {'bytes x':>8}")
    for model_dtype, rows in cap["per_model_dtype"].items():
        for kv_dtype, r in rows.items():
            print(f"{model_dtype:<12} {kv_dtype:<10} {r['kv_bytes_per_token']:>8} {r['kv_blocks_total']:>7} "
                  f"{r['blocks_per_request']:>8} {r['requests_fit']:>9} {r['requests_ratio_vs_auto']:>6.2f}x "
                  f"{r['bytes_ratio_vs_auto']:>7.2f}x")


def _print_demo(demo: dict[str, Any]) -> None:
    types = list(demo["per_dtype"]["auto"]["accuracy"])
    print(f"\n(2) demo accuracy, n={demo['n']} (seed {demo['seed']}); one answer moves a type by "
          f"{max(demo['one_answer_points'].values()):.3f} at most")
    print(f"{'kv dtype':<10} " + " ".join(f"{t:>9}" for t in types) + f" {'max|d|':>7} {'changed':>8}")
    for kv_dtype, r in demo["per_dtype"].items():
        print(f"{kv_dtype:<10} " + " ".join(f"{r['accuracy'][t]:>9.3f}" for t in types)
              + f" {r['max_abs_delta']:>7.3f} {r['answers_changed_vs_auto']:>8}")


def _print_agreement(agreement: dict[str, Any]) -> None:
    print(f"\n(3) greedy agreement with auto ({AGREEMENT_DTYPE}); KL(auto || dtype) in nats over same-context "
          "positions; gap = auto's logprob of its token minus of the dtype's, at the first divergence")
    print(f"{'kv dtype':<10} {'identical':>10} {'1st div mean':>13} {'min':>5} {'KL mean':>10} {'KL median':>10} "
          f"{'KL max':>9} {'positions':>10} {'gap mean':>9}")
    dash = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
    for kv_dtype, a in agreement.items():
        fd, kl = a["first_divergence"], a["kl"]
        print(f"{kv_dtype:<10} {a['identical']:>4}/{a['requests']:<5} {dash(fd['mean'], '.1f'):>13} "
              f"{dash(fd['min'], 'd'):>5} {kl['mean']:>10.2e} {kl['median']:>10.2e} {kl['max']:>9.2e} "
              f"{kl['positions']:>10} {dash(a['auto_logprob_gap_at_divergence_mean'], '.3f'):>9}")


def _print_speed(sp: dict[str, Any]) -> None:
    print(f"\n(4) speed, LLM.chat, {sp['rounds']} round(s)")
    print(f"{'kv dtype':<10} {'tok/s':>8} {'x auto':>7} {'write s':>8} {'gather s':>9}  per-round walls s (ratio)")
    for kv_dtype in KV_DTYPES:
        r = sp[kv_dtype]
        walls = "/".join(f"{x:.1f}" for x in r["wall_s_rounds"])
        ratios = "/".join(f"{x:.2f}" for x in r["ratio_per_round"])
        print(f"{kv_dtype:<10} {r['tokens_per_s']:>8.1f} {r['ratio_vs_auto']:>6.2f}x {r['kv_write_s']:>8.2f} "
              f"{r['kv_gather_s']:>9.2f}  {walls} ({ratios}); same tokens as (3): {r['tokens_match_agreement_run']}")
    for kv_dtype in KV_DTYPES[1:]:
        r = sp[kv_dtype]
        gap = 1 - r["ratio_vs_auto"]
        print(f"{kv_dtype}: {abs(gap):.1%} {'slower' if gap > 0 else 'faster'} than auto; its KV write+gather adds "
              f"{r['kv_storage_extra_share_of_auto_wall']:.1%} of auto's median wall ({sp['auto']['wall_s']:.2f} s); "
              f"median CPU {r['cpu_s']:.1f} s vs auto {sp['auto']['cpu_s']:.1f} s")


def _print_scaling(sc: dict[str, Any]) -> None:
    print("\n(5) scaling study: per layer K/V of prefills quantized with one scale per token per KV head (engine) "
          "vs one per tensor; rel = ||x' - x|| / ||x||, mean over layers")
    print(f"{'source':<7} {'format/kind':<12} {'tokens':>7} {'amax':>6} {'rel tok-head':>13} {'rel tensor':>11} "
          f"{'max abs tok-head':>17} {'max abs tensor':>15}")
    for source in ("100m", "demo"):
        r = sc[source]
        for key in (k for k in r if "/" in k):
            a, b = r[key]["per_token_head"], r[key]["per_tensor"]
            print(f"{source:<7} {key:<12} {r['tokens']:>7} {r['amax'][key[-1]]:>6.2f} {a['rel_mean']:>13.4f} "
                  f"{b['rel_mean']:>11.4f} {a['max_abs']:>17.4f} {b['max_abs']:>15.4f}")


def print_tables(res: dict[str, Any]) -> None:
    _print_capacity(res["capacity"])
    _print_demo(res["demo_accuracy"])
    _print_agreement(res["agreement"])
    _print_speed(res["speed"])
    _print_scaling(res["scaling_study"])
    print("\ntargets: " + "; ".join(f"{k} {v['measured']} ({v['target']}): {'met' if v['met'] else 'MISSED'}"
                                    + (f" [{v['note']}]" if "note" in v else "") for k, v in res["targets"].items()))



"""The streaming video benchmark's report: medians over rounds, the target, the card, the table, the JSON line.

Role: turn what `streaming_video.py` measured (per mode, round and turn: TTFT and its split, stats deltas,
token ids) into per-turn medians, the stream / reencode TTFT ratio, the identical-output count and the
last-turn verdict, and render them.
What it does not know: how it was measured.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from benchmarks.card import machine_line

TTFT_MAX_RATIO = 0.3  # last turn's TTFT, stream vs reencode


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def _same(values: list[Any]) -> Any:
    """The value if every round agrees, else the list (a count that moved between rounds is worth seeing)."""
    return values[0] if all(v == values[0] for v in values) else values


def _turn(by_mode: dict[str, list[dict[str, Any]]], t: int) -> dict[str, Any]:
    recs = {mode: [run["turns"][t] for run in runs] for mode, runs in by_mode.items()}
    s, r = recs["stream"], recs["reencode"]
    tokens = [rec["token_ids"] for rec in s + r]
    row: dict[str, Any] = {"turn": s[0]["turn"], "frames": s[0]["frames"],
                           "prompt_tokens": _same([rec["prompt_len"] for rec in s + r])}
    for mode, rs in recs.items():
        ttft = _median([x["ttft_ms"] for x in rs])
        pre, enc = _median([x["preprocess_ms"] for x in rs]), _median([x["encode_ms"] for x in rs])
        row[mode] = {
            "ttft_ms": ttft, "ttft_ms_rounds": [round(x["ttft_ms"], 1) for x in rs],
            "engine_ttft_ms": _median([x["engine_ttft_ms"] for x in rs]),
            "preprocess_ms": pre, "encode_ms": enc,
            "rest_ms": _median([x["ttft_ms"] - x["preprocess_ms"] - x["encode_ms"] for x in rs]),
            "encoder_tokens": _same([x["encoder_tokens_encoded"] for x in rs]),
            "encoder_items": _same([x["encoder_items_encoded"] for x in rs]),
            "encoder_cache_hits": _same([x["encoder_cache_hits"] for x in rs]),
            "prefix_hit_tokens": _same([x["prefix_cache_hit_tokens"] for x in rs]),
            "prompt_tokens_computed": _same([x["prompt_tokens_computed"] for x in rs]),
            "num_cached_tokens": _same([x["num_cached_tokens"] for x in rs]),
        }
    row["ratio"] = round(row["stream"]["ttft_ms"] / row["reencode"]["ttft_ms"], 3)
    row["ratio_rounds"] = [round(a["ttft_ms"] / b["ttft_ms"], 3) for a, b in zip(s, r)]
    row["identical"] = all(x == tokens[0] for x in tokens)
    row["token_ids"] = tokens[0]
    return row


def summarize(runs: list[dict[str, Any]], turns: int) -> dict[str, Any]:
    by_mode = {mode: [run for run in runs if run["mode"] == mode] for mode in ("stream", "reencode")}
    per_turn = [_turn(by_mode, t) for t in range(turns)]
    last = per_turn[-1]
    identical = sum(row["identical"] for row in per_turn)
    totals = {}
    for mode, mode_runs in by_mode.items():
        totals[mode] = {
            "encoder_tokens": _same([sum(rec["encoder_tokens_encoded"] for rec in run["turns"]) for run in mode_runs]),
            "prompt_tokens_computed": _same([sum(rec["prompt_tokens_computed"] for rec in run["turns"])
                                             for run in mode_runs]),
            "ttft_ms_sum": _median([sum(rec["ttft_ms"] for rec in run["turns"]) for run in mode_runs]),
            "load_s": _median([run["load_s"] for run in mode_runs]),
            "warmup_s": _median([run["warmup_s"] for run in mode_runs]),
            "end_stats": mode_runs[0]["end_stats"],
            "preemptions": sum(rec["num_preemptions"] for run in mode_runs for rec in run["turns"]),
            "kv_cache_evictions": sum(rec["kv_cache_evictions"] for run in mode_runs for rec in run["turns"]),
            "encoder_cache_evictions": sum(rec["encoder_cache_evictions"] for run in mode_runs for rec in run["turns"]),
            "finish_reasons": sorted({rec["finish_reason"] for run in mode_runs for rec in run["turns"]}),
        }
    return {
        "per_turn": per_turn, "totals": totals,
        "identical_outputs": f"{identical}/{turns}",
        "last_turn": {"turn": last["turn"], "ttft_stream_ms": last["stream"]["ttft_ms"],
                      "ttft_reencode_ms": last["reencode"]["ttft_ms"], "ratio": last["ratio"],
                      "ratio_rounds": last["ratio_rounds"], "target": TTFT_MAX_RATIO,
                      "met": last["ratio"] <= TTFT_MAX_RATIO,
                      "split_ms": {mode: {k: last[mode][k] for k in ("preprocess_ms", "encode_ms", "rest_ms")}
                                   for mode in ("stream", "reencode")}},
    }


def print_card(machine: dict[str, Any], model: dict[str, Any], settings: dict[str, Any],
               summary: dict[str, Any]) -> None:
    s = settings
    print("== mmserve streaming video benchmark ==")
    print(f"machine   : {machine_line(machine)}")
    print(f"software  : torch {machine['torch']}, transformers {machine['transformers']}, "
          f"torch threads {machine['torch_threads']} (torch's default)")
    print(f"model     : {model['name']}: {model['dir']}, {model['params'] / 1e6:.1f}M params, {s['dtype']}")
    print(f"engine    : LLM defaults + {', '.join(f'{k}={v}' for k, v in s['engine_args'].items())}; a fresh LLM "
          "per mode and round (load off the clock), warmed up by " + s["warmup"])
    print(f"stream    : moving_shapes seed {s['seed']}, {s['frame_size_px'][0]}x{s['frame_size_px'][1]} px at "
          f"{s['fps']:g} fps; turn t sends frames[:{s['frames_per_turn']}*t] ({s['seconds_per_turn']:g} s more per "
          f"turn), {s['turns']} turns, one request at a time, '{s['question']}', {s['output_tokens']} greedy tokens")
    print(f"modes     : stream = no uuid (groups keyed by pixels: encoder + prefix cache reuse); reencode = video "
          f"uuid {s['reencode_uuid']} (nothing reused)")
    print(f"rounds    : {s['rounds']}, both modes per round, the first mode alternating; medians reported")
    print("TTFT      : wall time from just before llm.chat (preprocessing counts) to metrics.first_token_time; "
          "split = preprocess (Engine.process_chat) + encode (vision encoder calls) + rest (schedule, prefill, "
          "first sample)")
    for mode, tot in summary["totals"].items():
        e = tot["end_stats"]
        print(f"caches    : {mode:<8} KV {e['kv_blocks_total']} blocks = {e['kv_capacity_tokens']} tokens "
              f"({e['kv_blocks_free']} free at the end, cached prefix blocks included); encoder cache {e['encoder_cache_bytes_used'] / 2**20:.1f} / "
              f"{e['encoder_cache_bytes_total'] / 2**20:.1f} MiB used at the end; over all rounds: "
              f"{tot['preemptions']} preemptions, {tot['kv_cache_evictions']} KV evictions, "
              f"{tot['encoder_cache_evictions']} encoder cache evictions")
    last = summary["last_turn"]
    for mode in ("stream", "reencode"):
        sp = last["split_ms"][mode]
        ttft = last[f"ttft_{mode}_ms"]
        print(f"turn {last['turn']:<4} : {mode:<8} TTFT {ttft:.0f} ms = preprocess {sp['preprocess_ms']:.0f} "
              f"({sp['preprocess_ms'] / ttft:.0%}) + encode {sp['encode_ms']:.0f} ({sp['encode_ms'] / ttft:.0%}) + "
              f"rest {sp['rest_ms']:.0f} ({sp['rest_ms'] / ttft:.0%}) ms (medians of each part)")
    print()


def _count(v: Any) -> str:
    return str(v) if not isinstance(v, list) else "/".join(str(x) for x in v)


def print_table(summary: dict[str, Any]) -> None:
    head = (f"{'turn':>4} {'frames':>6} {'prompt':>6} | {'enc tok':>7} {'enc tok':>7} | {'prefix hit':>10} "
            f"{'computed':>8} | {'TTFT ms':>8} {'TTFT ms':>8} | {'ratio':>5} | {'same':>4}")
    sub = (f"{'':>4} {'':>6} {'tokens':>6} | {'stream':>7} {'reenc':>7} | {'stream':>10} {'stream':>8} | "
           f"{'stream':>8} {'reenc':>8} | {'':>5} | {'out':>4}")
    print(head + "\n" + sub + "\n" + "-" * len(head))
    for row in summary["per_turn"]:
        s, r = row["stream"], row["reencode"]
        print(f"{row['turn']:>4} {row['frames']:>6} {_count(row['prompt_tokens']):>6} | {_count(s['encoder_tokens']):>7} "
              f"{_count(r['encoder_tokens']):>7} | {_count(s['prefix_hit_tokens']):>10} "
              f"{_count(s['prompt_tokens_computed']):>8} | {s['ttft_ms']:>8.1f} {r['ttft_ms']:>8.1f} | "
              f"{row['ratio']:>5.2f} | {'yes' if row['identical'] else 'NO':>4}")
    t = summary["totals"]
    print(f"{'all':>4} {'':>6} {'':>6} | {_count(t['stream']['encoder_tokens']):>7} "
          f"{_count(t['reencode']['encoder_tokens']):>7} | {'':>10} {_count(t['stream']['prompt_tokens_computed']):>8} | "
          f"{t['stream']['ttft_ms_sum']:>8.0f} {t['reencode']['ttft_ms_sum']:>8.0f} | "
          f"{t['stream']['ttft_ms_sum'] / t['reencode']['ttft_ms_sum']:>5.2f} |")
    print("(enc tok = encoder_tokens_encoded delta, in vision patches before the merge (Qwen2-VL: 4 per prompt "
          "token); prefix hit = prefix_cache_hit_tokens delta; computed = "
          "prompt_tokens_computed delta; ratio = median TTFT stream / reencode; same out = token ids equal in both "
          "modes and every round; a/b/c = the value differed between rounds)")
    last = summary["last_turn"]
    print(f"target: turn-{last['turn']} TTFT stream {last['ttft_stream_ms']:.0f} ms vs reencode "
          f"{last['ttft_reencode_ms']:.0f} ms = {last['ratio']:.3f}x (per round: "
          f"{', '.join(f'{x:.3f}' for x in last['ratio_rounds'])}); <= {last['target']}x: "
          f"{'met' if last['met'] else 'NOT met'}; identical outputs {summary['identical_outputs']} turns")


def json_line(machine: dict[str, Any], model: dict[str, Any], settings: dict[str, Any], summary: dict[str, Any],
              run_s: float) -> str:
    last = summary["last_turn"]
    per_turn = [{k: v for k, v in row.items() if k != "token_ids"} | {"token_ids": row["token_ids"]}
                for row in summary["per_turn"]]
    return json.dumps({"bench": "streaming_video", "machine": machine, "model_dir": model["dir"],
                       "model": model, "settings": settings, "per_turn": per_turn,
                       f"turn{last['turn']}": {k: last[k] for k in ("ttft_stream_ms", "ttft_reencode_ms", "ratio",
                                                                    "ratio_rounds", "target", "met", "split_ms")},
                       "identical_outputs": summary["identical_outputs"], "totals": summary["totals"],
                       "run_s": round(run_s, 1)}, separators=(",", ":"))

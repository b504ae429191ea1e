"""`benchmarks/peers/compare.py`'s rounds folded into one entry per system and format: medians of the
speeds, the rounds' agreement, greedy tokens against transformers' (first divergence per request), and
for structured outputs how many outputs parse and validate against the schema.

What it does not know: how the rounds ran (workers, venvs, threads) or how the entry is printed.
"""

from __future__ import annotations

import json
import statistics
from typing import Any


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 2) if vals else None


def validity(json_schema: dict, texts: list[str], finish_reasons: list[str | None]) -> dict[str, int]:
    """How many outputs finished and parse as JSON valid against the schema, and how many max_tokens cut."""
    import jsonschema

    finished = valid = 0
    for text, reason in zip(texts, finish_reasons):
        if reason == "length":
            continue
        finished += 1
        try:
            jsonschema.validate(json.loads(text), json_schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"outputs": len(texts), "finished": finished, "finished_valid": valid, "cut": len(texts) - finished}


def aggregate(rounds: list[dict[str, Any]], reference: list[list[int]] | None,
              json_schema: dict | None = None) -> dict[str, Any]:
    ok = [r for r in rounds if "error" not in r]
    entry: dict[str, Any] = {"rounds_ok": len(ok), "rounds": len(rounds)}
    if not ok:
        entry["error"] = rounds[-1]["error"] if rounds else "not run"
        entry["log_tail"] = rounds[-1].get("log_tail") if rounds else None
        return entry
    entry.update({
        "tokens_per_s": _median([r["tokens_per_s"] for r in ok]),
        "ttft_ms": _median([r.get("ttft_ms_median") for r in ok]),
        "decode_tokens_per_s": _median([r.get("decode_tokens_per_s") for r in ok]),
        "cold_call_s": _median([r.get("cold_call_s") for r in ok]),
        "load_s": _median([r.get("load_s") for r in ok]),
        "per_round": [{k: r.get(k) for k in ("tokens_per_s", "ttft_ms_median", "decode_tokens_per_s", "wall_s",
                                              "cold_call_s", "load_s", "process_s", "others_cores")} for r in ok],
        "others_cores": _median([r.get("others_cores") for r in ok]),
        "output_tokens": ok[0]["output_tokens"],
        "versions": ok[0].get("versions"),
        "ttft_dist_ms": [x for r in ok for x in r.get("ttft_ms", [])],
        "itl_dist_ms": [x for r in ok for x in r.get("itl_ms", [])],
        "itl_per_token": bool(ok[0].get("itl_per_token")),
    })
    floors = [r["floor"] for r in ok if r.get("floor")]
    if floors:  # the round that measured the machine fastest gives the lowest (strictest) floor
        entry["floor"] = min(floors, key=lambda f: f["floor_s"])
    for key in ("image_backend", "prompt_tokens_note", "gguf", "ld_preload", "engine_args"):
        if key in ok[0]:
            entry[key] = ok[0][key]
    if len(rounds) > len(ok):
        entry["failed_rounds"] = [r["error"] for r in rounds if "error" in r]
    lengths = {len(t) for r in ok for t in r["tokens"]}
    entry["output_lengths"] = sorted(lengths)
    # greedy outputs: the same in every round, and against transformers on the first requests
    entry["rounds_agree"] = all(r["tokens"] == ok[0]["tokens"] for r in ok)
    if json_schema is not None:
        entry["first_round_tokens"] = ok[0]["tokens"]
        entry["validity"] = validity(json_schema, ok[0].get("texts", []), ok[0].get("finish_reasons", []))
    if reference:
        n = min(len(reference), len(ok[0]["tokens"]))
        same = [ok[0]["tokens"][i] == reference[i] for i in range(n)]
        entry["identical"] = sum(same)
        entry["compared"] = n
        firsts = []
        for i in range(n):
            a, b = ok[0]["tokens"][i], reference[i]
            firsts.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if a == b else min(len(a), len(b))))
        entry["first_divergence"] = firsts
    return entry

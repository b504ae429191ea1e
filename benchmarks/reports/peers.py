"""The peer benchmark's report: the card, the table, the targets, the PNG and the one JSON line.

Role: render what `peers.py` measured; the targets are computed here from the measured medians
(nothing is hard-coded but the thresholds). What it does not know: how anything was measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.card import machine_line
from benchmarks.reports import plots

SPEEDUP_TARGET = 1.2  # mmserve / peer
BUSY_CORES = 0.25  # a measurement during which other processes kept more cores busy is flagged
LABELS = {"mmserve": "mmserve", "vllm": "vLLM-CPU", "llamacpp": "llama.cpp"}
# the peer each mmserve row is compared against: the format the peer's users run for the same bytes
# per weight (mmserve int8 weights against llama.cpp's Q8_0, int4 against Q4_0); batch int8 against
# mmserve's own float32 (quantization must not cost throughput)
PEER_OF = {("float32", "batch"): "vllm/float32/batch", ("bfloat16", "batch"): "vllm/bfloat16/batch",
           ("int8", "batch"): "mmserve/float32/batch", ("float32", "one"): "llamacpp/float32/one",
           ("int8", "one"): "llamacpp/q8_0/one", ("w8a8", "one"): "llamacpp/q8_0/one",
           ("int4", "one"): "llamacpp/q4_0/one", ("w4a8", "one"): "llamacpp/q4_0/one",
           ("int4_weight_only", "one"): "llamacpp/q4_0/one"}
INT8_BATCH_TARGET = 1.0  # mmserve int8 / mmserve float32 at batch
SHORT = {"float32": "f32", "bfloat16": "bf16", "int8": "int8", "int4": "int4", "w8a8": "w8a8", "w4a8": "w4a8",
         "int4_weight_only": "int4 (weight-only)",
         "q8_0": "Q8_0", "q4_0": "Q4_0"}


def _pair(name: str, mine: tuple[float | None, str | None], theirs: tuple[float | None, str | None],
          met: Any) -> dict[str, Any]:
    """A target comparing two measured (value, why-missing) pairs; `met(mine, theirs)` decides it."""
    (mm, why_mm), (peer, why_peer) = mine, theirs
    t: dict[str, Any] = {"name": name, "mmserve": mm, "peer": peer}
    if mm is None or peer is None:
        t.update(met=None, why=why_mm or why_peer)
    else:
        t.update(ratio=round(mm / peer, 3), met=met(mm, peer))
    return t


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _floor_check(mm: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """Whether the target is within reach at all: the wall it asks for (the peer's wall / target)
    against the FLOP floor of the work mmserve's call did (float32 only: the peak is float32's)."""
    floor = mm.get("floor")
    if not floor or not peer.get("tokens_per_s"):
        return {}
    needed_s = mm["output_tokens"] / (peer["tokens_per_s"] * SPEEDUP_TARGET)
    return {"wall_needed_s": round(needed_s, 3), "floor_s": floor["floor_s"],
            "peak_matmul_gflops": floor["peak_matmul_gflops"], "floor_gflop": floor["gflop"],
            "mmserve_wall_s": round(mm["output_tokens"] / mm["tokens_per_s"], 3)}


def targets(entries: dict[str, dict[str, Any]], status: dict[str, str] | None = None,
            structured: bool = False) -> list[dict[str, Any]]:
    """Each target: name, the measured value(s), met True/False, or None with why it was not measured.
    `structured`: the batch races under a JSON schema, and every output that finished must be valid."""
    out: list[dict[str, Any]] = []

    def get(key: str, field: str) -> tuple[float | None, str | None]:
        e = entries.get(key)
        if e is None:
            system = key.split("/")[0]
            if status and status.get(system, "ok") != "ok":
                return None, f"{LABELS[system]}: {status[system]}"
            return None, f"{key} not run"
        if "error" in e:
            return None, f"{key} failed"
        return e.get(field), (None if e.get(field) is not None else f"{key} has no {field}")

    for dtype in ("float32", "bfloat16"):
        mm, why_mm = get(f"mmserve/{dtype}/batch", "tokens_per_s")
        vl, why_vl = get(f"vllm/{dtype}/batch", "tokens_per_s")
        kind = "json_schema batch" if structured else "batch"
        t = {"name": f"{kind} {dtype}: mmserve tok/s >= {SPEEDUP_TARGET}x vLLM-CPU", "mmserve": mm, "peer": vl}
        if mm is None or vl is None:
            t.update(met=None, why=why_mm or why_vl)
        else:
            t.update(ratio=round(mm / vl, 3), met=mm / vl >= SPEEDUP_TARGET)
            t.update(_floor_check(entries[f"mmserve/{dtype}/batch"], entries[f"vllm/{dtype}/batch"]))
            mm_tokens, vl_tokens = (entries[f"{s}/{dtype}/batch"].get("first_round_tokens") for s in ("mmserve", "vllm"))
            if mm_tokens and vl_tokens:  # the same greedy tokens: both applied the grammar alike
                t["same_tokens"] = sum(a == b for a, b in zip(mm_tokens, vl_tokens))
        out.append(t)
    if structured:
        for key, e in entries.items():
            v = e.get("validity")
            t = {"name": f"{key}: every finished output valid against the schema", "validity": v}
            if not v:
                t.update(met=None, why=f"{key} failed")
            elif not v["finished"]:
                t.update(met=None, why=f"no output finished ({v['cut']} cut by max_tokens)")
            else:
                t.update(met=v["finished_valid"] == v["finished"])
            out.append(t)
        return out
    for fmt in ("float32", "int8", "w8a8", "int4", "w4a8", "int4_weight_only"):
        if fmt != "float32" and f"mmserve/{fmt}/one" not in entries:
            continue  # the quantized pairs are reported where they were asked for
        peer_key = PEER_OF[(fmt, "one")]
        peer_fmt = SHORT[peer_key.split("/")[1]]
        out.append(_pair(f"one at a time: mmserve {fmt} decode tok/s >= {SPEEDUP_TARGET}x llama.cpp {peer_fmt}",
                         get(f"mmserve/{fmt}/one", "decode_tokens_per_s"), get(peer_key, "decode_tokens_per_s"),
                         lambda mm, peer: mm / peer >= SPEEDUP_TARGET))
        out.append(_pair(f"one at a time: mmserve {fmt} TTFT <= llama.cpp {peer_fmt}",
                         get(f"mmserve/{fmt}/one", "ttft_ms"), get(peer_key, "ttft_ms"),
                         lambda mm, peer: mm <= peer))
    if "mmserve/int8/batch" in entries:
        out.append(_pair(f"batch: mmserve int8 tok/s >= {INT8_BATCH_TARGET}x mmserve float32",
                         get("mmserve/int8/batch", "tokens_per_s"), get("mmserve/float32/batch", "tokens_per_s"),
                         lambda mm, peer: mm / peer >= INT8_BATCH_TARGET))
    for mode in ("batch", "one"):
        e = entries.get(f"mmserve/float32/{mode}", {})
        t = {"name": f"float32 {mode}: mmserve identical to transformers on every compared request",
             "identical": e.get("identical"), "compared": e.get("compared")}
        if e.get("compared"):
            t["met"] = e["identical"] == e["compared"]
        else:
            t.update(met=None, why="no reference" if e and "error" not in e else "mmserve run failed or not run")
        out.append(t)
    return out


def print_card(card: dict[str, Any], results: dict[str, Any]) -> None:
    m = card["machine"]
    print("== mmserve peer benchmark ==")
    print(f"machine   : {machine_line(m)}")
    print(f"software  : mmserve venv: torch {m['torch']}, transformers {m['transformers']} (the reference); "
          f"{card['threads']} threads per system (torch.set_num_threads / OMP_NUM_THREADS / n_threads)")
    for s, st in card["status"].items():
        print(f"system    : {LABELS[s]:<10} {st}")
    for name, res in results.items():
        w = res["workload"]
        print(f"model     : {name}: {res['model_dir']}, {res['params'] / 1e6:.2f}M params; prompts "
              f"{w['prompt_tokens']['min']}-{w['prompt_tokens']['max']} tokens (mmserve's count)")
        for e in res["results"].values():
            if "versions" in e and e["system"] != "mmserve" and e.get("versions"):
                print(f"            {LABELS[e['system']]} {e['dtype']} {e['mode']}: "
                      + ", ".join(f"{k} {v}" for k, v in e["versions"].items())
                      + (f", image processor backend {e['image_backend']}" if e.get("image_backend") else ""))
        preloads = sorted({(LABELS[e["system"]], e["ld_preload"]) for e in res["results"].values()
                           if e.get("ld_preload")})
        for label, libs in preloads:
            print(f"            {label} preloads {libs}")
        engine_args = sorted({(e["mode"], ", ".join(f"{k}={v!r}" for k, v in e["engine_args"].items()))
                              for e in res["results"].values() if e.get("engine_args")})
        for mode, args in engine_args:
            flag = "  [not mmserve's default: compile_cpu_decode]" if "compile_cpu_decode" in args else ""
            print(f"            mmserve {mode}: LLM(model, {args}){flag}")
        for note in res["notes"]:
            print(f"            {note}")
    print(f"workload  : {card['requests']} requests, one synthetic image each ({w['image_side_px']['min']}-"
          f"{w['image_side_px']['max']} px sides, seed {w['seed']}), one question each, exactly "
          f"{card['output_tokens']} greedy output tokens (min = max, EOS ignored)")
    print(f"method    : each measurement a fresh subprocess with its system's own python; {card['rounds']} round(s), "
          "order reversed every other round; medians. Each process first runs one short warm-up request on a "
          "separate image (its time is 'cold call'), then the timed call(s).")
    print("            batch: all requests in one call, tok/s = output tokens / call wall; TTFT from the call's "
          "start. one: requests one after another; decode tok/s = sum(n-1) / sum(last - first token).")
    print(f"            greedy agreement: against transformers generate (float32, PIL image processor) on the "
          f"first {card['reference_requests']} requests. Shared machine: absolute numbers are noisy.")
    others = [r["others_cores"] for res in results.values() for e in res["results"].values()
              for r in e.get("per_round", []) if r.get("others_cores") is not None]
    if others:
        busy = [x for x in others if x > BUSY_CORES]
        print(f"noise     : load average at start {card['load_average_at_start']}; other processes kept "
              f"{max(others):.2f} cores busy at most during a measurement; {len(busy)} of {len(others)} "
              f"measurements had > {BUSY_CORES} cores busy elsewhere"
              + ("  <-- SHARED MACHINE: read the per-round values" if busy else ""))
    print(f"run dir   : {card['run_dir']} (workload, per-round JSON results, logs)")


def print_table(results: dict[str, Any]) -> None:
    head = (f"\n{'model':<6} {'system':<10} {'dtype':<9} {'mode':<6} {'tok/s':>8} {'TTFT ms':>9} {'decode t/s':>10} "
            f"{'ident.':>7} {'load s':>7} {'cold s':>7} {'others':>6} {'vs peer':>9}  note")
    print(head + "\n" + "-" * (len(head) + 10))
    for name, res in results.items():
        entries = res["results"]
        for e in entries.values():
            label = LABELS[e["system"]]
            if "error" in e:
                print(f"{name:<6} {label:<10} {e['dtype']:<9} {e['mode']:<6} {'FAILED':>8}  {e['error'][:160]}")
                continue
            ident = f"{e['identical']}/{e['compared']}" if e.get("compared") else "-"
            ratio = ""
            if e["system"] == "mmserve":
                peer = entries.get(PEER_OF.get((e["dtype"], e["mode"]), ""))
                if peer and "error" not in peer:
                    field = "tokens_per_s" if e["mode"] == "batch" else "decode_tokens_per_s"
                    if e.get(field) and peer.get(field):
                        ratio = f"{e[field] / peer[field]:.2f}x"
            note = "rounds " + "/".join(_fmt(r["tokens_per_s"]) + ("*" if (r.get("others_cores") or 0) > BUSY_CORES
                                                                        else "") for r in e["per_round"])
            if e.get("compared") and e["identical"] < e["compared"]:
                note += "; first divergence at token " + ",".join("-" if i is None else str(i)
                                                                   for i in e["first_divergence"])
            if not e.get("rounds_agree", True):
                note += "; outputs differ between rounds"
            if len(e.get("output_lengths", [])) > 1:
                note += f"; output lengths {e['output_lengths']}"
            if e.get("validity"):
                note += "; valid {finished_valid}/{finished} finished, {cut} cut".format(**e["validity"])
            if e.get("failed_rounds"):
                note += f"; {len(e['failed_rounds'])} round(s) failed"
            print(f"{name:<6} {label:<10} {e['dtype']:<9} {e['mode']:<6} {_fmt(e['tokens_per_s']):>8} "
                  f"{_fmt(e['ttft_ms']):>9} {_fmt(e.get('decode_tokens_per_s')):>10} {ident:>7} "
                  f"{_fmt(e.get('load_s'), '.1f'):>7} {_fmt(e.get('cold_call_s'), '.2f'):>7} {_fmt(e.get('others_cores'), '.2f'):>6} {ratio:>9}  {note}")
    print("(tok/s: output tokens per second of wall; batch rows: all requests in one call, one rows: end to end one "
          "at a time; TTFT: median; load s: engine construction (vLLM compiles here); cold s: the process's first (warm-up) call; others: cores other processes kept busy "
          f"meanwhile (median; * marks a round with > {BUSY_CORES}); ident.: greedy tokens equal to transformers' "
          "float32 ones; vs peer: mmserve over vLLM-CPU (batch tok/s; int8: over mmserve float32) or llama.cpp in the "
          "format of the same bits per weight (decode tok/s))")


def print_targets(results: dict[str, Any]) -> None:
    print("\ntargets:")
    for name, res in results.items():
        for t in res["targets"]:
            verdict = {True: "met", False: "NOT MET", None: "not measured"}[t["met"]]
            if "ratio" in t:
                detail = f"mmserve {_fmt(t['mmserve'])} vs {_fmt(t['peer'])} -> {t['ratio']:.2f}x"
                if "same_tokens" in t:
                    detail += f"; {t['same_tokens']} outputs token for token the same on both"
            elif "compared" in t and t.get("compared"):
                detail = f"{t['identical']}/{t['compared']} identical"
            elif t.get("validity"):
                v = t["validity"]
                detail = f"{v['finished_valid']}/{v['finished']} finished valid, {v['cut']} cut by max_tokens"
            else:
                detail = t.get("why", "")
            print(f"  [{name}] {t['name']}: {verdict} ({detail})")
            if "floor_s" in t:
                reach = "beyond the floor" if t["wall_needed_s"] < t["floor_s"] else "above the floor"
                print(f"      the target asks for a {t['wall_needed_s']:.2f} s call; the FLOP floor of its work is "
                      f"{t['floor_s']:.2f} s ({sum(t['floor_gflop'].values()):.0f} GFLOP at the measured "
                      f"{t['peak_matmul_gflops']:.0f} GFLOP/s peak; {reach}); mmserve took {t['mmserve_wall_s']:.2f} s")


def write_plot(results: dict[str, Any], path: Path) -> str:
    """tok/s per system and mode (bars, per-round range), TTFT and ITL distributions (box plots)."""
    plt = plots.pyplot()
    if plt is None:
        return plots.NOT_INSTALLED
    rows = [(model, e) for model, res in results.items() for e in res["results"].values() if "error" not in e]
    if not rows:
        return "not written: nothing measured"
    labels = [f"{m}\n{LABELS[e['system']]}\n{SHORT[e['dtype']]} {e['mode']}" for m, e in rows]
    colors = {"mmserve": "tab:blue", "vllm": "tab:orange", "llamacpp": "tab:green"}
    fig, axes = plt.subplots(3, 1, figsize=(max(8, 1.3 * len(rows)), 13))
    ax = axes[0]
    vals = [e["tokens_per_s"] for _, e in rows]
    lo = [v - min(r["tokens_per_s"] for r in e["per_round"]) for v, (_, e) in zip(vals, rows)]
    hi = [max(r["tokens_per_s"] for r in e["per_round"]) - v for v, (_, e) in zip(vals, rows)]
    ax.bar(range(len(rows)), vals, yerr=[lo, hi], color=[colors[e["system"]] for _, e in rows], capsize=3)
    dec = [(i, e["decode_tokens_per_s"]) for i, (_, e) in enumerate(rows) if e.get("decode_tokens_per_s")]
    if dec:
        ax.scatter([i for i, _ in dec], [v for _, v in dec], marker="_", s=400, color="black", label="decode tok/s")
        ax.legend()
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("output tokens/s (median, round range)")
    ax.set_title("throughput per system and mode")
    for ax, key, title in ((axes[1], "ttft_dist_ms", "TTFT per request (ms), all rounds"),
                           (axes[2], "itl_dist_ms", "inter-token latency (ms): per token where streamed, "
                                                    "else per-request mean")):
        data = [e.get(key) or [float("nan")] for _, e in rows]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(rows) + 1), labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(title)
    return plots.save(fig, path)


def json_line(card: dict[str, Any], results: dict[str, Any], plot_note: str, run_s: float) -> str:
    slim = {}
    for name, res in results.items():
        entries = {k: {f: v for f, v in e.items() if f not in ("ttft_dist_ms", "itl_dist_ms", "first_round_tokens")}
                   for k, e in res["results"].items()}
        slim[name] = dict(res, results=entries)
    return json.dumps({"bench": "peers", "card": card, "models": slim, "plot": plot_note,
                       "run_s": round(run_s, 1)}, separators=(",", ":"))

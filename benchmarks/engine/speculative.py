"""n-gram speculative decoding (prompt lookup) on against off, one request at a time and batched, and
against llama.cpp's prompt-lookup decoding on the same checkpoint and prompts.

Run: python -m benchmarks.engine.speculative [--rounds 3] [--max-tokens 128] [--no-llamacpp]
Role: the measured answer to the speculative-decoding targets, on the 30m bench checkpoint (random Qwen2-VL,
float32, mmserve's defaults otherwise). A random-weight model never quotes as a trained one does, but its
greedy output falls into loops after a short phrase repeated, where n-gram drafts find it. The workload
(fixed seed, the same every round, in `.bench/speculative/`): 12 quoting prompts (a phrase of 1-4 words
repeated to ~1000 characters; the prompts whose mean acceptance length, vLLM's 1 + accepted / drafts, is >= 3
form a row), 4 passages (the same words in random order: no phrase repeats in the prompt), and 32 other
quoting prompts for one batched `generate` call. Greedy, ignore_eos, max_tokens N. Each side is a fresh
subprocess (`--worker SIDE`), sides alternate order by round, medians. mmserve: `off`, `k3`, `k5`
(`{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}`; no batch-size
cutoff (`disable_by_batch_size` null); `k3` also batches at mmserve's default cutoff, 8); decode tok/s = (N - 1) / (last - first token) from
`RequestOutput.metrics`, ms a decode step from its inter-token latencies; batched: output tokens / the call's
wall time; every speculating answer must equal `off`'s. llama.cpp (llama-cpp-python in `.peers/llamacpp`, the
f32 GGUF `peers.compare` converted into `.peers/gguf/`): `Llama.generate` on the same token ids, greedy, 2
threads, tokens stamped; plain, then `LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=K)` (its
acceptance replayed with its own proposer). Each side's CPU seconds per wall second are reported.
Targets: quoting >= 1.5x off, >= 2.0x where acceptance >= 3; batch >= 0.95x off; >= 1.2x llama.cpp's PLD.

What it does not know: mmserve internals beyond `LLM.generate`, `get_stats` and the request metrics.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.card import BENCH_DIR, ROOT, json_line, machine_info, machine_line, print_card

MODEL = "30m"
BATCH = 32
LOOKUP = (1, 3)  # prompt_lookup_min, prompt_lookup_max (llama.cpp's max_ngram_size searches 3..1 too)
KS = (3, 5)
DISABLE_AT = 8  # mmserve's default (speculative.DEFAULT_DISABLE_BY_BATCH_SIZE; llama.cpp's worker has no mmserve)
WORDS = ("red blue green square circle large small left right above below the a photo of with near bright "
         "dark river city tree road").split()
WORKLOAD = BENCH_DIR / "speculative" / "workload.json"
LLAMA_PYTHON = ROOT / ".peers" / "llamacpp" / "bin" / "python"
TARGETS = {"quote": 1.5, "loop": 2.0, "batch": 0.95, "llamacpp": 1.2}
SPEC_SIDES = tuple(f"k{k}" for k in KS)
MM_SIDES = ("off", *SPEC_SIDES)
LLAMA_VARIANTS = ("plain", *(f"pld{k}" for k in KS))


def _texts(seed: int, n: int, chars: int, repeated: bool) -> list[str]:
    """`n` texts of ~`chars` characters: a phrase of 1-4 words repeated, or words in random order."""
    rng = random.Random(seed)
    phrases = [" ".join(rng.choice(WORDS) for _ in range(1 + i % 4)) + " " for i in range(n)]
    shuffled = lambda: " ".join(rng.choice(WORDS) for _ in range(chars // 6))  # noqa: E731
    return [p * (chars // len(p) + 1) if repeated else shuffled() for p in phrases]


def build_workload(model_dir: Path, max_tokens: int, gguf: Path | None) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = lambda texts: [tok(t)["input_ids"] for t in texts]  # noqa: E731
    kinds = ["quote"] * 12 + ["passage"] * 4
    work = {"model_dir": str(model_dir), "gguf": str(gguf) if gguf else None, "max_tokens": max_tokens,
            "kinds": kinds, "single": ids(_texts(1, 12, 1000, True) + _texts(2, 4, 1000, False)),
            "batch": ids(_texts(3, BATCH, 600, True)), "warm": ids(_texts(4, 1, 300, True))}
    WORKLOAD.parent.mkdir(parents=True, exist_ok=True)
    WORKLOAD.write_text(json.dumps(work))
    return work


def _cpu_timed(fn: Any, *args: Any) -> tuple[Any, float, float]:
    """`fn(*args)`, its wall seconds and the process's CPU seconds per wall second."""
    started, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    wall = time.perf_counter() - started
    return result, wall, (time.process_time() - cpu) / wall


def _spec(k: int | None, cutoff: bool = False) -> dict[str, Any] | None:
    extra = {} if cutoff else {"disable_by_batch_size": None}
    return None if k is None else {"method": "ngram", "num_speculative_tokens": k, **extra,
                                   "prompt_lookup_min": LOOKUP[0], "prompt_lookup_max": LOOKUP[1]}


def _token_prompts(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": ids} for ids in prompts]


def _one_at_a_time(llm: Any, prompts: list[list[int]], params: Any) -> list[dict[str, Any]]:
    """Each prompt alone: tokens, first-token and decode seconds, decode steps, drafts and accepted tokens."""
    def _spec_counts(llm: Any) -> tuple[int, int]:
        stats = llm.get_stats()
        return stats.get("spec_decode_num_drafts", 0), stats.get("spec_decode_num_accepted_tokens", 0)

    records = []
    for ids in prompts:
        before = _spec_counts(llm)
        out = llm.generate(_token_prompts([ids]), params, use_tqdm=False)[0]
        after, m = _spec_counts(llm), out.metrics
        first, last = m.first_token_time, m.last_token_time or m.finish_time
        records.append({"tokens": list(out.outputs[0].token_ids), "ttft_s": first - m.arrival_time,
                        "decode_s": last - first, "steps": len(m.inter_token_latencies_s),
                        "drafts": after[0] - before[0], "accepted": after[1] - before[1]})
    return records


def _batched(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    outs, wall, cores = _cpu_timed(llm.generate, _token_prompts(prompts), params, False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"tokens": tokens, "wall_s": wall, "cores": cores, "tok_per_s": sum(map(len, tokens)) / wall}


def worker_mmserve(side: str, work: dict[str, Any]) -> dict[str, Any]:
    import torch

    from benchmarks.checkpoints import kv_cache_bytes
    from mmserve import LLM, SamplingParams

    k = None if side == "off" else int(side[1:])
    params = SamplingParams(temperature=0, max_tokens=work["max_tokens"], ignore_eos=True)
    model_dir = Path(work["model_dir"])
    kv = kv_cache_bytes(model_dir, BATCH, work["max_tokens"])  # room for the whole batch: nothing preempted
    out: dict[str, Any] = {"threads": torch.get_num_threads()}
    engines = [("batch", _spec(k))] + ([("batch_disabled", _spec(k, cutoff=True))] if k == KS[0] else [])
    for key, config in engines:  # the second: speculation off while >= DISABLE_AT requests run
        with LLM(str(model_dir), speculative_config=config, kv_cache_bytes=kv) as llm:
            llm.generate(_token_prompts(work["warm"] * 2), params, use_tqdm=False)
            if key == "batch":
                out["single"], _, cores = _cpu_timed(_one_at_a_time, llm, work["single"], params)
                out["single_cores"] = cores
            out[key] = _batched(llm, work["batch"], params)
    return out


def _llama_one(llm: Any, ids: list[int], n: int) -> dict[str, Any]:
    started, tokens, stamps = time.perf_counter(), [], []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        tokens.append(int(token))
        if len(tokens) >= n:
            break
    return {"tokens": tokens, "ttft_s": stamps[0] - started, "decode_s": stamps[-1] - stamps[0]}


def _llama_acceptance(draft: Any, prompt: list[int], out: list[int]) -> tuple[int, int]:
    """(drafts, accepted tokens) of llama-cpp-python's loop: its proposer sees the context up to the newest
    token; the drafts that match the greedy tokens are accepted, then one more token comes."""
    context, i, drafts, accepted = list(prompt) + out[:1], 1, 0, 0
    while i < len(out):
        proposal = [int(t) for t in draft(np.array(context, dtype=np.intc))]
        n = 0
        while n < len(proposal) and i + n < len(out) and proposal[n] == out[i + n]:
            n += 1
        drafts, accepted = drafts + bool(proposal), accepted + n
        context += out[i:i + n + 1]
        i += n + 1
    return drafts, accepted


def worker_llamacpp(work: dict[str, Any], round_index: int) -> dict[str, Any]:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp._internals import LlamaSampler
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def greedy(**_kwargs: Any) -> Any:  # generate() builds its sampler through this: the argmax alone
        sampler = LlamaSampler()
        sampler.add_greedy()
        return sampler

    out: dict[str, Any] = {"threads": 2, "version": llama_cpp.__version__}
    for name in (LLAMA_VARIANTS if round_index % 2 == 0 else LLAMA_VARIANTS[::-1]):
        k = None if name == "plain" else int(name[3:])
        draft = LlamaPromptLookupDecoding(max_ngram_size=LOOKUP[1], num_pred_tokens=k) if k else None
        # logits_all with a draft: llama-cpp-python sizes its scores by the argument, not by the draft (a bug)
        llm = Llama(model_path=work["gguf"], n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2,
                    n_threads_batch=2, seed=0, draft_model=draft, logits_all=bool(draft), verbose=False)
        llm._init_sampler = greedy
        _llama_one(llm, work["warm"][0], 8)
        records, _, cores = _cpu_timed(lambda m=llm: [_llama_one(m, ids, work["max_tokens"])
                                                      for ids in work["single"]])
        for record, ids in zip(records, work["single"]):
            counts = _llama_acceptance(draft, ids, record["tokens"]) if k else (0, 0)
            record["drafts"], record["accepted"] = counts
        out[name], out[f"{name}_cores"] = records, cores
        llm.close()
    return out


def _run_worker(side: str, round_index: int) -> dict[str, Any]:
    python = str(LLAMA_PYTHON) if side == "llamacpp" else sys.executable
    proc = subprocess.run([python, "-m", "benchmarks.engine.speculative", "--worker", side, "--round",
                           str(round_index)], capture_output=True, text=True, check=False, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {side} failed: {proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _gguf(model_dir: Path) -> tuple[Path | None, str]:
    """The f32 GGUF `peers.compare` converted for this checkpoint, or None and why not."""
    from benchmarks.peers.compare import checkpoint_hash

    if not LLAMA_PYTHON.is_file():
        return None, f"no llama.cpp venv at {LLAMA_PYTHON.parent.parent} (scripts/setup_peers.sh)"
    path = ROOT / ".peers" / "gguf" / checkpoint_hash(model_dir) / "model-f32.gguf"
    if not path.is_file():
        return None, f"no {path.relative_to(ROOT)}: run benchmarks.peers.compare --models {MODEL} once"
    return path, ""


def _per_prompt(rounds: list[dict[str, Any]], side: str, key: str) -> list[dict[str, Any]]:
    """Per prompt: the median decode and first-token seconds; the first round's tokens and draft counts."""
    runs = [r[side][key] for r in rounds]
    return [dict(runs[0][i], decode_s=statistics.median(run[i]["decode_s"] for run in runs),
                 ttft_s=statistics.median(run[i]["ttft_s"] for run in runs)) for i in range(len(runs[0]))]


def _bin(records: list[dict[str, Any]], idx: list[int]) -> dict[str, Any]:
    """Decode tok/s over the prompts `idx` (their tokens after the first over their decode seconds), the mean
    acceptance length (vLLM's), ms per decode step where steps are known."""
    chosen = [records[i] for i in idx]
    decode_tokens, decode_s = sum(len(r["tokens"]) - 1 for r in chosen), sum(r["decode_s"] for r in chosen)
    drafts, accepted = sum(r.get("drafts", 0) for r in chosen), sum(r.get("accepted", 0) for r in chosen)
    steps = sum(r.get("steps", 0) for r in chosen)
    return {"prompts": len(idx), "tok_per_s": decode_tokens / decode_s if decode_s else 0.0,
            "acceptance": 1 + accepted / drafts if drafts else 1.0,
            "ms_per_step": 1e3 * decode_s / steps if steps else None,
            "tokens_per_step": decode_tokens / steps if steps else None,
            "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in chosen) if chosen else None}


def _identical(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Every speculating answer against `off`'s of the same round, prompt by prompt; llama.cpp's answers equal
    to mmserve's (float numerics differ: informative, not a target)."""
    out: dict[str, Any] = {"checked": 0, "differ": 0}
    def _answers(res: dict[str, Any], key: str) -> list[list[int]]:
        return [x["tokens"] for x in res[key]] if isinstance(res[key], list) else res[key]["tokens"]
    for r in rounds:
        for side, key in ((s, k) for s in SPEC_SIDES for k in ("single", "batch", "batch_disabled")):
            if key in r[side]:
                ref, got = _answers(r["off"], key.replace("_disabled", "")), _answers(r[side], key)
                out["checked"] += len(ref)
                out["differ"] += sum(a != b for a, b in zip(ref, got, strict=True))
        if "llamacpp" in r:
            ref = _answers(r["off"], "single")
            out["llamacpp_equal"] = {v: sum(a == b for a, b in zip(ref, _answers(r["llamacpp"], v)))
                                     for v in LLAMA_VARIANTS}
    out["identical"] = out["checked"] > 0 and out["differ"] == 0
    return out


def _one_at_a_time_summary(rounds: list[dict[str, Any]], kinds: list[str]) -> dict[str, Any]:
    """Per K: the quoting prompts, those of them whose acceptance is >= 3, the passages: each side's bin."""
    quote, passage = ([i for i, k in enumerate(kinds) if k == kind] for kind in ("quote", "passage"))
    off, out = _per_prompt(rounds, "off", "single"), {}
    llama = {v: _per_prompt(rounds, "llamacpp", v) for v in LLAMA_VARIANTS} if "llamacpp" in rounds[0] else {}
    for k in KS:
        on = _per_prompt(rounds, f"k{k}", "single")
        per_prompt = [_bin(on, [i])["acceptance"] for i in quote]
        speedups = [_bin(on, [i])["tok_per_s"] / _bin(off, [i])["tok_per_s"] for i in quote]
        bins = {"quote": quote, "loop": [i for i, a in zip(quote, per_prompt) if a >= 3], "passage": passage}
        row: dict[str, Any] = {"acceptance_per_prompt": [round(a, 2) for a in per_prompt],
                               "speedup_per_prompt": [round(x, 2) for x in speedups]}
        for name, idx in bins.items():
            cell = {"off": _bin(off, idx), "on": _bin(on, idx)}
            if llama:
                cell |= {"llama_plain": _bin(llama["plain"], idx), "llama_pld": _bin(llama[f"pld{k}"], idx)}
            a, b, c = (cell.get(x, {}).get("tok_per_s") for x in ("on", "off", "llama_pld"))
            cell |= {"on_over_off": a / b if a and b else None,
                     "on_over_llama_pld": a / c if a and c else None}
            row[name] = cell
        out[f"k{k}"] = row
    return out


def _summary(rounds: list[dict[str, Any]], kinds: list[str]) -> dict[str, Any]:
    med = lambda side, key: statistics.median(r[side][key]["tok_per_s"] for r in rounds)  # noqa: E731
    cores = lambda side, key: round(statistics.median(  # noqa: E731
        r[side][key] if "_" in key else r[side][key]["cores"] for r in rounds), 2)
    s: dict[str, Any] = {"one_at_a_time": _one_at_a_time_summary(rounds, kinds)}
    s["batch"] = {"off": med("off", "batch"), **{side: med(side, "batch") for side in SPEC_SIDES},
                  f"k{KS[0]}_disable{DISABLE_AT}": med(f"k{KS[0]}", "batch_disabled")}
    s["batch_over_off"] = {name: v / s["batch"]["off"] for name, v in s["batch"].items()}
    s["cores"] = {side: cores(side, "single_cores") for side in MM_SIDES}
    s["batch_cores"] = {side: cores(side, "batch") for side in MM_SIDES}
    s["cores"] |= {f"llamacpp_{v}": cores("llamacpp", f"{v}_cores") for v in LLAMA_VARIANTS
                   if "llamacpp" in rounds[0]}
    s |= {"threads": {"mmserve": rounds[-1]["off"]["threads"], "llamacpp": 2}, "equality": _identical(rounds)}
    ok = lambda value, goal: None if value is None else value >= goal  # noqa: E731
    rows = {k: s["one_at_a_time"][f"k{k}"] for k in KS}
    s["met"] = {f"k{k}_{name}": ok(row[cell][key], TARGETS[name]) for k, row in rows.items()
                for name, cell, key in (("quote", "quote", "on_over_off"), ("loop", "loop", "on_over_off"),
                                        ("llamacpp", "quote", "on_over_llama_pld"))}
    s["met"] |= {f"batch_{n}": ok(v, TARGETS["batch"]) for n, v in s["batch_over_off"].items() if n != "off"}
    return s


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _print_card(s: dict[str, Any], work: dict[str, Any], rounds: int, machine: dict[str, Any],
                note: str) -> None:
    eq, lengths = s["equality"], [len(ids) for ids in work["single"]]
    used = (*s["cores"].values(), *s["batch_cores"].values())
    contended = any(v < 0.9 * s["threads"]["mmserve"] for v in used)
    llama = f"; llama.cpp equal, of {len(lengths)}: {eq['llamacpp_equal']}" if "llamacpp_equal" in eq else ""
    print_card("mmserve n-gram speculative decoding benchmark", {
        "machine": machine_line(machine) + f", torch {machine['torch']}",
        "model": f"{MODEL} bench checkpoint (random Qwen2-VL, {Path(work['model_dir']).name}), float32",
        "workload": f"one at a time: 12 quoting prompts (a 1-4 word phrase repeated; {min(lengths)}-"
                    f"{max(lengths)} tokens) + 4 passages; batch: {BATCH} quoting prompts, one call; greedy, "
                    f"ignore_eos, max_tokens {work['max_tokens']}",
        "spec": f"ngram, K = num_speculative_tokens {' and '.join(map(str, KS))}, prompt_lookup_min/max "
                f"{LOOKUP[0]}/{LOOKUP[1]}; llama.cpp: LlamaPromptLookupDecoding(max_ngram_size={LOOKUP[1]}, "
                "num_pred_tokens=K)" + (f" [llama.cpp left out: {note}]" if note else ""),
        "method": f"{rounds} rounds, fresh process per side, alternating order, medians; decode tok/s = "
                  "(tokens - 1) / (last - first token); batch: output tokens / the call's wall time",
        "threads": f"{s['threads']}; CPU s per wall s while measured: one at a time {s['cores']}, batch "
                   f"{s['batch_cores']}" + (" (fewer than the threads: other work shared the cores)"
                                            if contended else ""),
        "identical": f"{'yes' if eq['identical'] else 'NO'} ({eq['checked'] - eq['differ']}/{eq['checked']} "
                     "speculating answers equal off's, all rounds, alone and batched)" + llama})


def _print_tables(s: dict[str, Any]) -> None:
    print("one request at a time: decode tok/s, acceptance (1 + accepted/drafts), ms a decode step (off/on)")
    print(f"{'K':>2} {'prompts':<23} {'off':>7} {'on':>7} {'on/off':>7} {'accept':>6} {'ms/step':>11} "
          f"{'llama':>7} {'llamaPLD':>8} {'accept':>6} {'on/PLD':>7}")
    for k in KS:
        row = s["one_at_a_time"][f"k{k}"]
        for name, label in (("quote", "quoting"), ("loop", "quoting, accept >= 3"), ("passage", "passages")):
            c = row[name]
            plain, pld = c.get("llama_plain", {}), c.get("llama_pld", {})
            on, off = c["on"], c["off"]
            print(f"{k:>2} {label:<19}{on['prompts']:>4} {off['tok_per_s']:>7.1f} {on['tok_per_s']:>7.1f} "
                  f"{_fmt(c['on_over_off'], '.2f'):>6}x {on['acceptance']:>6.2f} "
                  f"{_fmt(off['ms_per_step'], '.2f'):>5}/{_fmt(on['ms_per_step'], '.2f'):<5} "
                  f"{_fmt(plain.get('tok_per_s')):>7} {_fmt(pld.get('tok_per_s')):>8} "
                  f"{_fmt(pld.get('acceptance'), '.2f'):>6} {_fmt(c['on_over_llama_pld'], '.2f'):>6}x")
        print(f"   K={k} per quoting prompt: acceptance {row['acceptance_per_prompt']}")
        print(f"       on/off per quoting prompt: {row['speedup_per_prompt']}")
    quote = s["one_at_a_time"][f"k{KS[0]}"]["quote"]
    print(f"   first token (median ms, quoting): off {quote['off']['ttft_ms']:.1f}, K={KS[0]} "
          f"{quote['on']['ttft_ms']:.1f}, llama.cpp {_fmt(quote.get('llama_plain', {}).get('ttft_ms'))}\n")
    print(f"batch of {BATCH} in one generate call: output tok/s")
    for name, value in s["batch"].items():
        print(f"  {name:<12} {value:>8.1f}  {s['batch_over_off'][name]:.3f}x off")
    yes, met = {True: "yes", False: "NO", None: "-"}, s["met"]
    print("\ntargets: " + "; ".join(
        f"K={k} quoting >= {TARGETS['quote']}x {yes[met[f'k{k}_quote']]}, accept >= 3 >= {TARGETS['loop']}x "
        f"{yes[met[f'k{k}_loop']]}, >= {TARGETS['llamacpp']}x llama.cpp PLD {yes[met[f'k{k}_llamacpp']]}"
        for k in KS) + "; " + ", ".join(f"{key} >= {TARGETS['batch']}x {yes[v]}" for key, v in met.items()
                                         if key.startswith("batch_")))
    print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp's side out")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # one side, in a fresh process
        work = json.loads(WORKLOAD.read_text())
        print(json.dumps(worker_llamacpp(work, args.round) if args.worker == "llamacpp"
                         else worker_mmserve(args.worker, work)))
        return
    from benchmarks.checkpoints import ensure_checkpoint

    model_dir = ensure_checkpoint(MODEL)
    gguf, note = (None, "--no-llamacpp") if args.no_llamacpp else _gguf(model_dir)
    work = build_workload(model_dir, args.max_tokens, gguf)
    sides = [*MM_SIDES] + (["llamacpp"] if gguf else [])
    rounds: list[dict[str, Any]] = [{} for _ in range(args.rounds)]
    for r, result in enumerate(rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            print(f"[speculative] round {r + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
            result[side] = _run_worker(side, r)
    (WORKLOAD.parent / "rounds.json").write_text(json.dumps(rounds))  # the raw measurements
    summary, machine = _summary(rounds, work["kinds"]), machine_info()
    _print_card(summary, work, args.rounds, machine, note)
    _print_tables(summary)
    json_line({"bench": "speculative", "model": MODEL, "max_tokens": args.max_tokens, "lookup": list(LOOKUP),
               "llamacpp_note": note or None, **summary, "rounds": args.rounds, "machine": machine},
              compact=True)


if __name__ == "__main__":
    main()

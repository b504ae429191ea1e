"""Speculative decoding with a draft model (method `draft_model`) on against off, one request at a time and
at batch 32: a truncated drafter, a self-draft control for the bound, and a constructed pair that agrees on
every token, which answers the 2.0x target; and where a drafted step's time goes.

Run: python -m benchmarks.engine.speculative_draft [--rounds 3] [--max-tokens 96] [--draft-layers 1] [--k 3]
Role: the measured answer to the draft-model targets, on the 30m bench checkpoint (random Qwen2-VL, 6
decoder layers, float32, mmserve's defaults otherwise). Drafters: `truncated_copy` of it (its first
`--draft-layers` decoder layers, the same embeddings, head, vision tower and tokenizer), which seldom agrees
with a random target; the target itself (`self`: acceptance K + 1 by construction at the target's cost, the
bound of the speed-up then; a control, never a drafter that meets a target); and the constructed pair of
`successor_pair`: a target of the 30m checkpoint's shapes (so its step costs what the 30m model's does) and a
1-layer, 64-wide drafter, both with their layers' output projections zero and a head that makes the greedy
next token succ(token) for one seeded permutation `succ`, whatever the context (acceptance K + 1, each
checked when built). All built once, in `.bench/speculative_draft/`. The workload (fixed seed, the same every
round, in that folder too): the first 6 quoting prompts of `benchmarks.engine.speculative` one at a time,
max_tokens N; 32 other quoting prompts in one batched `generate` call, max_tokens 64. Greedy, ignore_eos.
Each side is a fresh subprocess (`--worker SIDE`), sides alternate order by round, medians. Sides: `off` and
`pair_off` (no speculation on the 30m and on the constructed target); `draft` (`{"method": "draft_model",
"model": the truncated copy, "num_speculative_tokens": K, "disable_by_batch_size": null}`, batched also at
mmserve's default cutoff, 8); `self` (K, one at a time only); `pair3`, `pair5` (the pair at K = 3 and 5,
mmserve's default cutoff). x off: against speculation off on the same target. A request whose acceptance
collapses (mmserve: under 10% of 32 draft tokens or more) drafts no more. Decode tok/s = (N - 1) / (last -
first token) from `RequestOutput.metrics`; acceptance = vLLM's 1 + accepted / drafts from `get_stats`;
batched: output tokens / the call's wall time; every speculating answer must equal its off side's, and the
constructed target's must follow succ. Profile (an untimed pass after the timed one, one at a time):
`DraftModelProposer.propose` wrapped in the worker; per drafted step (not a request's first), the seconds in
it, the target's forward of that step (`llm.engine.inspect().last_step.forward_s`: verification with its
logits and sampling) and the step's cycle (from the last proposal's end to this one's).
Targets: one at a time >= 2.0x off where acceptance >= 3 (judged on the pair's sides); batch 32 >= 0.95x off
(the truncation without a cutoff and at 8, the pair at 8).

What it does not know: mmserve internals beyond `LLM.generate`, `get_stats`, the request metrics, the
proposer's entry point and the last step's timing; a trained drafter's acceptance (the pair's is built in,
the truncation's is a random model's); other work on the machine (the CPU seconds per wall second in the
card tell of it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.card import BENCH_DIR, ROOT, json_line, machine_info, machine_line, print_card
from benchmarks.engine.speculative import (
    BATCH,
    DISABLE_AT,
    MODEL,
    _batched,
    _bin,
    _cpu_timed,
    _fmt,
    _one_at_a_time,
    _per_prompt,
    _texts,
    _token_prompts,
)

OUT_DIR = BENCH_DIR / "speculative_draft"
WORKLOAD = OUT_DIR / "workload.json"
PROMPTS = 6  # quoting prompts, one at a time
BATCH_MAX_TOKENS = 64
PAIR_KS = (3, 5)  # the constructed pair's num_speculative_tokens, a side each
PAIR_SIDES = tuple(f"pair{k}" for k in PAIR_KS)
SPEC_SIDES = ("draft", "self", *PAIR_SIDES)
SIDES = ("off", "draft", "self", "pair_off", *PAIR_SIDES)
TARGETS = {"loop": 2.0, "batch": 0.95}


def build_workload(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The prompts' token ids, the truncated drafter and the constructed pair (each built once)."""
    from transformers import AutoTokenizer

    from benchmarks.checkpoints import parameter_count
    from benchmarks.engine.successor_pair import ensure_pair
    from testkit.drafters import truncated_copy

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = lambda texts: [tok(t)["input_ids"] for t in texts]  # noqa: E731
    drafter = truncated_copy(model_dir, OUT_DIR / f"{model_dir.name}-{args.draft_layers}l", args.draft_layers)
    pair_target, pair_drafter, info = ensure_pair(model_dir)
    config = json.loads((model_dir / "config.json").read_text())["text_config"]
    work = {"model_dir": str(model_dir), "drafter": str(drafter), "k": args.k, "max_tokens": args.max_tokens,
            "single": ids(_texts(1, 12, 1000, True)[:PROMPTS]), "batch": ids(_texts(3, BATCH, 600, True)),
            "warm": ids(_texts(4, 1, 300, True)), "layers": {"target": config["num_hidden_layers"],
                                                              "draft": args.draft_layers},
            "pair": {"target": str(pair_target), "drafter": str(pair_drafter), "info": info},
            "params": {"target": parameter_count(model_dir), "draft": parameter_count(drafter),
                       "pair_drafter": parameter_count(pair_drafter)}}
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    WORKLOAD.write_text(json.dumps(work))
    return work


def _spec(drafter: str, k: int, cutoff: bool = False) -> dict[str, Any]:
    extra = {} if cutoff else {"disable_by_batch_size": None}
    return {"method": "draft_model", "model": drafter, "num_speculative_tokens": k, **extra}


def _engines(side: str, work: dict[str, Any]) -> list[tuple[str, str, dict[str, Any] | None]]:
    """The engines a side runs, in order: (key, target checkpoint, speculative_config); the first runs the
    prompts one at a time too. The pair's sides batch at mmserve's default cutoff only."""
    model, pair = work["model_dir"], work["pair"]
    if side in ("off", "pair_off"):
        return [("batch", pair["target"] if side == "pair_off" else model, None)]
    if side in PAIR_SIDES:
        return [("batch", pair["target"], _spec(pair["drafter"], int(side[4:]), cutoff=True))]
    drafter = work["drafter"] if side == "draft" else model
    cutoff = [("batch_disabled", model, _spec(drafter, work["k"], cutoff=True))] if side == "draft" else []
    return [("batch", model, _spec(drafter, work["k"])), *cutoff]


def _profile(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, float]:
    """One untimed pass of the prompts one at a time, the proposer wrapped. Over the drafted steps (each
    proposal after a request's first, whose proposal feeds the drafter the whole prompt): the drafter's
    seconds, the target's forward seconds of the step, and the step's whole cycle (from the request's last
    proposal's end to this one's); the pass's drafts and accepted tokens, its decode tokens."""
    from mmserve.runner.draft_model import DraftModelProposer

    original, ended = DraftModelProposer.propose, {}
    spent = {"drafter_s": 0.0, "verify_s": 0.0, "cycle_s": 0.0, "steps": 0}

    def timed(self: Any, requests: Any, wanted: Any, *args: Any, **kwargs: Any) -> Any:
        step, started, key = llm.engine.inspect().last_step, time.perf_counter(), tuple(sorted(wanted))
        drafts = original(self, requests, wanted, *args, **kwargs)
        now = time.perf_counter()
        if key and key in ended:
            spent["drafter_s"] += now - started
            spent["verify_s"] += step.forward_s
            spent["cycle_s"] += now - ended[key]
            spent["steps"] += 1
        ended[key] = now
        return drafts

    DraftModelProposer.propose = timed
    try:
        records = _one_at_a_time(llm, prompts, params)
    finally:
        DraftModelProposer.propose = original
    return spent | {key: sum(r[key] for r in records) for key in ("drafts", "accepted")} | {
        "tokens": sum(len(r["tokens"]) - 1 for r in records)}


def worker(side: str, work: dict[str, Any]) -> dict[str, Any]:
    import torch

    from benchmarks.checkpoints import kv_cache_bytes
    from mmserve import LLM, SamplingParams

    single = SamplingParams(temperature=0, max_tokens=work["max_tokens"], ignore_eos=True)
    batch = SamplingParams(temperature=0, max_tokens=BATCH_MAX_TOKENS, ignore_eos=True)
    kv = kv_cache_bytes(Path(work["model_dir"]), BATCH, BATCH_MAX_TOKENS)  # the whole batch at once
    out: dict[str, Any] = {"threads": torch.get_num_threads()}
    for key, target, config in _engines(side, work):  # batch_disabled: spec off while >= DISABLE_AT run
        with LLM(target, speculative_config=config, kv_cache_bytes=kv) as llm:
            llm.generate(_token_prompts(work["warm"] * 2), single, use_tqdm=False)
            if key == "batch":
                timed = _cpu_timed(_one_at_a_time, llm, work["single"], single)
                out["single"], out["single_cores"] = timed[0], timed[2]
                if config is not None:
                    out["profile"] = _profile(llm, work["single"], single)
            if side != "self":  # the control bounds the one-at-a-time speed-up only
                out[key] = _batched(llm, work["batch"], batch)
    return out


def _run_worker(side: str, round_index: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.engine.speculative_draft", "--worker", side]
    proc = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {side} (round {round_index + 1}) failed: {proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _ref(side: str) -> str:
    """The side a speculating side is compared with: speculation off on the same target."""
    return "pair_off" if side in PAIR_SIDES else "off"


def _answers(result: dict[str, Any], key: str) -> list[list[int]]:
    return [x["tokens"] for x in result[key]] if key == "single" else result[key]["tokens"]


def _identical(rounds: list[dict[str, Any]], work: dict[str, Any]) -> dict[str, Any]:
    """Every speculating answer against speculation off's on its target, in the same round (the first that
    differs, if any); and how many of the constructed target's answers follow `succ` from the prompt."""
    from benchmarks.engine.successor_pair import successor

    out: dict[str, Any] = {"checked": 0, "differ": 0, "first_difference": None}
    for r, result in enumerate(rounds):
        for side, key in ((s, k) for s in SPEC_SIDES for k in ("single", "batch", "batch_disabled")):
            if key not in result[side]:
                continue
            ref = _answers(result[_ref(side)], key.replace("_disabled", ""))
            for i, (a, b) in enumerate(zip(ref, _answers(result[side], key), strict=True)):
                out["checked"] += 1
                if a != b:
                    out["differ"] += 1
                    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    out["first_difference"] = out["first_difference"] or {
                        "round": r + 1, "side": side, "key": key, "prompt": i, "token": at}
    succ = successor(work["pair"]["info"]["vocab_size"], work["pair"]["info"]["special"]).tolist()
    chains = [[p[-1], *a] for key in ("single", "batch") for p, a in
              zip(work[key], _answers(rounds[0]["pair_off"], key), strict=True)]
    out["pair_follows_succ"] = [sum(all(succ[x] == y for x, y in zip(c, c[1:])) for c in chains), len(chains)]
    out["identical"] = out["checked"] > 0 and out["differ"] == 0
    return out


def _profile_summary(rounds: list[dict[str, Any]], side: str) -> dict[str, float]:
    """A drafted step (medians over rounds): its ms in the drafter, in the target's forward (verification),
    the rest (scheduling, batch building, output) and in all; the tokens it yields (1 + accepted / drafts),
    ms per token it yields, and the share of the decode tokens drafted steps yielded (a request whose
    acceptance collapsed, under 10% of 32 draft tokens, drafts no more)."""
    med = lambda f: statistics.median(f(r[side]["profile"]) for r in rounds)  # noqa: E731
    cycle, drafter, verify = (med(lambda p, k=k: 1e3 * p[k] / p["steps"])
                              for k in ("cycle_s", "drafter_s", "verify_s"))
    tokens = med(lambda p: 1 + p["accepted"] / p["drafts"])
    return {"step_ms": cycle, "drafter_ms": drafter, "verify_ms": verify, "rest_ms": cycle - drafter - verify,
            "drafter_share": drafter / cycle, "verify_share": verify / cycle, "tokens_per_step": tokens,
            "ms_per_token": cycle / tokens,
            "drafted_token_share": med(lambda p: (p["drafts"] + p["accepted"]) / p["tokens"])}


def _single(rounds: list[dict[str, Any]], side: str) -> dict[str, Any]:
    """A speculating side one request at a time against speculation off on its target: its bin of every
    prompt, x off, per prompt acceptance and x off, x off over the prompts at acceptance >= 3 (None: none)."""
    on, off = _per_prompt(rounds, side, "single"), _per_prompt(rounds, _ref(side), "single")
    every = list(range(len(on)))
    alone = [(_bin(on, [i]), _bin(off, [i])) for i in every]
    loop = [i for i, (a, _) in zip(every, alone) if a["acceptance"] >= 3]
    row = {"on": _bin(on, every), "acceptance_per_prompt": [round(a["acceptance"], 2) for a, _ in alone],
           "x_off_per_prompt": [round(a["tok_per_s"] / b["tok_per_s"], 2) for a, b in alone],
           "accept_ge_3_prompts": len(loop)}
    row["x_off"] = row["on"]["tok_per_s"] / _bin(off, every)["tok_per_s"]
    row["x_off_accept_ge_3"] = _bin(on, loop)["tok_per_s"] / _bin(off, loop)["tok_per_s"] if loop else None
    return row


def _summary(rounds: list[dict[str, Any]], work: dict[str, Any]) -> dict[str, Any]:
    every = list(range(len(work["single"])))
    s: dict[str, Any] = {"off": {side: _bin(_per_prompt(rounds, side, "single"), every)
                                 for side in ("off", "pair_off")}}
    s["single"] = {side: _single(rounds, side) for side in SPEC_SIDES}
    s["profile"] = {side: _profile_summary(rounds, side) for side in SPEC_SIDES}
    rows = {"off": ("off", "batch"), "draft_null": ("draft", "batch"),  # name: (side, key)
            f"draft_cutoff{DISABLE_AT}": ("draft", "batch_disabled"), "pair_off": ("pair_off", "batch"),
            **{f"{side}_cutoff{DISABLE_AT}": (side, "batch") for side in PAIR_SIDES}}
    tps = lambda r, name: r[rows[name][0]][rows[name][1]]["tok_per_s"]  # noqa: E731
    s["batch"] = {name: statistics.median(tps(r, name) for r in rounds) for name in rows}
    ref = {name: _ref(rows[name][0]) for name in rows if not name.endswith("off")}
    s["batch_x_off"] = {name: s["batch"][name] / s["batch"][off] for name, off in ref.items()}
    s["batch_x_off_per_round"] = {name: [round(tps(r, name) / tps(r, off), 3) for r in rounds]
                                  for name, off in ref.items()}
    ok = lambda value, goal: value is not None and value >= goal  # noqa: E731
    s["met"] = {f"{side}_single_2x_at_acceptance_3": ok(s["single"][side]["x_off_accept_ge_3"],
                                                        TARGETS["loop"]) for side in PAIR_SIDES}
    s["met"] |= {f"{name}_batch": ok(value, TARGETS["batch"]) for name, value in s["batch_x_off"].items()}
    s["cores"] = {side: round(statistics.median(r[side]["single_cores"] for r in rounds), 2)
                  for side in SIDES}
    s["batch_cores"] = {side: round(statistics.median(r[side]["batch"]["cores"] for r in rounds), 2)
                        for side in SIDES if side != "self"}
    s |= {"threads": rounds[-1]["off"]["threads"], "equality": _identical(rounds, work)}
    follows = s["equality"]["pair_follows_succ"]
    s["met"] |= {"identical": s["equality"]["identical"], "pair_follows_succ": follows[0] == follows[1]}
    return s


def _print_card(s: dict[str, Any], work: dict[str, Any], rounds: int, machine: dict[str, Any]) -> None:
    eq, lengths, info = s["equality"], [len(ids) for ids in work["single"]], work["pair"]["info"]
    layers, params = work["layers"], work["params"]
    contended = any(v < 0.9 * s["threads"] for v in (*s["cores"].values(), *s["batch_cores"].values()))
    diff = f"; first difference: {eq['first_difference']}" if eq["first_difference"] else ""
    text, pair, follows = info["drafter"]["text"], params["pair_drafter"], eq["pair_follows_succ"]
    print_card("mmserve draft-model speculative decoding benchmark", {
        "machine": machine_line(machine) + f", torch {machine['torch']}",
        "model": f"{MODEL} bench checkpoint (random Qwen2-VL, {Path(work['model_dir']).name}), float32, "
                 f"{layers['target']} decoder layers, {params['target'] / 1e6:.1f}M parameters",
        "drafter": f"truncated_copy, its first {layers['draft']} decoder layer(s): "
                   f"{params['draft'] / 1e6:.1f}M parameters, {params['draft'] / params['target']:.0%} of "
                   "the target's (embeddings, head and vision tower kept); control: the target itself",
        "pair": f"constructed (successor_pair, {Path(work['pair']['target']).parent.name}): greedy next "
                "token = succ(token), succ one seeded random cycle over the non-special ids; target = the "
                f"{MODEL} checkpoint's shapes, o_proj and down_proj zero, final norm 1, head row succ(t) = "
                f"embed[t]/|embed[t]|; drafter: the same on {text['num_hidden_layers']} layer, hidden "
                f"{text['hidden_size']} ({pair / 1e6:.1f}M parameters, {pair / params['target']:.0%}); "
                f"cosine margin {info['cosine_margin']}; transformers' greedy follows succ "
                f"{info['checked_steps']} steps; mmserve's off answers follow succ: {follows[0]} of "
                f"{follows[1]}",
        "workload": f"one at a time: {len(lengths)} quoting prompts ({min(lengths)}-{max(lengths)} tokens), "
                    f"max_tokens {work['max_tokens']}; batch: {BATCH} quoting prompts, one call, max_tokens "
                    f"{BATCH_MAX_TOKENS}; greedy, ignore_eos",
        "spec": f"draft_model; truncation and self: K = {work['k']}, disable_by_batch_size null (truncation "
                f"batched also at the default, {DISABLE_AT}); pair: K = {', '.join(map(str, PAIR_KS))}, the "
                f"default cutoff ({DISABLE_AT}); a request whose acceptance collapses (< 10% of >= 32 draft "
                "tokens) drafts no more",
        "method": f"medians of {rounds} rounds, each side a fresh process, the sides' order alternating by "
                  "round; x off: against speculation off on the same target (pair: the constructed target); "
                  "decode tok/s = (tokens - 1) / (last - first token); batch: output tokens / the call's "
                  "wall time; profile: an untimed pass after the timed one",
        "threads": f"{s['threads']} torch threads; CPU s per wall s, one at a time {s['cores']}, batch "
                   f"{s['batch_cores']}{' (under the threads: other work shared the cores)' * contended}",
        "identical": ("yes" if eq["identical"] else "NO") + f": {eq['checked'] - eq['differ']} of "
                     f"{eq['checked']} speculating answers equal off's (all rounds, alone, batched){diff}"})


def _print_tables(s: dict[str, Any], work: dict[str, Any]) -> None:
    k, layers, single = work["k"], work["layers"]["draft"], s["single"]
    print("one request at a time: decode tok/s, acceptance (1 + accepted/drafts), ms and tokens a step;")
    print("x off: against speculation off on the same target; x off@3: over the prompts at acceptance >= 3")
    print(f"{'side':<49} {'tok/s':>7} {'x off':>6} {'x off@3':>7} {'accept':>6} {'ms/step':>7} "
          f"{'tok/step':>8}")
    labels = {"off": f"off ({MODEL} bench checkpoint)", "draft": f"draft: {layers}-layer truncation, K={k}",
              "self": f"self-draft control, K={k} (a BOUND, not a drafter)",
              "pair_off": "off (constructed target)", **{side: f"PAIR: constructed drafter, K={side[4:]}"
                                                         for side in PAIR_SIDES}}
    for side in ("off", "draft", "self", "pair_off", *PAIR_SIDES):
        c, row = single[side]["on"] if side in single else s["off"][side], single.get(side, {})
        print(f"{labels[side]:<49} {c['tok_per_s']:>7.1f} {_fmt(row.get('x_off'), '.2f'):>5}x "
              f"{_fmt(row.get('x_off_accept_ge_3'), '.2f'):>6}x {c['acceptance']:>6.2f} "
              f"{_fmt(c['ms_per_step'], '.2f'):>7} {_fmt(c['tokens_per_step'], '.2f'):>8}")
    for side in SPEC_SIDES:
        print(f"   {side} per prompt: acceptance {single[side]['acceptance_per_prompt']}, "
              f"x off {single[side]['x_off_per_prompt']}")
    print("\na drafted decode step (untimed pass, medians): ms in the drafter, the target's forward, rest")
    print(f"{'side':<6} {'step ms':>7} {'drafter':>14} {'target fwd':>14} {'rest':>14} {'tok/step':>8} "
          f"{'ms/tok':>6} {'drafted tok':>11}")
    for side in SPEC_SIDES:
        p = s["profile"][side]
        print(f"{side:<6} {p['step_ms']:>7.2f} {p['drafter_ms']:>6.2f} ({p['drafter_share']:>4.0%}) "
              f"{p['verify_ms']:>6.2f} ({p['verify_share']:>4.0%}) {p['rest_ms']:>6.2f} "
              f"({p['rest_ms'] / p['step_ms']:>4.0%}) {p['tokens_per_step']:>8.2f} {p['ms_per_token']:>6.2f} "
              f"{p['drafted_token_share']:>11.0%}")
    print("   off, ms a decode step (1 token): " + ", ".join(
        f"{labels[side]} {s['off'][side]['ms_per_step']:.2f}" for side in ("off", "pair_off")))
    print(f"\nbatch of {BATCH} in one generate call: output tok/s, medians; x off: of the medians (pair: "
          "against the constructed target's off)")
    for name, value in s["batch"].items():
        rounds = s["batch_x_off_per_round"].get(name)
        print(f"  {name:<16} {value:>8.1f}  {s['batch_x_off'].get(name, 1.0):.3f}x off"
              + (f"  (each round against its own off: {rounds})" if rounds else ""))
    yes, met = {True: "yes", False: "NO"}, s["met"]
    at3 = lambda side: _fmt(single[side]["x_off_accept_ge_3"], ".2f")  # noqa: E731
    print(f"\ntargets: one at a time >= {TARGETS['loop']}x where acceptance >= 3: " + ", ".join(
        f"{side} {yes[met[f'{side}_single_2x_at_acceptance_3']]} ({at3(side)}x, acceptance "
        f"{single[side]['on']['acceptance']:.2f})" for side in PAIR_SIDES)
        + f" [truncation: {at3('draft')}x, acceptance "
        f"{single['draft']['on']['acceptance']:.2f}]; batch >= {TARGETS['batch']}x: " + ", ".join(
            f"{name} {yes[met[f'{name}_batch']]}" for name in s["batch_x_off"])
        + f"; identical {yes[met['identical']]}; pair follows succ {yes[met['pair_follows_succ']]}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--draft-layers", type=int, default=1, help="the drafter's decoder layers")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # one side, in a fresh process
        print(json.dumps(worker(args.worker, json.loads(WORKLOAD.read_text()))))
        return
    from benchmarks.checkpoints import ensure_checkpoint

    work = build_workload(ensure_checkpoint(MODEL), args)
    rounds: list[dict[str, Any]] = [{} for _ in range(args.rounds)]
    for r, result in enumerate(rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            print(f"[speculative_draft] round {r + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
            result[side] = _run_worker(side, r)
    (OUT_DIR / "rounds.json").write_text(json.dumps(rounds))  # the raw measurements
    summary, machine = _summary(rounds, work), machine_info()
    _print_card(summary, work, args.rounds, machine)
    _print_tables(summary, work)
    json_line({"bench": "speculative_draft", "model": MODEL, "k": args.k, "max_tokens": args.max_tokens,
               "pair_ks": list(PAIR_KS), "batch_max_tokens": BATCH_MAX_TOKENS,
               "drafter_layers": args.draft_layers, "target_layers": work["layers"]["target"],
               "params": work["params"], "pair": work["pair"]["info"], **summary, "rounds": args.rounds,
               "machine": machine}, compact=True)


if __name__ == "__main__":
    main()

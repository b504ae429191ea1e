"""What the CPU's decode-step compile costs at start-up and buys afterwards, per `compile_cpu_decode` setting.

Run: python -m benchmarks.engine.cpu_decode_compile [--model 30m|100m|DIR] [--rounds 3] [--batch 32]

Role: one run, each measurement in a fresh process (torch threads = the machine's usable cores), the
settings' order rotated each round, medians. Settings (compile_cases.SETTINGS): `default` (unset: every
step eager), `startup` (`compile_cpu_decode=True`: compiled before the engine serves) and `background`
(`MMSERVE_COMPILE_CPU_DECODE=1`: compiled in a thread while eager steps serve). The compiled ones are
measured with a warm TorchInductor cache (what a user's second start finds) and a cold one (a fresh,
empty cache directory: a first start). Per measurement:
- start-up: seconds until `LLM(...)` returns (the engine serves from then on);
- compiled after: seconds from the start until the compiled step replays (`background` only;
  `startup`'s is its start-up);
- while compiling: decode tokens/s of the batches served eagerly before the switch (`background` only);
- decode tokens/s afterwards (compiled, or eager for `default`): a batch of `--batch` text prompts and one
  request at a time, `--output-tokens` greedy tokens each (min = max, so every run decodes the same).
Prints a card, a table and one JSON line last.

What it does not know: mmserve internals beyond the offline API and `LLMEngine.wait_for_compiled_decode`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchmarks.card import json_line
from benchmarks.engine.compile_cases import SETTINGS, median_of, run_cases

PROMPTS = ("Describe a sunny beach in detail.", "Write a short story about a robot.", "List ten colours.",
           "Explain how a bicycle works.", "What is the capital of France?", "Count from one to twenty.",
           "Tell me about the moon.", "Write a poem about the sea.")


def _decode_tokens_per_s(llm: Any, prompts: list[str], output_tokens: int) -> float:
    from mmserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_tokens, min_tokens=output_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)


def measure(model_dir: str, setting: str, batch: int, output_tokens: int) -> dict[str, Any]:
    """One measurement, in this process (the harness starts a fresh one for each)."""
    import torch

    from mmserve import LLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    started = time.perf_counter()
    llm = LLM(model_dir, compile_cpu_decode=SETTINGS[setting].kwarg, max_num_seqs=batch, max_model_len=512)
    startup_s = time.perf_counter() - started
    result: dict[str, Any] = {"startup_s": startup_s}
    if setting == "background":
        during = []
        while llm.engine.get_stats()["cpu_decode_compile"] == "compiling":
            during.append(_decode_tokens_per_s(llm, prompts, output_tokens))
        if not llm.engine.wait_for_compiled_decode(timeout_s=0):
            raise RuntimeError(f"the background compile ended {llm.engine.get_stats()['cpu_decode_compile']!r}")
        result["compiled_after_s"] = time.perf_counter() - started
        result["while_compiling_tokens_per_s"] = statistics.median(during) if during else None
    _decode_tokens_per_s(llm, prompts[:1], 4)  # the first step after the switch off the clock
    result["batch_tokens_per_s"] = statistics.median(_decode_tokens_per_s(llm, prompts, output_tokens)
                                                     for _ in range(3))
    result["one_tokens_per_s"] = statistics.median(_decode_tokens_per_s(llm, prompts[i:i + 1], output_tokens)
                                                   for i in range(3))
    graphs = llm.engine.inspect().graphs.decode
    result["replays"] = graphs.num_replays if graphs is not None else 0
    return result


def _describe(r: dict[str, Any]) -> str:
    return (f"start-up {r['startup_s']:.1f} s, batch {r['batch_tokens_per_s']:.1f} tok/s, "
            f"one {r['one_tokens_per_s']:.1f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="30m", help="30m, 100m, 1b or a checkpoint directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--worker", choices=tuple(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        json_line(measure(args.model, args.worker, args.batch, args.output_tokens))
        return

    from benchmarks.card import machine_info
    from benchmarks.checkpoints import ensure_model, parameter_count

    model_dir = ensure_model(args.model)
    cases = [("default", "warm"), ("startup", "warm"), ("background", "warm"), ("startup", "cold"),
             ("background", "cold")]
    worker_args = ["--model", str(model_dir), "--batch", str(args.batch), "--output-tokens", str(args.output_tokens)]
    runs = run_cases("benchmarks.engine.cpu_decode_compile", cases, args.rounds, worker_args, _describe)

    keys = ("startup_s", "compiled_after_s", "while_compiling_tokens_per_s", "batch_tokens_per_s", "one_tokens_per_s")
    results = {name: {k: median_of(rs, k) for k in keys} for name, rs in runs.items()}
    eager = results["default/warm"]
    for res in results.values():
        res["batch_over_eager"] = round(res["batch_tokens_per_s"] / eager["batch_tokens_per_s"], 3)
        res["one_over_eager"] = round(res["one_tokens_per_s"] / eager["one_tokens_per_s"], 3)

    machine = machine_info(len(os.sched_getaffinity(0)))
    print("== mmserve CPU decode compile: start-up cost and speed, per compile_cpu_decode setting ==")
    print(f"machine : {machine['usable_cpus']} usable CPUs, {machine['platform']}, torch {machine['torch']}")
    print(f"model   : {model_dir} ({parameter_count(model_dir) / 1e6:.1f}M params), float32; batch {args.batch} "
          f"and one at a time, {args.output_tokens} greedy tokens each; {args.rounds} rounds, fresh process each, "
          "medians; cold = an empty TorchInductor cache")
    print(f"{'setting':16s} {'start-up s':>10s} {'compiled s':>10s} {'while comp.':>11s} {'batch tok/s':>11s} "
          f"{'x eager':>6s} {'one tok/s':>9s} {'x eager':>6s}")
    for name, res in results.items():
        def cell(value: float | None, width: int) -> str:
            return f"{'—' if value is None else value:>{width}}"
        print(f"{name:16s} {cell(res['startup_s'], 10)} {cell(res['compiled_after_s'], 10)} "
              f"{cell(res['while_compiling_tokens_per_s'], 11)} {cell(res['batch_tokens_per_s'], 11)} "
              f"{cell(res['batch_over_eager'], 6)} {cell(res['one_tokens_per_s'], 9)} {cell(res['one_over_eager'], 6)}")
    json_line({"bench": "cpu_decode_compile", "model": str(model_dir), "batch": args.batch,
                      "output_tokens": args.output_tokens, "rounds": args.rounds, "machine": machine,
                      "results": results}, compact=True)


if __name__ == "__main__":
    main()

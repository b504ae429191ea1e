"""CPU-kernel benchmark: what this CPU's instruction sets buy mmserve's decode, build against build.

Run: python -m benchmarks.engine.cpu_kernels [--model 100m|30m|DIR] [--rounds 3] [--quick]

Role: mmserve builds its native kernels for the instruction sets of the CPU it runs on
(`runner/cpu/native.isa_flags`: AVX2/FMA everywhere; AVX-512, AVX-512 BF16/VNNI and AMX where present).
This measures, side by side in one run, the same engine with its kernels built for AVX2 only (what any
x86-64 machine of the last decade gets; bfloat16 then stays on oneDNN's linear, which itself uses
AMX where the CPU has it) and built for this CPU:
1. kernels: ms of one product at the model's language-model shapes (q/k/v, gate/up, down, head),
   1 and 32 rows, per weight format, both builds, and oneDNN's bfloat16 `F.linear` (medians of 20).
2. decode: tokens/s of `LLM.generate` on text prompts, one request at a time and a batch of 32 (64
   output tokens), per weight format (float32, bfloat16, int8, int4, w8a8, w4a8) and build; each measurement a
   fresh process (the build chosen before anything loads), builds alternating, formats rotated, medians.
Prints a card, a table per section, and one JSON line last.

What it does not know: mmserve internals beyond `runner/cpu/native` (whose `isa_flags` a measurement
process replaces to get the AVX2 build) and the kernels' layer classes (section 1).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.card import ROOT, json_line, machine_info, machine_line
from benchmarks.checkpoints import EAGER, ensure_model
from benchmarks.engine.quantization import (
    BATCH,
    OUTPUT_TOKENS,
    PROMPTS,
    _decode_tokens_per_s,
    _median_ms,
)
from mmserve.config import QUANTIZATION_METHODS

FORMATS = ("float32", "bfloat16", *QUANTIZATION_METHODS)
BUILDS = ("avx2", "this cpu")


def use_build(build: str) -> None:
    """Make this process's kernels the `build` ones (before any kernel loads)."""
    from mmserve.runner.cpu import native

    if build == "avx2":
        native.isa_flags = lambda: native.AVX2_FLAGS


# ---- 1. kernels ----------------------------------------------------------------------------------------
def _layers(linear: torch.nn.Linear, build: str) -> dict[str, Any]:
    from mmserve.models.quantization import QuantizedLinear, method_format
    from mmserve.runner.cpu import bf16_gemm, gemm, native, quant_gemm

    compiler, cache = native._compiler(), native.envs.cache_dir() / "kernels"
    isa = native.AVX2_FLAGS if build == "avx2" else None
    layers: dict[str, Any] = {"float32": gemm.PanelLinear(linear, gemm.PanelKernel(
        native.build(compiler, cache, gemm.SOURCE, isa)))}
    lib = quant_gemm.QuantKernel(native.build(compiler, cache, quant_gemm.SOURCE, isa))
    for method in QUANTIZATION_METHODS:
        layers[method] = quant_gemm.QuantPanelLinear(
            QuantizedLinear.from_linear(linear, method_format(method, linear.in_features)), lib)
    bf16 = bf16_gemm.kernel() if build != "avx2" else None
    half = copy.deepcopy(linear).to(torch.bfloat16)  # (`Module.to` converts in place)
    layers["bfloat16"] = bf16_gemm.BFloat16PanelLinear(half, bf16) if bf16 is not None else half
    return layers


def measure_kernels(model_dir: Path) -> list[dict[str, Any]]:
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    hidden, inter, vocab = text["hidden_size"], text["intermediate_size"], text["vocab_size"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    qkv = hidden + 2 * kv_heads * (hidden // heads)
    rows = []
    for out_features, in_features in ((qkv, hidden), (2 * inter, hidden), (hidden, inter), (vocab, hidden)):
        torch.manual_seed(0)
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        layers = {build: _layers(linear, build) for build in BUILDS}
        for m in (1, BATCH):
            x = torch.randn(m, in_features)
            entry: dict[str, Any] = {"shape": f"{out_features}x{in_features}", "rows": m}
            for fmt in FORMATS:
                xi = x.to(torch.bfloat16) if fmt == "bfloat16" else x
                for build in BUILDS:
                    layer = layers[build][fmt]
                    entry[f"{fmt} {build}"] = round(_median_ms(lambda layer=layer, xi=xi: layer(xi)), 4)
            rows.append(entry)
    return rows


# ---- 2. decode -----------------------------------------------------------------------------------------
def child(model_dir: Path, fmt: str, build: str) -> dict[str, float]:
    """One measurement in this (fresh) process."""
    use_build(build)
    from mmserve import LLM

    kwargs: dict[str, Any] = {"dtype": "bfloat16"} if fmt == "bfloat16" else {}
    if fmt in QUANTIZATION_METHODS:
        kwargs["quantization"] = fmt
    llm = LLM(str(model_dir), max_num_seqs=BATCH, max_model_len=1024, **EAGER, **kwargs)
    batch_prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(BATCH)]
    one = _decode_tokens_per_s(llm, [PROMPTS[0]])
    batch = _decode_tokens_per_s(llm, batch_prompts)
    llm.check_integrity()
    return {"one": one, "batch": batch}


def measure_decode(model_dir: Path, rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    samples = {fmt: {build: {"one": [], "batch": []} for build in BUILDS} for fmt in FORMATS}
    for r in range(rounds):
        formats = FORMATS[r % len(FORMATS):] + FORMATS[:r % len(FORMATS)]
        for fmt in formats:
            for build in (BUILDS if r % 2 == 0 else BUILDS[::-1]):
                cmd = [sys.executable, "-m", "benchmarks.engine.cpu_kernels", "--model", str(model_dir),
                       "--child", fmt, build]
                out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True,
                                     text=True).stdout.strip().splitlines()[-1]
                got = json.loads(out)
                for key in ("one", "batch"):
                    samples[fmt][build][key].append(got[key])
                print(f"round {r + 1}: {fmt:>8} {build:>8}: one {got['one']:.1f} tok/s, batch {got['batch']:.1f} tok/s",
                      file=sys.stderr)
    return {fmt: {build: {k: round(statistics.median(v), 1) for k, v in s.items()} for build, s in by.items()}
            for fmt, by in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="100m", help="100m (default), 30m, or a checkpoint directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 round")
    parser.add_argument("--child", nargs=2, metavar=("FORMAT", "BUILD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    if args.child:
        json_line(child(Path(args.model), *args.child))
        return
    from mmserve.runner.cpu import native

    model_dir = ensure_model(args.model)
    rounds = 1 if args.quick else args.rounds
    machine = machine_info(threads)
    print("== mmserve CPU-kernel benchmark: AVX2 build against this CPU's ==")
    print(f"machine   : {machine_line(machine)}")
    print(f"software  : torch {machine['torch']}, torch threads {threads}")
    print(f"this cpu  : {' '.join(native.isa_flags())}")
    print(f"model     : {args.model} ({model_dir.name}, random weights)")
    print(f"workload  : text prompts, {OUTPUT_TOKENS} output tokens; one request at a time and a batch of {BATCH}; "
          f"{rounds} round(s), a fresh process per measurement, builds alternating, medians")

    kernels = measure_kernels(model_dir)
    print("\n-- kernels: ms per product (medians of 20); bfloat16 'avx2' is oneDNN's linear --")
    print(f"{'shape':>12} {'rows':>5} " + " ".join(f"{fmt:>17}" for fmt in FORMATS))
    for row in kernels:
        cells = [f"{row[f'{fmt} avx2']:>7.3f} -> {row[f'{fmt} this cpu']:>6.3f}" for fmt in FORMATS]
        print(f"{row['shape']:>12} {row['rows']:>5} " + " ".join(f"{c:>17}" for c in cells))

    decode = measure_decode(model_dir, rounds)
    print("\n-- decode tokens/s: AVX2 build -> this CPU's (x gain) --")
    print(f"{'format':>9} {'one at a time':>28} {'batch of ' + str(BATCH):>28}")
    gains = {}
    for fmt, by in decode.items():
        gains[fmt] = {k: round(by["this cpu"][k] / by["avx2"][k], 3) for k in ("one", "batch")}
        cells = [f"{by['avx2'][k]:>7.1f} -> {by['this cpu'][k]:>7.1f} (x{gains[fmt][k]:.2f})" for k in ("one", "batch")]
        print(f"{fmt:>9} {cells[0]:>28} {cells[1]:>28}")
    this_cpu = {fmt: by["this cpu"] for fmt, by in decode.items()}
    json_line({"benchmark": "cpu_kernels", "model": args.model, "rounds": rounds, "isa": list(native.isa_flags()),
                      "kernels_ms": kernels, "tokens_per_s": decode, "gain_over_avx2_build": gains,
                      "ratio_to_float32": {fmt: {k: round(v[k] / this_cpu["float32"][k], 3) for k in v}
                                           for fmt, v in this_cpu.items()}})


if __name__ == "__main__":
    main()

"""Quantized-weights benchmark: what int8 / int4 / w8a8 weights buy (bytes, decode speed) and cost (accuracy).

Run: python -m benchmarks.engine.quantization [--model 30m|100m|DIR] [--rounds 3] [--quick] [--only demo]

Role: one run, torch threads = the machine's usable cores, four measurements:
1. kernels: milliseconds of one product at the bench model's language-model shapes (hidden x hidden,
   gate/up, down), 1 and 32 rows: mmserve's float32 panel kernel, its int8 / int4 / w8a8 / w4a8 panels, and
   ATen's `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` (bfloat16 inputs, the only ones they
   run fast) — the measurement the kernel choice rests on. Medians of 20 calls after 3 warm-ups.
2. weight bytes: `get_stats()["weight_bytes"]` per method, and its ratio to float32.
3. speed: decode tokens/s of `LLM.generate` on text prompts, one request at a time (64 output tokens)
   and a batch of 32 (64 output tokens each), per method; a fresh LLM per method per round (load off the
   clock), the method order rotated each round, medians; the ratio to float32 in the same run.
4. accuracy: mean per-token KL(float32 || quantized) of the next-token distribution along the float32
   greedy path of 8 text prompts (64 tokens each), teacher-forced through each model in one prefill
   (float32 log-softmax).
5. demo accuracy: `mmserve.demo.eval.evaluate` per question type on the bundled (trained) demo model,
   500 conversations, per method.
`--only demo` runs section 5 alone; `--only kl` section 4 alone, with the bytes of the language model's
linear layers (what the methods quantize) per method. Prints a card, a table per section, and one JSON line last.

What it does not know: mmserve internals beyond the offline API, `models.loader.load_model`,
`runner/cpu/layout.prepare_for_cpu` and the quantized kernels' modules (section 1 and 4).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.card import json_line, machine_info, machine_line
from benchmarks.checkpoints import EAGER, ensure_model, parameter_count
from mmserve.config import QUANTIZATION_METHODS

METHODS = (None, *QUANTIZATION_METHODS)
PROMPTS = ("Describe a sunny beach in detail.", "Write a short story about a robot.", "List ten colours.",
           "Explain how a bicycle works.", "What is the capital of France?", "Count from one to twenty.",
           "Tell me about the moon.", "Write a poem about the sea.")
OUTPUT_TOKENS = 64
BATCH = 32
TARGETS = {"kl_int8": 0.01, "kl_w8a8": 0.01, "kl_int4": 0.05, "kl_int4_weight_only": 0.05, "weight_bytes_int8": 0.3,
           "weight_bytes_int4": 0.2,
           "batch_int8_over_float32": 1.0}


def _name(method: str | None) -> str:
    return method or "float32"


def _median_ms(fn, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


# ---- 1. kernels --------------------------------------------------------------------------------------
def measure_kernels(model_dir: Path) -> list[dict[str, Any]]:
    from mmserve.models.quantization import QuantizedLinear, method_format, quantize_int8
    from mmserve.runner.cpu import gemm, quant_gemm

    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    hidden, inter = text["hidden_size"], text["intermediate_size"]
    rows = []
    for out_features, in_features in ((hidden, hidden), (2 * inter, hidden), (hidden, inter)):
        torch.manual_seed(0)
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        layers: dict[str, Any] = {}
        if gemm.kernel() is not None:
            layers["float32 panel"] = gemm.PanelLinear(linear, gemm.kernel())
        lib = quant_gemm.kernel()
        if lib is not None:
            for method in METHODS[1:]:
                layers[f"{method} panel"] = quant_gemm.QuantPanelLinear(
                    QuantizedLinear.from_linear(linear, method_format(method, in_features)), lib)
        codes, scales = quantize_int8(linear.weight)
        int4 = None
        if in_features % 128 == 0:
            w4 = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)
            int4 = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4, 1),
                    torch.randn(in_features // 128, out_features, 2).bfloat16())
        for m in (1, BATCH):
            x = torch.randn(m, in_features)
            xb = x.bfloat16()
            entry = {"shape": f"{out_features}x{in_features}", "rows": m}
            for label, layer in layers.items():
                entry[label] = _median_ms(lambda layer=layer, x=x: layer(x))
            entry["aten int8pack (bf16)"] = _median_ms(
                lambda xb=xb, codes=codes, scales=scales: torch.ops.aten._weight_int8pack_mm(
                    xb, codes, scales[:, 0].bfloat16()))
            if int4 is not None:
                entry["aten int4pack (bf16)"] = _median_ms(
                    lambda xb=xb, int4=int4: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, int4[0], 128, int4[1]))
            rows.append(entry)
    return rows


# ---- 2. and 3. speed and bytes -------------------------------------------------------------------------
def _llm(model_dir: Path, method: str | None, max_num_seqs: int):
    from mmserve import LLM

    kwargs = {"quantization": method} if method else {}
    return LLM(str(model_dir), max_num_seqs=max_num_seqs, max_model_len=1024, **EAGER, **kwargs)


def _decode_tokens_per_s(llm, prompts: list[str]) -> float:
    from mmserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, min_tokens=OUTPUT_TOKENS)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(chats[:1], params, use_tqdm=False)  # warm
    start = time.perf_counter()
    outputs = llm.chat(chats, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def measure_speed(model_dir: Path, rounds: int) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    samples: dict[str, dict[str, list[float]]] = {_name(m): {"one": [], "batch": []} for m in METHODS}
    weight_bytes: dict[str, int] = {}
    batch_prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(BATCH)]
    for r in range(rounds):
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
        for method in order:
            llm = _llm(model_dir, method, BATCH)
            weight_bytes[_name(method)] = llm.get_stats()["weight_bytes"]
            samples[_name(method)]["one"].append(_decode_tokens_per_s(llm, [PROMPTS[r % len(PROMPTS)]]))
            samples[_name(method)]["batch"].append(_decode_tokens_per_s(llm, batch_prompts))
            llm.check_integrity()
            del llm
            gc.collect()
            print(f"round {r + 1}: {_name(method)} one {samples[_name(method)]['one'][-1]:.1f} tok/s, "
                  f"batch {samples[_name(method)]['batch'][-1]:.1f} tok/s", file=sys.stderr)
    medians = {m: {k: statistics.median(v) for k, v in s.items()} for m, s in samples.items()}
    return medians, weight_bytes


# ---- 4. accuracy ---------------------------------------------------------------------------------------
def _language_model_linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the language model's linear layers (what the methods quantize), float or quantized."""
    from mmserve.models.quantization import QuantizedLinear, weight_bytes

    return sum(weight_bytes(m) for m in model.language_model.modules()
               if isinstance(m, (torch.nn.Linear, QuantizedLinear)))


@torch.inference_mode()
def measure_kl(model_dir: Path, prompts: tuple[str, ...],
               linear_bytes: dict[str, int] | None = None) -> dict[str, float]:
    """`linear_bytes`, when given, is filled with each method's `_language_model_linear_bytes`."""
    from mmserve import LLM, SamplingParams
    from mmserve.inputs.items import ProcessedPrompt, PromptPositions
    from mmserve.models.loader import load_model
    from mmserve.runner.cpu.layout import prepare_for_cpu
    from testkit.models import full_logits, load_family

    llm = LLM(str(model_dir), max_model_len=1024, **EAGER)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, min_tokens=OUTPUT_TOKENS)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    spec = llm.engine.spec
    paths = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs]
    del llm
    reference, _, _ = load_family(model_dir)
    if linear_bytes is not None:
        linear_bytes["float32"] = _language_model_linear_bytes(reference)
    prepare_for_cpu(reference)

    def logprobs(model) -> list[torch.Tensor]:
        out = []
        for prompt_ids, generated in paths:
            ids = prompt_ids + generated[:-1]
            prompt = ProcessedPrompt(None, ids, positions=PromptPositions(spec.num_position_rows))
            logits = full_logits(model, prompt, spec)[len(prompt_ids) - 1:]
            out.append(torch.log_softmax(logits.float(), dim=-1))
        return out

    want = logprobs(reference)
    del reference
    kl: dict[str, float] = {}
    for method in METHODS[1:]:
        model = load_model(model_dir, "float32", "cpu", method)
        if linear_bytes is not None:
            linear_bytes[method] = _language_model_linear_bytes(model)
        prepare_for_cpu(model)
        got = logprobs(model)
        per_token = torch.cat([(w.exp() * (w - g)).sum(-1) for w, g in zip(want, got)])
        kl[method] = per_token.mean().item()
        del model
        gc.collect()
    return kl


# ---- 5. demo accuracy -----------------------------------------------------------------------------------
def measure_demo(n: int) -> dict[str, dict[str, float]]:
    from mmserve.demo.eval import evaluate

    return {_name(m): evaluate(None, n=n, **EAGER, **({"quantization": m} if m else {})).accuracy for m in METHODS}


def print_demo(demo: dict[str, dict[str, float]], n: int) -> None:
    print(f"\n-- demo model accuracy per question type ({n} conversations) --")
    types = list(demo["float32"])
    print(f"{'method':>8} " + " ".join(f"{t:>9}" for t in types))
    for method, acc in demo.items():
        print(f"{method:>8} " + " ".join(f"{acc[t]:>9.3f}" for t in types))


# ---- report --------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="100m", help="30m, 100m (default), or a checkpoint directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 round, 2 KL prompts, 100 demo conversations")
    parser.add_argument("--only", choices=("demo", "kl"), help="run one section alone (kl: with the bytes of "
                                                                 "the language model's linears)")
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    demo_n = 100 if args.quick else 500
    if args.only == "demo":
        print("== mmserve quantized-weights benchmark: demo accuracy ==")
        demo = measure_demo(demo_n)
        print_demo(demo, demo_n)
        deltas = {m: round(max(abs(acc[t] - demo["float32"][t]) for t in acc), 4) for m, acc in demo.items()}
        json_line({"benchmark": "quantization", "section": "demo", "n": demo_n, "accuracy": demo,
                          "max_abs_delta_vs_float32": deltas})
        return
    model_dir = ensure_model(args.model)
    rounds = 1 if args.quick else args.rounds
    if args.only == "kl":
        print(f"== mmserve quantized-weights benchmark: KL and linear bytes, {args.model} ==")
        linear_bytes: dict[str, int] = {}
        kl = measure_kl(model_dir, PROMPTS[:2] if args.quick else PROMPTS, linear_bytes)
        ratios = {m: round(b / linear_bytes["float32"], 4) for m, b in linear_bytes.items()}
        print(f"{'method':>8} {'KL':>9} {'linears MiB':>12} {'x float32':>10}")
        for method, b in linear_bytes.items():
            print(f"{method:>8} {kl.get(method, 0.0):>9.5f} {b / 2**20:>12.1f} {ratios[method]:>10.3f}")
        json_line({"benchmark": "quantization", "section": "kl", "model": args.model,
                          "kl": {m: round(v, 6) for m, v in kl.items()}, "linear_bytes": linear_bytes,
                          "linear_bytes_ratio": ratios, "targets": TARGETS})
        return
    machine = machine_info(threads)
    params = parameter_count(model_dir)

    print("== mmserve quantized-weights benchmark ==")
    print(f"machine   : {machine_line(machine)}")
    print(f"software  : torch {machine['torch']}, torch threads {threads}")
    print(f"model     : {args.model} ({params / 1e6:.0f}M parameters, random weights), float32 activations")
    print(f"workload  : text prompts, {OUTPUT_TOKENS} output tokens; one request at a time and a batch of {BATCH}; "
          f"{rounds} round(s), methods rotated, medians")

    kernels = measure_kernels(model_dir)
    print("\n-- kernels: ms per product (medians of 20) --")
    labels = [k for k in kernels[0] if k not in ("shape", "rows")]
    print(f"{'shape':>12} {'rows':>5} " + " ".join(f"{label:>20}" for label in labels))
    for row in kernels:
        print(f"{row['shape']:>12} {row['rows']:>5} " + " ".join(f"{row.get(label, float('nan')):>20.3f}"
                                                                   for label in labels))

    speed, weight_bytes = measure_speed(model_dir, rounds)
    base = speed["float32"]
    print("\n-- weight bytes and decode speed --")
    print(f"{'method':>8} {'weight MiB':>11} {'x float32':>10} {'one tok/s':>10} {'x f32':>7} {'batch tok/s':>12} "
          f"{'x f32':>7}")
    for name, s in speed.items():
        print(f"{name:>8} {weight_bytes[name] / 2**20:>11.1f} {weight_bytes[name] / weight_bytes['float32']:>10.3f} "
              f"{s['one']:>10.1f} {s['one'] / base['one']:>7.3f} {s['batch']:>12.1f} {s['batch'] / base['batch']:>7.3f}")

    kl = measure_kl(model_dir, PROMPTS[:2] if args.quick else PROMPTS)
    print("\n-- accuracy: mean per-token KL(float32 || quantized) along the float32 greedy path --")
    for method, value in kl.items():
        print(f"{method:>8} {value:.5f}")

    result = {
        "benchmark": "quantization", "model": args.model, "parameters": params, "rounds": rounds,
        "kernels_ms": kernels,
        "weight_bytes": weight_bytes,
        "weight_bytes_ratio": {m: round(b / weight_bytes["float32"], 4) for m, b in weight_bytes.items()},
        "tokens_per_s": {m: {k: round(v, 1) for k, v in s.items()} for m, s in speed.items()},
        "ratio_to_float32": {m: {k: round(v / base[k], 3) for k, v in s.items()} for m, s in speed.items()},
        "kl": {m: round(v, 6) for m, v in kl.items()},
        "targets": TARGETS,
    }
    json_line(result)


if __name__ == "__main__":
    main()

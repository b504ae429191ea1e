"""What the sampling surface costs: logprobs on a batch, and n choices against n separate requests.

Run: python -m benchmarks.engine.sampling [--model 30m|100m|tiny|DIR] [--rounds 3] [--batch 32] [--tokens 32] [--n 8]

Role: the issue's two speed targets, measured side by side in one process, alternating rounds, medians:
- a batch of `--batch` image requests (the peers workload's shape: one 160-192 px image, a short
  question) decoding `--tokens` greedy tokens each, with `logprobs=5` against the same batch without
  (target: >= 0.95x the tokens/s), and with penalties (repetition, frequency, presence) for reference;
- `n=--n` choices of one image request (temperature 0.8, seeded) against `--n` separate requests of the
  same prompt on an engine without the prefix cache (target: >= 3x the tokens/s), with the engine's
  stats for the n run: items encoded and prompt tokens computed; for the peers shape's image and for a
  large one (`--large-px` square taken at its size, raising the processor's max_pixels: 896 px is a
  prompt of about a thousand tokens), both with `--tokens` tokens.
Each run builds its requests afresh with new pictures, so nothing is served from the encoder or prefix
cache across runs or rounds. Prints a card, a table and one JSON line last.

What it does not know: the peers; transformers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.card import json_line
from benchmarks.engine.step_profile import _requests


def _request(seed: int, px: int | None) -> list[dict]:
    """One image question: the peers shape (px None) or a `px` square picture."""
    if px is None:
        return _requests(1, seed)[0]
    import numpy as np

    from benchmarks.workload import synthetic_image

    image = synthetic_image(np.random.default_rng(seed), px, px)
    return [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                         {"type": "text", "text": "Describe the image."}]}]


def _generated_tokens_per_s(llm: Any, chats: list, params: Any, px: int | None = None) -> tuple[float, list]:
    # a `px` picture is taken at its size (the checkpoint's processor would cap it at a few hundred rows)
    kwargs = None if px is None else {"max_pixels": px * px}
    started = time.perf_counter()
    outputs = llm.chat(chats, params, use_tqdm=False, mm_processor_kwargs=kwargs)
    elapsed = time.perf_counter() - started
    return sum(len(c.token_ids) for o in outputs for c in o.outputs) / elapsed, outputs


def _stats_delta(llm: Any, before: dict) -> dict:
    after = llm.get_stats()
    return {k: after[k] - before[k] for k in ("encoder_items_encoded", "prompt_tokens_computed")}


def batch_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of a batch benchmark of this kind: model, rounds, batch size, tokens per request."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default="30m", help="30m (default), 100m, tiny, or a checkpoint directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = batch_parser(__doc__)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--large-px", type=int, default=896)
    args = parser.parse_args(argv)
    from benchmarks.card import machine_info
    from benchmarks.checkpoints import EAGER, ensure_model
    from mmserve import LLM, SamplingParams

    model_dir = ensure_model(args.model)
    llm = LLM(str(model_dir), max_num_seqs=max(args.batch, args.n), **EAGER)
    separate = LLM(str(model_dir), max_num_seqs=max(args.batch, args.n), enable_prefix_caching=False, **EAGER)
    greedy = dict(temperature=0, max_tokens=args.tokens, min_tokens=args.tokens)
    batch_params = {"plain": SamplingParams(**greedy), "logprobs=5": SamplingParams(**greedy, logprobs=5),
                    "penalties": SamplingParams(**greedy, repetition_penalty=1.1, frequency_penalty=0.3,
                                                presence_penalty=0.2)}
    sampled = dict(temperature=0.8, seed=1, max_tokens=args.tokens, min_tokens=args.tokens)
    llm.chat(_requests(2, 99999), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    separate.chat(_requests(2, 99998), SamplingParams(max_tokens=4), use_tqdm=False)
    shapes = {"": None, " (large)": args.large_px}
    names = [*batch_params] + [f"n {kind}{shape}" for shape in shapes for kind in ("choices", "separate")]
    rates: dict[str, list[float]] = {name: [] for name in names}
    n_stats: dict[str, list[dict]] = {shape: [] for shape in shapes}
    for r in range(args.rounds):
        order = list(batch_params) if r % 2 == 0 else list(reversed(batch_params))
        for name in order:  # each variant its own pictures: none is served from another's caches
            seed = 1000 * r + list(batch_params).index(name) + 1
            rates[name].append(_generated_tokens_per_s(llm, _requests(args.batch, seed), batch_params[name])[0])
        for s, (shape, px) in enumerate(shapes.items()):
            runs = [("choices", llm, 1, SamplingParams(n=args.n, **sampled)),
                    ("separate", separate, args.n, SamplingParams(**sampled))]
            for kind, engine, copies, params in (runs if r % 2 == 0 else runs[::-1]):
                chat = _request(1000 * r + 100 + 10 * s + (kind == "separate"), px)
                before = engine.get_stats()
                rates[f"n {kind}{shape}"].append(_generated_tokens_per_s(engine, [chat] * copies, params, px)[0])
                if kind == "choices":
                    n_stats[shape].append(_stats_delta(engine, before))
    llm.check_integrity()
    separate.check_integrity()
    median = {name: statistics.median(values) for name, values in rates.items()}
    logprobs_ratio = median["logprobs=5"] / median["plain"]
    penalties_ratio = median["penalties"] / median["plain"]
    n_ratios = {shape.strip(" ()") or "peers": median[f"n choices{shape}"] / median[f"n separate{shape}"]
                for shape in shapes}
    prompt_tokens = {shape.strip(" ()") or "peers": len(llm.engine.process_chat(
        _request(7, px), None if px is None else {"max_pixels": px * px}).prompt_token_ids) for shape, px in shapes.items()}
    machine = machine_info(torch.get_num_threads())
    print("== mmserve sampling surface ==")
    print(f"machine : {machine['usable_cpus']} CPUs, torch {machine['torch']}, {torch.get_num_threads()} threads")
    print(f"model   : {model_dir}; batch {args.batch} x {args.tokens} tokens; n={args.n}; {args.rounds} rounds, "
          "alternating, medians of generated tokens/s (prefill and encoding included)")
    print(f"{'run':>20} {'tok/s':>9}   rounds")
    for name, values in rates.items():
        print(f"{name:>20} {median[name]:>9.1f}   {' '.join(f'{v:.1f}' for v in values)}")
    print(f"logprobs=5 / plain: {logprobs_ratio:.3f} (target >= 0.95); penalties / plain: {penalties_ratio:.3f}")
    for (shape, ratio), stats in zip(n_ratios.items(), n_stats.values()):
        print(f"n={args.n} / {args.n} separate requests without the prefix cache, {shape} image "
              f"({prompt_tokens[shape]}-token prompt): {ratio:.2f}x (target >= 3); per n run: "
              f"{stats[-1]['encoder_items_encoded']} item(s) encoded, {stats[-1]['prompt_tokens_computed']} prompt "
              "tokens computed")
    json_line({"bench": "sampling", "machine": machine, "model_dir": str(model_dir), "batch": args.batch,
                      "tokens": args.tokens, "n": args.n, "rounds": args.rounds,
                      "tokens_per_s": {k: round(v, 2) for k, v in median.items()},
                      "logprobs_ratio": round(logprobs_ratio, 4), "penalties_ratio": round(penalties_ratio, 4),
                      "n_ratios": {k: round(v, 3) for k, v in n_ratios.items()}, "n_run_stats": dict(zip(n_ratios, n_stats.values())),
                      "prompt_tokens": prompt_tokens}, compact=True)


if __name__ == "__main__":
    main()

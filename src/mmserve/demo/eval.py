"""Accuracy of a model on the shapes task, measured through the engine.

Role: `python -m mmserve.demo.eval --n N --seed S [--model DIR]` generates N fresh conversations
(seed S; eval seeds lie below `shapes.TRAIN_SEED_BASE`, which the trainer never uses), runs them in one
batch through `mmserve.LLM` with greedy decoding, and prints a table of exact-match accuracy per
question type, then one JSON line last. What it does not know: how the model was trained.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mmserve
from mmserve.config import DEMO_MODEL_DIR
from mmserve.demo import shapes


def default_model_dir() -> Path:
    """The bundled demo checkpoint."""
    return DEMO_MODEL_DIR


@dataclass(frozen=True)
class EvalResult:
    model: str
    n: int
    seed: int
    accuracy: dict[str, float]  # per question type, plus "overall"
    counts: dict[str, int]  # conversations per question type
    answers: list[str]  # the model's answer for each conversation, in sample order
    wall_s: float


def evaluate(model_dir: str | Path | None = None, n: int = 500, seed: int = 0,
             max_num_batched_tokens: int = 8192, **engine_kwargs: object) -> EvalResult:
    """Run n conversations of stream `seed` through the engine; exact match after strip().
    `engine_kwargs` go to `mmserve.LLM` (e.g. kv_cache_dtype="int8")."""
    if seed >= shapes.TRAIN_SEED_BASE:
        raise ValueError(f"eval seeds must be below {shapes.TRAIN_SEED_BASE} (training uses the rest)")
    model_dir = Path(model_dir) if model_dir else default_model_dir()
    samples = shapes.make_samples(seed, n)
    started = time.perf_counter()
    llm = mmserve.LLM(str(model_dir), enable_prefix_caching=True, max_num_batched_tokens=max_num_batched_tokens,
                      **engine_kwargs)
    outputs = llm.chat([s.messages for s in samples], mmserve.SamplingParams(temperature=0, max_tokens=32),
                       use_tqdm=False)
    answers = [out.outputs[0].text.strip() for out in outputs]
    hits: dict[str, list[bool]] = {t: [] for t in shapes.QUESTION_TYPES}
    for sample, answer in zip(samples, answers):
        hits[sample.question_type].append(answer == sample.answer)
    accuracy = {t: sum(h) / len(h) for t, h in hits.items() if h}
    accuracy["overall"] = sum(sum(h) for h in hits.values()) / max(1, n)
    counts = {t: len(h) for t, h in hits.items()}
    return EvalResult(str(model_dir), n, seed, accuracy, counts, answers, time.perf_counter() - started)


def print_report(result: EvalResult, out=sys.stdout) -> None:
    print(f"model: {result.model}\nconversations: {result.n} (seed {result.seed}), wall {result.wall_s:.1f} s",
          file=out)
    print(f"{'question type':<14} {'n':>5} {'accuracy':>9}", file=out)
    for qtype, acc in result.accuracy.items():
        n = result.counts.get(qtype, result.n)
        print(f"{qtype:<14} {n:>5} {acc:>9.3f}", file=out)
    record = {"model": result.model, "n": result.n, "seed": result.seed, "wall_s": round(result.wall_s, 2),
              "accuracy": {k: round(v, 4) for k, v in result.accuracy.items()}}
    print(json.dumps(record), file=out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Exact-match accuracy of a model on the shapes task, via the engine.")
    p.add_argument("--n", type=int, default=500, help="number of conversations")
    p.add_argument("--seed", type=int, default=0, help=f"stream seed, below {shapes.TRAIN_SEED_BASE}")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the bundled demo model)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"])
    args = p.parse_args(argv)
    print_report(evaluate(args.model, args.n, args.seed, args.max_num_batched_tokens,
                          kv_cache_dtype=args.kv_cache_dtype))


if __name__ == "__main__":
    main()

"""What the routing simulation charges for work: one replica's costs, measured on this machine.

Role: with the engine itself (offline, one replica's share of the cores: `--threads`, default the
cores divided by two replicas), time the steps that prefill a text prompt at two lengths (a fixed
cost per step plus a cost per token), the step that also encodes one image of the workload's size
(less that prefill), and a decode step at several batch sizes; read the chat template's token
lengths (the start every conversation shares, an image's span, a question) and the replica's
limits (max_num_seqs, the token budget, KV blocks, how many of these images its encoder cache
holds). Writes them as JSON under `.bench/` (cached per model and thread count) for
benchmarks/routing_sim.py.

What it does not know: routing, other replicas.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.checkpoints import BENCH_DIR, EAGER, ensure_model  # noqa: E402
from benchmarks.workload import synthetic_image  # noqa: E402

IMAGE_SIZE = (448, 336)
ANSWER_TOKENS = 16
QUESTION = "What is in this picture?"
BATCH_SIZES = (1, 4, 16, 32)
REPEATS = 3


def _timed_step(engine: Any) -> float:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def _prefill_s(engine: Any, prompt: Any, tag: str) -> float:
    """Median seconds of the step that prefills `prompt` alone (prefix caching is off)."""
    from mmserve import SamplingParams

    times = []
    for i in range(REPEATS):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
        times.append(_timed_step(engine))
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times)


def measure(model: str, threads: int) -> dict[str, Any]:
    import torch

    from mmserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    model_dir = ensure_model(model)
    llm = LLM(str(model_dir), enable_prefix_caching=False, **EAGER)
    engine = llm.engine
    vocab = engine.spec.vocab_size
    rng = np.random.default_rng(0)

    def text(n: int) -> Any:
        return engine.process({"prompt_token_ids": rng.integers(100, min(vocab, 30000), n).tolist()})

    short, long = 64, 512
    t_short, t_long = _prefill_s(engine, text(short), "s"), _prefill_s(engine, text(long), "l")
    per_token = (t_long - t_short) / (long - short)
    overhead = max(0.0, t_short - short * per_token)
    encode_times = []
    for i in range(REPEATS):  # a new image each time: no encoder-cache hit
        image = synthetic_image(np.random.default_rng(100 + i), *IMAGE_SIZE)
        prompt = engine.process_chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                                   {"type": "text", "text": QUESTION}]}])
        step_s = _prefill_s(engine, prompt, f"i{i}")
        encode_times.append(step_s - overhead - prompt.num_tokens * per_token)
    item = prompt.items[0]
    decode = []
    for batch in BATCH_SIZES:
        for i in range(batch):
            engine.add_request(f"d{batch}-{i}", text(32), SamplingParams(max_tokens=12, min_tokens=12, temperature=0))
        engine.step()  # the prefills
        steps = [_timed_step(engine) for _ in range(8)]
        while engine.has_unfinished_requests():
            engine.step()
        decode.append((batch, statistics.median(steps)))
    engine.check_integrity()
    stats = engine.get_stats()
    image_bytes = item.output_rows * stats["budget_bytes_per_embedding_row"]
    sched = engine.config.scheduler
    result = {
        "model": str(model_dir), "threads": threads, "image_size": list(IMAGE_SIZE),
        "costs": {"encode_s": round(statistics.median(encode_times), 6), "prefill_s_per_token": round(per_token, 8),
                  "decode_s": [[b, round(s, 6)] for b, s in decode], "step_overhead_s": round(overhead, 6)},
        "shape": {"lead_tokens": item.offset, "image_tokens": item.length,
                  "question_tokens": prompt.num_tokens - item.offset - item.length, "answer_tokens": ANSWER_TOKENS,
                  "block_size": engine.config.cache.block_size},
        "limits": {"max_num_seqs": sched.max_num_seqs,
                   "max_batched_tokens": sched.max_num_batched_tokens,
                   "encoder_cache_images": int(stats["budget_encoder_cache_bytes"] // image_bytes),
                   "kv_blocks": stats["kv_blocks_total"]},
    }
    llm.shutdown()
    return result


def ensure_costs(model: str, threads: int | None = None) -> Path:
    """The costs JSON for `model` at `threads`, measured (in a fresh process) on first use."""
    import subprocess

    threads = threads or max(1, (os.cpu_count() or 2) // 2)
    path = BENCH_DIR / f"routing-costs-{Path(model).name}-t{threads}.json"
    if not path.is_file():
        print(f"measuring routing costs on {model} with {threads} thread(s) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, str(Path(__file__)), model, str(threads), str(path)], check=True)
    return path


def capacity_conversations_per_s(costs: Any, shape: Any, limits: Any, turns: int) -> float:
    """Roughly the conversations per second one replica serves when full: each turn prefills its new
    tokens (the history found cached) and decodes its answer in a batch of max_num_seqs; the image
    is encoded once. Only sets the simulation's offered load."""
    batch = limits.max_num_seqs
    new_tokens = shape.lead_tokens + shape.image_tokens + turns * shape.question_tokens \
        + (turns - 1) * shape.answer_tokens
    decode_s = turns * shape.answer_tokens * costs.decode_step_s(batch) / batch
    return 1.0 / (costs.encode_s + new_tokens * costs.prefill_s_per_token + decode_s)


if __name__ == "__main__":
    name, threads_arg, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(measure(name, threads_arg), indent=1))
    print(out.read_text())

"""What the routing simulation charges for work: one replica's costs, measured on this machine.

Role: with the engine itself (offline, one replica's share of the cores: the cores divided by two
replicas), time the step that prefills a prompt with one image of the workload's size, the steps
that prefill text prompts of as many tokens and of a few (the encode is the difference at equal
length; a fixed cost per step plus a cost per token from the two text prompts), and a decode step
at several batch sizes; read the chat template's token
lengths (the start every conversation shares, an image's span, a question) and the replica's
limits (max_num_seqs, the token budget, KV blocks, how many of these images its encoder cache
holds). Writes them as JSON under `.bench/` (cached per model and thread count) for
benchmarks/cluster/routing_sim.py.

What it does not know: routing, other replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.card import ROOT
from benchmarks.checkpoints import BENCH_DIR, EAGER, ensure_model
from benchmarks.workload import synthetic_image

IMAGE_SIZE = (448, 336)
ANSWER_TOKENS = 16
QUESTION = "What is in this picture?"
BATCH_SIZES = (1, 4, 16, 32)
REPEATS = 3


def _timed_step(engine: Any) -> float:  # one step's seconds
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def _first_token_s(engine: Any, prompt: Any, request_id: str) -> float:
    """Seconds from adding `prompt` alone to its first token: its encode (unless the encoder cache has its
    images), prefill and sampling, over however many steps they take (prefix caching is off)."""
    from mmserve import SamplingParams

    started = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started


def _prefill_s(engine: Any, prompt: Any, tag: str) -> float:
    """The median of REPEATS `_first_token_s` of a text prompt."""
    return statistics.median(_first_token_s(engine, prompt, f"{tag}-{i}") for i in range(REPEATS))


def measure(model: str, threads: int, log_dir: Path = BENCH_DIR) -> dict[str, Any]:
    """`log_dir`: where the server it starts for the API's share writes its log."""
    import torch

    from mmserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    model_dir = ensure_model(model)
    llm = LLM(str(model_dir), enable_prefix_caching=False, **EAGER)
    engine = llm.engine
    words = engine.processor.tokenizer.encode("the quick brown fox jumps over a lazy dog near the river " * 200)
    rng = np.random.default_rng(0)

    def text(n: int) -> Any:  # n ordinary text tokens (never a placeholder), shuffled: no prefix in common
        return engine.process({"prompt_token_ids": rng.permutation(words)[:n].tolist()})

    image_steps, prompt = [], None
    for i in range(REPEATS):  # a new image each time: no encoder-cache hit
        image = synthetic_image(np.random.default_rng(100 + i), *IMAGE_SIZE)
        prompt = engine.process_chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                                   {"type": "text", "text": QUESTION}]}])
        image_steps.append(_first_token_s(engine, prompt, f"i{i}"))
    assert prompt is not None
    # the same number of text tokens, and a short prompt: the encode is the difference, prefill the slope
    short = 32
    t_short, t_same = _prefill_s(engine, text(short), "s"), _prefill_s(engine, text(prompt.num_tokens), "l")
    chat = engine.process_chat([{"role": "user", "content": "Say something about the weather."}])
    chat_s = _prefill_s(engine, chat, "c")
    per_token = (t_same - t_short) / (prompt.num_tokens - short)
    overhead = max(0.0, t_short - short * per_token)
    encode_times = [t - t_same for t in image_steps]
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
    result["costs"]["api_overhead_s"] = round(_api_overhead_s(model_dir, chat_s, log_dir), 6)
    return result


def _api_overhead_s(model_dir: Path, engine_text_s: float, log_dir: Path) -> float:
    """What the server adds to a request's time to first token (HTTP, JSON, the hop to a replica and back):
    a short text completion's TTFT through a two-replica server, less the engine's own first token."""
    import asyncio

    import httpx

    from benchmarks.cluster.replicas import stream_chat
    from benchmarks.server.serve import local_server_process

    async def ttfts(url: str) -> list[float]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            body = {"model": str(model_dir), "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "user", "content": "Say something about the weather."}]}
            return [(await stream_chat(client, body))[0] for _ in range(8)]

    with local_server_process(model_dir, ["--data-parallel-size", "2", "--no-compile-cpu-decode",
                                          "--no-enable-prefix-caching"],
                              log_dir / "routing-costs-server.log") as server:
        times = asyncio.run(ttfts(server.url))
    return max(0.0, statistics.median(times[2:]) - engine_text_s)


def ensure_costs(model: str, threads: int | None = None, path: Path | None = None) -> Path:
    """The costs JSON for `model` at `threads` (at `path`, default under .bench/), measured in a fresh
    process on first use."""
    import subprocess

    threads = threads or max(1, (os.cpu_count() or 2) // 2)
    path = path or BENCH_DIR / f"routing-costs-{Path(model).name}-t{threads}.json"
    if not path.is_file():
        print(f"measuring routing costs on {model} with {threads} thread(s) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "benchmarks.cluster.routing_costs", model, str(threads), str(path)],
                       check=True, cwd=ROOT)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="30m, 100m, tiny or a checkpoint directory")
    parser.add_argument("threads", type=int, help="torch threads per replica")
    parser.add_argument("out", type=Path, help="the costs JSON to write (its folder gets the server logs)")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(measure(args.model, args.threads, args.out.parent), indent=1))
    print(args.out.read_text())


if __name__ == "__main__":
    main()

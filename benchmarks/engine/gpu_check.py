"""GPU check: captured graphs on vs off give the same tokens, and how much faster they are.

Role: on one CUDA device, with the ~100M Qwen2-VL bench checkpoint (`benchmarks/engine/offline.py` builds it
under `.bench/` on first use; `--model tiny` for the tiny test model), in bfloat16 by default:
1. graphs on vs off: the offline workload (`benchmarks/workload.py`) through two fresh `LLM`s, one with
   encoder and decode graphs, one without; greedy tokens must be identical (exit 1 otherwise);
2. a speed table: vision-encoder latency for 1, 4 and 16 images (eager tower vs captured graph), one
   decode step at batch 1, 8 and 32 (eager vs graphs; `engine.step()` wall time, median), and the
   end-to-end offline throughput of both engines.
Prints a card, the table, and one JSON line last. Without a CUDA device it says so and exits 2;
`--allow-cpu` runs the same code on the CPU (graphs as replay-equivalents: a smoke test, no speed-up).

What it does not know: mmserve internals beyond `LLM`, `Engine.step`, the runner's graph runners and
the model's `encode_items`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.card import json_line
from benchmarks.checkpoints import ensure_checkpoint, greedy
from benchmarks.workload import build_workload, synthetic_image

NO_CUDA_EXIT = 2
ENCODER_IMAGES = (1, 4, 16)
DECODE_BATCHES = (1, 8, 32)
IMAGE_SIDE_PX = 336  # one encoder item: 24 x 24 patches of 14 px = 576 encoder tokens


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_s(fn, device: str, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


CPU_SMOKE_ENCODER_BUCKETS = ((2048, 17), (12288, 17))  # the CPU's masked attention is quadratic: few, small


def _engine_args(args: argparse.Namespace, graphs: bool) -> dict[str, Any]:
    out = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(DECODE_BATCHES), max_model_len=2048,
               max_num_batched_tokens=4096, enable_encoder_cuda_graphs=graphs, enable_decode_cuda_graphs=graphs)
    if graphs and args.device == "cpu":
        out.update(encoder_graph_buckets=CPU_SMOKE_ENCODER_BUCKETS, decode_graph_batch_sizes=DECODE_BATCHES)
    return out


def run_offline(llm, args: argparse.Namespace) -> tuple[list[list[int]], float]:
    """Greedy tokens of the workload and output tokens per second."""
    convs = [c.messages for c in build_workload(args.num_requests, seed=0).conversations]
    llm.chat(convs[:2], greedy(4), use_tqdm=False)  # warm: first kernels, allocator
    started = time.perf_counter()
    outputs = llm.chat(convs, greedy(args.output_tokens), use_tqdm=False)
    wall_s = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return tokens, sum(len(t) for t in tokens) / wall_s


def encoder_latency(eager_llm, graph_llm, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """Median seconds to encode n images: the model's eager `encode_items` vs the captured graph."""
    import numpy as np

    engine = graph_llm.engine
    graphs = engine.runner.encoder_graphs
    rng = np.random.default_rng(0)
    out = {}
    for n in ENCODER_IMAGES:
        images = [synthetic_image(rng, IMAGE_SIDE_PX, IMAGE_SIDE_PX) for _ in range(n)]
        prompt = engine.process_chat([{"role": "user", "content": [
            *({"type": "image_pil", "image_pil": im} for im in images), {"type": "text", "text": "Hi."}]}])
        payloads = [item.payload for item in prompt.items]
        eager_fn = lambda p=payloads: eager_llm.engine.model.encode_items(p)  # noqa: E731
        row = {"eager_s": _median_s(eager_fn, args.device, args.repeats)}
        if graphs is not None and graphs.plan(graphs.adapter.layout(payloads)) is not None:
            row["graphs_s"] = _median_s(lambda p=payloads: graphs.run(p), args.device, args.repeats)
        out[n] = row
    return out


def decode_step_latency(llm, batch: int, args: argparse.Namespace) -> float:
    """Median `engine.step()` seconds with `batch` text requests all decoding."""
    from mmserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=64 + args.repeats * 2, min_tokens=64 + args.repeats * 2)
    for i in range(batch):
        chat = [{"role": "user", "content": [{"type": "text", "text": f"Count to {i + 10}, please."}]}]
        engine.add_request(f"decode-{batch}-{i}", engine.process_chat(chat), params)
    while len(requests := engine.inspect().runner_requests) < batch or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in requests.values()):
        engine.step()
    seconds = _median_s(engine.step, args.device, args.repeats)
    engine.abort_request([f"decode-{batch}-{i}" for i in range(batch)])
    engine.step()
    return seconds


def print_table(card: dict[str, Any], results: dict[str, Any]) -> None:
    print(" ".join(f"{k}={v}" for k, v in card.items()))
    print(f"graphs on vs off: {results['identical']}/{results['num_requests']} requests with identical tokens")
    print(f"{'measure':<28}{'eager':>12}{'graphs':>12}{'speed-up':>10}")

    def row(name: str, eager: float | None, graphs: float | None, unit: str, higher_is_better: bool = False) -> None:
        scale = 1e3 if unit == "ms" else 1.0
        eager_s = "-" if eager is None else f"{eager * scale:.2f}"
        graphs_s = "-" if graphs is None else f"{graphs * scale:.2f}"
        speedup = "-" if not eager or not graphs else f"{(graphs / eager if higher_is_better else eager / graphs):.2f}x"
        print(f"{name + ' (' + unit + ')':<28}{eager_s:>12}{graphs_s:>12}{speedup:>10}")

    for n, r in results["encoder"].items():
        row(f"encoder {n} image(s)", r["eager_s"], r.get("graphs_s"), "ms")
    for b, r in results["decode"].items():
        row(f"decode step batch {b}", r["eager_s"], r["graphs_s"], "ms")
    row("offline throughput", results["throughput"]["eager"], results["throughput"]["graphs"], "tok/s",
        higher_is_better=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["100m", "tiny"], default="100m")
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, run on the CPU (smoke test)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if torch.cuda.is_available():
        args.device = "cuda"
    elif args.allow_cpu:
        args.device = "cpu"
    else:
        print("gpu_check: no CUDA device: skipping (the CUDA path stays unverified here)", file=sys.stderr)
        return NO_CUDA_EXIT
    from mmserve import LLM

    started = time.perf_counter()
    model_dir = ensure_checkpoint(args.model)
    card = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke)",
            "model": args.model, "dtype": args.dtype, "torch": torch.__version__,
            "requests": args.num_requests, "output_tokens": args.output_tokens}
    eager = LLM(str(model_dir), **_engine_args(args, graphs=False))
    graphed = LLM(str(model_dir), **_engine_args(args, graphs=True))
    eager_tokens, eager_tps = run_offline(eager, args)
    graph_tokens, graph_tps = run_offline(graphed, args)
    identical = sum(a == b for a, b in zip(eager_tokens, graph_tokens))
    results: dict[str, Any] = {"identical": identical, "num_requests": len(eager_tokens),
                               "throughput": {"eager": eager_tps, "graphs": graph_tps}}
    results["encoder"] = encoder_latency(eager, graphed, args)
    results["decode"] = {b: {"eager_s": decode_step_latency(eager, b, args),
                             "graphs_s": decode_step_latency(graphed, b, args)} for b in DECODE_BATCHES}
    graphs = graphed.engine.inspect().graphs
    results["graph_stats"] = {
        "encoder_buckets_captured": len(graphs.encoder.captured) if graphs.encoder else 0,
        "encoder_capture_bytes": graphs.encoder.capture_bytes if graphs.encoder else 0,
        "decode_graphs_captured": len(graphs.decode.captured) if graphs.decode else 0}
    print_table(card, results)
    json_line({"bench": "gpu_check", "card": card, "run_s": round(time.perf_counter() - started, 1),
                      **results})
    if identical != len(eager_tokens):
        print(f"gpu_check: FAIL: graphs changed the tokens of {len(eager_tokens) - identical} requests",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

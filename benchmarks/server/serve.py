"""Online serving benchmark: N concurrent clients with the official `openai` client against a server.

Role: send a fixed-seed multimodal workload as streaming chat completions from N concurrent clients
(`--clients 1,8,32` runs each count in turn against the same server), each client taking the next
conversation when its last one is answered; greedy. Two workloads:
- `shapes` (default): conversations from `mmserve.demo.shapes` (every question type, two-image
  comparisons included) for the bundled demo model; answers end naturally and are checked against
  the generator's ground truth, so the report includes accuracy under concurrency;
- `generic`: the offline benchmark's workload of `benchmarks/workload.py` (images as PNG data URIs;
  repeated images are byte-identical, so the encoder cache reuses them); every answer is exactly
  `--output-tokens` tokens (min_tokens = max_tokens).
Measures per request: time to first token (TTFT), time per output token after the first (TPOT) and
every inter-token latency (ITL, between chunks that carry text: a token that completes no
character yet arrives with the next one, so ITL can exceed TPOT); overall: request and output-token throughput.
With `--url` it talks to a running server; otherwise it starts `mmserve serve` on a free loopback
port (`--server-model`: the bundled demo model by default, or `tiny`, the tiny random checkpoint built
under `.bench/` on first use, or a directory) and stops it afterwards.

Prints a card (machine, server, model, workload), a human table, and one JSON line last. Also writes
a PNG (`--plot`, default `.bench/serve.png`; matplotlib, the optional `bench` extra; skipped with a
note when it is not installed): output tokens/s per client count and the TTFT and ITL distributions.
What it does not know: mmserve internals; it only speaks HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.card import ROOT, json_line, machine_info, machine_line
from benchmarks.reports import plots
from benchmarks.workload import Workload, build_workload


@dataclass
class RequestRecord:
    ttft_s: float
    latency_s: float
    output_tokens: int
    itl_s: list[float] = field(default_factory=list)
    text: str = ""
    expected: str | None = None  # the ground-truth answer, when the workload has one

    @property
    def tpot_s(self) -> float | None:
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# ---- workload as OpenAI messages ---------------------------------------------------------------------
def to_openai_messages(workload: Workload) -> list[list[dict[str, Any]]]:
    """image_pil parts -> image_url data URIs; the same PIL object encodes to the same bytes once."""
    encoded: dict[int, str] = {}

    def uri(image: Any) -> str:
        if id(image) not in encoded:
            buf = io.BytesIO()
            image.save(buf, "PNG")
            encoded[id(image)] = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        return encoded[id(image)]

    out = []
    for conv in workload.conversations:
        messages = []
        for message in conv.messages:
            content = message["content"]
            if isinstance(content, list):
                content = [{"type": "image_url", "image_url": {"url": uri(p["image_pil"])}}
                           if p["type"] == "image_pil" else p for p in content]
            messages.append({**message, "content": content})
        out.append(messages)
    return out


def image_data_uri(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@dataclass
class Job:
    """One conversation to send: its messages, its sampling, and the right answer when known."""

    messages: list[dict[str, Any]]
    max_tokens: int
    min_tokens: int = 0
    expected: str | None = None


async def sse_chunks(response: httpx.Response) -> AsyncIterator[dict[str, Any] | None]:
    """The parsed `data:` events of a streamed completion, in order; None for the closing [DONE]."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield None if payload == "[DONE]" else json.loads(payload)


def shapes_jobs(num_requests: int, seed: int, start: int = 0) -> tuple[list[Job], dict[str, Any]]:
    from mmserve.demo import shapes

    seed = seed + 17  # an eval-range seed (below the trainer's), never trained on
    samples = shapes.make_samples(seed, num_requests, start)
    jobs = [Job([{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": image_data_uri(i)}}
                                               for i in s.images), {"type": "text", "text": s.question}]}],
                max_tokens=24, expected=s.answer) for s in samples]
    summary = {"name": "shapes", "num_requests": num_requests, "seed": seed,
               "num_images": sum(len(s.images) for s in samples), "question_types": list(shapes.QUESTION_TYPES)}
    return jobs, summary


def generic_jobs(num_requests: int, seed: int, output_tokens: int) -> tuple[list[Job], dict[str, Any]]:
    workload = build_workload(num_requests=num_requests, seed=seed)
    jobs = [Job(m, output_tokens, output_tokens) for m in to_openai_messages(workload)]
    return jobs, {"name": "generic", **workload.summary()}


# ---- clients ---------------------------------------------------------------------------------------
async def one_request(client: Any, model: str, job: Job) -> RequestRecord:
    started = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    usage_tokens = None
    stream = await client.chat.completions.create(
        model=model, messages=job.messages, max_tokens=job.max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"min_tokens": job.min_tokens})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
    finished = time.perf_counter()
    if not arrivals:
        raise RuntimeError("a request streamed no content")
    return RequestRecord(arrivals[0] - started, finished - started, usage_tokens or len(arrivals),
                         [b - a for a, b in zip(arrivals, arrivals[1:])], "".join(pieces), job.expected)


async def run_clients(base_url: str, api_key: str, model: str, jobs: list[Job],
                      num_clients: int) -> tuple[list[RequestRecord], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=600)
    await one_request(client, model, Job(jobs[0].messages, 2))  # warm-up, off the clock
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    records: list[RequestRecord] = []

    async def worker() -> None:
        while not queue.empty():
            records.append(await one_request(client, model, queue.get_nowait()))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(num_clients)))
    wall = time.perf_counter() - started
    await client.close()
    return records, wall


# ---- the server under test -------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalServer:
    url: str
    pid: int  # the `mmserve serve` process (its encoder workers, if any, are its children)


@contextlib.contextmanager
def local_server_process(model_dir: Path | None, extra_args: list[str], log_path: Path | None = None):
    """`mmserve serve [model_dir]` on a free loopback port (no model_dir: the demo model); yields a
    `LocalServer`. Its output goes to `log_path` (default `.bench/serve-bench-server.log`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if log_path is None:
        (ROOT / ".bench").mkdir(exist_ok=True)
        log_path = ROOT / ".bench" / "serve-bench-server.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed below)
    model_arg = [str(model_dir)] if model_dir else []
    process = subprocess.Popen([sys.executable, "-m", "mmserve.entrypoints.cli", "serve", *model_arg,
                                "--port", str(port), "--log-level", "warning", *extra_args],
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        else:
            raise RuntimeError(f"the server did not start; see {log.name}")
        yield LocalServer(url, process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a server stuck in shutdown is not left running
            process.kill()
            process.wait()
        log.close()


@contextlib.contextmanager
def local_server(model_dir: Path | None, extra_args: list[str]):
    """`local_server_process`, yielding only the URL."""
    with local_server_process(model_dir, extra_args) as server:
        yield server.url


# ---- report ----------------------------------------------------------------------------------------
# ---- the server's state -----------------------------------------------------------------------------
IDLE_KEYS = ("requests_running", "requests_waiting", "kv_blocks_total", "kv_blocks_free",
             "encoder_cache_bytes_referenced", "encoder_cache_bytes_used", "encoder_cache_bytes_total",
             "requests_finished", "prefix_cache_hit_tokens")



def is_idle(stats: dict[str, Any]) -> bool:
    """No request running or waiting, every KV block free, no encoder-cache bytes held by a request."""
    return (stats.get("requests_running") == 0 and stats.get("requests_waiting") == 0
            and stats.get("kv_blocks_free") == stats.get("kv_blocks_total")
            and stats.get("encoder_cache_bytes_referenced") == 0)


async def wait_idle(client: httpx.AsyncClient, timeout_s: float) -> tuple[bool, dict[str, Any]]:
    """Poll /v1/stats until the engine is idle (or the timeout): (idle, the IDLE_KEYS figures then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = (await client.get("/v1/stats")).json()
        if is_idle(stats) or time.monotonic() > deadline:
            return is_idle(stats), {k: stats.get(k) for k in IDLE_KEYS}
        await asyncio.sleep(0.2)


def percentiles_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
    arr = np.asarray(values) * 1000.0
    return {"p50": round(float(np.percentile(arr, 50)), 2), "p99": round(float(np.percentile(arr, 99)), 2),
            "mean": round(float(arr.mean()), 2)}


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    output_tokens = sum(r.output_tokens for r in records)
    checked = [r for r in records if r.expected is not None]
    return {
        "num_requests": len(records), "wall_s": round(wall_s, 3),
        "request_throughput_per_s": round(len(records) / wall_s, 3),
        "output_token_throughput_per_s": round(output_tokens / wall_s, 2),
        "ttft_ms": percentiles_ms([r.ttft_s for r in records]),
        "tpot_ms": percentiles_ms([t for r in records if (t := r.tpot_s) is not None]),
        "itl_ms": percentiles_ms([x for r in records for x in r.itl_s]),
        "e2e_latency_ms": percentiles_ms([r.latency_s for r in records]),
        "accuracy": round(sum(r.text == r.expected for r in checked) / len(checked), 4) if checked else None,
    }


def print_card(card: dict[str, Any]) -> None:
    print("== mmserve serving benchmark ==")
    print(f"machine   : {machine_line(card)}")
    print(f"server    : {card['server']} model {card['model']}")
    w = card["workload"]
    if w["name"] == "shapes":
        what = (f"{w['num_requests']} shapes conversations (seed {w['seed']}, every question type), "
                f"{w['num_images']} images as PNG data URIs; answers end naturally (max 24 tokens) and are checked")
    else:
        what = (f"{w['num_requests']} chat requests (seed {w['seed']}), {w['num_images']} images "
                f"({w['repeated_image_fraction']:.0%} repeats) as PNG data URIs, {card['output_tokens']} greedy "
                f"output tokens each")
    print(f"workload  : {what}; streaming; clients {', '.join(str(c) for c in card['clients'])}, "
          "fresh conversations for each count")
    print()


def print_table(results: list[dict[str, Any]]) -> None:
    head = (f"{'clients':>7} {'req/s':>8} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8} "
            f"{'ITL p50':>8} {'p99':>8} {'accuracy':>9}")
    print(head + "\n" + "-" * len(head))
    for r in results:
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
        print(f"{r['clients']:>7} {r['request_throughput_per_s']:>8.2f} {r['output_token_throughput_per_s']:>8.1f} "
              f"{r['ttft_ms']['p50']:>9.1f} {r['ttft_ms']['p99']:>8.1f} {r['tpot_ms']['p50']:>9.2f} "
              f"{r['tpot_ms']['p99']:>8.2f} {r['itl_ms']['p50']:>8.2f} {r['itl_ms']['p99']:>8.2f} {acc:>9}")
    print("(latencies in ms; TTFT = time to first token, TPOT = time per output token after the first, "
          "ITL = inter-token latency)")


def write_plot(results: list[dict[str, Any]], dists: list[dict[str, list[float]]], path: Path) -> str:
    """Output tokens/s per client count; TTFT and ITL distributions (box plots, ms) per client count."""
    plt = plots.pyplot()
    if plt is None:
        return plots.NOT_INSTALLED
    labels = [str(r["clients"]) for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(max(12, 2 * len(results) + 8), 4.5))
    axes[0].bar(labels, [r["output_token_throughput_per_s"] for r in results], color="tab:blue")
    axes[0].set_xlabel("concurrent clients")
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("throughput")
    for ax, key, title in ((axes[1], "ttft_ms", "TTFT (ms)"), (axes[2], "itl_ms", "inter-token latency (ms)")):
        ax.boxplot([d[key] or [float("nan")] for d in dists], showfliers=True)
        ax.set_xticks(range(1, len(labels) + 1), labels)
        ax.set_xlabel("concurrent clients")
        ax.set_yscale("log")
        ax.set_title(title)
    return plots.save(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one, see --server-model)")
    parser.add_argument("--server-model", default="demo",
                        help="for a local server: demo (the bundled model, default), tiny, or a model directory")
    parser.add_argument("--model", help="model name to request (default: the server's first model)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    parser.add_argument("--workload", choices=("shapes", "generic"), default="shapes")
    parser.add_argument("--clients", default="1,8,32", help="concurrent client counts, run in turn (default 1,8,32)")
    parser.add_argument("--requests", type=int, default=64, help="conversations per client count (default 64)")
    parser.add_argument("--output-tokens", type=int, default=16, help="generic workload: tokens per answer")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--server-args", default="", help="extra `mmserve serve` flags for a local server")
    parser.add_argument("--plot", type=Path, default=ROOT / ".bench" / "serve.png",
                        help="PNG of tokens/s and TTFT/ITL distributions per client count (default .bench/serve.png)")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    args = parser.parse_args(argv)
    client_counts = [int(c) for c in args.clients.split(",")]

    def jobs_for(round_index: int) -> tuple[list[Job], dict[str, Any]]:
        """Fresh conversations for every client count, so no round finds the last one's images cached."""
        if args.workload == "shapes":
            return shapes_jobs(args.requests, args.seed, start=round_index * args.requests)
        return generic_jobs(args.requests, args.seed + round_index, args.output_tokens)

    workload = jobs_for(0)[1]
    results = []
    dists: list[dict[str, list[float]]] = []  # raw per-request TTFT and per-token ITL, for the plot
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            model_dir = None
            if args.server_model == "tiny":
                from benchmarks.checkpoints import ensure_checkpoint

                model_dir = ensure_checkpoint("tiny")
            elif args.server_model != "demo":
                model_dir = Path(args.server_model)
            url = stack.enter_context(local_server(model_dir, args.server_args.split()))
        headers = {"Authorization": f"Bearer {args.api_key}"}
        model = args.model or httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        for round_index, clients in enumerate(client_counts):
            records, wall = asyncio.run(run_clients(url, args.api_key, model, jobs_for(round_index)[0], clients))
            results.append({"clients": clients, **summarize(records, wall)})
            dists.append({"ttft_ms": [r.ttft_s * 1000 for r in records],
                          "itl_ms": [x * 1000 for r in records for x in r.itl_s]})
    card = {**machine_info(software=False), "server": url, "model": model,
            "clients": client_counts, "output_tokens": args.output_tokens, "workload": workload}
    print_card(card)
    print_table(results)
    if not args.no_plot:
        print(f"plot: {write_plot(results, dists, args.plot)}")
    json_line({"benchmark": "serve", "model": model, "workload": workload, "results": results})


if __name__ == "__main__":
    main()

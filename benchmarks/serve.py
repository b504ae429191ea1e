"""Online serving benchmark: N concurrent clients with the official `openai` client against a server.

Role: send the fixed-seed multimodal workload of `benchmarks/workload.py` (images as PNG data URIs;
repeated images are byte-identical, so the server's encoder cache can reuse them) as streaming chat
completions from `--clients` concurrent clients, each taking the next conversation when its last one
is answered; every answer is exactly `--output-tokens` tokens (min_tokens = max_tokens, greedy).
Measures per request: time to first token (TTFT), time per output token after the first (TPOT) and
every inter-token latency (ITL, between chunks that carry text: a token that completes no
character yet arrives with the next one, so ITL can exceed TPOT); overall: request and output-token throughput.
With `--url` it talks to a running server; otherwise it starts `mmserve serve` on the tiny random
checkpoint (built under `.bench/` on first use) on a free loopback port and stops it afterwards.

Prints a card (machine, server, model, workload), a human table, and one JSON line last.
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
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/serve.py` from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.workload import Workload, build_workload  # noqa: E402


@dataclass
class RequestRecord:
    ttft_s: float
    latency_s: float
    output_tokens: int
    itl_s: list[float] = field(default_factory=list)

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


# ---- clients ---------------------------------------------------------------------------------------
async def one_request(client: Any, model: str, messages: list[dict[str, Any]], output_tokens: int) -> RequestRecord:
    started = time.perf_counter()
    arrivals: list[float] = []
    usage_tokens = None
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=output_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"min_tokens": output_tokens})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
    finished = time.perf_counter()
    if not arrivals:
        raise RuntimeError("a request streamed no content")
    return RequestRecord(arrivals[0] - started, finished - started, usage_tokens or len(arrivals),
                         [b - a for a, b in zip(arrivals, arrivals[1:])])


async def run_clients(base_url: str, api_key: str, model: str, conversations: list[list[dict[str, Any]]],
                      num_clients: int, output_tokens: int) -> tuple[list[RequestRecord], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=600)
    await one_request(client, model, conversations[0], 2)  # warm-up, off the clock
    queue: asyncio.Queue = asyncio.Queue()
    for conv in conversations:
        queue.put_nowait(conv)
    records: list[RequestRecord] = []

    async def worker() -> None:
        while not queue.empty():
            records.append(await one_request(client, model, queue.get_nowait(), output_tokens))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(num_clients)))
    wall = time.perf_counter() - started
    await client.close()
    return records, wall


# ---- the server under test -------------------------------------------------------------------------
@contextlib.contextmanager
def local_server(model_dir: Path, extra_args: list[str]):
    """`mmserve serve` on a free loopback port; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(ROOT / ".bench" / "serve-bench-server.log", "w")  # noqa: SIM115 (closed below)
    process = subprocess.Popen([sys.executable, "-m", "mmserve.entrypoints.cli", "serve", str(model_dir),
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
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


# ---- report ----------------------------------------------------------------------------------------
def percentiles_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
    arr = np.asarray(values) * 1000.0
    return {"p50": round(float(np.percentile(arr, 50)), 2), "p99": round(float(np.percentile(arr, 99)), 2),
            "mean": round(float(arr.mean()), 2)}


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    output_tokens = sum(r.output_tokens for r in records)
    return {
        "num_requests": len(records), "wall_s": round(wall_s, 3),
        "request_throughput_per_s": round(len(records) / wall_s, 3),
        "output_token_throughput_per_s": round(output_tokens / wall_s, 2),
        "ttft_ms": percentiles_ms([r.ttft_s for r in records]),
        "tpot_ms": percentiles_ms([t for r in records if (t := r.tpot_s) is not None]),
        "itl_ms": percentiles_ms([x for r in records for x in r.itl_s]),
        "e2e_latency_ms": percentiles_ms([r.latency_s for r in records]),
    }


def print_report(card: dict[str, Any], result: dict[str, Any]) -> None:
    print("== mmserve serving benchmark ==")
    print(f"machine   : {card['usable_cpus']} usable CPUs ({card['cpu_count']} total), {card['platform']}, "
          f"python {card['python']}")
    print(f"server    : {card['server']} model {card['model']}")
    w = card["workload"]
    print(f"workload  : {w['num_requests']} chat requests (seed {w['seed']}), {w['num_images']} images "
          f"({w['repeated_image_fraction']:.0%} repeats) as PNG data URIs, {card['clients']} concurrent "
          f"clients, {card['output_tokens']} greedy output tokens each (streaming)")
    print()
    print(f"{'metric':<22}{'p50':>10}{'p99':>10}{'mean':>10}")
    for key, label in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
                       ("e2e_latency_ms", "latency (ms)")):
        row = result[key]
        print(f"{label:<22}{row['p50']:>10.2f}{row['p99']:>10.2f}{row['mean']:>10.2f}")
    print(f"{'requests/s':<22}{result['request_throughput_per_s']:>10.3f}")
    print(f"{'output tokens/s':<22}{result['output_token_throughput_per_s']:>10.2f}")
    print(f"{'wall (s)':<22}{result['wall_s']:>10.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one on the tiny checkpoint)")
    parser.add_argument("--model", help="model name to request (default: the server's first model)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--requests", type=int, default=32, help="conversations to send (default 32)")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens per answer (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--server-args", default="", help="extra `mmserve serve` flags for a local server")
    args = parser.parse_args(argv)

    workload = build_workload(num_requests=args.requests, seed=args.seed)
    conversations = to_openai_messages(workload)
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from benchmarks.offline import ensure_checkpoint

            url = stack.enter_context(local_server(ensure_checkpoint("tiny"), args.server_args.split()))
        headers = {"Authorization": f"Bearer {args.api_key}"}
        model = args.model or httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        records, wall = asyncio.run(run_clients(url, args.api_key, model, conversations, args.clients,
                                                args.output_tokens))
    result = summarize(records, wall)
    card = {"cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "platform": platform.platform(), "python": platform.python_version(), "server": url, "model": model,
            "clients": args.clients, "output_tokens": args.output_tokens, "workload": workload.summary()}
    print_report(card, result)
    print(json.dumps({"benchmark": "serve", "model": model, "clients": args.clients,
                      "output_tokens": args.output_tokens, "workload": workload.summary(), **result}))


if __name__ == "__main__":
    main()

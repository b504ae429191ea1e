"""What the Responses and Messages routes add to chat's latency, on the same conversation, side by side.

Run: python -m benchmarks.server.api_overhead [--rounds 5] [--requests 20] [--max-tokens 16]

Role: the issue's target that the Responses API (`/v1/responses`) and Anthropic's Messages API
(`/v1/messages`) add at most 2% to chat completions' latency. One `mmserve serve` of the bundled demo model
(at its defaults) answers the same conversation (a shapes picture and its question, greedy, at most
`--max-tokens` tokens: the same answer, so the same tokens, by every route) by each route, one request at a time; rounds alternate the routes' order and each
round starts the server afresh (a fresh process), every request's end-to-end latency is taken on the client
and each route's median over all rounds is compared with chat's. The three routes build one prompt
(`ChatServing.submit`): what differs is only each route's translation and answer shape.
Prints a card, a table and one JSON line last.

What it does not know: mmserve internals; it only speaks HTTP.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import time
from typing import Any

import httpx

from benchmarks.card import json_line, machine_info, print_card
from benchmarks.server.serve import local_server

ROUTES = ("chat", "responses", "messages")
TARGET_RATIO = 1.02


def _picture() -> tuple[str, str]:
    """(base64 PNG, question) of one shapes picture."""
    from mmserve.demo import shapes

    sample = shapes.make_sample(0, 4, "describe")
    buffer = io.BytesIO()
    sample.images[0].save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode(), sample.question


def bodies(max_tokens: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """(path, body) per route: the same conversation, greedy, at most `max_tokens` tokens (the routes answer
    it alike, so they generate the same tokens: `run_round` checks the counts agree)."""
    data, question = _picture()
    url = "data:image/png;base64," + data
    chat = {"model": "mmserve-demo", "temperature": 0, "max_tokens": max_tokens, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]}]}
    responses = {"model": "mmserve-demo", "temperature": 0, "max_output_tokens": max_tokens, "store": False,
                 "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                         {"type": "input_text", "text": question}]}]}
    messages = {"model": "mmserve-demo", "temperature": 0, "max_tokens": max_tokens, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": data}},
                                     {"type": "text", "text": question}]}]}
    return {"chat": ("/v1/chat/completions", chat), "responses": ("/v1/responses", responses),
            "messages": ("/v1/messages", messages)}


def _output_tokens(route: str, answer: dict[str, Any]) -> int:
    usage = answer["usage"]
    return usage["completion_tokens"] if route == "chat" else usage["output_tokens"]


def run_round(order: tuple[str, ...], requests: int, max_tokens: int) -> dict[str, list[float]]:
    """A fresh server; per route in `order`, one warm-up then `requests` timed requests, one at a time."""
    latencies: dict[str, list[float]] = {route: [] for route in order}
    counts: dict[str, set[int]] = {route: set() for route in order}
    routes = bodies(max_tokens)
    with local_server(None, []) as url, httpx.Client(base_url=url, timeout=120) as client:
        for route in order:
            path, body = routes[route]
            for i in range(requests + 1):
                started = time.perf_counter()
                reply = client.post(path, json=body)
                elapsed = time.perf_counter() - started
                if reply.status_code != 200:
                    raise RuntimeError(f"{route}: {reply.status_code} {reply.text[:300]}")
                counts[route].add(_output_tokens(route, reply.json()))
                if i:  # the first is a warm-up (its prompt then comes from the prefix cache, as the rest)
                    latencies[route].append(elapsed)
    if len(set().union(*counts.values())) != 1:
        raise RuntimeError(f"the routes generated different numbers of tokens: {counts}")
    return latencies


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    latencies: dict[str, list[float]] = {route: [] for route in ROUTES}
    for r in range(args.rounds):
        order = ROUTES if r % 2 == 0 else ROUTES[::-1]
        for route, values in run_round(order, args.requests, args.max_tokens).items():
            latencies[route].extend(values)
    medians_ms = {route: statistics.median(values) * 1e3 for route, values in latencies.items()}
    targets = [{"name": f"{route} median latency / chat's", "value": round(medians_ms[route] / medians_ms["chat"], 4),
                "goal": f"<= {TARGET_RATIO}", "met": medians_ms[route] <= TARGET_RATIO * medians_ms["chat"]}
               for route in ROUTES[1:]]
    print_card("mmserve API overhead benchmark", {
        "machine": str(machine_info()), "server": "mmserve serve (the bundled demo model, defaults)",
        "workload": f"one picture + question, greedy, {args.max_tokens} tokens, one request at a time",
        "method": f"{args.rounds} rounds (a fresh server each, route order alternating), {args.requests} "
                  "requests per route per round after a warm-up; medians"})
    print(f"{'route':<12} {'median ms':>10} {'p90 ms':>8}")
    for route in ROUTES:
        p90 = statistics.quantiles(latencies[route], n=10)[-1] * 1e3
        print(f"{route:<12} {medians_ms[route]:>10.1f} {p90:>8.1f}")
    for t in targets:
        print(f"{t['name']:<40} {t['value']:>8.3f} {t['goal']:>8}  {'yes' if t['met'] else 'NO'}")
    json_line({"bench": "api_overhead", "machine": machine_info(), "rounds": args.rounds,
               "requests_per_round": args.requests, "max_tokens": args.max_tokens,
               "median_ms": {k: round(v, 2) for k, v in medians_ms.items()}, "targets": targets}, compact=True)


if __name__ == "__main__":
    main()

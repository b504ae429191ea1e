"""Soak benchmark: N concurrent clients for T minutes against a demo-model server it starts.

Role: start `mmserve serve` (the bundled demo model; `--server-args` adds flags), then run N asyncio
clients that each loop until the deadline, one request at a time, over raw HTTP (httpx):
- the request's conversation is drawn from a small pool of shapes samples (`serve.shapes_jobs`), so
  images repeat across requests and the encoder cache and prefix cache are hit again and again; the
  pool keeps only the samples the server answers right when asked alone (the model is ~98% right on
  unseen pictures), so under load any other answer is a serving fault, not model accuracy;
- each request is, by weighted draw: plain (non-streaming), streaming (SSE parsed), a disconnect
  (streamed, the client closes the connection after the first chunk: not an error; the server must
  abort it; it asks for 64 tokens, min_tokens too, so generation is still going at the hang-up), a
  fresh picture (one never sent before, so the encoder runs under load and the encoder cache fills
  and evicts; its answer must come, but is not checked) or a bad input (a corrupt base64 image, bytes that are not an image, an invalid field value, an unknown
  model: a 4xx is expected; a 2xx or a 5xx is a failure);
- greedy (temperature 0); every completed answer is compared with the sample's ground truth.
Meanwhile it samples the resident memory (VmRSS) of the server's process tree from /proc. After the
deadline (in-flight requests finish) it polls `/v1/stats` until the engine is idle: no running or
waiting requests, every KV block free (prefix-cached blocks sit in the free list, so they count as
free) and no encoder-cache bytes referenced by a request (unreferenced outputs stay cached for reuse,
up to the cache's byte bound: that is not a leak).

Reports requests by kind, every status seen, failures by status (or transport error), wrong answers,
p50/p99 latency of answered requests and server RSS per minute, RSS growth first→last minute, and
whether the engine went back to idle. Prints a card, a table (per minute) and one JSON line last (the
whole report: tests/e2e/test_soak.py runs `python -m benchmarks.server.soak` and judges that line).
What it does not know: mmserve internals; it speaks HTTP, and reads /proc for memory.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks.card import ROOT, json_line, machine_info, machine_line
from benchmarks.procs import rss_bytes
from benchmarks.server.serve import (
    Job,
    local_server_process,
    percentiles_ms,
    shapes_jobs,
    sse_chunks,
    wait_idle,
)

KINDS = ("plain", "stream", "fresh", "disconnect", "bad_input")
ANSWERED_KINDS = ("plain", "stream", "fresh")
BAD_INPUTS = ("bad_base64", "not_an_image", "bad_max_tokens", "bad_temperature", "unknown_model")
MIB = 1 << 20
DISCONNECT_TOKENS = 64  # min_tokens = max_tokens for a request the client hangs up on


@dataclass(frozen=True)
class SoakConfig:
    clients: int = 32
    duration_s: float = 600.0  # clients start no request after this; those in flight finish
    pool_size: int = 48  # distinct shapes conversations (every question type); requests repeat them
    seed: int = 0
    disconnect_fraction: float = 0.10
    bad_input_fraction: float = 0.05
    fresh_fraction: float = 0.05  # a picture never sent before: encoded under load (its answer is not checked)
    stream_fraction: float = 0.5  # of the remaining (answered) requests, the share that streams
    max_tokens: int = 24  # the longest shapes answer is well under this; answers end with a stop token
    bucket_s: float = 60.0  # the table's rows
    rss_interval_s: float = 5.0
    request_timeout_s: float = 120.0  # generous: 32 clients on 2 shared cores
    idle_timeout_s: float = 30.0  # how long the engine may take to be idle after the last request
    server_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.clients < 1 or self.duration_s <= 0 or self.pool_size < 1 or self.bucket_s <= 0:
            raise ValueError(f"clients, duration_s, pool_size and bucket_s must be positive: {self}")
        fractions = (self.disconnect_fraction, self.bad_input_fraction, self.fresh_fraction, self.stream_fraction)
        if not all(0.0 <= f <= 1.0 for f in fractions) or sum(fractions[:3]) > 1.0:
            raise ValueError(f"fractions must lie in [0, 1] and disconnects + bad inputs + fresh <= 1: {self}")

    @property
    def num_buckets(self) -> int:
        return max(1, math.ceil(self.duration_s / self.bucket_s))

    def kind_weights(self) -> dict[str, float]:
        answered = 1.0 - self.disconnect_fraction - self.bad_input_fraction - self.fresh_fraction
        return {"plain": answered * (1.0 - self.stream_fraction), "stream": answered * self.stream_fraction,
                "fresh": self.fresh_fraction, "disconnect": self.disconnect_fraction,
                "bad_input": self.bad_input_fraction}


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it. `failure` is None when the server behaved as it should."""

    kind: str
    finished_s: float  # since the soak started
    latency_s: float  # send to last byte (a disconnect: to its first chunk)
    status: int | None  # None: no HTTP status (a transport error)
    failure: str | None = None  # a status ("500"), "stream_error", "no_done", or a transport error's name
    wrong: bool = False  # answered, but not the ground truth
    detail: str = ""


@dataclass
class SoakReport:
    config: SoakConfig
    server_pid: int
    model: str
    pool_kept: int  # samples the server answered right alone (the rest are model errors, left out)
    requests: int
    by_kind: dict[str, int]
    statuses: dict[str, int]  # every status (or transport error) seen, expected ones included
    errors_by_status: dict[str, int]  # failures only
    server_errors_5xx: int  # 5xx statuses plus error events inside 200 streams
    wrong_answers: int
    disconnects: int  # streams cut by the client after a first chunk
    bad_inputs_refused: int  # bad inputs answered 4xx
    latency_ms: dict[str, float]  # answered requests: p50, p99, mean
    minutes: list[dict[str, Any]]  # one row per bucket
    rss_mib_first: float | None
    rss_mib_last: float | None
    rss_growth_pct: float | None
    idle_after: bool
    idle_stats: dict[str, Any]
    encoder_cache: dict[str, int]  # hits, misses and evictions during the soak (repeated images hit)
    server_aborts: int  # requests the server finished as aborted (its metrics): the disconnects it noticed
    examples: list[str] = field(default_factory=list)  # the first few failures and wrong answers

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out["config"] = {k: v for k, v in asdict(self.config).items() if k != "server_args"} | {
            "server_args": list(self.config.server_args)}
        return {"benchmark": "soak", **out}


# ---- requests ----------------------------------------------------------------------------------------
def bad_body(variant: str, model: str, job: Job, max_tokens: int) -> dict[str, Any]:
    """A request the server must refuse with a 4xx."""
    good = {"model": model, "messages": job.messages, "max_tokens": max_tokens, "temperature": 0}
    question = {"type": "text", "text": "How many shapes are there?"}

    def with_image_url(url: str) -> dict[str, Any]:
        return {**good, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, question]}]}

    if variant == "bad_base64":
        return with_image_url("data:image/png;base64,!!not*base64!!")
    if variant == "not_an_image":
        return with_image_url("data:image/png;base64," + base64.b64encode(b"these bytes are no PNG" * 8).decode())
    if variant == "bad_max_tokens":
        return {**good, "max_tokens": -1}
    if variant == "bad_temperature":
        return {**good, "temperature": "hot"}
    if variant == "unknown_model":
        return {**good, "model": "no-such-model"}
    raise ValueError(variant)


def _failure_for_status(kind: str, status: int) -> str | None:
    if kind == "bad_input":
        return None if 400 <= status < 500 else str(status)
    return None if status == 200 else str(status)


async def one_request(client: httpx.AsyncClient, kind: str, body: dict[str, Any], expected: str | None,
                      t0: float) -> Outcome:
    started = time.perf_counter()

    def outcome(status: int | None, failure: str | None = None, wrong: bool = False, detail: str = "") -> Outcome:
        now = time.perf_counter()
        return Outcome(kind, now - t0, now - started, status, failure, wrong, detail)

    try:
        if kind in ("plain", "fresh", "bad_input"):
            response = await client.post("/v1/chat/completions", json=body)
            failure = _failure_for_status(kind, response.status_code)
            if failure is not None or kind == "bad_input":
                return outcome(response.status_code, failure, detail=response.text[:200] if failure else "")
            text = response.json()["choices"][0]["message"]["content"]
            if expected is None:  # a fresh picture: any non-empty answer (the demo model is ~98% right)
                return outcome(200, None if text else "empty_answer")
            return outcome(200, wrong=text != expected, detail=f"{text!r} != {expected!r}")
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            if response.status_code != 200:
                await response.aread()
                return outcome(response.status_code, str(response.status_code), detail=response.text[:200])
            pieces: list[str] = []
            async for chunk in sse_chunks(response):
                if kind == "disconnect":
                    return outcome(200)  # leaving the block closes the connection mid-stream
                if chunk is None:
                    text = "".join(pieces)
                    return outcome(200, wrong=text != expected, detail=f"{text!r} != {expected!r}")
                if "error" in chunk:
                    return outcome(200, "stream_error", detail=json.dumps(chunk["error"])[:200])
                if chunk["choices"]:
                    pieces.append(chunk["choices"][0]["delta"].get("content") or "")
            return outcome(200, "no_done", detail="the stream ended without [DONE]")
    except httpx.HTTPError as exc:
        return outcome(None, type(exc).__name__, detail=str(exc)[:200])
    except (ValueError, KeyError, IndexError, TypeError) as exc:  # a 200 whose body is not what OpenAI's is
        return outcome(200, "malformed", detail=f"{type(exc).__name__}: {exc}"[:200])


# ---- server memory -----------------------------------------------------------------------------------
async def sample_rss(pid: int, interval_s: float, t0: float, samples: list[tuple[float, int]],
                     stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append((time.perf_counter() - t0, rss_bytes(pid)))
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass


# ---- the soak ------------------------------------------------------------------------------------------
async def aborted_requests(client: httpx.AsyncClient) -> int:
    """The server's count of requests finished as aborted, from /metrics."""
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith('mmserve_requests_total{finish_reason="abort"}'):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


async def keep_answered_right(client: httpx.AsyncClient, model: str, jobs: list[Job], max_tokens: int) -> list[Job]:
    """The pool's samples the server answers right when asked alone, one at a time."""
    kept = []
    for job in jobs:
        body = {"model": model, "messages": job.messages, "max_tokens": max_tokens, "temperature": 0}
        result = await one_request(client, "plain", body, job.expected, time.perf_counter())
        if result.failure is None and not result.wrong:
            kept.append(job)
    return kept


async def drive(config: SoakConfig, url: str, pid: int) -> SoakReport:
    limits = httpx.Limits(max_connections=config.clients + 4, max_keepalive_connections=config.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=config.request_timeout_s, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        jobs, _ = shapes_jobs(config.pool_size, config.seed)
        pool = await keep_answered_right(client, model, jobs, config.max_tokens)
        if not pool:
            raise RuntimeError("the server answered no pool sample right, even alone")
        before = (await client.get("/v1/stats")).json()
        aborts_before = await aborted_requests(client)
        outcomes: list[Outcome] = []
        rss: list[tuple[float, int]] = []
        kinds, weights = zip(*config.kind_weights().items())
        t0 = time.perf_counter()

        fresh_index = [0] * config.clients

        async def soak_client(index: int) -> None:
            rng = random.Random(config.seed * 100_003 + index)  # each client its own deterministic draw
            while time.perf_counter() - t0 < config.duration_s:
                kind = rng.choices(kinds, weights)[0]
                job = rng.choice(pool)
                body = {"model": model, "messages": job.messages, "max_tokens": config.max_tokens, "temperature": 0}
                if kind == "bad_input":
                    body = bad_body(rng.choice(BAD_INPUTS), model, job, config.max_tokens)
                elif kind == "fresh":  # past the pool's samples, each client its own range: never seen before
                    fresh_index[index] += 1
                    job = shapes_jobs(1, config.seed, start=config.pool_size + index * 1_000_000 + fresh_index[index])[0][0]
                    job = replace(job, expected=None)
                    body["messages"] = job.messages
                elif kind == "disconnect":  # a long answer, so the server is still generating at the hang-up
                    body |= {"max_tokens": DISCONNECT_TOKENS, "min_tokens": DISCONNECT_TOKENS}
                outcomes.append(await one_request(client, kind, body, job.expected, t0))

        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(pid, config.rss_interval_s, t0, rss, stop))
        await asyncio.gather(*(soak_client(i) for i in range(config.clients)))
        stop.set()
        await sampler
        rss.append((time.perf_counter() - t0, rss_bytes(pid)))  # the last bucket's closing sample
        idle, idle_stats = await wait_idle(client, config.idle_timeout_s)
        after = (await client.get("/v1/stats")).json()
        aborts = await aborted_requests(client) - aborts_before
    encoder_cache = {k: after[k] - before[k] for k in ("encoder_cache_hits", "encoder_cache_misses",
                                                        "encoder_cache_evictions")}
    return build_report(config, pid, model, len(pool), outcomes, rss, idle, idle_stats, encoder_cache, aborts)


def _bucket(config: SoakConfig, at_s: float) -> int:
    return min(int(at_s // config.bucket_s), config.num_buckets - 1)  # in flight at the deadline: the last row


def build_report(config: SoakConfig, pid: int, model: str, pool_kept: int, outcomes: list[Outcome],
                 rss: list[tuple[float, int]], idle: bool, idle_stats: dict[str, Any],
                 encoder_cache: dict[str, int], server_aborts: int) -> SoakReport:
    statuses = Counter(str(o.status) if o.status is not None else o.failure for o in outcomes)
    failures = Counter(o.failure for o in outcomes if o.failure is not None)
    server_errors = sum(n for key, n in failures.items() if key.startswith("5") or key == "stream_error")
    answered = [o for o in outcomes if o.kind in ANSWERED_KINDS and o.failure is None]
    examples = [f"{o.kind} {o.status}: {o.failure or 'wrong answer'} {o.detail}"
                for o in outcomes if o.failure is not None or o.wrong][:5]
    rss_by_bucket: dict[int, int] = {}
    for at_s, value in rss:  # the last sample in a bucket: its memory at the end of that minute
        rss_by_bucket[_bucket(config, at_s)] = value
    minutes = []
    for b in range(config.num_buckets):
        rows = [o for o in outcomes if _bucket(config, o.finished_s) == b]
        latencies = percentiles_ms([o.latency_s for o in answered if _bucket(config, o.finished_s) == b])
        minutes.append({"minute": b + 1, "requests": len(rows), "failures": sum(o.failure is not None for o in rows),
                        "wrong": sum(o.wrong for o in rows),
                        "disconnects": sum(o.kind == "disconnect" and o.failure is None for o in rows),
                        "bad_refused": sum(o.kind == "bad_input" and o.failure is None for o in rows),
                        "p50_ms": latencies["p50"], "p99_ms": latencies["p99"],
                        "rss_mib": round(rss_by_bucket[b] / MIB, 1) if b in rss_by_bucket else None})
    known = [m["rss_mib"] for m in minutes if m["rss_mib"] is not None]
    first, last = (known[0], known[-1]) if known else (None, None)
    return SoakReport(
        config=config, server_pid=pid, model=model, pool_kept=pool_kept, requests=len(outcomes),
        by_kind={k: sum(o.kind == k for o in outcomes) for k in KINDS}, statuses=dict(sorted(statuses.items())),
        errors_by_status=dict(sorted(failures.items())), server_errors_5xx=server_errors,
        wrong_answers=sum(o.wrong for o in outcomes),
        disconnects=sum(o.kind == "disconnect" and o.failure is None for o in outcomes),
        bad_inputs_refused=sum(o.kind == "bad_input" and o.failure is None for o in outcomes),
        latency_ms=percentiles_ms([o.latency_s for o in answered]), minutes=minutes,
        rss_mib_first=first, rss_mib_last=last,
        rss_growth_pct=round(100.0 * (last - first) / first, 2) if first else None,
        idle_after=idle, idle_stats=idle_stats, encoder_cache=encoder_cache, server_aborts=server_aborts,
        examples=examples)


def run_soak(config: SoakConfig, log_path: Path | None = None) -> SoakReport:
    """Start a demo-model server, soak it, stop it. The server's output goes to `log_path`
    (default `.bench/soak-server.log`)."""
    if log_path is None:
        (ROOT / ".bench").mkdir(exist_ok=True)
        log_path = ROOT / ".bench" / "soak-server.log"
    with local_server_process(None, list(config.server_args), log_path) as server:
        return asyncio.run(drive(config, server.url, server.pid))


# ---- printing ------------------------------------------------------------------------------------------
def print_card(report: SoakReport) -> None:
    c = report.config
    w = c.kind_weights()
    print("== mmserve soak ==")
    print(f"machine   : {machine_line(machine_info(software=False))}")
    print(f"server    : mmserve serve (pid {report.server_pid}) {' '.join(c.server_args)}".rstrip()
          + f"; model {report.model}")
    print(f"workload  : {c.clients} clients for {c.duration_s:.0f} s, greedy, max_tokens {c.max_tokens}; "
          f"{c.pool_size} shapes conversations (seed {c.seed}), {report.pool_kept} answered right alone and kept, "
          "drawn again and again (repeated images)")
    print(f"mix       : plain {w['plain']:.1%}, streaming {w['stream']:.1%}, fresh picture {w['fresh']:.0%}, "
          "disconnect after the first chunk "
          f"{w['disconnect']:.0%}, bad input {w['bad_input']:.0%} ({', '.join(BAD_INPUTS)}: 4xx expected)")
    print(f"checks    : timeout {c.request_timeout_s:.0f} s per request; RSS of the server's process tree every "
          f"{c.rss_interval_s:.0f} s; idle within {c.idle_timeout_s:.0f} s after the last request")
    print()


def print_table(report: SoakReport) -> None:
    head = (f"{'minute':>6} {'requests':>9} {'failures':>9} {'wrong':>6} {'disconn':>8} {'bad 4xx':>8} "
            f"{'p50 ms':>8} {'p99 ms':>8} {'RSS MiB':>8}")
    print(head + "\n" + "-" * len(head))
    for m in report.minutes:
        rss = "-" if m["rss_mib"] is None else f"{m['rss_mib']:.1f}"
        print(f"{m['minute']:>6} {m['requests']:>9} {m['failures']:>9} {m['wrong']:>6} {m['disconnects']:>8} "
              f"{m['bad_refused']:>8} {m['p50_ms']:>8.1f} {m['p99_ms']:>8.1f} {rss:>8}")
    print(f"(latency: answered plain and streaming requests, send to last byte; rows are {report.config.bucket_s:.0f} s "
          "by finish time; RSS at the row's end)")
    print(f"requests {report.requests} {report.by_kind}; statuses {report.statuses}")
    print(f"failures {report.errors_by_status or 'none'}; 5xx {report.server_errors_5xx}; wrong answers "
          f"{report.wrong_answers}; latency p50 {report.latency_ms['p50']:.1f} ms, p99 {report.latency_ms['p99']:.1f} ms")
    print(f"RSS first {report.rss_mib_first} MiB, last {report.rss_mib_last} MiB, growth {report.rss_growth_pct}%; "
          f"encoder cache during the soak {report.encoder_cache}; "
          f"requests the server aborted {report.server_aborts} (of {report.disconnects} disconnects)")
    print(f"idle after: {report.idle_after} {report.idle_stats}")
    for example in report.examples:
        print(f"  e.g. {example}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long clients keep sending (default 10)")
    parser.add_argument("--pool", type=int, default=48, help="distinct shapes conversations (default 48)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="",
                        help="extra `mmserve serve` flags, e.g. --server-args='--encoder-workers 2'")
    parser.add_argument("--log", type=Path, default=None, help="the server's log (default .bench/soak-server.log)")
    args = parser.parse_args(argv)
    duration_s = args.minutes * 60.0
    config = SoakConfig(clients=args.clients, duration_s=duration_s, pool_size=args.pool, seed=args.seed,
                        bucket_s=min(60.0, duration_s), server_args=tuple(args.server_args.split()))
    report = run_soak(config, args.log)
    print_card(report)
    print_table(report)
    json_line(report.summary())


if __name__ == "__main__":
    main()

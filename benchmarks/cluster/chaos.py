"""Chaos benchmark: streaming clients against a two-replica server while replicas and encoder workers die.

Role: start `mmserve serve` (the bundled demo model, `--data-parallel-size 2`, 2 process encoder workers
per replica, on 127.0.0.1 only), ask every prompt of a small pool of shapes questions once, alone (the
quiet run: each prompt's greedy answer), then run N concurrent streaming clients for `--duration-s`
while every `--kill-every-s` a process is SIGKILLed, alternating a replica (its pid from `/v1/stats`
`replicas[*].pid`) and an encoder worker (a multiprocessing child of a replica, found by walking /proc).
A share of the requests carry a fresh picture (never sent before) so the encoder workers have work to
lose when they die; their answers are not compared (there is no quiet answer), only awaited.

Every request ends in exactly one outcome:
- `ok` / `wrong`: [DONE] arrived; a pool prompt's text equals (or not) its quiet answer;
- `error_under_way`: an error event after the first token: its replica died mid-stream (allowed: the
  server cannot take back tokens it sent);
- `error_before_start`: an error event before any token: the server should have sent it elsewhere;
- `http_5xx` / `http_other`: the status line was not 200;
- `hung`: no byte for `--hang-s`, or not finished within `--request-timeout-s`;
- `lost`: sent, and the connection ended without [DONE] or an error event (reset, truncated stream).
Target: 0 lost, 0 hung, 0 wrong, 0 error_before_start, 0 x 5xx. Also reported: the RSS of the server's
process tree (first sample after the quiet run, last after the chaos once the replicas are back), the
kills (time, victim, pid), and whether the engine went back to idle. Prints a card, a table per
`--kill-every-s` window and one JSON line last. It stops by itself and ends the server's whole tree.
What it does not know: mmserve internals; it speaks HTTP, reads /proc and sends signals to the server's
own children.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.card import BENCH_DIR, json_line, machine_info, machine_line, print_card
from benchmarks.procs import cmdline, proc_stat, process_tree, reap_leftovers, rss_bytes
from benchmarks.server.serve import Job, local_server_process, shapes_jobs, sse_chunks, wait_idle

OUTCOMES = ("ok", "wrong", "error_under_way", "error_before_start", "http_5xx", "http_other", "hung", "lost")
FAILURES = ("wrong", "error_before_start", "http_5xx", "hung", "lost")  # the targets: each must stay 0
MIB = 1 << 20


@dataclass(frozen=True)
class ChaosConfig:
    clients: int = 32
    duration_s: float = 180.0  # clients start no request after this; those in flight finish
    kill_every_s: float = 30.0
    replicas: int = 2
    encoder_workers: int = 2  # per replica
    pool_size: int = 24  # shapes prompts with a quiet answer
    fresh_fraction: float = 0.25  # requests with a never-sent picture: work for the encoder workers
    max_tokens: int = 24
    seed: int = 0
    hang_s: float = 120.0  # no byte for this long: hung (generous: 32 clients on 2 shared cores)
    request_timeout_s: float = 300.0  # not finished within this: hung
    idle_timeout_s: float = 60.0  # how long the engine may take to be idle after the last request
    rss_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if min(self.clients, self.pool_size, self.replicas) < 1 or self.duration_s <= 0 or self.kill_every_s <= 0:
            raise ValueError(f"clients, pool_size, replicas, duration_s and kill_every_s must be positive: {self}")
        if not 0.0 <= self.fresh_fraction <= 1.0:
            raise ValueError(f"fresh_fraction must lie in [0, 1]: {self}")

    def server_args(self) -> list[str]:
        # eager decode steps: a background compile would share the two cores with the chaos
        return ["--data-parallel-size", str(self.replicas), "--encoder-workers", str(self.encoder_workers),
                "--encoder-backend", "process", "--no-compile-cpu-decode"]


@dataclass(frozen=True)
class Outcome:
    kind: str  # one of OUTCOMES
    finished_s: float  # since the chaos started
    fresh: bool
    detail: str = ""


@dataclass(frozen=True)
class Kill:
    at_s: float
    victim: str  # "replica" or "encoder_worker"
    pid: int | None  # None: no such process was alive to kill
    detail: str = ""


@dataclass
class ChaosRun:
    config: ChaosConfig
    quiet: dict[int, str] = field(default_factory=dict)  # pool index -> greedy answer alone
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since the chaos started, bytes)
    tree_pids: set[int] = field(default_factory=set)  # every pid the server's tree ever had
    idle_after: bool = False
    idle_stats: dict[str, Any] = field(default_factory=dict)
    replicas_after: dict[str, Any] = field(default_factory=dict)
    server_log: dict[str, int] = field(default_factory=dict)  # server_log_events of its log


# ---- one streamed request ----------------------------------------------------------------------------
async def _read_stream(response: httpx.Response) -> tuple[str, str, str]:
    """(outcome, text, detail) of a 200 stream read to its end."""
    pieces: list[str] = []
    async for chunk in sse_chunks(response):
        if chunk is None:
            return "ok", "".join(pieces), ""
        if "error" in chunk:
            kind = "error_under_way" if any(pieces) else "error_before_start"
            return kind, "".join(pieces), json.dumps(chunk["error"])[:200]
        if chunk.get("choices"):
            pieces.append(chunk["choices"][0].get("delta", {}).get("content") or "")
    return "lost", "".join(pieces), "the stream ended without [DONE] or an error event"


async def stream_once(client: httpx.AsyncClient, body: dict[str, Any], timeout_s: float) -> tuple[str, str, str]:
    """(outcome, text, detail) of one streamed chat completion."""
    async def attempt() -> tuple[str, str, str]:
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            if response.status_code != 200:
                await response.aread()
                kind = "http_5xx" if response.status_code >= 500 else "http_other"
                return kind, "", f"{response.status_code} {response.text[:200]}"
            return await _read_stream(response)

    try:
        return await asyncio.wait_for(attempt(), timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
        return "hung", "", type(exc).__name__
    except httpx.HTTPError as exc:
        return "lost", "", f"{type(exc).__name__}: {exc}"[:200]
    except (ValueError, KeyError, IndexError, TypeError) as exc:  # a body that is not OpenAI's: no answer either
        return "lost", "", f"malformed: {type(exc).__name__}: {exc}"[:200]


def _body(model: str, job: Job, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": job.messages, "max_tokens": max_tokens, "temperature": 0}


# ---- the victims -------------------------------------------------------------------------------------
def encoder_worker_pids(replica_pids: list[int]) -> list[int]:
    """The multiprocessing children of the replicas: their encoder workers (not a resource tracker)."""
    out = []
    for replica in replica_pids:
        for pid, (role, _) in process_tree(replica).items():
            if pid != replica and role == "encoder_worker" and "resource_tracker" not in cmdline(pid):
                out.append(pid)
    return sorted(out)


async def kill_one(client: httpx.AsyncClient, victim: str, turn: int, at_s: float) -> Kill:
    try:
        stats = (await client.get("/v1/stats")).json()
    except (httpx.HTTPError, ValueError) as exc:  # the chaos goes on; the miss is reported
        return Kill(at_s, victim, None, f"no stats: {type(exc).__name__}")
    replica_pids = [r["pid"] for r in stats.get("replicas", []) if r.get("pid")]
    pids = replica_pids if victim == "replica" else encoder_worker_pids(replica_pids)
    if not pids:
        return Kill(at_s, victim, None, "none alive")
    pid = pids[turn % len(pids)]
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return Kill(at_s, victim, pid, "exited before the signal")
    return Kill(at_s, victim, pid)


async def killer(client: httpx.AsyncClient, run: ChaosRun, t0: float, stop: asyncio.Event) -> None:
    """Every kill_every_s before the deadline: a replica, then an encoder worker, and so on."""
    c = run.config
    num_kills = max(0, math.ceil(c.duration_s / c.kill_every_s) - 1)  # none at the deadline itself
    for n in range(num_kills):
        wake_s = (n + 1) * c.kill_every_s
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, wake_s - (time.perf_counter() - t0)))
            return
        except asyncio.TimeoutError:
            pass
        victim = "replica" if n % 2 == 0 else "encoder_worker"
        run.kills.append(await kill_one(client, victim, n // 2, time.perf_counter() - t0))


async def sample_memory(pid: int, run: ChaosRun, t0: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        run.tree_pids |= set(process_tree(pid))
        run.rss.append((time.perf_counter() - t0, rss_bytes(pid)))
        try:
            await asyncio.wait_for(stop.wait(), run.config.rss_interval_s)
        except asyncio.TimeoutError:
            pass


# ---- the run -----------------------------------------------------------------------------------------
async def quiet_answers(client: httpx.AsyncClient, model: str, pool: list[Job], c: ChaosConfig) -> dict[int, str]:
    """Each pool prompt's greedy answer, asked alone before the chaos starts."""
    answers = {}
    for index, job in enumerate(pool):
        kind, text, detail = await stream_once(client, _body(model, job, c.max_tokens), c.request_timeout_s)
        if kind != "ok":
            raise RuntimeError(f"the quiet run failed on prompt {index}: {kind} {detail}")
        answers[index] = text
    return answers


async def chaos_client(client: httpx.AsyncClient, model: str, pool: list[Job], run: ChaosRun,
                       index: int, t0: float) -> None:
    c = run.config
    rng = random.Random(c.seed * 1000 + index)
    n = 0
    while time.perf_counter() - t0 < c.duration_s:
        fresh = rng.random() < c.fresh_fraction
        if fresh:  # a picture no request sent before: its encode is work a dying worker can lose
            job, expected = shapes_jobs(1, c.seed, start=10_000 + 1000 * index + n)[0][0], None
            n += 1
        else:
            pick = rng.randrange(len(pool))
            job, expected = pool[pick], run.quiet[pick]
        kind, text, detail = await stream_once(client, _body(model, job, c.max_tokens), c.request_timeout_s)
        if kind == "ok" and expected is not None and text != expected:
            kind, detail = "wrong", f"{text!r} != {expected!r}"
        run.outcomes.append(Outcome(kind, time.perf_counter() - t0, fresh, detail))


async def drive(run: ChaosRun, url: str, pid: int) -> None:
    c = run.config
    timeout = httpx.Timeout(c.request_timeout_s, read=c.hang_s)
    limits = httpx.Limits(max_connections=c.clients + 4, max_keepalive_connections=c.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        pool, _ = shapes_jobs(c.pool_size, c.seed)
        run.quiet = await quiet_answers(client, model, pool, c)
        stop = asyncio.Event()
        t0 = time.perf_counter()
        background = [asyncio.create_task(killer(client, run, t0, stop)),
                      asyncio.create_task(sample_memory(pid, run, t0, stop))]
        await asyncio.gather(*(chaos_client(client, model, pool, run, i, t0) for i in range(c.clients)))
        stop.set()
        await asyncio.gather(*background)
        run.replicas_after = await wait_replicas(client, c.replicas, c.idle_timeout_s)
        run.idle_after, run.idle_stats = await wait_idle(client, c.idle_timeout_s)
        run.tree_pids |= set(process_tree(pid))
        run.rss.append((time.perf_counter() - t0, rss_bytes(pid)))  # the replicas are back: the last sample


async def wait_replicas(client: httpx.AsyncClient, total: int, timeout_s: float) -> dict[str, Any]:
    """Poll until every replica is alive again (or the timeout): what the server reports then."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = (await client.get("/v1/stats")).json()
        if stats.get("replicas_alive") == total or time.monotonic() > deadline:
            return {k: stats.get(k) for k in ("replicas_alive", "replicas_total", "replica_restarts",
                                              "encoder_workers_alive", "encoder_worker_restarts",
                                              "encoder_items_redispatched")}
        await asyncio.sleep(0.5)


def run_chaos(config: ChaosConfig, log_path: Path | None = None) -> ChaosRun:
    """Start the server, run the chaos, stop the server and end whatever of its tree outlived it."""
    BENCH_DIR.mkdir(exist_ok=True)
    run = ChaosRun(config)
    log_path = log_path or BENCH_DIR / "chaos-server.log"
    try:
        with local_server_process(None, config.server_args(), log_path) as server:
            run.tree_pids.add(server.pid)
            asyncio.run(drive(run, server.url, server.pid))
    finally:
        reap_leftovers(run.tree_pids, sig=signal.SIGTERM)
        reap_leftovers(run.tree_pids, sig=signal.SIGKILL)
    run.server_log = server_log_events(log_path.read_text(errors="replace"))
    return run


# ---- the report --------------------------------------------------------------------------------------
WORKER_DIED = re.compile(r"encoder worker \d+ \(generation \d+, pid \d+\) died .*?; (\d+) in-flight items")


def server_log_events(text: str) -> dict[str, int]:
    """What the server logged about the deaths: the summed /v1/stats forget a killed replica's counters
    (its encoder workers' restarts among them), the log does not."""
    moved = [int(n) for n in WORKER_DIED.findall(text)]
    return {"replica_deaths": len(re.findall(r"replica \d+ died .*restarting it now", text)),
            "requests_routed_again": text.count("routing it again"),
            "encoder_worker_deaths": len(moved), "encoder_items_moved": sum(moved),
            "encoder_workers_not_stopping_at_shutdown": text.count("did not stop; sending terminate")}


def summarize(run: ChaosRun) -> dict[str, Any]:
    counts = Counter(o.kind for o in run.outcomes)
    rss = [value for _, value in run.rss]
    first, last = (rss[0] / MIB, rss[-1] / MIB) if rss else (None, None)
    left = sorted(pid for pid in run.tree_pids if proc_stat(pid) is not None)
    examples = [f"{o.kind} at {o.finished_s:.0f}s{' (fresh)' if o.fresh else ''}: {o.detail}"
                for o in run.outcomes if o.kind in FAILURES][:8]
    return {"bench": "chaos", "config": asdict(run.config), "requests": len(run.outcomes),
            "requests_done": counts["ok"] + counts["wrong"], "outcomes": {k: counts[k] for k in OUTCOMES},
            "lost": counts["lost"], "hung": counts["hung"], "wrong": counts["wrong"], "http_5xx": counts["http_5xx"],
            "error_before_start": counts["error_before_start"], "error_under_way": counts["error_under_way"],
            "targets_met": all(counts[k] == 0 for k in FAILURES),
            "kills": [asdict(k) for k in run.kills], "replicas_after": run.replicas_after, "server_log": run.server_log,
            "idle_after": run.idle_after, "idle_stats": run.idle_stats,
            "rss_mib_first": round(first, 1) if first else None, "rss_mib_last": round(last, 1) if last else None,
            "rss_growth_pct": round(100.0 * (last - first) / first, 2) if first else None,
            "processes_left": left, "examples": examples}


def print_report(summary: dict[str, Any], machine: dict[str, Any]) -> None:
    c = summary["config"]
    print_card("mmserve chaos", {
        "machine": machine_line(machine),
        "server": f"mmserve serve (demo model) --data-parallel-size {c['replicas']}, {c['encoder_workers']} "
                  "process encoder workers per replica, 127.0.0.1",
        "workload": f"{c['clients']} streaming clients for {c['duration_s']:.0f} s, greedy, max_tokens "
                    f"{c['max_tokens']}; {c['pool_size']} shapes prompts (quiet answers first), "
                    f"{c['fresh_fraction']:.0%} fresh pictures",
        "chaos": f"SIGKILL every {c['kill_every_s']:.0f} s, a replica and an encoder worker in turn; hung: no "
                 f"byte for {c['hang_s']:.0f} s or not done in {c['request_timeout_s']:.0f} s"})
    head = f"{'window':>8} " + " ".join(f"{k:>18}" for k in OUTCOMES)
    print(head + "\n" + "-" * len(head))
    for row in summary["windows"]:
        print(f"{row['window']:>8} " + " ".join(f"{row[k]:>18}" for k in OUTCOMES))
    for kill in summary["kills"]:
        print(f"  kill at {kill['at_s']:.0f}s: {kill['victim']} pid {kill['pid']} {kill['detail']}".rstrip())
    print(f"requests {summary['requests']}, done {summary['requests_done']}; lost {summary['lost']}, hung "
          f"{summary['hung']}, wrong {summary['wrong']}, 5xx {summary['http_5xx']}, error before the first token "
          f"{summary['error_before_start']}; error events under way (allowed) {summary['error_under_way']}")
    print(f"RSS of the server's tree: first {summary['rss_mib_first']} MiB, last {summary['rss_mib_last']} MiB, "
          f"growth {summary['rss_growth_pct']}%; after: {summary['replicas_after']}; idle {summary['idle_after']}; "
          f"processes left {summary['processes_left'] or 'none'}")
    print(f"server log: {summary['server_log']}")
    for example in summary["examples"]:
        print(f"  e.g. {example}")
    print(f"targets (0 lost, hung, wrong, 5xx, error before start): {'met' if summary['targets_met'] else 'MISSED'}")


def windows(run: ChaosRun) -> list[dict[str, Any]]:
    """Outcomes per kill window (by finish time; those finishing after the deadline join the last)."""
    c = run.config
    num = max(1, math.ceil(c.duration_s / c.kill_every_s))
    rows = []
    for w in range(num):
        mine = [o for o in run.outcomes if min(int(o.finished_s // c.kill_every_s), num - 1) == w]
        counts = Counter(o.kind for o in mine)
        rows.append({"window": f"{w * c.kill_every_s:.0f}s", **{k: counts[k] for k in OUTCOMES}})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=180.0, help="how long clients keep sending (default 180)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--kill-every-s", type=float, default=30.0)
    parser.add_argument("--hang-s", type=float, default=ChaosConfig.hang_s)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = ChaosConfig(clients=args.clients, duration_s=args.duration_s, kill_every_s=args.kill_every_s,
                         hang_s=args.hang_s, seed=args.seed)
    run = run_chaos(config)
    summary = summarize(run) | {"windows": windows(run)}
    print_report(summary, machine_info(software=False))
    json_line(summary)


if __name__ == "__main__":
    main()

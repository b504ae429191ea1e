"""Encoder disaggregation benchmark: text streams' latency while bursts of large images arrive.

Role: serve one model with each encoder placement in turn — `inline` (encoder_workers=0: images are
encoded inside the engine's step), `process-1`, `process-2` (one or two local worker processes) and
`ray-1` (one Ray actor) — each in a fresh `mmserve serve` subprocess, and drive every one with the
same workload from `benchmarks/server/serve.py`'s streaming client:
- K text-only chat clients, each asking again and again for exactly `text_tokens` greedy tokens
  (min_tokens = max_tokens), timed per token (TTFT and inter-token latency, ITL);
- meanwhile, at fixed times, bursts of requests that each carry one large image (sides drawn from
  448-640 px, fresh pixels from `benchmarks/workload.py`'s generator, so nothing is cached) and ask
  for a short answer, timed to their first token.
A burst's window runs from its send time to the last first token of its images (the span in which
its encoding and prefill happen). Reported per mode: text ITL and TTFT p50/p99 overall and inside
burst windows, image TTFT p50/p99, total output tokens/s, and where the CPU went: CPU seconds of
the server process, of its encoder workers and of the rest of its process tree (read from /proc),
of this client, and of everything else on the machine. Targets, against inline: text ITL p99 in
burst windows <= 0.5x, total tokens/s >= 0.9x. Modes alternate in rounds; medians are reported.
The model is the bench checkpoint (`--model 100m` by default, `tiny` for a smoke run) with the lm_head
rows of tokens that print nothing zeroed (`visible_checkpoint`), so every token streams as a chunk.
`--server-threads 1` sets the server's OMP_NUM_THREADS, to see what sharing the cores costs.

Prints a card, a table and one JSON line last (`benchmarks/reports/disagg.py`).
What it does not know: mmserve internals; it speaks HTTP, and reads /proc for CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from benchmarks.procs import cmdline, machine_busy_s, proc_stat, process_tree, reap_leftovers
from benchmarks.reports.disagg import (
    json_line,
    median_tree,
    print_card,
    print_table,
    summarize,
    targets,
)
from benchmarks.server.serve import Job, RequestRecord, image_data_uri, local_server, one_request
from benchmarks.workload import QUESTIONS, synthetic_image

# name -> (encoder workers, backend); inline first: every target is a ratio to it
MODES = {"inline": (0, "process"), "process-1": (1, "process"), "process-2": (2, "process"), "ray-1": (1, "ray"),
         "pd-1+1": (0, "process")}
# modes that are not encoder placements: prefill/decode disaggregation, the same cores split between a
# prefill replica and a decode replica (one thread each on 2 cores) behind the API server
PD_ARGS = {"pd-1+1": ["--prefill-replicas", "1", "--decode-replicas", "1"]}
TEXT_TOPICS = ("a lighthouse", "a train journey", "a small robot", "the sea", "a mountain village", "a library",
               "an old clock", "a garden in winter")


@dataclass(frozen=True)
class Settings:
    model: str  # "tiny", "100m" or a checkpoint directory
    clients: int  # concurrent text-only streams
    text_tokens: int  # per text request (min_tokens = max_tokens)
    image_tokens: int  # per image request
    burst_size: int  # image requests per burst
    burst_interval_s: float
    num_bursts: int  # the run lasts num_bursts * burst_interval_s (text keeps going until the last burst is done)
    side_px: tuple[int, int]  # image sides drawn uniformly from this range
    rounds: int
    seed: int
    modes: tuple[str, ...]
    server_threads: int | None = None  # OMP_NUM_THREADS for the server (None: torch's default)

    @property
    def duration_s(self) -> float:
        return self.num_bursts * self.burst_interval_s


# ---- the checkpoint ------------------------------------------------------------------------------
def visible_checkpoint(src: Path) -> Path:
    """`src` with the lm_head rows of every token id that is not printable ASCII on its own set to zero.

    The bench checkpoints' random lm_heads mostly pick ids the tokenizer decodes to nothing (the 100m
    model's 32000 rows vs a 407-token tokenizer; special tokens; lone UTF-8 bytes), and the server
    streams a chunk only when text grows, so per-token times could not be seen over HTTP. A zero row
    scores 0 while the best visible row scores well above it, so greedy picks visible tokens only;
    the shapes and FLOPs are the checkpoint's own. Written once, beside `src` under `.bench/`."""
    dst = src.parent / f"{src.name}-visible"
    if (dst / "model.safetensors").is_file():
        return dst
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    tmp = src.parent / f"{dst.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
    tok = AutoTokenizer.from_pretrained(src)
    special = set(tok.all_special_ids) | {int(i) for i in tok.added_tokens_decoder}
    visible = [i for i in range(len(tok)) if i not in special
               and (text := tok.decode([i])) and text.isascii() and text.isprintable()]
    weights = load_file(src / "model.safetensors")
    keep = torch.zeros(weights["lm_head.weight"].shape[0], dtype=torch.bool)
    keep[visible] = True
    weights["lm_head.weight"][~keep] = 0.0
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.rename(dst)
    return dst


# ---- workload --------------------------------------------------------------------------------------
def text_job(settings: Settings, index: int) -> Job:
    topic = TEXT_TOPICS[index % len(TEXT_TOPICS)]
    content = f"Tell me a long story about {topic}. It is story number {index}."
    return Job([{"role": "user", "content": content}], settings.text_tokens, settings.text_tokens)


def image_jobs(settings: Settings, count: int, seed: int) -> list[Job]:
    """`count` requests, each with one fresh image (PNG data URI, encoded here, off the clock)."""
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(count):
        width, height = (int(v) for v in rng.integers(settings.side_px[0], settings.side_px[1] + 1, 2))
        uri = image_data_uri(synthetic_image(rng, width, height))
        content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": QUESTIONS[i % 12]}]
        jobs.append(Job([{"role": "user", "content": content}], settings.image_tokens, settings.image_tokens))
    return jobs


# ---- CPU accounting from /proc -------------------------------------------------------------------------
@dataclass
class CpuMeter:
    """CPU seconds spent between `start` and `stop` by role in the server's process tree, by this
    client, and by the machine; 'outside' is what other processes on the machine used meanwhile."""

    server_pid: int
    before: dict[int, tuple[str, float]] = field(default_factory=dict)
    machine_before: float = 0.0
    client_before: float = 0.0
    wall_before: float = 0.0

    def start(self) -> None:
        self.before = process_tree(self.server_pid)
        self.machine_before, self.client_before = machine_busy_s(), proc_stat(os.getpid())[2]
        self.wall_before = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        after = process_tree(self.server_pid)
        wall = time.perf_counter() - self.wall_before
        roles: dict[str, float] = {"engine": 0.0, "encoder_worker": 0.0, "other": 0.0}
        for pid, (role, cpu) in after.items():
            roles[role] += cpu - self.before.get(pid, (role, 0.0))[1]
        client = proc_stat(os.getpid())[2] - self.client_before
        busy = machine_busy_s() - self.machine_before
        cores = len(os.sched_getaffinity(0))
        tree = sum(roles.values())
        return {"wall_s": round(wall, 2), **{f"{k}_s": round(v, 2) for k, v in roles.items()},
                "client_s": round(client, 2), "machine_busy_s": round(busy, 2),
                "outside_s": round(max(busy - tree - client, 0.0), 2),
                "machine_utilization": round(busy / (wall * cores), 3), "num_processes": len(after)}


# ---- one mode ------------------------------------------------------------------------------------
@dataclass
class Timed:
    started: float  # perf_counter when the request was sent
    record: RequestRecord

    def arrivals(self) -> np.ndarray:
        """perf_counter of every content chunk (first token, then one per ITL)."""
        first = self.started + self.record.ttft_s
        return first + np.concatenate([[0.0], np.cumsum(self.record.itl_s)])


async def timed(client: Any, model: str, job: Job) -> Timed:
    started = time.perf_counter()
    return Timed(started, await one_request(client, model, job))


async def drive(url: str, model: str, settings: Settings, bursts: list[list[Job]],
                warmup: list[Job], meter: CpuMeter) -> dict[str, Any]:
    """Warm up off the clock, then the text clients and the burst schedule; returns the raw timings."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    await one_request(client, model, Job(text_job(settings, 0).messages, 4, 4))  # min_tokens: random weights
    await asyncio.gather(*(one_request(client, model, job) for job in warmup))  # every worker builds its kernels
    meter.start()
    t0 = time.perf_counter()
    bursts_done = asyncio.Event()
    text: list[Timed] = []
    counter = iter(range(1, 1 << 30))

    async def text_client() -> None:
        while time.perf_counter() - t0 < settings.duration_s or not bursts_done.is_set():
            text.append(await timed(client, model, text_job(settings, next(counter))))

    async def burst_schedule() -> list[tuple[float, list[Timed]]]:
        sent = []
        for b, burst in enumerate(bursts):
            await asyncio.sleep(max(0.0, t0 + (b + 0.5) * settings.burst_interval_s - time.perf_counter()))
            sent.append((time.perf_counter(), [asyncio.create_task(timed(client, model, job)) for job in burst]))
        out = [(at, list(await asyncio.gather(*tasks))) for at, tasks in sent]
        bursts_done.set()
        return out

    *_, images = await asyncio.gather(*(text_client() for _ in range(settings.clients)), burst_schedule())
    wall = time.perf_counter() - t0
    cpu = meter.stop()
    await client.close()
    return {"text": text, "bursts": images, "wall_s": wall, "cpu": cpu}


def scrape(url: str) -> dict[str, Any]:
    """Worker liveness counters from /v1/stats, and the mean worker encode latency from /metrics."""
    stats = httpx.get(url + "/v1/stats", timeout=30).json()
    keep = ("encoder_items_encoded", "encoder_workers_alive", "encoder_worker_restarts",
            "encoder_items_redispatched", "num_preemptions", "kv_transfers", "kv_blocks_transferred",
            "kv_bytes_transferred", "kv_blocks_deduplicated", "kv_transfer_ms_p50", "kv_transfer_ms_p99")
    out: dict[str, Any] = {k: stats[k] for k in keep if k in stats}
    total = count = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("mmserve_encoder_worker_latency_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("mmserve_encoder_worker_latency_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    if count:
        out["encoder_worker_latency_ms_mean"] = round(1000 * total / count, 1)
    return out


def _server_pid() -> int:
    """The `mmserve serve` child that `local_server` started."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        stat = proc_stat(pid)
        if stat and stat[1] == os.getpid() and "mmserve.entrypoints.cli" in cmdline(pid):
            return pid
    raise RuntimeError("the server process was not found among this process's children")


def run_mode(mode: str, settings: Settings, model_dir: Path, bursts: list[list[Job]], round_index: int) -> dict:
    workers, backend = MODES[mode]
    warmup = image_jobs(settings, max(2, workers), settings.seed + 1000 + round_index)
    log = lambda msg: print(f"[{mode} round {round_index + 1}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    args = ["--encoder-workers", str(workers), "--encoder-backend", backend, *PD_ARGS.get(mode, [])]
    tree: set[int] = set()
    try:
        with local_server(model_dir, args) as url:
            startup_s = time.perf_counter() - started
            pid = _server_pid()
            tree = set(process_tree(pid)) - {pid}
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            log(f"server up in {startup_s:.1f}s (pid {pid}); warming up, then {settings.duration_s:.0f}s of load")
            raw = asyncio.run(drive(url, model, settings, bursts, warmup, CpuMeter(pid)))
            server = scrape(url)
            tree |= set(process_tree(pid)) - {pid}
    finally:
        leftovers = reap_leftovers(tree)
    result = {"mode": mode, "encoder_workers": workers, "encoder_backend": backend if workers else None,
              "replicas": "1 prefill + 1 decode" if mode in PD_ARGS else None,
              "startup_s": round(startup_s, 1), **summarize(raw), "server": server}
    if leftovers:
        result["leftover_processes_ended"] = leftovers
    log(f"{result['output_token_throughput_per_s']} tok/s, text ITL p99 in bursts "
        f"{result['text_itl_ms_in_bursts']['p99']} ms, image TTFT p50 {result['image_ttft_ms']['p50']} ms")
    return result


# ---- rounds and medians --------------------------------------------------------------------------
def run_all(settings: Settings, model_dir: Path) -> dict[str, dict[str, Any]]:
    """Every mode once per round (the order reversed every other round, so drift spreads evenly)."""
    bursts_flat = image_jobs(settings, settings.num_bursts * settings.burst_size, settings.seed)
    bursts = [bursts_flat[i:i + settings.burst_size] for i in range(0, len(bursts_flat), settings.burst_size)]
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in settings.modes}
    for r in range(settings.rounds):
        order = settings.modes if r % 2 == 0 else tuple(reversed(settings.modes))
        for mode in order:
            try:
                per_mode[mode].append(run_mode(mode, settings, model_dir, bursts, r))
            except Exception as exc:  # noqa: BLE001 (a mode that cannot run is reported, the others still run)
                print(f"[{mode}] FAILED: {exc}", file=sys.stderr, flush=True)
                per_mode[mode].append({"mode": mode, "encoder_workers": MODES[mode][0],
                                       "error": f"{type(exc).__name__}: {exc}"})
    results = {}
    for mode, rounds in per_mode.items():
        ok = [r for r in rounds if "error" not in r]
        results[mode] = dict(median_tree(ok), rounds=len(ok)) if ok else rounds[-1]
        if ok and len(ok) > 1:
            results[mode]["rounds_text_itl_p99_in_bursts_ms"] = [r["text_itl_ms_in_bursts"]["p99"] for r in ok]
            results[mode]["rounds_output_token_throughput_per_s"] = [r["output_token_throughput_per_s"] for r in ok]
    return results


# ---- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="100m", help="100m (default), tiny, or a checkpoint directory")
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 bursts 2 s apart, 1 round (< 2 min)")
    parser.add_argument("--clients", type=int, default=4, help="text-only streams (default 4)")
    parser.add_argument("--text-tokens", type=int, default=64, help="tokens per text request (default 64)")
    parser.add_argument("--image-tokens", type=int, default=8, help="tokens per image request (default 8)")
    parser.add_argument("--burst-size", type=int, default=2, help="image requests per burst (default 2)")
    parser.add_argument("--burst-interval", type=float, default=8.0, help="seconds between bursts (default 8)")
    parser.add_argument("--bursts", type=int, default=4,
                        help="bursts per mode and round; the load lasts bursts x interval (default 4: 32 s)")
    parser.add_argument("--min-side", type=int, default=448)
    parser.add_argument("--max-side", type=int, default=640)
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all modes, medians kept (default 2)")
    parser.add_argument("--modes", default="inline,process-1,process-2,ray-1",
                        help=f"subset of {','.join(MODES)} (default: the encoder placements; pd-1+1 is "
                             "prefill/decode disaggregation against inline, the colocated engine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-threads", type=int, default=None,
                        help="OMP_NUM_THREADS for the server, a diagnosis of core contention (default: unset)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.bursts, args.burst_interval, args.burst_size, args.text_tokens = "tiny", 4, 2.0, 3, 32
        args.rounds = 1
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown or "inline" not in modes:
        parser.error(f"--modes takes {', '.join(MODES)} and must include inline (the baseline); got {args.modes}")
    return Settings(args.model, args.clients, args.text_tokens, args.image_tokens, args.burst_size,
                    args.burst_interval, args.bursts, (args.min_side, args.max_side), args.rounds, args.seed,
                    tuple(m for m in MODES if m in modes), args.server_threads)


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    run_started = time.perf_counter()
    from benchmarks.card import machine_info
    from benchmarks.checkpoints import ensure_checkpoint, parameter_count

    source = ensure_checkpoint(settings.model) if settings.model in ("tiny", "100m") else Path(settings.model)
    model_dir = visible_checkpoint(source)
    if settings.server_threads:  # every server inherits it; this process's torch has its threads already
        os.environ["OMP_NUM_THREADS"] = str(settings.server_threads)
    results = run_all(settings, model_dir)
    machine = machine_info(torch.get_num_threads())  # torch's default: the server's too unless --server-threads
    machine["server_torch_threads"] = settings.server_threads or machine["torch_threads"]
    model = {"name": settings.model, "dir": str(model_dir), "source": str(source), "params": parameter_count(model_dir)}
    verdicts = targets(results)
    print_card(machine, model, asdict(settings), results)
    print_table(results, verdicts, machine["usable_cpus"])
    print(json_line(machine, model, asdict(settings), results, verdicts, time.perf_counter() - run_started))


if __name__ == "__main__":
    main()

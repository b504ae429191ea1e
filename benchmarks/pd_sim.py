"""Prefill/decode disaggregation at scale, on paper: N colocated replicas against P prefill + D decode
replicas on the same cores (P + D = N), under steady text chats and bursts of large images.

Role: a discrete-event simulation with the per-replica costs `benchmarks/routing_costs.py` measured on
this machine (an image's encode, a prompt token's prefill, a decode step per batch size, a step's fixed
cost) and the KV transfer's cost measured now through mmserve's own path: `PagedKVStorage.read_blocks`
into a `SharedMemoryConnector` segment on one side, `write_blocks` out of it on the other (bytes per
second each way; a transfer costs its sender and its receiver a step's time each). A colocated replica
admits prompts and decodes in the same steps, so a step that encodes and prefills a burst's images
stalls every decode in it. A prefill replica only prefills (and sends); a decode replica only decodes
(and receives), so a burst reaches the decodes only as the transfers it adds.

Workload: `text_streams` closed-loop text chats per replica (a prompt of `text_prompt_tokens`, then
`text_tokens` greedy tokens, then the next), and every `burst_interval_s` a burst of
`burst_images` fresh images per replica (nothing cached: the worst case for the encoder), each asking
for `image_answer_tokens`. Reports per setup: text inter-token latency p50/p99 (also inside burst
windows: a burst's send to its images' last first token), text and image TTFT p50/p99, output tokens/s,
and the KV moved per second.

`python benchmarks/pd_sim.py --replicas 2,8,32` prints a card, a table, and one JSON line last.
What it does not know: engines, HTTP; a replica here is its queues and costs.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.routing_sim import Costs, load_costs  # noqa: E402


@dataclass(frozen=True)
class PDWorkload:
    text_streams: int = 4  # per replica of the setup's size
    text_prompt_tokens: int = 40
    text_tokens: int = 64
    burst_images: int = 2  # per replica
    image_prompt_tokens: int = 237  # the measured shape: the template, a 448x336 image, a question
    image_answer_tokens: int = 8
    burst_interval_s: float = 8.0
    num_bursts: int = 6
    seed: int = 0


@dataclass(frozen=True)
class Transfer:
    kv_bytes_per_token: int
    read_bytes_per_s: float  # storage -> segment (the sender's step)
    write_bytes_per_s: float  # segment -> storage (the receiver's step)

    def send_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.read_bytes_per_s

    def receive_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.write_bytes_per_s


@dataclass
class _Request:
    text: bool
    arrival_s: float
    prompt_tokens: int
    answer_tokens: int
    image: bool
    token_times: list = field(default_factory=list)
    stream: int = -1  # the text stream it belongs to


@dataclass
class _Replica:
    role: str  # "both", "prefill", "decode"
    waiting: list = field(default_factory=list)  # prompts to prefill (or, on a decode replica, KV to receive)
    running: list = field(default_factory=list)  # decoding
    busy: bool = False


class PDSimulation:
    def __init__(self, num_prefill: int, num_decode: int, costs: Costs, transfer: Transfer, workload: PDWorkload,
                 max_num_seqs: int, max_batched_tokens: int, size: int) -> None:
        """num_decode == 0: `num_prefill` colocated replicas. `size`: the setup's replica count (the workload scales with it)."""
        roles = ["both"] * num_prefill if not num_decode else ["prefill"] * num_prefill + ["decode"] * num_decode
        self.replicas = [_Replica(r) for r in roles]
        self.costs, self.transfer, self.workload = costs, transfer, workload
        self.max_num_seqs, self.max_batched_tokens, self.size = max_num_seqs, max_batched_tokens, size
        self.events: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.done: list[_Request] = []
        self.windows: list[list[float]] = []  # [start, end] per burst
        self.bytes_moved = 0
        self.end_s = workload.num_bursts * workload.burst_interval_s

    def _at(self, time_s: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (time_s, next(self.seq), kind, payload))

    def _entry(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.role in ("both", "prefill")]

    def _least_loaded(self, indices: list[int]) -> int:
        return min(indices, key=lambda i: (len(self.replicas[i].waiting) + len(self.replicas[i].running), i))

    def run(self) -> dict[str, Any]:
        w = self.workload
        for s in range(w.text_streams * self.size):
            self._at(s * 0.01, "text", s)
        for b in range(w.num_bursts):
            self._at((b + 0.5) * w.burst_interval_s, "burst", b)
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "text" and self.now < self.end_s:
                self._submit(_Request(True, self.now, w.text_prompt_tokens, w.text_tokens, False, stream=payload))
            elif kind == "burst":
                self.windows.append([self.now, self.now])
                for _ in range(w.burst_images * self.size):
                    self._submit(_Request(False, self.now, w.image_prompt_tokens, w.image_answer_tokens, True))
            elif kind == "step_done":
                self._step_done(*payload)
        return self.report()

    def _submit(self, request: _Request) -> None:
        index = self._least_loaded(self._entry())
        self.replicas[index].waiting.append(request)
        self._kick(index)

    def _kick(self, index: int) -> None:
        if not self.replicas[index].busy:
            self._start_step(index)

    def _start_step(self, index: int) -> None:
        replica, c = self.replicas[index], self.costs
        admitted, cost, budget = [], c.step_overhead_s, self.max_batched_tokens
        while replica.waiting and len(replica.running) + len(admitted) < self.max_num_seqs:
            request = replica.waiting[0]
            if replica.role == "decode":  # its KV arrives: copied into this replica's storage
                cost += self.transfer.receive_s(request.prompt_tokens)
            else:
                if admitted and request.prompt_tokens > budget:
                    break
                budget -= request.prompt_tokens
                cost += request.prompt_tokens * c.prefill_s_per_token + (c.encode_s if request.image else 0.0)
                if replica.role == "prefill":  # its KV leaves: copied out of this replica's storage
                    cost += self.transfer.send_s(request.prompt_tokens)
            admitted.append(replica.waiting.pop(0))
        decoding = list(replica.running)
        if decoding or (admitted and replica.role == "decode"):
            cost += c.decode_step_s(len(decoding) + (len(admitted) if replica.role == "decode" else 0))
        if not admitted and not decoding:
            replica.busy = False
            return
        replica.busy = True
        self._at(self.now + cost, "step_done", (index, tuple(admitted), tuple(decoding)))

    def _step_done(self, index: int, admitted: tuple[_Request, ...], decoding: tuple[_Request, ...]) -> None:
        replica = self.replicas[index]
        for request in admitted:
            if replica.role == "decode":  # received: its next token comes with this step
                request.token_times.append(self.now)
                replica.running.append(request)
                continue
            request.token_times.append(self.now)  # the first token, from the prefill
            if request.image and self.windows:
                self.windows[-1][1] = max(self.windows[-1][1], self.now)
            if replica.role == "prefill" and request.answer_tokens > 1:
                self.bytes_moved += request.prompt_tokens * self.transfer.kv_bytes_per_token
                target = self._least_loaded([i for i, r in enumerate(self.replicas) if r.role == "decode"])
                self.replicas[target].waiting.append(request)
                self._kick(target)
            else:
                replica.running.append(request)
        for request in decoding:
            request.token_times.append(self.now)
        for request in [*admitted, *decoding]:
            if len(request.token_times) >= request.answer_tokens and request in replica.running:
                replica.running.remove(request)
                self._finish(request)
            elif replica.role == "prefill" and request.answer_tokens <= 1:
                self._finish(request)
        self._start_step(index)

    def _finish(self, request: _Request) -> None:
        self.done.append(request)
        if request.text:
            self._at(self.now, "text", request.stream)

    def report(self) -> dict[str, Any]:
        text = [r for r in self.done if r.text]
        images = [r for r in self.done if r.image]
        gaps, burst_gaps = [], []
        for r in text:
            for a, b in itertools.pairwise(r.token_times):
                gaps.append(b - a)
                if any(a < end and b > start for start, end in self.windows):
                    burst_gaps.append(b - a)
        pct = lambda xs, q: round(float(np.percentile(np.asarray(xs) * 1000, q)), 1) if xs else None  # noqa: E731
        wall = max(self.now, 1e-9)
        tokens = sum(len(r.token_times) for r in self.done)
        text_ttft = [r.token_times[0] - r.arrival_s for r in text]
        image_ttft = [r.token_times[0] - r.arrival_s for r in images]
        return {"text_itl_ms": {"p50": pct(gaps, 50), "p99": pct(gaps, 99)},
                "text_itl_ms_in_bursts": {"p50": pct(burst_gaps, 50), "p99": pct(burst_gaps, 99)},
                "text_ttft_ms": {"p50": pct(text_ttft, 50), "p99": pct(text_ttft, 99)},
                "image_ttft_ms": {"p50": pct(image_ttft, 50), "p99": pct(image_ttft, 99)},
                "output_tokens_per_s": round(tokens / wall, 1),
                "kv_mib_per_s": round(self.bytes_moved / wall / 2**20, 2), "requests_done": len(self.done)}


def measure_transfer(kv_bytes_per_token: int, block_size: int = 16, num_blocks: int = 2048,
                     rounds: int = 5) -> tuple[float, float]:
    """Bytes per second of mmserve's own shared-memory path, each way: read_blocks into a segment, and
    write_blocks out of it (medians of `rounds`, `num_blocks` scattered blocks of a float32 cache)."""
    import torch

    from mmserve.cluster.kv_connector import SharedMemoryConnector
    from mmserve.runner.kv_quant import kv_format
    from mmserve.runner.kv_storage import PagedKVStorage

    head_dim = 64
    layers = max(1, kv_bytes_per_token // (2 * head_dim * 4))
    storage = PagedKVStorage(layers, num_blocks * 2, block_size, 1, head_dim, kv_format("auto", torch.float32))
    ids = list(range(0, num_blocks * 2, 2))
    connector, reads, writes = SharedMemoryConnector(), [], []
    for _ in range(rounds):
        started = time.perf_counter()
        transfer = connector.send("m", storage.block_part_shapes(), len(ids), lambda outs: storage.read_blocks(ids, outs))
        reads.append(time.perf_counter() - started)
        started = time.perf_counter()
        connector.receive(transfer, lambda parts: storage.write_blocks(ids, parts))
        writes.append(time.perf_counter() - started)
    moved = len(ids) * block_size * layers * 2 * head_dim * 4
    return moved / float(np.median(reads)), moved / float(np.median(writes))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="2,8,32", help="setup sizes N: N colocated vs P + D = N")
    parser.add_argument("--costs", type=Path, default=None, help="routing_costs.py's JSON (default: measured on --model)")
    parser.add_argument("--model", default="30m")
    parser.add_argument("--kv-bytes-per-token", type=int, default=3072, help="the 30m model, float32 (default)")
    parser.add_argument("--bursts", type=int, default=PDWorkload.num_bursts)
    args = parser.parse_args(argv)
    from benchmarks.routing_costs import ensure_costs

    costs_path = args.costs or ensure_costs(args.model)
    costs, _, limits, data = load_costs(costs_path)
    read_bps, write_bps = measure_transfer(args.kv_bytes_per_token)
    transfer = Transfer(args.kv_bytes_per_token, read_bps, write_bps)
    workload = PDWorkload(num_bursts=args.bursts)
    card = {"bench": "pd_sim", "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "costs": str(costs_path), "measured_on": data.get("model"), "costs_s": asdict(costs),
            "transfer": {"kv_bytes_per_token": transfer.kv_bytes_per_token,
                         "read_gib_per_s": round(read_bps / 2**30, 2), "write_gib_per_s": round(write_bps / 2**30, 2)},
            "workload": asdict(workload), "max_num_seqs": limits.max_num_seqs}
    print("== prefill/decode disaggregation simulation ==")
    for key, value in card.items():
        print(f"  {key:12} {value}")
    results = []
    print(f"\n{'N':>4} {'setup':10} {'ITL p50':>8} {'p99':>7} | {'in bursts p50':>13} {'p99':>7} | "
          f"{'text TTFT p50':>13} {'p99':>7} | {'image TTFT p50':>14} {'p99':>7} | {'tok/s':>7} {'KV MiB/s':>8}")
    for n in [int(v) for v in args.replicas.split(",")]:
        setups = [("colocated", n, 0)] + [(f"{p}P+{n - p}D", p, n - p) for p in sorted({n // 2, max(1, n // 4)})
                                          if 0 < p < n]
        for name, p, d in setups:
            res = PDSimulation(p, d, costs, transfer, workload, limits.max_num_seqs, limits.max_batched_tokens, n).run()
            res.update(replicas=n, setup=name, prefill=p, decode=d)
            results.append(res)
            print(f"{n:>4} {name:10} {res['text_itl_ms']['p50']:>8} {res['text_itl_ms']['p99']:>7} | "
                  f"{res['text_itl_ms_in_bursts']['p50']:>13} {res['text_itl_ms_in_bursts']['p99']:>7} | "
                  f"{res['text_ttft_ms']['p50']:>13} {res['text_ttft_ms']['p99']:>7} | "
                  f"{res['image_ttft_ms']['p50']:>14} {res['image_ttft_ms']['p99']:>7} | "
                  f"{res['output_tokens_per_s']:>7} {res['kv_mib_per_s']:>8}", flush=True)
    ratios = []
    for n in dict.fromkeys(r["replicas"] for r in results):
        base = next(r for r in results if r["replicas"] == n and r["setup"] == "colocated")
        for r in results:
            if r["replicas"] == n and r["setup"] != "colocated":
                ratios.append({"replicas": n, "setup": r["setup"], "itl_p99_in_bursts_ratio": round(
                    r["text_itl_ms_in_bursts"]["p99"] / base["text_itl_ms_in_bursts"]["p99"], 3),
                    "throughput_ratio": round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 3)})
    for ratio in ratios:
        print(f"  {ratio['replicas']:>3} {ratio['setup']:10} text ITL p99 in bursts {ratio['itl_p99_in_bursts_ratio']}x "
              f"colocated, throughput {ratio['throughput_ratio']}x")
    print(json.dumps({**card, "results": results, "ratios": ratios}))


if __name__ == "__main__":
    main()

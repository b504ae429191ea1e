"""Prefill/decode disaggregation at scale, on paper: N colocated replicas against P prefill + D decode
replicas on the same cores (P + D = N), under steady text chats and bursts of large images.

Role: a discrete-event simulation with given per-replica costs (an image's encode, a prompt token's
prefill, a decode step per batch size, a step's fixed cost) and a KV transfer's cost (bytes per second
each way; a transfer costs its sender and its receiver a step's time each). A colocated replica
admits prompts and decodes in the same steps, so a step that encodes and prefills a burst's images
stalls every decode in it. A prefill replica only prefills (and sends); a decode replica only decodes
(and receives), so a burst reaches the decodes only as the transfers it adds.

Workload: `text_streams` closed-loop text chats per replica (a prompt of `text_prompt_tokens`, then
`text_tokens` greedy tokens, then the next), and every `burst_interval_s` a burst of
`burst_images` fresh images per replica (nothing cached: the worst case for the encoder), each asking
for `image_answer_tokens`. Reports per setup: text inter-token latency p50/p99 (also inside burst
windows: a burst's send to its images' last first token), text and image TTFT p50/p99, output tokens/s,
and the KV moved per second.

Shared by the benchmark (`python -m benchmarks.cluster.pd_sim` measures the costs and prints the
simulation) and the unit tests, so it lives here, outside both. What it does not know: engines, HTTP,
measuring, printing; a replica here is its queues and costs.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from testkit.routing_sim import Costs


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

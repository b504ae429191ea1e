"""Routing at scale, on paper: a discrete-event simulation of N replicas behind mmserve's own router.

Role: replay a multimodal chat workload — Zipf-popular images, multi-turn conversations that revisit
their image turn after turn — against N simulated replicas, each with an LRU encoder cache (counted
in images), an LRU prefix cache (counted in KV blocks), a waiting queue and continuous batching
(whole prompts admitted up to `max_num_seqs` and a token budget, one decode token per running
request per step). A step costs what was measured (`benchmarks/cluster/routing_costs.py` writes the
costs file `load_costs` reads): each image encoded, each prompt token prefilled, a decode step at the
batch's size, and what the API server adds to a request's time to first token. The routing
decision is `mmserve.cluster.router.Router` itself, fed the same kind of keys the server computes
(an image's content key, the chained hashes of the prompt's full blocks) and told each eviction at
once (a real replica reports them every half second).

Reports per policy: image reuse (occurrences of an image served without encoding it, from a replica's
encoder cache or inside its prefix-cache hit) against one infinitely large engine's (1 - distinct /
occurrences), the prefix hit rate (prompt tokens found cached), TTFT p50/p99 and load imbalance
(max over replicas of the time-averaged requests held, over their mean).

Shared by the benchmarks (`python -m benchmarks.cluster.routing_sim` prints its card and table) and the
unit tests, so it lives here, outside both. What it does not know: engines, tensors, HTTP, printing; a
replica here is its queues, caches and costs.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mmserve.cluster.router import RouteKeys, Router, RouterConfig

SAMPLE_EVERY_S = 0.05  # how often the replicas' loads are sampled for the imbalance


@dataclass(frozen=True)
class Costs:
    """Seconds per piece of work on one replica (measured: benchmarks/cluster/routing_costs.py)."""

    encode_s: float  # one image of the workload's size
    prefill_s_per_token: float
    decode_s: tuple[tuple[int, float], ...]  # (batch size, seconds per decode step), ascending
    step_overhead_s: float = 0.0  # a step's fixed cost (scheduling, sampling) beyond the above
    api_overhead_s: float = 0.0  # what the server adds to a request's time to first token (HTTP, the hop)

    def decode_step_s(self, batch: int) -> float:
        sizes = [b for b, _ in self.decode_s]
        return float(np.interp(batch, sizes, [s for _, s in self.decode_s]))


@dataclass(frozen=True)
class Shape:
    """Token lengths of a conversation's pieces (from the measured model's tokenizer and template)."""

    lead_tokens: int  # the template's start, shared by every conversation
    image_tokens: int
    question_tokens: int  # a user turn's text and its template tokens
    answer_tokens: int  # every answer is this long
    block_size: int = 16
    # an earlier answer, sent back in the history, is the tokens the model generated (so the next turn
    # finds the answer's cached blocks); a random model's text often re-tokenizes otherwise
    answers_come_back: bool = True


@dataclass(frozen=True)
class Workload:
    num_images: int = 2000  # the pool images are drawn from
    zipf_s: float = 1.0
    num_conversations: int = 4000
    turns: int = 3  # each turn asks about the conversation's image again, with the history before it
    conversations_per_s: float = 40.0  # Poisson arrivals of first turns
    think_s: float = 1.0  # from an answer to the next turn
    seed: int = 0


@dataclass(frozen=True)
class ReplicaLimits:
    max_num_seqs: int = 32
    max_batched_tokens: int = 2048
    encoder_cache_images: int = 64
    kv_blocks: int = 1024


@dataclass
class _Request:
    conversation: int
    turn: int
    image: int
    arrival_s: float
    tokens: list  # symbolic tokens of the prompt
    keys: RouteKeys
    replica: int = -1
    remaining: int = 0  # output tokens still to decode
    first_token_s: float | None = None


@dataclass
class _Replica:
    encoder: OrderedDict = field(default_factory=OrderedDict)  # image -> None, least recent first
    prefix: OrderedDict = field(default_factory=OrderedDict)  # block hash -> None
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    busy: bool = False
    load_sum: float = 0.0  # sum of sampled loads


def zipf_images(rng: np.random.Generator, workload: Workload) -> np.ndarray:
    """One image per conversation, image k with probability ∝ 1 / (k+1)^s."""
    weights = 1.0 / np.arange(1, workload.num_images + 1) ** workload.zipf_s
    return rng.choice(workload.num_images, size=workload.num_conversations, p=weights / weights.sum())


def prompt_tokens(shape: Shape, conversation: int, image: int, turn: int) -> list:
    """Symbolic tokens: the shared lead, the image, then per earlier turn its question and answer, then
    this turn's question. Equal symbols are equal tokens, so equal prefixes hash to equal blocks."""
    tokens: list = [("lead", i) for i in range(shape.lead_tokens)]
    tokens += [("img", image, i) for i in range(shape.image_tokens)]
    for t in range(turn + 1):
        tokens += [("q", conversation, t, i) for i in range(shape.question_tokens)]
        if t < turn:
            kind = "a" if shape.answers_come_back else "retokenized"
            tokens += [(kind, conversation, t, i) for i in range(shape.answer_tokens)]
    return tokens


def block_hashes(tokens: list, block_size: int) -> tuple[int, ...]:
    hashes, parent = [], 0
    for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        hashes.append(parent)
    return tuple(hashes)


class Simulation:
    def __init__(self, num_replicas: int, policy: str, costs: Costs, shape: Shape, workload: Workload,
                 limits: ReplicaLimits, router: RouterConfig | None = None) -> None:
        self.costs, self.shape, self.workload, self.limits = costs, shape, workload, limits
        base = router or RouterConfig()
        self.router = Router(num_replicas, replace(base, policy=policy))
        self.replicas = [_Replica() for _ in range(num_replicas)]
        self.events: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.images_seen = 0
        self.images_encoded = 0
        self.images_in_prefix = 0
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0
        self.ttfts: list[float] = []
        self.samples = 0
        self.pending_conversations = 0

    # ---- events -----------------------------------------------------------------------------------
    def _at(self, time_s: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (time_s, next(self.seq), kind, payload))

    def run(self) -> dict[str, Any]:
        rng = np.random.default_rng(self.workload.seed)
        images = zipf_images(rng, self.workload)
        arrivals = np.cumsum(rng.exponential(1.0 / self.workload.conversations_per_s, self.workload.num_conversations))
        for c, (image, t) in enumerate(zip(images, arrivals, strict=True)):
            self._at(float(t), "arrive", (c, int(image), 0))
        self.pending_conversations = self.workload.num_conversations
        self._at(SAMPLE_EVERY_S, "sample", None)
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(*payload)
            elif kind == "step_done":
                self._step_done(*payload)
            elif kind == "sample" and self.pending_conversations > 0:
                self._sample()
        return self.report()

    def _arrive(self, conversation: int, image: int, turn: int) -> None:
        tokens = prompt_tokens(self.shape, conversation, image, turn)
        keys = RouteKeys(((f"img{image}", self.shape.image_tokens),), block_hashes(tokens, self.shape.block_size),
                         self.shape.block_size, len(tokens))
        request = _Request(conversation, turn, image, self.now, tokens, keys)
        decision = self.router.choose(keys)
        assert decision is not None
        self.router.dispatched(decision, keys)
        request.replica = decision.replica
        replica = self.replicas[decision.replica]
        replica.waiting.append(request)
        if not replica.busy:
            self._start_step(decision.replica)

    def _sample(self) -> None:
        for r in self.replicas:
            r.load_sum += len(r.waiting) + len(r.running)
        self.samples += 1
        self._at(self.now + SAMPLE_EVERY_S, "sample", None)

    # ---- a replica's step -------------------------------------------------------------------------
    def _start_step(self, index: int) -> None:
        replica = self.replicas[index]
        admitted, budget, cost = [], self.limits.max_batched_tokens, self.costs.step_overhead_s
        while replica.waiting and len(replica.running) + len(admitted) < self.limits.max_num_seqs:
            request = replica.waiting[0]
            to_compute, encodes = self._admit_cost(index, request)
            if admitted and to_compute > budget:
                break
            replica.waiting.popleft()
            admitted.append(request)
            budget -= to_compute
            cost += to_compute * self.costs.prefill_s_per_token + encodes * self.costs.encode_s
        decoding = [r for r in replica.running if r.first_token_s is not None]
        if decoding:
            cost += self.costs.decode_step_s(len(decoding))
        if not admitted and not decoding:
            replica.busy = False
            return
        replica.running.extend(admitted)
        replica.busy = True
        self._at(self.now + cost, "step_done", (index, tuple(admitted), tuple(decoding)))

    def _admit_cost(self, index: int, request: _Request) -> tuple[int, int]:
        """(tokens to prefill, images to encode) for `request` on replica `index`; updates its caches."""
        replica, bs = self.replicas[index], self.shape.block_size
        hit_blocks = 0
        for h in request.keys.block_hashes:
            if h not in replica.prefix:
                break
            replica.prefix.move_to_end(h)
            hit_blocks += 1
        hit_tokens = min(hit_blocks * bs, len(request.tokens) - 1)
        self.prompt_tokens += len(request.tokens)
        self.prefix_hit_tokens += hit_tokens
        self.images_seen += 1
        image_end = self.shape.lead_tokens + self.shape.image_tokens
        encodes = 0
        key = request.image
        if hit_tokens >= image_end:
            self.images_in_prefix += 1
        elif key in replica.encoder:
            replica.encoder.move_to_end(key)
        else:
            encodes = 1
            self.images_encoded += 1
            replica.encoder[key] = None
            while len(replica.encoder) > self.limits.encoder_cache_images:
                evicted, _ = replica.encoder.popitem(last=False)
                self.router.evicted(index, media_keys=[f"img{evicted}"])
        return len(request.tokens) - hit_tokens, encodes

    def _step_done(self, index: int, admitted: tuple[_Request, ...], decoding: tuple[_Request, ...]) -> None:
        for request in admitted:
            request.first_token_s = self.now
            request.remaining = self.shape.answer_tokens - 1
            self.ttfts.append(self.now - request.arrival_s + self.costs.api_overhead_s)
            self._cache_blocks(index, request.keys.block_hashes)
        for request in decoding:
            request.remaining -= 1
        for request in [*admitted, *decoding]:
            if request.remaining <= 0:
                self._finish(index, request)
        self._start_step(index)

    def _cache_blocks(self, index: int, hashes: tuple[int, ...]) -> None:
        prefix = self.replicas[index].prefix
        evicted = []
        for h in hashes:
            prefix[h] = None
            prefix.move_to_end(h)
        while len(prefix) > self.limits.kv_blocks:
            evicted.append(prefix.popitem(last=False)[0])
        if evicted:
            self.router.evicted(index, block_hashes=evicted)

    def _finish(self, index: int, request: _Request) -> None:
        replica = self.replicas[index]
        replica.running.remove(request)
        self.router.finished(index)
        # the answer's blocks are cached too: the next turn's prompt starts with them
        answered = prompt_tokens(self.shape, request.conversation, request.image, request.turn)
        answered += [("a", request.conversation, request.turn, i) for i in range(self.shape.answer_tokens)]
        self._cache_blocks(index, block_hashes(answered, self.shape.block_size))
        if request.turn + 1 < self.workload.turns:
            self._at(self.now + self.workload.think_s, "arrive", (request.conversation, request.image, request.turn + 1))
        else:
            self.pending_conversations -= 1

    # ---- results ----------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        rng = np.random.default_rng(self.workload.seed)
        distinct = len(set(zipf_images(rng, self.workload).tolist()))
        occurrences = self.workload.num_conversations * self.workload.turns
        loads = [r.load_sum / max(self.samples, 1) for r in self.replicas]
        mean_load = sum(loads) / len(loads)
        reuse = 1 - self.images_encoded / max(self.images_seen, 1)
        infinite = 1 - distinct / occurrences
        ttft = np.asarray(self.ttfts) * 1000
        return {
            "replicas": len(self.replicas), "policy": self.router.config.policy,
            "image_reuse": round(reuse, 4), "infinite_engine_image_reuse": round(infinite, 4),
            "reuse_vs_infinite": round(reuse / infinite, 4) if infinite else None,
            "encoder_cache_hit_rate": round((self.images_seen - self.images_encoded - self.images_in_prefix)
                                            / max(self.images_seen, 1), 4),
            "images_in_prefix_hits": round(self.images_in_prefix / max(self.images_seen, 1), 4),
            "prefix_hit_rate": round(self.prefix_hit_tokens / max(self.prompt_tokens, 1), 4),
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1), "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1),
            "load_imbalance": round(max(loads) / mean_load, 3) if mean_load > 0 else None,
            "mean_load": round(mean_load, 2), "sim_duration_s": round(self.now, 1),
        }


def simulate(num_replicas: int, policy: str, costs: Costs, shape: Shape, workload: Workload,
             limits: ReplicaLimits) -> dict[str, Any]:
    return Simulation(num_replicas, policy, costs, shape, workload, limits).run()


def load_costs(path: Path) -> tuple[Costs, Shape, ReplicaLimits, dict[str, Any]]:
    data = json.loads(path.read_text())
    costs = Costs(data["costs"]["encode_s"], data["costs"]["prefill_s_per_token"],
                  tuple((int(b), float(s)) for b, s in data["costs"]["decode_s"]),
                  data["costs"].get("step_overhead_s", 0.0), data["costs"].get("api_overhead_s", 0.0))
    return costs, Shape(**data["shape"]), ReplicaLimits(**data["limits"]), data

"""Captured vision-encoder graphs, one per bucket, with the eager encoder as the fallback.

Role: at start-up, capture the family's graph-safe encoder forward once per `EncoderBucket`
(smallest first) until the captures take `memory_budget_bytes`; per step, plan the batch
(runner/graphs/buckets.py), copy its inputs into the bucket's static buffers (padding rows and
dummy contexts included), check no buffer moved, replay, and copy the real rows out of the static
output before anything can replay again — the outputs handed out stay valid after the next replay.
A batch no bucket holds runs eagerly.

The family supplies an `EncoderGraphAdapter` (e.g. models/qwen2_vl/vision_graph.py), built of the
types in models/layers/encoder_batch.py: its attention
kinds, the token multiple its buckets need, how a batch is laid out, the static input buffers of a
bucket, and a forward that reads nothing but those buffers.

What it does not know: any family, requests, the encoder cache, budgets (the buckets come in).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mmserve.models.layers.encoder_batch import (
    EncoderBucket,
    EncoderGraphBatch,
    EncoderPlan,
)
from mmserve.runner.encoder.runner import EncodeFn
from mmserve.runner.graphs.buckets import default_encoder_buckets, parse_encoder_buckets, plan_encoder_batch
from mmserve.runner.graphs.capture import (
    CapturedGraph,
    GraphMemoryMeter,
    StaticBuffers,
    capture_graph,
    new_graph_pool,
)

logger = logging.getLogger(__name__)


class EncoderGraphAdapter(Protocol):
    """What a family's vision tower offers for captured graphs."""

    attention_kinds: tuple[str, ...]  # e.g. ("full",) or ("full", "window"): the bucket key's context counts
    token_multiple: int  # a bucket's tokens and every padding must be a multiple (the merge unit)

    def layout(self, payloads: Sequence[Any]) -> EncoderGraphBatch:
        """The batch's contexts per kind, rows per item and host-side arrays (all on the CPU)."""
        ...

    def static_inputs(self, bucket: EncoderBucket, device: torch.device) -> dict[str, torch.Tensor]:
        """Zeroed buffers of the bucket's shapes on `device` (also "meta": shapes only). Buckets differ only
        in the leading dimension: the runner gives each bucket leading rows of one shared set."""
        ...

    def host_inputs(self, batch: EncoderGraphBatch | None, plan: EncoderPlan) -> dict[str, torch.Tensor]:
        """CPU tensors to load into the leading rows of the static buffers (batch None: capture, all
        padding). Metadata (context starts, orders) is given whole, padding included."""
        ...

    def forward(self, inputs: Mapping[str, torch.Tensor], bucket: EncoderBucket) -> torch.Tensor:
        """Graph-safe forward over the static buffers only: (num_streams, bucket rows, width); the
        batch's real rows come first, in item order."""
        ...


def capture_plan(bucket: EncoderBucket) -> EncoderPlan:
    """All-padding contexts for capture: a valid layout (every context >= 1 token) of the bucket."""
    contexts = tuple((bucket.total_tokens - (n - 1),) + (1,) * (n - 1) for n in bucket.num_contexts)
    return EncoderPlan(bucket, 0, contexts, tuple(0 for _ in bucket.num_contexts))


@dataclass
class _BucketGraph:
    buffers: StaticBuffers
    graph: CapturedGraph


@dataclass
class EncoderGraphStats:
    captured: list[EncoderBucket] = field(default_factory=list)
    skipped_over_budget: list[EncoderBucket] = field(default_factory=list)
    capture_bytes: int = 0
    num_replays: int = 0
    num_eager_batches: int = 0


class EncoderGraphRunner:
    def __init__(self, adapter: EncoderGraphAdapter, buckets: Sequence[EncoderBucket], device: torch.device,
                 memory_budget_bytes: int | None = None) -> None:
        unusable = [b for b in buckets if b.total_tokens % adapter.token_multiple
                    or len(b.num_contexts) != len(adapter.attention_kinds)]
        if unusable:
            raise ValueError(f"encoder graph buckets {unusable} do not suit this vision tower: tokens must be a "
                             f"multiple of {adapter.token_multiple}, one context count per attention kind "
                             f"{adapter.attention_kinds}")
        self.adapter = adapter
        self.buckets = sorted(buckets)
        self.device = device
        self.memory_budget_bytes = memory_budget_bytes
        self.graphs: dict[EncoderBucket, _BucketGraph] = {}
        self.stats = EncoderGraphStats()
        self.pool = new_graph_pool(device)
        self._shared_inputs: dict[str, torch.Tensor] | None = None

    @torch.inference_mode()
    def capture_all(self) -> EncoderGraphStats:
        """Capture every bucket, smallest first, while the captures stay within the memory budget."""
        meter = GraphMemoryMeter(self.device)
        for i, bucket in enumerate(self.buckets):
            entry = self._capture(bucket)
            used = meter.used_bytes()
            if self.memory_budget_bytes is not None and used > self.memory_budget_bytes:
                del entry  # over budget: this bucket and every larger one run eagerly
                self.stats.skipped_over_budget = self.buckets[i:]
                logger.warning("encoder graphs: %d buckets captured within %d bytes; %d larger ones run eagerly",
                               len(self.graphs), self.memory_budget_bytes, len(self.buckets) - i)
                break
            self.graphs[bucket] = entry
            self.stats.captured.append(bucket)
            self.stats.capture_bytes = used
        return self.stats

    def _inputs_of(self, bucket: EncoderBucket) -> dict[str, torch.Tensor]:
        """The bucket's static inputs: leading rows of one set of buffers sized for every bucket. Graphs never
        replay concurrently and each run loads its inputs first, so sharing saves a copy per bucket (the
        pixels of a 16k-token bucket alone are ~77 MB)."""
        if self._shared_inputs is None:
            envelope = EncoderBucket(max(b.total_tokens for b in self.buckets),
                                     tuple(max(c) for c in zip(*(b.num_contexts for b in self.buckets))))
            self._shared_inputs = self.adapter.static_inputs(envelope, self.device)
        shapes = self.adapter.static_inputs(bucket, torch.device("meta"))  # shapes only, no memory
        return {name: self._shared_inputs[name][:shape.shape[0]] for name, shape in shapes.items()}

    def _capture(self, bucket: EncoderBucket) -> _BucketGraph:
        buffers = StaticBuffers(self._inputs_of(bucket))
        for name, host in self.adapter.host_inputs(None, capture_plan(bucket)).items():
            buffers.load(name, host)
        graph = capture_graph(lambda: self.adapter.forward(buffers.tensors, bucket), self.device, self.pool)
        buffers.record()
        return _BucketGraph(buffers, graph)

    def plan(self, batch: EncoderGraphBatch) -> EncoderPlan | None:
        return plan_encoder_batch(batch.context_tokens, list(self.graphs))

    @torch.inference_mode()
    def run(self, payloads: Sequence[Any]) -> list[torch.Tensor] | None:
        """One (num_streams, rows, width) tensor per payload, or None when no captured bucket holds the
        batch (the caller encodes it eagerly)."""
        batch = self.adapter.layout(payloads)
        plan = self.plan(batch)
        if plan is None:
            self.stats.num_eager_batches += 1
            return None
        entry = self.graphs[plan.bucket]
        for name, host in self.adapter.host_inputs(batch, plan).items():
            entry.buffers.load(name, host)
        entry.buffers.assert_unmoved()
        entry.graph.replay()
        self.stats.num_replays += 1
        # copied out of the static output now: the next replay overwrites it
        rows = entry.graph.output[:, :batch.num_rows].clone()
        return list(rows.split(list(batch.item_rows), dim=1))


def graphed_encode_fn(graphs: EncoderGraphRunner, eager: EncodeFn) -> EncodeFn:
    """The runner's encode function: a captured graph when a bucket holds the batch, else `eager`."""

    def encode(payloads: Sequence[Any]) -> list[torch.Tensor]:
        outputs = graphs.run(payloads)
        return eager(payloads) if outputs is None else outputs

    return encode


@dataclass(frozen=True)
class EncoderGraphSettings:
    """What the engine resolves for encoder graphs (from GraphConfig and the encoder budgets)."""

    max_tokens_per_step: int  # the resolved encoder token budget: the default buckets cover it
    max_items_per_step: int
    memory_budget_bytes: int
    buckets: tuple[tuple[int, ...], ...] | None = None  # the engine arg; None: default_encoder_buckets


def build_encoder_graphs(model: object, settings: EncoderGraphSettings,
                         device: torch.device) -> EncoderGraphRunner | None:
    """Capture the model's encoder graphs; None (eager) when its family offers no graph layout."""
    make_adapter = getattr(model, "encoder_graph_adapter", None)
    if make_adapter is None:
        logger.info("encoder graphs: %s has no graph layout; its encoder runs eagerly", type(model).__name__)
        return None
    adapter: EncoderGraphAdapter = make_adapter()
    kinds = len(adapter.attention_kinds)
    if settings.buckets is None:
        buckets = default_encoder_buckets(settings.max_tokens_per_step, settings.max_items_per_step, kinds,
                                          adapter.token_multiple)
    else:
        buckets = parse_encoder_buckets(settings.buckets, kinds)
    runner = EncoderGraphRunner(adapter, buckets, device, settings.memory_budget_bytes)
    stats = runner.capture_all()
    logger.info("encoder graphs: %d of %d buckets captured (%d bytes), attention kinds %s",
                len(stats.captured), len(buckets), stats.capture_bytes, ",".join(adapter.attention_kinds))
    return runner

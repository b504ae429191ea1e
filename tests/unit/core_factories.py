"""Small factories for core tests: requests, schedulers and a fake runner that 'samples' tokens."""

from __future__ import annotations

import itertools

from mmserve.core.budget import EncoderBudget
from mmserve.core.chunk_policy import ChunkBoundaryPolicy
from mmserve.core.encoder_cache import EncoderCacheManager
from mmserve.core.item_scheduler import ItemScheduler
from mmserve.core.kv_cache import KVCacheManager
from mmserve.core.request import ItemSpec, Request
from mmserve.core.scheduler import Scheduler, SchedulerLimits
from mmserve.core.step import ModelRunnerOutput, SchedulerOutput
from mmserve.sampling_params import SamplingParams

EOS = 2
PAD = 99
_ids = itertools.count()


def make_request(num_prompt_tokens: int = 10, max_tokens: int = 4, items: tuple[ItemSpec, ...] = (),
                 prompt: list[int] | None = None, min_tokens: int = 0, request_id: str | None = None) -> Request:
    tokens = prompt if prompt is not None else [10 + (i % 50) for i in range(num_prompt_tokens)]
    for it in items:
        tokens[it.offset:it.end] = [PAD] * it.length
    return Request(request_id or f"r{next(_ids)}", tokens,
                   SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=False),
                   eos_token_ids=(EOS,), items=items)


def image(index: int, offset: int, rows: int, content: str = "img-a") -> ItemSpec:
    return ItemSpec(index=index, offset=offset, length=rows, content_hash=content, encoder_tokens=rows * 4,
                    output_rows=rows)


BYTES_PER_ROW = 10


def make_items(max_items: int = 8, max_tokens: int = 1024, output_bytes: int | None = 10_000,
               cache_bytes: int | None = None, atomic_max: int = 64) -> ItemScheduler:
    budget, _ = EncoderBudget.resolve(max_items_per_step=max_items, max_encoder_tokens_per_step=max_tokens,
                                      output_budget_bytes=output_bytes, cache_bytes=cache_bytes,
                                      bytes_per_row=BYTES_PER_ROW, model_atomic_max_tokens=atomic_max,
                                      model_atomic_max_rows=atomic_max // 4)
    return ItemScheduler(EncoderCacheManager(budget.cache_bytes, budget.output_budget_bytes), budget)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64,
                   max_num_seqs: int = 8, prefix_caching: bool = True, chunked: bool = True,
                   items: ItemScheduler | None = None, indivisible_items: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    return Scheduler(SchedulerLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     enable_chunked_prefill=chunked), kv, items or make_items(),
                     ChunkBoundaryPolicy(indivisible_items))


class FakeRunner:
    """Mirrors what the real runner tracks, and samples token 7 (or EOS when told to)."""

    def __init__(self, fail_batch_steps: set[int] = frozenset(), bad_keys: set[str] = frozenset()) -> None:
        self.fail_batch_steps = set(fail_batch_steps)  # step numbers whose encoder batch raises
        self.bad_keys = set(bad_keys)  # keys whose encoder output has the wrong shape
        self.lost_keys: set[str] = set()  # keys the runner, once, neither commits nor reports failed
        self.items: dict[str, tuple] = {}
        self.encoded: list[tuple[str, int]] = []  # (request id, item index) in encoding order
        self.progress: dict[str, int] = {}
        self.total: dict[str, int] = {}
        self.eos_for: set[str] = set()
        self.history: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.history.append(out)
        for rid in out.finished_request_ids:
            self.progress.pop(rid, None)
        for new in out.new_requests:
            self.progress[new.request_id] = new.num_computed_tokens
            self.total[new.request_id] = len(new.token_ids)
            self.items[new.request_id] = new.items
        for cached in out.cached_requests:
            assert self.progress[cached.request_id] == cached.num_computed_tokens
        result = ModelRunnerOutput()
        produced = {self.items[rid][i].content_hash for rid, idx in out.encoder_items.items() for i in idx}
        if produced and len(self.history) - 1 in self.fail_batch_steps:
            result.encoder_batch_error = "encoder failed: injected"
            failed = produced
        else:
            failed = produced & self.bad_keys
            result.encoder_failed_keys = {k: f"bad output for {k}" for k in failed}
            self.encoded.extend((rid, i) for rid, idx in out.encoder_items.items() for i in idx
                                if self.items[rid][i].content_hash not in failed)
            lost, self.lost_keys = produced & self.lost_keys, self.lost_keys - produced  # lost once
            result.encoder_committed_keys = sorted(produced - failed - lost)
            failed = failed | lost  # a lost output's rows are not there either
        for rid, n in out.num_scheduled_tokens.items():
            s, e = self.progress[rid], self.progress[rid] + n
            if any(it.content_hash in failed and it.offset < e and it.end > s for it in self.items[rid]):
                result.skipped.add(rid)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            if rid in result.skipped:
                continue
            self.progress[rid] += n
            if self.progress[rid] >= self.total[rid]:
                sampled[rid] = EOS if rid in self.eos_for else 7
                self.total[rid] += 1
        result.sampled_token_ids = sampled
        return result


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> list:
    outputs = []
    for _ in range(max_steps):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        outputs.extend(sched.update(out, runner.execute(out)))
        sched.check_integrity()
    assert not sched.num_unfinished, "requests left unfinished"
    return outputs

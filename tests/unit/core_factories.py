"""Small factories for core tests: requests, schedulers and a fake runner that 'samples' tokens."""

from __future__ import annotations

import itertools

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


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64,
                   max_num_seqs: int = 8, prefix_caching: bool = True, chunked: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    return Scheduler(SchedulerLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     enable_chunked_prefill=chunked), kv)


class FakeRunner:
    """Mirrors what the real runner tracks, and samples token 7 (or EOS when told to)."""

    def __init__(self) -> None:
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
        for cached in out.cached_requests:
            assert self.progress[cached.request_id] == cached.num_computed_tokens
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            self.progress[rid] += n
            if self.progress[rid] >= self.total[rid]:
                sampled[rid] = EOS if rid in self.eos_for else 7
                self.total[rid] += 1
        return ModelRunnerOutput(sampled_token_ids=sampled)


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

"""What the runner needs of each live request besides the scheduler's output, until it no longer needs it.

Role: `new_request` makes the scheduler's torch-free `Request` of a processed prompt and `runner_prompt`
its layout for the runner (positions, placeholder rows, item keys, stop ids, bad words). `RequestInputs`
keeps, per live request, that layout (sent with a new or resumed request) and its items' payloads by
item index: `step_inputs` sends the runner the prompts of a step's new requests and the payloads of the
items it encodes (keyed by content key), and `drop_encoded` releases the pixels once an item is encoded
and held, so a long request does not keep them. A decode replica's request also keeps the indices of the
prompt blocks it receives.
What it does not know: scheduling policy, outputs, text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from mmserve.core.encoder_cache import EntryState
from mmserve.core.request import Request, item_specs
from mmserve.core.step import SchedulerOutput
from mmserve.inputs.items import ProcessedPrompt
from mmserve.runner.encoder.runner import EncodeJob
from mmserve.runner.state import RunnerPrompt, StepInputs
from mmserve.sampling_params import SamplingParams


def new_request(request_id: str, prompt: ProcessedPrompt, params: SamplingParams, eos_token_ids: Any,
                arrival_time: float | None, cross_kv_bytes_per_row: int, prefill_after: str | None = None) -> Request:
    """The scheduler's view of a request: token ids, item spans, budgets; no pixels."""
    cross_rows = sum(i.output_rows for i in prompt.items if i.cross_attention is not None)
    return Request(request_id, list(prompt.prompt_token_ids), params, eos_token_ids, item_specs(prompt.items),
                   arrival_time or time.time(), prefill_after=prefill_after, cache_salt=prompt.cache_salt,
                   cross_kv_bytes=cross_kv_bytes_per_row * cross_rows)


def runner_prompt(prompt: ProcessedPrompt, request: Request, spans: tuple[tuple[int, int], ...],
                  bad_words: tuple[tuple[int, ...], ...]) -> RunnerPrompt:
    """The prompt's layout as the runner reads it (sent once per new or resumed request); `spans`: its
    bidirectional runs (`FamilySpec.bidirectional_spans`)."""
    return RunnerPrompt(prompt.positions, prompt.embed_mask, prompt.embed_cumsum,
                        tuple(i.content_hash for i in prompt.items), tuple(i.output_rows for i in prompt.items),
                        tuple(sorted(request.min_tokens_banned_ids)), spans, bad_words,
                        tuple(i.cross_attention for i in prompt.items if i.cross_attention is not None))


@dataclass
class _Inputs:
    request: Request
    prompt: RunnerPrompt
    payloads: dict[int, Any]  # item index -> the family's encoder input, until the item is encoded and held
    transfer_indices: tuple[int, ...] = ()  # a decode replica's request: the prompt blocks it receives


class RequestInputs:
    def __init__(self) -> None:
        self._inputs: dict[str, _Inputs] = {}

    def add(self, request: Request, prompt: RunnerPrompt, payloads: dict[int, Any],
            transfer_indices: Iterable[int] = ()) -> None:
        self._inputs[request.request_id] = _Inputs(request, prompt, payloads, tuple(transfer_indices))

    def release(self, request_id: str) -> None:
        self._inputs.pop(request_id, None)

    def live_ids(self) -> set[str]:
        return set(self._inputs)

    def transfer_indices(self, request_id: str) -> tuple[int, ...]:
        """The indices (in its block list) of the prompt blocks a transferred request receives."""
        return self._inputs[request_id].transfer_indices

    def num_payloads(self) -> dict[str, int]:
        """Payloads still held, by request (engine/inspection.py)."""
        return {rid: len(i.payloads) for rid, i in self._inputs.items()}

    def produced_keys(self, sched: SchedulerOutput) -> list[str]:
        """The content keys of the items a step encodes (of live requests)."""
        return [self._inputs[rid].request.items[i].content_hash for rid, indices in sched.encoder_items.items()
                if rid in self._inputs for i in indices]

    def step_inputs(self, sched: SchedulerOutput, token_bitmasks: dict[str, Any]) -> StepInputs:
        """The prompts of a step's new (or resumed) requests and the payloads of its items, by content key."""
        inputs = StepInputs({n.request_id: self._inputs[n.request_id].prompt for n in sched.new_requests},
                            token_bitmasks=token_bitmasks)
        for rid, indices in sched.encoder_items.items():
            held = self._inputs[rid]
            for i in indices:
                spec = held.request.items[i]
                if i not in held.payloads:  # dropped only once encoded and held: a bookkeeping bug
                    raise RuntimeError(f"{rid}: item {i} is scheduled for encoding but its payload was released")
                inputs.encoder_jobs.append(EncodeJob(spec.content_hash, held.payloads[i], spec.output_rows,
                                                     spec.encoder_tokens))
        return inputs

    def drop_encoded(self, request_ids: Iterable[str], entry_state: Callable[[str], EntryState | None],
                     holds: Callable[[str, str], bool]) -> None:
        """Release the pixels of items that are encoded (`entry_state(content key)`) and held by their request
        (`holds(request id, content key)`): the encoder cache keeps a held entry until the request finishes,
        so they are never needed again."""
        for rid in request_ids:
            held = self._inputs.get(rid)
            if held is None or not held.payloads:
                continue
            for i in list(held.payloads):
                key = held.request.items[i].content_hash
                # READY: encoded and held; PENDING: a worker has it (the pool keeps it until its outcome)
                if entry_state(key) in (EntryState.READY, EntryState.PENDING) and holds(rid, key):
                    del held.payloads[i]

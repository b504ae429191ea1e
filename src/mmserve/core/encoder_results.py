"""Applying a step's encoder results to the encoder cache: who commits, who fails.

Role: after a step, the keys the runner reports committed become READY; a key the step produced that the
runner reports neither committed, failed nor in flight goes back to MISSING (a later step produces it
again); a failure pinned to one key fails every request using it; a batch failure fails only the step's
producers. Split out of the scheduler, which owns the requests and how they finish (`fail`).
What it does not know: tensors, scheduling, how a failed request is finished.
"""

from __future__ import annotations

from collections.abc import Callable

from mmserve.core.encoder_cache import EncoderCacheManager, EntryState
from mmserve.core.request import Request
from mmserve.core.step import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput


def apply_encoder_results(cache: EncoderCacheManager, requests: dict[str, Request], sched: SchedulerOutput,
                          result: ModelRunnerOutput,
                          fail: Callable[[Request, str], EngineCoreOutput]) -> list[EngineCoreOutput]:
    """Commit what the runner reports committed; fail exactly who a failure belongs to (`fail` finishes a
    request with an error and returns its output)."""
    outputs = []
    produced = {}  # key -> producer request id
    for rid, indices in sched.encoder_items.items():
        request = requests.get(rid)
        for i in indices:
            if request is not None:
                produced[request.items[i].content_hash] = rid
    # commits first: a producer failed below for another key must not take a committed output with it.
    # With encoder workers an output arrives in a later step than its production: any PENDING key counts
    committed = set(result.encoder_committed_keys)
    for key in committed:
        cache.commit(key)
    for key in produced:
        if key not in committed and key not in result.encoder_failed_keys \
                and key not in result.encoder_in_flight_keys:
            cache.fail(key)
    for key, reason in result.encoder_failed_keys.items():  # pinned to one key: all its users fail
        if key not in produced and cache.state(key) == EntryState.PENDING:
            cache.fail(key)  # produced in an earlier step (a worker's outcome)
        for rid in sorted(cache.users(key)):
            outputs.append(fail(requests[rid], reason))
    if result.encoder_batch_error is not None:  # only the producers fail; consumers keep waiting
        for rid in sorted(set(produced.values())):
            if rid in requests:
                outputs.append(fail(requests[rid], result.encoder_batch_error))
    return outputs

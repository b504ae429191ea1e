"""The `process` encoder backend (workers/process_pool.py, workers/process_worker.py): outputs equal inline
encoding, payloads and outputs cross through shared memory, a worker killed with items in flight loses
none of them, a pool whose workers cannot start waits (and says for how long) without raising, and
shutdown leaves no process behind.

float32 results depend in their last bits on the batch an item is encoded in and on the torch thread
count, so exact comparisons use the same batches and one thread on both sides."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

from mmserve.models.loader import load_model
from mmserve.runner.encoder.runner import EncodeJob
from mmserve.workers.process_pool import ProcessEncoderPool
from mmserve.workers.process_worker import (
    MAX_BATCH_ITEMS,
    ItemDone,
    ItemFailed,
    JobMessage,
    SharedArray,
    bounded_text,
    from_shared,
    in_shared_memory,
    to_shared,
)
from mmserve.workers.spec import MAX_RESTARTS_PER_MINUTE, WORKER_RESTART_POLICY, WorkerSpec
from testkit.tiny_checkpoints import build_checkpoint
from tests.models.helpers import image_part, load_processor, random_image, text_part, user
from tests.models.pool_helpers import collect

IMAGE_SIZES = [(56, 56), (100, 80), (64, 200), (120, 120), (30, 90), (90, 150)]  # width, height
TIMEOUT_S = 120.0  # a hang guard: workers import torch and build their encoder, slower on a busy machine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("process_pool"), "qwen2_vl", seed=0)


@pytest.fixture(scope="module")
def jobs(checkpoint) -> list[EncodeJob]:
    """One job per image of a processed prompt, of different sizes."""
    proc = load_processor(checkpoint)
    rng = np.random.default_rng(0)
    images = [random_image(rng, w, h) for w, h in IMAGE_SIZES]
    chat = proc.render_chat(user(*[image_part(i) for i in images], text_part("Compare them.")))
    prompt = proc.process(chat.prompt, images=chat.images)
    out = [EncodeJob(i.content_hash, i.payload, i.output_rows, i.encoder_tokens) for i in prompt.items]
    assert len({j.expected_rows for j in out}) > 3 and len({j.key for j in out}) == len(out)
    return out


@pytest.fixture(scope="module")
def encode_inline(checkpoint) -> Callable[[list[EncodeJob]], list[torch.Tensor]]:
    """The model's encode_items in this process, with one torch thread as the workers have."""
    model = load_model(checkpoint, "float32")

    @torch.inference_mode()
    def encode(batch: list[EncodeJob]) -> list[torch.Tensor]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return [o.clone() for o in model.encode_items([j.payload for j in batch])]
        finally:
            torch.set_num_threads(threads)
    return encode


def _spec(model_dir, die_on_key: str | None = None) -> WorkerSpec:
    return WorkerSpec(str(model_dir), "float32", "cpu", threads=1, die_on_key=die_on_key)


def _collect(pool, keys: list[str], timeout_s: float = TIMEOUT_S) -> dict:
    return collect(pool, keys, timeout_s)


def _assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ---- the wire format --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Nested:
    frames: tuple[np.ndarray, ...]
    named: dict[str, np.ndarray]
    labels: np.ndarray  # strings: torch has no such dtype, so it travels pickled
    grid: tuple[int, int, int]


def test_payload_arrays_cross_as_shared_memory_and_arrive_intact(jobs):
    payload = jobs[2].payload
    wire = to_shared(payload)
    assert type(wire) is type(payload) and isinstance(wire.pixel_values, SharedArray)
    assert wire.pixel_values.tensor.is_shared() and wire.grid_thw == payload.grid_thw
    # what a queue sends: the pixels are a shared-memory handle, not a pickled copy
    message = bytes(ForkingPickler.dumps(JobMessage(jobs[2].key, wire)))
    assert len(message) < 2048 < payload.pixel_values.nbytes
    back = from_shared(ForkingPickler.loads(message).payload)
    assert type(back) is type(payload) and back.grid_thw == payload.grid_thw
    assert back.time_interval == payload.time_interval
    assert type(back.pixel_values) is np.ndarray and back.pixel_values.dtype == payload.pixel_values.dtype
    assert np.array_equal(back.pixel_values, payload.pixel_values)
    assert not back.pixel_values.flags.writeable  # the pool resends these bytes if the worker dies

    rng = np.random.default_rng(1)
    nested = _Nested((rng.random((2, 3)), rng.integers(0, 9, 4, dtype=np.int16)),
                     {"mask": rng.random(5) > 0.5}, np.array(["a", "b"]), (1, 2, 3))
    wire = to_shared(nested)
    assert all(isinstance(f, SharedArray) for f in wire.frames) and isinstance(wire.named["mask"], SharedArray)
    assert wire.labels is nested.labels
    back = from_shared(ForkingPickler.loads(ForkingPickler.dumps(wire)))
    for ours, theirs in zip(back.frames + (back.named["mask"], back.labels),
                            nested.frames + (nested.named["mask"], nested.labels)):
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
    assert to_shared(jobs[0].payload.grid_thw) is jobs[0].payload.grid_thw  # nothing to share: untouched


def test_an_output_view_gets_its_own_shared_segment():
    batch = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    item = batch[2:4][None]  # (streams, rows, width): a view of the batch
    shared = in_shared_memory(item)
    assert shared.is_shared() and torch.equal(shared, item)
    assert shared.untyped_storage().nbytes() == item.numel() * item.element_size()
    assert in_shared_memory(shared) is shared
    # a result message is one atomic pipe write (< PIPE_BUF), whatever the output's size
    for message in (ItemDone("k" * 64, in_shared_memory(torch.zeros(1, 4096, 64))),
                    ItemFailed("k" * 64, bounded_text("x" * 100_000))):
        wire = bytes(ForkingPickler.dumps(message))
        assert len(wire) < 4096
        ForkingPickler.loads(wire)  # claims the shared memory handle it carries


# ---- the pool -----------------------------------------------------------------------------------
def test_outputs_equal_inline_encoding(checkpoint, jobs, encode_inline):
    pool = ProcessEncoderPool(_spec(checkpoint), num_workers=2)
    pids = list(pool.worker_pids().values())
    try:
        # submitted before the workers have loaded their model: the jobs queue, alternating between the
        # two (fewest in flight first), and each worker takes its share as one batch
        pool.submit(jobs)
        assert pool.stats().items_in_flight == len(jobs)
        got = _collect(pool, [j.key for j in jobs])
        assert pool.stats().items_in_flight == 0
        for worker in (0, 1):
            share = jobs[worker::2]
            assert len(share) <= MAX_BATCH_ITEMS and {got[j.key].worker for j in share} == {worker}
            for job, ref in zip(share, encode_inline(share)):
                out = got[job.key]
                assert out.error is None and out.latency_s > 0
                assert tuple(out.output.shape) == (1, job.expected_rows, 64)  # (streams, rows, width)
                assert torch.equal(out.output, ref)
                assert not out.output.is_shared()  # copied out: the cache keeps it without an fd

        # one at a time (a batch of one), against the inline encoding of that item alone
        for job in jobs:
            pool.submit([job])
            out = _collect(pool, [job.key])[job.key]
            assert torch.equal(out.output, encode_inline([job])[0])

        # an exception in a batch fails its items, not the worker
        bad = EncodeJob("bad-item", dataclasses.replace(jobs[0].payload, grid_thw=(1, 3, 3)), 1, 9)
        pool.submit([bad])
        out = _collect(pool, ["bad-item"])["bad-item"]
        assert out.output is None and out.error.startswith("encoder failed:")
        pool.submit([jobs[1]])
        assert torch.equal(_collect(pool, [jobs[1].key])[jobs[1].key].output, encode_inline([jobs[1]])[0])
        stats = pool.stats()
        assert (stats.workers_alive, stats.worker_restarts, stats.items_redispatched) == (2, 0, 0)
        with pytest.raises(ValueError, match="already in the encoder pool"):
            pool.submit([jobs[0], jobs[0]])
    finally:
        pool.shutdown()
    _assert_gone(pids)
    pool.shutdown()  # twice is fine
    assert pool.poll() == [] and pool.stats().workers_alive == 0
    with pytest.raises(RuntimeError):
        pool.submit(jobs[:1])


def test_a_killed_worker_loses_no_item(checkpoint, jobs, encode_inline):
    # worker 0 gets jobs 0, 2, 4 as its first batch and dies (SIGKILL) on job 0 before encoding any
    pool = ProcessEncoderPool(_spec(checkpoint, die_on_key=jobs[0].key), num_workers=2,
                              keep_shared_outputs=True)
    pids = list(pool.worker_pids().values())
    try:
        pool.submit(jobs)
        got = _collect(pool, [j.key for j in jobs])
        pids += list(pool.worker_pids().values())
        for job in jobs:
            out = got[job.key]
            ref = encode_inline([job])[0]  # its batch after the death is not known: compare closely
            assert out.error is None and out.output.shape == ref.shape
            assert torch.allclose(out.output, ref, rtol=0, atol=1e-5)
            assert out.output.is_shared()  # handed over as it arrived
        stats = pool.stats()
        assert stats.items_redispatched >= 1 and stats.worker_restarts == 1
        assert stats.workers_alive == 2 and stats.items_in_flight == 0
        assert got[jobs[0].key].worker == 0  # the restarted worker (a later generation) encoded it
        assert pool.seconds_without_workers() == 0.0
    finally:
        pool.shutdown()
    _assert_gone(pids)


@pytest.mark.slow
def test_no_worker_can_start_the_pool_waits_and_says_how_long(tmp_path, jobs):
    # one slot: every start imports torch before failing (~2 s of CPU each, 1 + MAX_RESTARTS_PER_MINUTE
    # of them, more on a busy machine: slow tier, and a deadline that only stops a hang); a second slot
    # would double that without testing more than the kill test does. The default policy's give-up, in a
    # window no busy machine can outlast (the starts could otherwise span a minute and restart again)
    policy = dataclasses.replace(WORKER_RESTART_POLICY, window_s=3600.0)
    pool = ProcessEncoderPool(_spec(tmp_path / "no-such-model"), num_workers=1, restart_policy=policy)
    pids = list(pool.worker_pids().values())
    try:
        pool.submit(jobs[:3])
        deadline_s = time.monotonic() + 4 * TIMEOUT_S
        while pool.seconds_without_workers() == 0.0:
            assert time.monotonic() < deadline_s, "the workers kept being restarted"
            assert pool.poll() == []
            pids += list(pool.worker_pids().values())
            time.sleep(0.02)
        first = pool.seconds_without_workers()
        time.sleep(0.05)
        assert pool.poll() == [] and pool.seconds_without_workers() > first > 0
        stats = pool.stats()
        assert stats.workers_alive == 0 and stats.worker_restarts == MAX_RESTARTS_PER_MINUTE
        assert stats.items_in_flight == 3  # still held, should a worker come back
        assert not pool.wait_ready(0.05)
    finally:
        pool.shutdown()
    _assert_gone(pids)

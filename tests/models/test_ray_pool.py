"""The `ray` encoder backend (workers/ray_pool.py) on a local two-CPU Ray cluster, one per module:
outputs equal inline encoding exactly, an actor that dies mid-item loses nothing (its items go to a
live actor, its slot gets a new one), a batch that raises fails only its own items, actors that
cannot start are restarted a bounded number of times while the pool says how long it has had none,
and shutdown kills the actors (and Ray only if the pool started it). Tests that need Ray are skipped
without it (the `ray` extra).

float32 results depend in their last bits on the batch an item is encoded in and on the torch thread
count, so exact comparisons use the same batches and one thread on both sides."""

import dataclasses
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from mmserve.errors import ModelLoadError
from mmserve.models.loader import load_model
from mmserve.runner.encoder.runner import EncodeJob
from mmserve.supervisor.restarts import RestartPolicy
from mmserve.workers import ray_pool
from mmserve.workers.ray_pool import RayEncoderPool
from mmserve.workers.spec import WorkerSpec
from testkit.tiny_checkpoints import build_checkpoint
from tests.models.helpers import image_part, load_processor, random_image, text_part, user
from tests.models.pool_helpers import collect

# hang guards only: actors start Python, Ray and torch and build an encoder, far slower on a busy machine
POLL_DEADLINE_S = 300.0
# Ray's own deadline for a worker process to register (60 s by default): past it Ray kills the actor, and
# the pool would count a restart that a quiet machine never sees
RAY_SYSTEM_CONFIG = {"worker_register_timeout_seconds": 600}
SIZES = [(56, 56), (112, 84), (200, 140), (84, 168), (140, 56)]  # (width, height): different rows


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=RAY_SYSTEM_CONFIG)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_checkpoint(tmp_path_factory.mktemp("ray_pool") / "qwen2_vl", "qwen2_vl", seed=0))


@pytest.fixture(scope="module")
def items(model_dir):
    """Image items of different sizes, as the processor makes them."""
    processor, rng = load_processor(model_dir), np.random.default_rng(0)
    parts = [image_part(random_image(rng, w, h)) for w, h in SIZES]
    chat = processor.render_chat(user(*parts, text_part("Describe.")))
    prompt = processor.process(chat.prompt, images=chat.images, videos=chat.videos)
    assert len({item.output_rows for item in prompt.items}) == len(SIZES)
    return prompt.items


WORKER_THREADS = 1


@pytest.fixture(scope="module")
def inline_model(model_dir):
    return load_model(model_dir, "float32")


def _inline(model, items, batches):
    """content key -> the inline encoder's output, in the test process, batch by batch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(WORKER_THREADS)
    try:
        with torch.inference_mode():
            return {items[i].content_hash: out.clone() for batch in batches
                    for i, out in zip(batch, model.encode_items([items[i].payload for i in batch]))}
    finally:
        torch.set_num_threads(threads)


def _jobs(items):
    return [EncodeJob(i.content_hash, i.payload, i.output_rows, i.encoder_tokens) for i in items]


def _spec(model_dir, die_on_key=None):
    return WorkerSpec(model_dir, "float32", "cpu", threads=WORKER_THREADS, die_on_key=die_on_key)


def _collect(pool, keys):
    return collect(pool, keys, POLL_DEADLINE_S, interval_s=0.02)


def _assert_exact(got, reference):
    for key, outcome in got.items():
        assert outcome.error is None, outcome.error
        assert outcome.output.device.type == "cpu"
        assert torch.equal(outcome.output, reference[key]), f"output for {key[:12]} differs"


# How the pool batches the two submits below: two workers, so batches of ceil(items / workers) in
# submit order, each to the worker with the fewest items in flight.
BATCHES = [[0, 1], [2, 3], [4]]


def test_outputs_equal_inline_encoding(ray_cluster, model_dir, items, inline_model):
    reference = _inline(inline_model, items, BATCHES)
    with RayEncoderPool(_spec(model_dir), num_workers=2) as pool:
        pool.submit(_jobs(items[:4]))
        pool.submit(_jobs(items[4:]))
        got = _collect(pool, reference)
        _assert_exact(got, reference)
        assert [got[i.content_hash].worker for i in items] == [0, 0, 1, 1, 0]
        assert all(o.latency_s > 0 for o in got.values())
        stats = pool.stats()
        assert (stats.workers_alive, stats.worker_restarts, stats.items_redispatched,
                stats.items_in_flight) == (2, 0, 0, 0)
        assert pool.seconds_without_workers() == 0.0
        assert pool.poll() == []

        # a batch that raises fails its own items; the actor lives on and encodes the next one
        bad = dataclasses.replace(items[0].payload, pixel_values=items[0].payload.pixel_values[:, :5])
        pool.submit([EncodeJob("bad-item", bad, items[0].output_rows, items[0].encoder_tokens)])
        outcome = _collect(pool, ["bad-item"])["bad-item"]
        assert outcome.output is None and "Error" in outcome.error
        pool.submit(_jobs(items[4:]))
        with pytest.raises(ValueError, match="already in the encoder pool"):
            pool.submit(_jobs(items[4:]))  # in flight: the engine never sends it twice
        _assert_exact(_collect(pool, [items[4].content_hash]), reference)
        assert pool.stats().worker_restarts == 0


@pytest.mark.slow
def test_submit_does_not_wait_for_the_workers(ray_cluster, model_dir, items):
    """A pool's actors take seconds to start; handing them items returns at once (timed: slow tier)."""
    with RayEncoderPool(_spec(model_dir), num_workers=2) as pool:
        t0 = time.monotonic()
        pool.submit(_jobs(items[:4]))
        assert time.monotonic() - t0 < 5.0, "submit waited for the workers"
        assert set(_collect(pool, [i.content_hash for i in items[:4]])) == {i.content_hash for i in items[:4]}


def test_a_dead_actor_loses_no_item(ray_cluster, model_dir, items, inline_model):
    """One worker, one item per submit: the actor dies on item 2 with items 3 and 4 queued behind it;
    they all go to its replacement. Items 0 and 1 are usually back already, but a reply still
    leaving the dying process is lost with it, and the item is encoded again."""
    reference = _inline(inline_model, items, [[i] for i in range(len(items))])
    with RayEncoderPool(_spec(model_dir, die_on_key=items[2].content_hash), num_workers=1) as pool:
        first_pid = pool.worker_pids(timeout_s=POLL_DEADLINE_S)[0]
        for item in items:
            pool.submit(_jobs([item]))
        got = _collect(pool, reference)
        for key, outcome in got.items():  # redispatched items share a batch: equal up to the last bits
            assert outcome.error is None, outcome.error
            torch.testing.assert_close(outcome.output, reference[key], rtol=1e-5, atol=1e-6)
        stats = pool.stats()
        assert stats.items_redispatched >= 3
        assert stats.worker_restarts == 1
        assert (stats.workers_alive, stats.items_in_flight) == (1, 0)
        assert pool.worker_pids(timeout_s=POLL_DEADLINE_S)[0] != first_pid
        assert pool.seconds_without_workers() == 0.0


def test_workers_that_cannot_start_are_restarted_a_bounded_number_of_times(ray_cluster, tmp_path, items):
    # each failed start costs seconds here; a window no busy machine can outlast between the two starts
    once = RestartPolicy(window_s=3600.0, max_restarts_per_window=1)
    with RayEncoderPool(_spec(str(tmp_path / "no-such-model")), num_workers=1, restart_policy=once) as pool:
        pool.submit(_jobs(items[:1]))
        deadline = time.monotonic() + POLL_DEADLINE_S
        while pool.seconds_without_workers() == 0.0:
            assert time.monotonic() < deadline, "the pool never noticed its worker could not start"
            assert pool.poll() == []  # the job waits; the pool does not fail it
            time.sleep(0.05)
        stats = pool.stats()
        assert (stats.workers_alive, stats.worker_restarts, stats.items_in_flight) == (0, 1, 1)
        time.sleep(0.1)
        assert pool.poll() == [] and pool.seconds_without_workers() >= 0.1
        assert pool.stats().worker_restarts == 1  # no more until the window has passed
        assert not pool.wait_ready(0.1)


def test_shutdown_kills_the_actors_and_leaves_ray_running(ray_cluster, model_dir):
    pool = RayEncoderPool(_spec(model_dir), num_workers=2)
    assert pool.wait_ready(POLL_DEADLINE_S)
    pids = list(pool.worker_pids(timeout_s=POLL_DEADLINE_S).values())
    assert len(set(pids)) == 2 and all(_running(pid) for pid in pids)
    pool.shutdown()
    deadline = time.monotonic() + POLL_DEADLINE_S  # a hang guard: Ray reaps a killed actor's process soon
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(pid) for pid in pids), "an encoder actor outlived shutdown"
    assert ray_cluster.is_initialized(), "the pool shut down a Ray it did not start"
    assert pool.poll() == [] and pool.stats().workers_alive == 0
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit([])


def test_a_pool_that_started_ray_shuts_it_down(model_dir, items):
    """In a fresh process: this module's cluster is up in this one."""
    pytest.importorskip("ray")
    script = f"""
import os, pickle, sys, time, ray
from mmserve.workers.spec import WorkerSpec
from mmserve.workers.ray_pool import RayEncoderPool
job = pickle.load(sys.stdin.buffer)
pool = RayEncoderPool(WorkerSpec({model_dir!r}, "float32", "cpu", 1), num_workers=1)
assert ray.is_initialized()
assert ray.cluster_resources()["CPU"] == len(os.sched_getaffinity(0))
pool.submit([job])
deadline, got = time.monotonic() + {POLL_DEADLINE_S}, []
while not got and time.monotonic() < deadline:
    got = pool.poll()
    time.sleep(0.02)
assert got and got[0].error is None and got[0].output.shape[1] == job.expected_rows, got
pool.shutdown()
assert not ray.is_initialized()
print("ok")
"""
    env = {**os.environ, **{f"RAY_{k}": str(v) for k, v in RAY_SYSTEM_CONFIG.items()}}  # the Ray it starts
    done = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(_jobs(items[:1])[0]),
                          capture_output=True, timeout=2 * POLL_DEADLINE_S, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith(b"ok"), done.stderr.decode()[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_outputs_cross_as_bytes_and_arrive_as_private_tensors(dtype):
    batch = torch.randn(2, 7, 6).to(dtype)
    for out in (batch[1:], batch[:, :0]):  # a view into a batch's output; no rows
        wire = ray_pool._WireTensor.of(out)
        assert wire.data.dtype == np.uint8  # numpy has no bfloat16
        back = wire.tensor()
        assert back.dtype == dtype and torch.equal(back, out)
        assert back.untyped_storage().nbytes() == out.numel() * out.element_size()


def test_missing_ray_says_how_to_install(monkeypatch, model_dir):
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    with pytest.raises(ModelLoadError, match=r"pip install mmserve\[ray\]"):
        RayEncoderPool(_spec(model_dir), num_workers=1)


def _running(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # gone before the open (ENOENT), or between the open and the read (ESRCH)
        return False

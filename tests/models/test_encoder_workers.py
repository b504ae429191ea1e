"""Vision encoding on worker processes (`encoder_workers`, backend `process`): the same greedy
output as inline encoding and as transformers, dedup stays central, a worker killed mid-item is
replaced without losing or changing an answer, a pool without workers fails only the requests
waiting on images, and the engine's exit leaves no worker behind."""

import os
import time

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.faults import FaultPlan
from mmserve.runner.encoder.pool import PoolStats
from mmserve.workers.spec import WorkerSpec, build_encoder
from testkit.conversations import GREEDY, parity_workload
from tests.models.helpers import image_part, random_image, text_part


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen3_5"])
def test_workers_answer_like_inline_and_transformers(all_checkpoints, expected_tokens, family):
    model_dir = str(all_checkpoints[family])
    with LLM(model_dir, encoder_workers=2, max_num_batched_tokens=64) as llm:
        outputs = llm.chat(parity_workload(family), GREEDY, use_tqdm=False)
        llm.check_integrity()
        stats = llm.get_stats()
    assert _tokens(outputs) == expected_tokens(family)
    assert stats["encoder_workers_alive"] == 2 and stats["encoder_items_in_flight"] == 0


def test_a_workers_encoder_takes_the_engines_cpu_kernels(all_checkpoints):
    """A worker's encoder (`build_encoder`) gets the engine's CPU kernels (`prepare_for_cpu`: in
    bfloat16 on a CPU without bfloat16 arithmetic, float32 products), so its rows are bitwise the
    engine's own and an answer does not depend on where its images were encoded."""
    model_dir = str(all_checkpoints["qwen2_vl"])
    rng = np.random.default_rng(3)
    conversation = [{"role": "user", "content": [image_part(random_image(rng, 150, 120)),
                                                 image_part(random_image(rng, 90, 200)), text_part("Compare.")]}]
    threads = torch.get_num_threads()
    with LLM(model_dir, dtype="bfloat16") as llm:
        processor = llm.engine.processor
        chat = processor.render_chat(conversation)
        payloads = [item.payload for item in processor.process(chat.prompt, images=chat.images).items]
        with torch.inference_mode():
            inline = [rows.clone() for rows in llm.engine.model.encode_items(payloads)]
    try:
        worker = build_encoder(WorkerSpec(model_dir, "bfloat16", "cpu", threads=threads))(payloads)
    finally:
        torch.set_num_threads(threads)
    assert len(worker) == len(inline) == 2
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in zip(inline, worker))


def _shared_image_requests(rng):
    a, b = random_image(rng, 120, 90), random_image(rng, 64, 150)
    return [[{"role": "user", "content": [image_part(a if i % 2 else b), text_part(f"Question {i}?")]}]
            for i in range(8)]


def test_shared_images_are_encoded_once(all_checkpoints):
    conversations = _shared_image_requests(np.random.default_rng(0))
    with LLM(str(all_checkpoints["qwen2_vl"]), encoder_workers=2) as llm:
        llm.chat(conversations, GREEDY, use_tqdm=False)
        assert llm.get_stats()["encoder_items_encoded"] == 2
        llm.check_integrity()


def test_a_worker_killed_mid_item_is_replaced(all_checkpoints):
    model_dir = str(all_checkpoints["qwen2_vl"])
    conversations = _shared_image_requests(np.random.default_rng(1))
    with LLM(model_dir) as inline:
        expected = _tokens(inline.chat(conversations, GREEDY, use_tqdm=False))
        victim = inline.engine.process_chat(conversations[0]).items[0].content_hash
    with LLM(model_dir, encoder_workers=2, faults=FaultPlan(encoder_worker_dies_on_key=victim)) as llm:
        outputs = llm.chat(conversations, GREEDY, use_tqdm=False)
        stats = llm.get_stats()
        llm.check_integrity()
    assert _tokens(outputs) == expected
    assert stats["encoder_items_redispatched"] > 0 and stats["encoder_worker_restarts"] == 1


class _NoWorkers:
    """A pool whose workers are all gone for good: nothing comes back."""

    def __init__(self, since_s: float) -> None:
        self.since = time.monotonic() - since_s

    def submit(self, jobs):
        pass

    def poll(self):
        return []

    def stats(self):
        return PoolStats(0, 3, 0, 0)

    def seconds_without_workers(self):
        return time.monotonic() - self.since

    def shutdown(self):
        pass


def test_no_workers_fails_only_the_requests_waiting_on_images(all_checkpoints):
    gone = FaultPlan(encoder_pool=lambda: _NoWorkers(since_s=0.0))
    with LLM(str(all_checkpoints["qwen2_vl"]), encoder_workers=1, encoder_timeout_s=0.5, faults=gone) as llm:
        rng = np.random.default_rng(2)
        outputs = llm.chat([[{"role": "user", "content": [image_part(random_image(rng, 80, 80)), text_part("Hi?")]}],
                            [{"role": "user", "content": [text_part("Just text, please.")]}]],
                           SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        image, text = outputs
        assert image.outputs[0].finish_reason == "error" and "encoder_timeout_s" in (image.error or "")
        assert text.outputs[0].finish_reason == "length" and len(text.outputs[0].token_ids) == 4
        llm.check_integrity()


def test_exit_stops_the_workers(all_checkpoints):
    llm = LLM(str(all_checkpoints["qwen2_vl"]), encoder_workers=2)
    llm.chat(_shared_image_requests(np.random.default_rng(3))[:2], GREEDY, use_tqdm=False)
    pids = list(llm.engine.encoder_pool.worker_pids().values())
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    llm.shutdown()
    deadline = time.monotonic() + 120  # a hang guard: shutdown has joined (or killed) them already
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_ray_workers_answer_like_transformers_and_dedup(all_checkpoints, expected_tokens):
    """The Ray backend on a local cluster the engine starts (and stops on exit)."""
    import ray

    with LLM(str(all_checkpoints["qwen2_vl"]), encoder_workers=1, encoder_backend="ray") as llm:
        assert _tokens(llm.chat(parity_workload("qwen2_vl"), GREEDY, use_tqdm=False)) == expected_tokens("qwen2_vl")
        before = llm.get_stats()["encoder_items_encoded"]
        llm.chat(_shared_image_requests(np.random.default_rng(4)), GREEDY, use_tqdm=False)
        assert llm.get_stats()["encoder_items_encoded"] - before == 2
        assert llm.get_stats()["encoder_workers_alive"] == 1
        llm.check_integrity()
    assert not ray.is_initialized()


def test_health_says_degraded_without_workers_and_text_is_still_served(all_checkpoints):
    from fastapi.testclient import TestClient

    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.entrypoints.openai.media import MediaRules
    from mmserve.entrypoints.openai.server import build_app
    from mmserve.entrypoints.openai.serving import ServerConfig

    llm = LLM(str(all_checkpoints["qwen2_vl"]), encoder_workers=1, encoder_timeout_s=0.5,
              faults=FaultPlan(encoder_pool=lambda: _NoWorkers(since_s=1.0)))
    app = build_app(AsyncEngine(llm.engine), ServerConfig("m", MediaRules(llm.engine.config.media)))
    with TestClient(app) as client:
        client.get("/v1/models")  # the engine thread has taken a stats snapshot by now
        deadline = time.monotonic() + 120  # a hang guard: the next stats snapshot says it
        while client.get("/health").json()["status"] != "degraded" and time.monotonic() < deadline:
            time.sleep(0.05)
        health = client.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "degraded",
                                                              "reason": "no encoder worker is alive"}
        reply = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 3, "temperature": 0,
                                                          "messages": [{"role": "user", "content": "Hello"}]})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


_WORKER_RUN = """
import sys
import numpy as np
from mmserve import LLM, SamplingParams
from mmserve.faults import FaultPlan
from testkit.conversations import random_image

def main(model_dir, kill):
    rng = np.random.default_rng(5)
    chats = [[{"role": "user", "content": [{"type": "image_pil", "image_pil": random_image(rng, 60 + i, 40)},
                                           {"type": "text", "text": "Hi?"}]}] for i in range(6)]
    faults = None
    if kill:  # the first generation of a worker exits hard on the first picture: SIGKILL-like, mid-item
        with LLM(model_dir) as inline:
            faults = FaultPlan(encoder_worker_dies_on_key=inline.engine.process_chat(chats[0]).items[0].content_hash)
    with LLM(model_dir, encoder_workers=2, faults=faults) as llm:
        outputs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "length" for o in outputs)

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "kill")
"""


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("sem.mp-", "torch_", "psm_"))} \
        if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("case", ["plain", "kill"])
def test_a_worker_run_leaves_stderr_clean_and_shared_memory_empty(all_checkpoints, tmp_path, case):
    """A run with process workers (and one where a worker dies mid-item) then a shutdown: no traceback from
    the resource tracker or anything else on stderr, and no shared-memory segment or semaphore left."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "run.py"
    script.write_text(_WORKER_RUN)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root),
                                                         os.environ.get("PYTHONPATH", "")])}
    before = _shm_names()
    run = subprocess.run([sys.executable, str(script), str(all_checkpoints["qwen2_vl"]), case], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for marker in ("Traceback", "resource_tracker", "leaked", "KeyError"):
        assert marker not in run.stderr, run.stderr[-3000:]
    assert _shm_names() - before == set()

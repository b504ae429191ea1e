"""Prefill/decode disaggregation across processes (cluster/pd_flow.py): one prefill and one decode replica
answer as one engine, a request's KV moves once through shared memory (only what the decode side
lacks), either replica may be killed, and nothing is left held or running afterwards.

In-process: a `ReplicaSet` with a prefill and a decode replica (the `mp` backend) over the tiny Qwen2-VL
checkpoint, its answers compared with the offline `LLM`'s; one small case with the `ray` backend.
Through the CLI: `mmserve serve --prefill-replicas 1 --decode-replicas 1` streams an answer whose first
token came from one process and the rest from the other.
"""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import time

import httpx
import pytest
from openai import OpenAI

from mmserve import SamplingParams
from mmserve.cluster import pd_flow
from mmserve.cluster.replicas import ReplicaSet
from mmserve.config import EngineConfig
from mmserve.engine.async_engine import EngineDeadError
from tests.e2e.conftest import otlp_receiver, running_server
from tests.e2e.test_replicas import (
    COLORS,
    ENGINE_ARGS,
    HANG_GUARD_S,
    NUM_TOKENS,
    QUESTIONS,
    RAY_REGISTER_ENV,
    _ask,
    _messages,
    _offline_answers,
    _run_then_shut_down,
)
from tests.e2e.test_server import png_bytes

PREFILL, DECODE = 0, 1  # slot indices: the prefill replicas first


@pytest.fixture(scope="module")
def model(all_checkpoints):
    return str(all_checkpoints["qwen2_vl"])


@pytest.fixture(scope="module")
def pngs():
    return [png_bytes(c, size=(224, 168)) for c in COLORS]


@pytest.fixture(scope="module")
def reference(model, pngs):
    return _offline_answers(model, pngs)


def _segments() -> set[str]:
    return set(glob.glob("/dev/shm/mmserve-kv-*"))


async def _idle(replicas: ReplicaSet) -> dict:
    await replicas.check_integrity()
    stats = await replicas.current_stats()
    for r in stats["replicas"]:
        if r["alive"]:
            assert r["kv_blocks_free"] == r["kv_blocks_total"], r
            assert r["requests_parked"] == r["requests_receiving_kv"] == 0, r
            assert r["encoder_cache_bytes_referenced"] == 0, r
    return stats


def test_a_prefill_and_a_decode_replica_answer_as_one_engine_and_survive_kills(model, pngs, reference,
                                                                                monkeypatch):
    # requests wait for the killed decode replica to come back: its restart, not a verdict, on a busy machine
    monkeypatch.setattr(pd_flow, "HANDOFF_TIMEOUT_S", HANG_GUARD_S)
    segments_before = _segments()
    replicas = ReplicaSet(EngineConfig.from_kwargs(model, **ENGINE_ARGS), 1, threads_per_replica=1,
                          decode_replicas=1)
    replicas.launch()
    pids = dict(replicas.replica_pids())

    async def run() -> None:
        replicas.start()
        work = [(i, q) for i in range(len(pngs)) for q in QUESTIONS]
        got = await asyncio.gather(*(_ask(replicas, f"a{n}", pngs[i], q) for n, (i, q) in enumerate(work)))
        assert dict(zip(work, got, strict=True)) == reference
        stats = await _idle(replicas)
        assert [r["role"] for r in stats["replicas"]] == ["prefill", "decode"]
        prefill, decode = stats["replicas"]
        assert prefill["requests_handed_off"] == decode["requests_received"] == len(work)
        assert decode["encoder_items_encoded"] == 0 and prefill["encoder_items_encoded"] == len(pngs)
        assert decode["generation_tokens"] == len(work) * (NUM_TOKENS - 1)  # all but the first token
        assert decode["kv_blocks_transferred"] == prefill["kv_blocks_sent"] > 0
        assert stats["kv_bytes_transferred"] == decode["kv_blocks_transferred"] * decode["kv_bytes_per_token"] * 16
        assert stats["kv_transfers"] == len(work) and stats["kv_transfer_ms_p99"] > 0

        # a stream: its first token from the prefill replica, the rest from the decode replica
        seen = []
        async for output in replicas.generate("s", await _prompt(replicas, pngs[0], QUESTIONS[0]),
                                              SamplingParams(temperature=0, max_tokens=NUM_TOKENS)):
            seen.append((len(output.outputs[0].token_ids), output.kv_parked))
        assert seen[0] == (1, True) and seen[-1][0] == NUM_TOKENS
        assert output.outputs[0].token_ids == reference[(0, QUESTIONS[0])]
        assert output.metrics.first_token_time is not None and output.num_cached_tokens > 0
        # asked again, its template and image blocks are on the decode replica: only the rest moved
        after = (await replicas.current_stats())["replicas"][DECODE]
        assert after["kv_blocks_deduplicated"] - decode["kv_blocks_deduplicated"] > 0
        assert after["kv_blocks_transferred"] - decode["kv_blocks_transferred"] <= 2

        # either replica killed while it holds requests: the non-streamed ones are answered again
        for victim in (DECODE, PREFILL):
            old = replicas.replica_pids()[victim]
            killed = asyncio.get_running_loop().create_future()

            def kill_once(victim=victim, killed=killed) -> None:
                if not killed.done():
                    os.kill(replicas.replica_pids()[victim], signal.SIGKILL)
                    killed.set_result(None)

            got = await asyncio.gather(*(_ask(replicas, f"k{victim}-{n}", pngs[i], q, on_first=kill_once)
                                         for n, (i, q) in enumerate(work)))
            assert dict(zip(work, got, strict=True)) == reference
            deadline = time.monotonic() + HANG_GUARD_S
            while replicas.replica_pids()[victim] in (None, old) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert replicas.replica_pids()[victim] not in (None, old)
            while replicas.stats()["replicas_alive"] < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)

        # a stream under way on its decode replica (tokens from there sent) ends with an error when it dies
        params = SamplingParams(temperature=0, max_tokens=512, min_tokens=512)
        with pytest.raises(EngineDeadError, match="died"):
            async for output in replicas.generate("dying", await _prompt(replicas, pngs[1], QUESTIONS[1]), params):
                if len(output.outputs[0].token_ids) == 3:
                    os.kill(replicas.replica_pids()[DECODE], signal.SIGKILL)
        deadline = time.monotonic() + HANG_GUARD_S
        while replicas.stats()["replicas_alive"] < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert await _ask(replicas, "after", pngs[1], QUESTIONS[1]) == reference[(1, QUESTIONS[1])]
        await _idle(replicas)

    _run_then_shut_down(replicas, run, pids)
    assert _segments() <= segments_before  # no transfer's shared memory is left behind


async def _prompt(replicas: ReplicaSet, png: bytes, question: str):
    from mmserve.inputs.media import decode_image_bytes

    return await replicas.process_chat([{"role": "user", "content": [
        {"type": "image_pil", "image_pil": decode_image_bytes(png, replicas.config.media)},
        {"type": "text", "text": question}]}])


def test_disaggregated_replicas_as_ray_actors(model, pngs, reference, monkeypatch):
    pytest.importorskip("ray")  # the `ray` extra, which the test environment installs
    monkeypatch.setenv(*RAY_REGISTER_ENV)  # read by the Ray the replica set starts
    replicas = ReplicaSet(EngineConfig.from_kwargs(model, **ENGINE_ARGS), 1, threads_per_replica=1,
                          decode_replicas=1, backend="ray")
    replicas.launch()
    pids = dict(replicas.replica_pids())

    async def run() -> None:
        replicas.start()
        work = [(i, QUESTIONS[0]) for i in range(2)]
        got = await asyncio.gather(*(_ask(replicas, f"r{n}", pngs[i], q) for n, (i, q) in enumerate(work)))
        assert dict(zip(work, got, strict=True)) == {k: reference[k] for k in work}
        stats = await _idle(replicas)
        assert stats["replicas"][1]["requests_received"] == 2 and stats["kv_blocks_transferred"] > 0

    _run_then_shut_down(replicas, run, pids)


def test_serve_with_a_prefill_and_a_decode_replica(model, pngs, reference, tmp_path, monkeypatch):
    """Traced as well: a request's spans from the server, its prefill replica and its decode replica in one trace."""
    pytest.importorskip("opentelemetry.sdk")  # the `otel` extra, which the test environment installs
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    with otlp_receiver() as (collector, spans), running_server(
            model, tmp_path / "pd.log", "--prefill-replicas", "1", "--decode-replicas", "1", "--num-kv-blocks",
            str(ENGINE_ARGS["num_kv_blocks"]), "--otlp-traces-endpoint", collector) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(model=server.model, max_tokens=NUM_TOKENS, temperature=0,
                                                messages=_messages(pngs[2], QUESTIONS[0]), stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        reply = client.chat.completions.create(model=server.model, max_tokens=NUM_TOKENS, temperature=0,
                                               messages=_messages(pngs[2], QUESTIONS[0]))
        assert reply.choices[0].message.content == text and reply.usage.completion_tokens == NUM_TOKENS
        stats = httpx.get(server.url + "/v1/stats", timeout=10).json()
        assert [r["role"] for r in stats["replicas"]] == ["prefill", "decode"]
        assert stats["requests_received"] == 2 and stats["kv_transfers"] == 2
        assert stats["requests_finished"] == 2  # each counted once, where it finished
        assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
        deadline = time.monotonic() + HANG_GUARD_S
        while sum(s.name == "engine.request" for s in spans) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
    (server_span,) = [s for s in spans if s.name == "POST /v1/chat/completions"
                      and s.attributes["gen_ai.request.id"] == reply.id]
    under = [s for s in spans if s.parent_span_id == server_span.span_id]
    names = sorted(s.name for s in under)
    # the prefill replica's request (finished "handoff") and the decode replica's, both under the server's span
    assert names.count("engine.request") == 2 and "kv_handoff" in names and "route" in names, names
    finishes = sorted(s.attributes["gen_ai.response.finish_reasons"][0] for s in under if s.name == "engine.request")
    assert finishes == ["handoff", "length"]

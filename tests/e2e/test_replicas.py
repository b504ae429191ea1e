"""Two engine replicas behind one server (cluster/): the same answers as one engine, routing by image,
a replica killed mid-run, a hybrid (Qwen3.5) model, and nothing left running afterwards.

In-process: a `ReplicaSet` of two local replica processes (the `mp` backend) over the tiny Qwen2-VL
checkpoint, driven as the server drives it; its answers are compared with the offline `LLM`'s.
Through the CLI: `mmserve serve --data-parallel-size 2` answers, reports per-replica stats and
metrics, and leaves no replica process behind when it stops.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest
from openai import OpenAI

from mmserve import LLM, SamplingParams
from mmserve.cluster.replicas import ReplicaSet
from mmserve.cluster.router import RouterConfig
from mmserve.config import EngineConfig
from mmserve.engine.async_engine import EngineDeadError
from mmserve.inputs.media import decode_image_bytes
from tests.e2e.conftest import otlp_receiver, running_server
from tests.e2e.test_server import data_uri, metric_samples, png_bytes

NUM_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
COLORS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]
QUESTIONS = ["What color is it?", "Describe it."]
ENGINE_ARGS = {"num_kv_blocks": 256}
HANG_GUARD_S = 300.0  # waits for processes that only stop a hang: never a verdict on a working machine
# Ray's deadline for an actor's worker process to register (60 s by default) is no verdict either
RAY_REGISTER_ENV = ("RAY_worker_register_timeout_seconds", "600")


def _messages(png: bytes, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(png)}},
                                         {"type": "text", "text": question}]}]


def _offline_answers(model: str, pngs: list[bytes]) -> dict[tuple[int, str], list[int]]:
    llm = LLM(model, **ENGINE_ARGS)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
    answers = {}
    for i, png in enumerate(pngs):
        image = decode_image_bytes(png, llm.engine.config.media)
        for q in QUESTIONS:
            out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                         {"type": "text", "text": q}]}], params, use_tqdm=False)[0]
            answers[(i, q)] = list(out.outputs[0].token_ids)
    llm.engine.check_integrity()
    llm.shutdown()
    return answers


@pytest.fixture(scope="module")
def model(all_checkpoints):
    return str(all_checkpoints["qwen2_vl"])


@pytest.fixture(scope="module")
def pngs():
    return [png_bytes(c, size=(224, 168)) for c in COLORS]  # an image is most of its prompt


@pytest.fixture(scope="module")
def reference(model, pngs):
    return _offline_answers(model, pngs)


async def _ask(replicas: ReplicaSet, request_id: str, png: bytes, question: str, restartable: bool = True,
               on_first=None, params: SamplingParams = GREEDY) -> list[int]:
    messages = [{"role": "user", "content": [{"type": "image_pil",
                                              "image_pil": decode_image_bytes(png, replicas.config.media)},
                                             {"type": "text", "text": question}]}]
    prompt = await replicas.process_chat(messages)
    last = None
    async for output in replicas.generate(request_id, prompt, params, restartable=restartable):
        if on_first is not None and output.outputs[0].token_ids:
            on_first()
            on_first = None
        last = output
    assert last is not None and last.finished
    return list(last.outputs[0].token_ids)


def _run_then_shut_down(replicas: ReplicaSet, run, first_pids: dict[int, int]) -> None:
    """asyncio.run(run()), then shut the replicas down whatever happened: none of their processes, the
    first ones or their replacements, may be left running."""
    try:
        asyncio.run(run())
    finally:
        final_pids = [p for p in replicas.replica_pids().values() if p is not None]
        replicas.shutdown()
    deadline = time.monotonic() + HANG_GUARD_S  # a Ray actor's process ends shortly after Ray reports it gone
    while not all(_process_gone(p) for p in final_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_process_gone(p) for p in [*first_pids.values(), *final_pids])


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_two_replicas_answer_as_one_engine_route_by_image_and_survive_a_kill(model, pngs, reference):
    config = EngineConfig.from_kwargs(model, **ENGINE_ARGS)
    replicas = ReplicaSet(config, 2, RouterConfig(policy="cache_aware"), threads_per_replica=1)
    replicas.launch()
    pids = dict(replicas.replica_pids())

    async def run() -> None:
        replicas.start()
        # every image asked about twice, shuffled, all at once
        work = [(i, q) for i in range(len(pngs)) for q in QUESTIONS]
        random.Random(0).shuffle(work)
        got = await asyncio.gather(*(_ask(replicas, f"a{n}", pngs[i], q) for n, (i, q) in enumerate(work)))
        assert dict(zip(work, got, strict=True)) == reference
        stats = await replicas.current_stats()
        assert stats["replicas_alive"] == 2 and [r["alive"] for r in stats["replicas"]] == [True, True]
        assert all(r["requests_finished"] > 0 for r in stats["replicas"]), stats["replicas"]  # both busy
        assert stats["requests_finished"] == len(work)
        assert stats["encoder_items_encoded"] <= len(pngs) + 1, stats  # each image encoded about once
        routed = {row["reason"]: row["requests"] for row in stats["router"]["routed"]}
        assert sum(routed.values()) == len(work) and routed.get("cache_hit", 0) >= 1, routed
        await replicas.check_integrity()

        # a replica killed while it holds requests of a 32-request run: the non-streamed ones are answered
        # elsewhere
        victim = 0
        killed = asyncio.get_running_loop().create_future()

        def kill_once() -> None:
            if not killed.done():
                os.kill(pids[victim], signal.SIGKILL)
                killed.set_result(None)

        run32 = work * 4  # the target's 32-request run
        tasks = [asyncio.create_task(_ask(replicas, f"b{n}", pngs[i], q, on_first=kill_once))
                 for n, (i, q) in enumerate(run32)]
        got = await asyncio.gather(*tasks)
        assert [reference[k] for k in run32] == got  # none lost, each answered as one engine answers
        deadline = time.monotonic() + HANG_GUARD_S  # the target (back within 30 s) holds on a quiet machine
        while replicas.replica_pids()[victim] is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert replicas.replica_pids()[victim] not in (None, pids[victim])
        stats = await replicas.current_stats()
        assert stats["replica_restarts"] == 1 and stats["replicas_alive"] == 2

        # a stream that has sent tokens ends with an error when its replica dies (long enough that its
        # replica cannot have sent every token before the kill)
        def kill_serving() -> None:
            for pid in replicas.replica_pids().values():
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)

        with pytest.raises(EngineDeadError, match="died"):
            await _ask(replicas, "stream", pngs[0], QUESTIONS[0], restartable=False, on_first=kill_serving,
                       params=SamplingParams(temperature=0, max_tokens=512, min_tokens=512))
        deadline = time.monotonic() + HANG_GUARD_S
        while replicas.stats()["replicas_alive"] < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert await _ask(replicas, "after", pngs[1], QUESTIONS[1]) == reference[(1, QUESTIONS[1])]
        await replicas.check_integrity()

    _run_then_shut_down(replicas, run, pids)


def test_two_replicas_serve_a_hybrid_model_as_one_engine(all_checkpoints, pngs):
    """Qwen3.5 (its state slots and snapshots live in each replica's engine): the same answers as one engine,
    every replica's slots and snapshots consistent after."""
    model = str(all_checkpoints["qwen3_5"])
    reference = _offline_answers(model, pngs[:2])
    replicas = ReplicaSet(EngineConfig.from_kwargs(model, **ENGINE_ARGS), 2, RouterConfig(policy="cache_aware"),
                          threads_per_replica=1)
    replicas.launch()
    pids = dict(replicas.replica_pids())

    async def run() -> None:
        replicas.start()
        work = [(i, q) for i in range(2) for q in QUESTIONS]
        got = await asyncio.gather(*(_ask(replicas, f"h{n}", pngs[i], q) for n, (i, q) in enumerate(work)))
        assert dict(zip(work, got, strict=True)) == reference
        await replicas.check_integrity()

    _run_then_shut_down(replicas, run, pids)


def test_serve_with_two_replicas(model, pngs, reference, tmp_path, monkeypatch):
    """Also traced (`--otlp-traces-endpoint`): each request's spans reach the collector from the server's
    process and its replica's, in one trace, the replica's under the server's request span."""
    pytest.importorskip("opentelemetry.sdk")  # the `otel` extra, which the test environment installs
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # exported within a fraction of a second
    with otlp_receiver() as (collector, spans), running_server(
            model, tmp_path / "replicas.log", "--data-parallel-size", "2", "--num-kv-blocks",
            str(ENGINE_ARGS["num_kv_blocks"]), "--otlp-traces-endpoint", collector) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply_ids = []
        for n, i in enumerate((0, 1, 0)):
            reply = client.chat.completions.create(model=server.model, max_tokens=NUM_TOKENS, temperature=0,
                                                   messages=_messages(pngs[i], QUESTIONS[0]),
                                                   extra_headers={"traceparent": CALLER} if n == 0 else None)
            assert reply.choices[0].finish_reason == "length"
            assert reply.usage.completion_tokens == NUM_TOKENS
            reply_ids.append(reply.id)
        stats = httpx.get(server.url + "/v1/stats", timeout=10).json()
        assert stats["replicas_total"] == 2 and stats["replicas_alive"] == 2
        assert stats["requests_finished"] == 3 and stats["kv_blocks_free"] <= stats["kv_blocks_total"]
        assert stats["encoder_items_encoded"] == 2  # the third asks about the first image again, where it is
        pids = [r["pid"] for r in stats["replicas"]]
        samples = metric_samples(server)
        assert samples[("mmserve_replica_requests_finished", (("replica", "0"),))] + \
            samples[("mmserve_replica_requests_finished", (("replica", "1"),))] == 3
        assert sum(v for (name, _), v in samples.items() if name == "mmserve_routed_total") == 3
        # only the third was expected to find its image (the template's first block is every prompt's)
        assert samples[("mmserve_router_expected_encoder_cache_hits_total", ())] == 1
        assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
        deadline = time.monotonic() + HANG_GUARD_S
        while sum(s.name == "engine.request" for s in spans) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
    deadline = time.monotonic() + HANG_GUARD_S
    while not all(_process_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_process_gone(p) for p in pids)
    _check_traces(list(spans), reply_ids)


CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # a client's W3C traceparent


def _check_traces(spans: list, reply_ids: list[str]) -> None:
    servers = {s.attributes["gen_ai.request.id"]: s for s in spans if s.name == "POST /v1/chat/completions"}
    assert set(servers) == set(reply_ids)
    first = servers[reply_ids[0]]
    assert (first.trace_id, first.parent_span_id) == ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    for reply_id in reply_ids:
        server = servers[reply_id]
        trace = [s for s in spans if s.trace_id == server.trace_id]
        under = {s.name: s for s in trace if s.parent_span_id == server.span_id}
        assert {"media_load", "route", "handoff", "engine.request"} <= set(under), sorted(under)
        assert {under[n].service for n in ("media_load", "route")} == {"mmserve"}  # the API server's process
        assert {under[n].service for n in ("handoff", "engine.request")} == {"mmserve-replica"}
        engine = under["engine.request"]
        assert engine.attributes["gen_ai.request.id"] == reply_id
        inside = {s.name for s in trace if s.parent_span_id == engine.span_id}
        assert {"queue", "encode", "prefill", "decode"} <= inside
    route = [s for s in spans if s.name == "route"]
    assert {s.attributes["mmserve.route.replica"] for s in route} == {0, 1}
    assert route[-1].attributes["mmserve.route.reason"] == "cache_hit"  # the third found its image


def test_replicas_as_ray_actors(model, pngs, reference, monkeypatch):
    """The `ray` backend on a local Ray instance: the same answers, and a killed actor is replaced."""
    pytest.importorskip("ray")  # the `ray` extra, which the test environment installs
    monkeypatch.setenv(*RAY_REGISTER_ENV)  # read by the Ray the replica set starts
    config = EngineConfig.from_kwargs(model, **ENGINE_ARGS)
    replicas = ReplicaSet(config, 2, threads_per_replica=1, backend="ray")
    replicas.launch()
    pids = dict(replicas.replica_pids())

    async def run() -> None:
        replicas.start()
        work = [(i, q) for i in range(2) for q in QUESTIONS]
        got = await asyncio.gather(*(_ask(replicas, f"r{n}", pngs[i], q) for n, (i, q) in enumerate(work)))
        assert dict(zip(work, got, strict=True)) == {k: reference[k] for k in work}
        assert (await replicas.current_stats())["replica_backend"] == "ray"
        os.kill(pids[0], signal.SIGKILL)
        got = await asyncio.gather(*(_ask(replicas, f"k{n}", pngs[i], q) for n, (i, q) in enumerate(work)))
        assert dict(zip(work, got, strict=True)) == {k: reference[k] for k in work}
        deadline = time.monotonic() + HANG_GUARD_S
        while replicas.replica_pids()[0] in (None, pids[0]) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert replicas.replica_pids()[0] not in (None, pids[0])
        await replicas.check_integrity()

    _run_then_shut_down(replicas, run, pids)
